"""The experiment runner: every policy x seed, on real data, stored as it goes, resumable.

``run_compare(config)`` trains each (policy, seed) run with :class:`lowprec.Precision`,
evaluates on the test split after every epoch, and writes everything to ``results.db`` in the
run folder (see :mod:`lowprec.experiments.results`). After each epoch the run's state (model, optimizer,
precision, generators) is checkpointed atomically; an interrupted compare continues with
``resume=True``: finished runs are kept, unfinished ones restart from their last checkpoint
and give the same numbers as an uninterrupted run. A run whose parameters become non-finite is
recorded as diverged, with its step, and the comparison goes on.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import platform
import sqlite3
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from .. import __version__
from ..analysis.certify import certify
from .config import CompareConfig, RunError, lr_at, split_models
from .data import Dataset, load_checked_dataset
from .models import build_checked_model
from ..training.hardware import device_facts
from ..training.optim import SGD, Adam
from ..training.precision import Precision
from .results import NOT_REQUESTED, ResultsDB, is_blank
from .runfolder import (CONFIG_FILE, FolderLock, RunIOError, atomic_torch_save,
                        atomic_write_bytes, foreign_entry, io_error, remove_stale_temps,
                        temp_path)
from .system import tune_cpu_allocator
from .timing import EpochMeter

__all__ = ["run_compare", "train_run", "environment", "atomic_save", "analyse_run",
           "certificate_formats", "config_differences", "check_policies", "failed_runs",
           "Progress", "run_id_of", "checkpoint_path", "resumable", "start_run_record",
           "failure_message", "mark_unrequested", "refuse_foreign", "record_config_file"]

def environment() -> dict:
    """Library versions, git revision and hardware, recorded with every run."""
    import numpy

    from ..numerics import kernel as _kernel

    versions = {"lowprec": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
                "python": sys.version.split()[0]}
    git = None
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            git = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    hw = {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
          "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
          "kernel": _kernel.available(), "platform": platform.platform(),
          "cpu": device_facts("cpu").to_json()}  # what backend=auto decides by
    if torch.cuda.is_available():
        hw["cuda"] = torch.cuda.get_device_name(0)
    return {"versions": versions, "git": git, "hardware": hw}


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file, then rename: a reader sees the old or the new file; on
    failure the temporary file is removed and RunIOError names the path."""
    atomic_torch_save(obj, path, "the checkpoint")


def certificate_formats(policy) -> list[str]:
    """The formats a trained run is certified in: its compute format, or fp16 and bf16 for a
    32-bit run (the paper's question: may this fp32 model run in 16 bits?)."""
    from ..numerics.formats import FP32, BinaryFormat, DynamicFixedFormat

    if isinstance(policy.compute, BinaryFormat):
        return []  # a binarized network has no float twin to compare with
    if policy.compute == FP32 or isinstance(policy.compute, DynamicFixedFormat):
        return ["fp16", "bf16"]
    return [str(policy.compute)]


def analyse_run(db: ResultsDB, run_id: str, model: nn.Module, prec: Precision, data: Dataset,
                x_train: torch.Tensor, y_train: torch.Tensor, cfg: CompareConfig) -> None:
    """Store the analyses of a trained run for the report: the certificate, layer-wise errors,
    the range profile and lost updates, in each format of :func:`certificate_formats`."""
    from ..analysis import layer_errors, lost_updates, range_profile
    from ..analysis import fp32_twin
    from ..numerics.formats import FP32, parse_format

    ce = nn.functional.cross_entropy
    batch = (x_train[:256].clone(), y_train[:256].clone())
    for fmt in certificate_formats(prec.policy):
        cert = certify(model, (data.x_test, data.y_test), fmt)
        db.record_analysis(run_id, f"certificate:{fmt}", cert.to_payload())
        errs = layer_errors(model, data.x_test[:256], fmt)
        db.record_analysis(run_id, f"layers:{fmt}", {"layers": [asdict(e) for e in errs]})
        twin = fp32_twin(model)  # fp32 gradients, measured against the format
        prof = range_profile(twin, batch, ce, fmt)
        db.record_analysis(run_id, f"ranges:{fmt}", _compact_profile(prof))
        pfmt = prec.policy.params if prec.policy.params != FP32 else parse_format(fmt)
        lost = lost_updates(twin, batch, ce, pfmt, lr=cfg.lr,
                            optimizer="adam" if cfg.optimizer == "adam" else "sgd")
        db.record_analysis(run_id, f"lost:{fmt}", {"format": str(pfmt), "lr": cfg.lr,
                                                   "layers": [asdict(r) for r in lost]})


