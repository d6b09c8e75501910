"""The results of a comparison as pandas DataFrames: ``lowprec.results.load(RUN_DIR)``.

```python
import lowprec.results

res = lowprec.results.load("runs/demo")
res.runs[["policy", "final_test_acc", "seconds"]]        # one row per run
res.epochs.groupby("policy")["test_acc"].max()            # one row per run and epoch
res.steps.query("policy == '16-mixed'")["loss_scale"]     # the loss-scale trace, step by step
res.analysis("certificate:fp16")                          # an analysis, flattened
```

The columns, in order: ``RUN_COLUMNS`` (one row per run: run_id, policy, seed, status,
backend, final_test_acc, best_test_acc, final_train_loss, epochs, seconds, diverged_step, error,
memory_total, policy_spec, started, finished, git, config, versions, hardware),
``EPOCH_COLUMNS``, ``STEP_COLUMNS``, ``ANALYSIS_COLUMNS``, ``MEMORY_COLUMNS``; accuracies are
fractions (0.98), times seconds, memory bytes. Nothing in the run folder is written.
``RunError``: a folder without results; ``CorruptDatabase``: a database that cannot be read.
"""

from .experiments.config import RunError
from .experiments.results import CorruptDatabase
from .experiments.tables import (ANALYSIS_COLUMNS, EPOCH_COLUMNS, MEMORY_COLUMNS, RUN_COLUMNS,
                                 STEP_COLUMNS, Results, load)

__all__ = ["load", "Results", "RunError", "CorruptDatabase", "RUN_COLUMNS", "EPOCH_COLUMNS",
           "STEP_COLUMNS", "ANALYSIS_COLUMNS", "MEMORY_COLUMNS"]
