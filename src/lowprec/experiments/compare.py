"""The entry point of a comparison: ``run_compare(config)`` checks the configuration, then runs
one model's comparison (:func:`lowprec.experiments.runner.run_model`) or, for several models
(``cfg.model`` comma-separated), one comparison per model (:mod:`lowprec.experiments.multi`)."""

from __future__ import annotations

from pathlib import Path

from dataclasses import replace

from .config import CompareConfig, split_models
from .multi import run_models
from .runner import failed_runs as _model_failed_runs
from .runner import run_model
from .runfolder import MODELS_FILE

__all__ = ["run_compare", "failed_runs"]


def run_compare(cfg: CompareConfig, executor=None, *, force_config: bool = False,
                config_text: str | None = None) -> Path:
    """Train every policy x seed of ``cfg``, store the results, write the report.
    Returns the run folder.

    ``executor`` decides where the runs execute: None runs them one after another in this
    process; :class:`lowprec.experiments.executors.RayExecutor` runs each as a Ray task. Either
    way this process is the only writer of results.db. Several models (``cfg.model``
    comma-separated) run one comparison per model (:mod:`lowprec.experiments.multi`).

    The folder is locked for the whole call. With ``cfg.resume`` the stored configuration must
    match ``cfg`` (RunError listing the differences) unless ``force_config``, which is recorded
    in the database. ``config_text``: the text of the ``--config`` file the command was given,
    kept as ``OUT/run.toml``. Raises RunError for a user's mistake, RunIOError when the disk
    fails, and KeyboardInterrupt as is (the folder stays resumable).
    """
    several = len(split_models(cfg.model)) > 1 or \
        (cfg.resume and (Path(cfg.out) / MODELS_FILE).is_file())  # resumed: its models checked
    if several:  # one comparison per architecture
        cfg.validate()
        if getattr(executor, "preflight", None):  # what can never run: refused before anything
            executor.preflight()
        return run_models(cfg, executor, force_config=force_config, config_text=config_text)
    return run_model(cfg, executor, force_config=force_config, config_text=config_text)


def failed_runs(out: str | Path, cfg: CompareConfig) -> list[tuple[str, str]]:
    """(run id, reason) of each requested run of ``cfg`` that failed, read from the run folder
    ``out``; over several models a run id is prefixed with its model (``MODEL/RUN``)."""
    models = split_models(cfg.model)
    if len(models) == 1 and not (Path(out) / MODELS_FILE).is_file():
        return _model_failed_runs(Path(out), cfg)
    return [(f"{m}/{run_id}", reason) for m in models
            for run_id, reason in _model_failed_runs(Path(out) / m, replace(cfg, model=m))]