def _compact_profile(prof) -> dict:
    """Per role: the histogram summed over layers and the weighted fractions."""
    out = {"format": prof.format, "roles": {}, "recommended_scale": prof.gradient_scale()}
    for role in ("weights", "activations", "activation_grads", "weight_grads"):
        rows = prof.role(role)
        if not rows:
            continue
        hist = None
        for r in rows:
            if r.hist:
                hist = r.hist if hist is None else [a + b for a, b in zip(hist, r.hist)]
        out["roles"][role] = {k: prof.fraction(role, k) for k in ("overflow", "flush",
                                                                  "subnormal")}
        out["roles"][role]["hist"] = hist or []
    return out


def _run_key(run_id: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run_id)[:60]
    return f"{safe}-{hashlib.sha1(run_id.encode()).hexdigest()[:8]}"


def _prepare_out(out: Path) -> None:
    """Create the run folder, or check that an existing one holds nothing but a run of
    lowprec's (before anything is written there), and that it is writable."""
    if not str(out).strip():
        raise RunError("--out is empty: name a run folder")
    refuse_foreign(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = temp_path(out / "write-test")
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise RunError(f"output folder {str(out)[:200]} is not writable "
                       f"({err.strerror or err})") from None


def refuse_foreign(out: Path, **kind) -> None:
    """RunError when ``out`` holds a file or folder that is not part of a lowprec run folder:
    lowprec writes only into an empty or new folder, or one of its own runs."""
    try:
        found = foreign_entry(out, **kind)
    except OSError as err:
        raise RunError(f"cannot read the output folder {str(out)[:200]} "
                       f"({err.strerror or err})") from None
    if found == ".":
        raise RunError(f"--out {str(out)[:200]} is a file, not a folder: name a new folder")
    if found is not None:
        raise RunError(f"--out {str(out)[:200]} holds {found[:120]!r}, which is not part of a "
                       "lowprec run folder: lowprec writes only into a new or empty folder, or "
                       "one of its own runs; choose another --out")


_HYPER = ("data", "model", "policies", "seeds", "epochs", "batch_size", "lr", "optimizer",
          "momentum", "weight_decay", "train_subset", "schedule")


def config_differences(stored: dict, cfg: CompareConfig) -> list[str]:
    """What a resumed comparison would do differently from the stored one ("key: stored X,
    given Y"): other training settings, and other policies or seeds (a resume continues the
    comparison it finds; extending or shrinking it is a change like any other, accepted with
    ``force_config``: new runs are then added, and runs no longer asked for are marked)."""
    given = cfg.to_json()
    # threads: a comparison stored before it was configurable has none to differ from
    keys = _HYPER + (("threads",) if "threads" in stored else ())
    return [f"{k}: stored {stored.get(k)!r}, given {given.get(k)!r}" for k in keys
            if stored.get(k) != given.get(k)]


def check_policies(cfg: CompareConfig) -> None:
    """Every policy can be set up on this machine (e.g. b=native needs native formats)."""
    for p in cfg.policies:
        try:
            Precision(p).resolve_backend(torch.device("cpu"))
        except ValueError as err:
            raise RunError(str(err)) from None


def _make_optimizer(cfg: CompareConfig, model: nn.Module):
    if cfg.optimizer == "sgd":
        return SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                   weight_decay=cfg.weight_decay)
    return Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


