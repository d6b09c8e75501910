"""The results of a comparison as pandas DataFrames: ``lowprec.results.load(RUN_DIR)``.

```python
import lowprec.results

res = lowprec.results.load("runs/demo")
res.runs[["policy", "final_test_acc", "seconds"]]        # one row per run
res.epochs.groupby("policy")["test_acc"].max()            # one row per run and epoch
res.steps.query("policy == '16-mixed'")["loss_scale"]     # the loss-scale trace, step by step
res.analysis("certificate:fp16")                          # an analysis, flattened
```

See :mod:`lowprec.experiments.tables` for the columns. Nothing in the run folder is written.
"""

from .experiments.tables import (ANALYSIS_COLUMNS, EPOCH_COLUMNS, RUN_COLUMNS, STEP_COLUMNS,
                                 Results, load)
from .experiments.results import CorruptDatabase

__all__ = ["load", "Results", "CorruptDatabase", "RUN_COLUMNS", "EPOCH_COLUMNS", "STEP_COLUMNS",
           "ANALYSIS_COLUMNS"]