@torch.no_grad()
def evaluate(model: nn.Module, prec: Precision, x: torch.Tensor, y: torch.Tensor,
             batch: int = 1000) -> tuple[float, float]:
    """(test loss, test accuracy) of ``model`` as the policy runs it."""
    was = model.training
    model.eval()
    total_loss, correct = 0.0, 0
    try:
        for i in range(0, len(x), batch):
            xb, yb = x[i:i + batch], y[i:i + batch]
            with prec.autocast():
                out = model(xb).float()
            total_loss += nn.functional.cross_entropy(out, yb, reduction="sum").item()
            correct += (out.argmax(dim=1) == yb).sum().item()
    finally:
        model.train(was)
    return total_loss / len(x), correct / len(x)


class Progress:
    """Progress of a comparison: nothing when quiet; on a terminal, rich progress bars (one
    overall, one per run in flight: the local runner has one at a time, the Ray driver one per
    task); otherwise (a pipe, a log file: ``make demo > log``), one plain line per finished
    epoch and per finished run, flushed at once, where rich would draw nothing until the end.
    ``step`` and ``run_done`` without a name act on the run started last."""

    def __init__(self, total_runs: int, quiet: bool, *, plain: bool | None = None) -> None:
        self.quiet = quiet
        self.bars: dict[str, int] = {}
        self.last: str | None = None
        self.total, self.done = total_runs, 0
        self.plain = (not sys.stdout.isatty()) if plain is None else plain
        if quiet or self.plain:
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as _Rich, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.p = _Rich(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
        self.overall = self.p.add_task("all runs", total=total_runs)

    @property
    def _bars(self) -> bool:
        return not (self.quiet or self.plain)

    def _line(self, text: str) -> None:
        print(text, flush=True)

    def __enter__(self):
        if self._bars:
            self.p.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bars:
            self.p.__exit__(*exc)

    def start_run(self, name: str, total_steps: int, done_steps: int = 0) -> None:
        self.last = name
        if not self._bars:
            return
        if name in self.bars:
            self.p.remove_task(self.bars.pop(name))
        self.bars[name] = self.p.add_task(name, total=total_steps, completed=done_steps)

    def step(self, n: int = 1, name: str | None = None) -> None:
        name = self.last if name is None else name
        if self._bars and name in self.bars:
            self.p.advance(self.bars[name], n)

    def epoch_done(self, name: str, epoch: int, epochs: int, *, train_loss=None,
                   test_acc=None, seconds=None) -> None:
        """A finished epoch (1-based): a plain line when not on a terminal."""
        if self.quiet or not self.plain:
            return
        parts = [f"{name}: epoch {epoch}/{epochs}"]
        if train_loss is not None and math.isfinite(train_loss):
            parts.append(f"train loss {train_loss:.4f}")
        if test_acc is not None and math.isfinite(test_acc):
            parts.append(f"test acc {100 * test_acc:.2f}%")
        if seconds is not None:
            parts.append(f"{seconds:.1f} s")
        self._line(", ".join(parts))

    def run_done(self, name: str | None = None) -> None:
        name = self.last if name is None else name
        self.done += 1
        if self.quiet:
            return
        if self.plain:
            self._line(f"all runs: {self.done}/{self.total} done" + (f" ({name})" if name else ""))
            return
        if name in self.bars:
            self.p.remove_task(self.bars.pop(name))
        self.p.advance(self.overall, 1)


def _measure_memory(prec: Precision, model: nn.Module, batch) -> object:
    """The memory ledger of one step, leaving no trace in the run: the forward and backward it
    needs would advance stochastic rounding's generator, move dynamic fixed-point ranges and
    BatchNorm statistics, and fill .grad; all of it is put back, so a run measured and a run
    resumed before its first checkpoint (which is not measured again) train identically."""
    model_state = copy.deepcopy(model.state_dict())
    prec_state = copy.deepcopy(prec.state_dict())
    rng = torch.get_rng_state()
    grads = {p: (None if p.grad is None else p.grad.clone()) for p in model.parameters()}
    try:
        return prec.memory(model, batch, nn.functional.cross_entropy)
    finally:
        model.load_state_dict(model_state)
        prec.load_state_dict(prec_state)
        torch.set_rng_state(rng)
        for p, g in grads.items():
            p.grad = g


def run_id_of(policy: str, seed: int) -> str:
    """The key of a (policy, seed) run in results.db."""
    return f"{policy}|seed={seed}"


def checkpoint_path(out: Path, run_id: str) -> Path:
    """Where a run's checkpoint lives in the run folder."""
    return out / "checkpoints" / f"{_run_key(run_id)}.pt"


def resumable(existing: dict | None) -> bool:
    """A stored run that continues (from its checkpoint) rather than starts afresh."""
    return existing is not None and (existing["status"] == "running" or (
        existing["status"] == "failed" and existing.get("error") == NOT_REQUESTED))


def _set_up(cfg: CompareConfig, data: Dataset, policy: str, seed: int):
    """The model, optimizer, Precision and training split of a run, as every run builds them."""
    torch.manual_seed(seed)
    model = build_checked_model(cfg.model, data)
    opt = _make_optimizer(cfg, model)
    prec = Precision(policy, seed=seed)
    model, opt = prec.setup(model, opt)
    x_train, y_train = data.x_train, data.y_train
    if cfg.train_subset:
        x_train, y_train = x_train[:cfg.train_subset], y_train[:cfg.train_subset]
    return model, opt, prec, x_train, y_train


def _record_start(db: ResultsDB, cfg: CompareConfig, policy: str, seed: int, env: dict,
                  prec: Precision, model: nn.Module, x_train, y_train) -> None:
    """A fresh run's row, backend and memory ledger (measured without a trace)."""
    run_id = run_id_of(policy, seed)
    db.start_run(run_id, policy=policy, policy_spec=prec.policy.spec, seed=seed,
                 config=cfg.to_json(), versions=env["versions"], git=env["git"],
                 hardware={**env.get("hardware", {}), "torch_threads": _threads(cfg),
                           "backend_choice": prec.backend_choice.to_json()})
    db.set_backend(run_id, prec.backend)
    batch = (x_train[:cfg.batch_size].clone(), y_train[:cfg.batch_size].clone())
    db.record_memory(run_id, _measure_memory(prec, model, batch))


def start_run_record(db: ResultsDB, cfg: CompareConfig, data: Dataset, policy: str, seed: int,
                     env: dict) -> None:
    """What :func:`train_run` records when a run starts afresh (its row, backend and memory
    ledger), done by a driver whose runs execute elsewhere (the Ray executor): the model is
    built as train_run builds it, and measured without a trace, so the run trains the same."""
    with _run_threads(cfg):  # measured as train_run would measure it
        model, _, prec, x_train, y_train = _set_up(cfg, data, policy, seed)
        _record_start(db, cfg, policy, seed, env, prec, model, x_train, y_train)


def failure_message(err: BaseException) -> str:
    """The one line a failed run stores."""
    msg = "".join(traceback.format_exception_only(type(err), err)).strip()
    return " ".join(msg.split())[:500]


@torch.no_grad()
def _grad_norm(model: nn.Module, scale: float) -> float:
    """The 2-norm of every parameter gradient, unscaled (the loss was multiplied by ``scale``),
    in fp32, as backward produced them (before the step rounds them to the parameter format);
    Inf or NaN on a step whose gradients overflowed."""
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32)
             for p in model.parameters() if p.grad is not None]
    if not norms:
        return float("nan")
    return torch.linalg.vector_norm(torch.stack(norms)).item() / scale


def _record_epoch(db: ResultsDB, run_id: str, record: dict) -> None:
    rest = {k: v for k, v in record.items() if k != "epoch"}
    db.record_epoch(run_id, record["epoch"], **rest)


def _threads(cfg: CompareConfig) -> int:
    return cfg.threads or torch.get_num_threads()


@contextmanager
def _run_threads(cfg: CompareConfig):
    """torch computes with the comparison's thread count inside, the caller's after."""
    caller = torch.get_num_threads()
    torch.set_num_threads(_threads(cfg))
    try:
        yield
    finally:
        torch.set_num_threads(caller)


def train_run(cfg: CompareConfig, data: Dataset, policy: str, seed: int, db: ResultsDB,
              out: Path, env: dict, progress: "Progress | None" = None) -> str:
    """Train (or continue) one (policy, seed) run of ``cfg`` on ``data``, recording every epoch
    in ``db`` and checkpointing under ``out/checkpoints``; returns its status. The caller holds
    the run folder's lock. A finished or diverged run is left as stored.

    The run trains with ``cfg.threads`` torch threads, wherever it runs (this process's count
    is given back at the end): a float reduction split over another number of threads sums in
    another order. Each epoch's checkpoint carries the epoch records it covers, replayed into
    ``db`` when the run continues from it: rows a checkpoint covers are never lost, even when
    the writer of ``db`` (a Ray driver) died before storing what the run had sent."""
    with _run_threads(cfg):
        return _train_run(cfg, data, policy, seed, db, out, env, progress)


def _train_run(cfg: CompareConfig, data: Dataset, policy: str, seed: int, db: ResultsDB,
               out: Path, env: dict, progress: "Progress | None") -> str:
    progress = progress or Progress(1, True)
    run_id = run_id_of(policy, seed)
    ckpt_path = checkpoint_path(out, run_id)
    existing = db.run(run_id)
    if existing and existing["status"] in ("finished", "diverged"):
        progress.run_done(f"{policy} seed {seed}")
        return existing["status"]

    model, opt, prec, x_train, y_train = _set_up(cfg, data, policy, seed)
    n = len(x_train)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    start_epoch = 0
    records: list[dict] = []  # record_epoch's arguments, every epoch so far (in checkpoints)
    if resumable(existing) and ckpt_path.exists():
        try:
            ckpt = torch.load(ckpt_path, weights_only=False)
        except Exception as err:  # a damaged checkpoint: redo the run rather than mix states
            ckpt = None
            db.record_analysis(run_id, "checkpoint_error", {"error": repr(err)[:300]})
    else:
        ckpt = None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        prec.load_state_dict(ckpt["precision"])
        if ckpt.get("rng") is not None:
            torch.set_rng_state(ckpt["rng"])
        start_epoch = ckpt["epoch"] + 1
        db.truncate(run_id, last_epoch=ckpt["epoch"], last_step=prec.steps - 1)
        records = list(ckpt.get("records") or ())  # none in a checkpoint of an older lowprec
        for rec in records:  # INSERT OR REPLACE: a row already stored is written unchanged
            _record_epoch(db, run_id, rec)
    elif resumable(existing) and db.memory(run_id) is not None:
        # interrupted before its first checkpoint: the same run, redone from its first epoch
        # (its row, start time and ledger are kept; what it recorded after them is dropped)
        db.truncate(run_id, last_epoch=-1, last_step=-1)
    else:
        _record_start(db, cfg, policy, seed, env, prec, model, x_train, y_train)
    # the thread count this run trains with, measured where it trains
    db.record_analysis(run_id, "threads", {"threads": torch.get_num_threads()})
    progress.start_run(f"{policy} seed {seed}", cfg.epochs * steps_per_epoch,
                       start_epoch * steps_per_epoch)

    status, diverged_step = "finished", None
    for epoch in range(start_epoch, cfg.epochs):
        # the order of an epoch depends only on (seed, epoch): resuming reproduces it
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, epoch)
        meter = EpochMeter().start()
        losses, trace_start, steps = [], len(prec.trace), []
        skipped0, nonfinite0 = prec.skipped, prec.nonfinite
        consecutive_bad = 0
        model.train()
        for i in range(0, n, cfg.batch_size):
            idx = perm[i:i + cfg.batch_size]
            xb, yb = x_train[idx], y_train[idx]
            opt.zero_grad()
            with prec.autocast():
                loss = nn.functional.cross_entropy(model(xb).float(), yb)
            prec.backward(loss)
            grad_norm = _grad_norm(model, prec.loss_scale.scale)
            steps.append({"step": prec.steps, "loss": loss.item(),
                          "lr": opt.param_groups[0]["lr"], "grad_norm": grad_norm})
            prec.step(opt)
            lv = steps[-1]["loss"]
            losses.append(lv)
            consecutive_bad = consecutive_bad + 1 if not math.isfinite(lv) else 0
            meter.sample()
            progress.step()
            params_bad = (prec.steps % 20 == 0 or i + cfg.batch_size >= n) and not all(
                torch.isfinite(p).all() for p in model.parameters())
            if params_bad or consecutive_bad >= 200:
                status, diverged_step = "diverged", prec.steps - 1
                break
        timing = meter.stop()  # the training steps' time; evaluation is not counted
        finite = [v for v in losses if math.isfinite(v)]
        train_loss = sum(finite) / len(finite) if len(finite) == len(losses) else float("nan")
        if status == "diverged":
            test_loss, test_acc = float("nan"), float("nan")
        else:
            test_loss, test_acc = evaluate(model, prec, data.x_test, data.y_test)
        record = dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss,
                      test_acc=test_acc, skipped=prec.skipped - skipped0,
                      nonfinite=prec.nonfinite - nonfinite0, loss_scale=prec.loss_scale.scale,
                      trace=prec.trace[trace_start:], steps=steps, **timing)
        _record_epoch(db, run_id, record)
        progress.epoch_done(f"{policy} seed {seed}", epoch + 1, cfg.epochs, train_loss=train_loss,
                            test_acc=test_acc, seconds=timing["seconds"])
        if status == "diverged":
            break
        records.append(record)
        # the weights as a native run stores them (emulated fp16 as float16: half the bytes);
        # load_state_dict copies them back into the float32 carriers exactly
        atomic_save({"model": prec.checkpoint_state_dict(), "optimizer": opt.state_dict(),
                     "precision": prec.state_dict(), "epoch": epoch,
                     "rng": torch.get_rng_state(), "records": records}, ckpt_path)
    if status == "finished":
        try:
            analyse_run(db, run_id, model, prec, data, x_train, y_train, cfg)
        except (OSError, sqlite3.OperationalError, RunIOError):
            raise
        except Exception as err:  # the run itself finished: keep it, record why analysis did not
            db.record_analysis(run_id, "analysis_error", {"error": repr(err)})
    db.finish_run(run_id, status, diverged_step=diverged_step)
    if ckpt_path.exists():
        ckpt_path.unlink()
    progress.run_done()
    return status


def _disk_error(err: BaseException, db_path: Path) -> RunIOError:
    if isinstance(err, RunIOError):
        return err
    return io_error(db_path, "results", err)


def record_config_file(out: Path, text: str | None) -> None:
    """The ``--config`` file a comparison was started with, as given: ``OUT/run.toml`` (its
    effective configuration is in results.db)."""
    if text is not None:
        atomic_write_bytes(out / CONFIG_FILE, text.encode(), "the configuration file")


def run_compare(cfg: CompareConfig, executor=None, *, force_config: bool = False,
                config_text: str | None = None) -> Path:
    """Train every policy x seed of ``cfg``, store the results, write the report.
    Returns the run folder.

    ``executor`` decides where the runs execute: None runs them one after another in this
    process; :class:`lowprec.experiments.executors.RayExecutor` runs each as a Ray task. Either
    way this process is the only writer of results.db. Several models (``cfg.model``
    comma-separated) run one comparison per model (:mod:`lowprec.experiments.multi`).

    The folder is locked for the whole call (:class:`FolderLock`). With ``cfg.resume`` the
    stored configuration must match ``cfg`` (RunError listing the differences) unless
    ``force_config``, which is recorded in the database. ``config_text``: the text of the
    ``--config`` file the command was given, kept as ``OUT/run.toml``. Raises RunError for a
    user's mistake,
    RunIOError when the disk fails, and KeyboardInterrupt as is (the folder stays resumable).
    """
    cfg.validate()
    if getattr(executor, "preflight", None):  # what can never run: refused before anything
        executor.preflight()
    if len(split_models(cfg.model)) > 1:  # one comparison per architecture
        from .multi import run_models

        return run_models(cfg, executor, force_config=force_config, config_text=config_text)
    tune_cpu_allocator()
    out = Path(cfg.out)
    _prepare_out(out)
    with FolderLock(out, "lowprec compare"):
        remove_stale_temps(out)
        record_config_file(out, config_text)
        db_path = out / "results.db"
        if db_path.exists() and not cfg.resume and not is_blank(db_path):
            raise RunError(f"{db_path} already exists: continue it with --resume, or choose "
                           "another --out")
        check_policies(cfg)
        try:
            data = load_checked_dataset(cfg.data, quiet=cfg.quiet)
            build_checked_model(cfg.model, data)
        except ValueError as err:
            raise RunError(str(err)) from None
        try:
            (out / "checkpoints").mkdir(exist_ok=True)
            db = ResultsDB(db_path)
        except OSError as err:
            raise io_error(out, "the run folder", err) from None
        except sqlite3.OperationalError as err:
            raise io_error(db_path, "the results database", err) from None
        try:
            _check_and_record_config(db, cfg, force_config)
            if executor is None:
                _train_all(cfg, data, db, out)
            else:
                mark_unrequested(db, cfg)
                executor.execute(cfg, data, db, out, environment())
            from .report import write_report

            write_report(out, db)
        except (OSError, sqlite3.OperationalError) as err:
            raise _disk_error(err, db_path) from None
        finally:
            db.close()
    return out


def _check_and_record_config(db: ResultsDB, cfg: CompareConfig, force: bool) -> None:
    stored = db.stored_config()
    cfg.resolve_threads(stored)
    if stored is None:
        db.set_meta("config", cfg.to_json())
        return
    diffs = config_differences(stored, cfg)
    if diffs and not force:
        raise RunError("--resume with another configuration (" + "; ".join(diffs) +
                       "): drop those flags to continue as stored, or add --force-config")
    if diffs:
        history = db.meta("forced_config") or []
        history.append({"time": time.time(), "differences": diffs, "config": cfg.to_json()})
        db.set_meta("forced_config", history)
        db.set_meta("config", cfg.to_json())


def mark_unrequested(db: ResultsDB, cfg: CompareConfig) -> None:
    """Interrupted runs this comparison no longer asks for are failed, NOT_REQUESTED."""
    wanted = {run_id_of(p, s) for p in cfg.policies for s in cfg.seeds}
    for r in db.runs():
        if r["status"] == "running" and r["run_id"] not in wanted:
            db.finish_run(r["run_id"], "failed", error=NOT_REQUESTED)


def _train_all(cfg: CompareConfig, data: Dataset, db: ResultsDB, out: Path) -> None:
    env = environment()
    runs = [(p, s) for p in cfg.policies for s in cfg.seeds]
    mark_unrequested(db, cfg)
    with Progress(len(runs), cfg.quiet) as progress:
        for policy, seed in runs:
            try:
                train_run(cfg, data, policy, seed, db, out, env, progress)
            except (KeyboardInterrupt, RunIOError, OSError, sqlite3.OperationalError):
                raise  # the comparison stops; the folder stays resumable
            except Exception as err:  # a run's failure is recorded; the others go on
                run_id = run_id_of(policy, seed)
                if db.run(run_id) is None:
                    db.start_run(run_id, policy=policy, policy_spec=str(policy), seed=seed,
                                 config=cfg.to_json(), versions=env["versions"],
                                 git=env["git"], hardware=env["hardware"])
                db.finish_run(run_id, "failed", error=failure_message(err))
                progress.run_done()


def failed_runs(out: Path, cfg: CompareConfig) -> list[tuple[str, str]]:
    """(run id, reason) of each requested run that failed, read from the run folder."""
    db = ResultsDB(Path(out) / "results.db", create=False)
    try:
        wanted = {run_id_of(p, s) for p in cfg.policies for s in cfg.seeds}
        return [(r["run_id"], r.get("error") or "") for r in db.runs()
                if r["status"] == "failed" and r["run_id"] in wanted]
    finally:
        db.close()
