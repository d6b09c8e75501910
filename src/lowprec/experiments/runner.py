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

import hashlib
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from .. import __version__
from ..analysis.certify import certify
from .config import CompareConfig, RunError, lr_at, split_models
from .data import Dataset, load_dataset
from .models import build_model
from ..training.optim import SGD, Adam
from ..training.policy import parse_policy
from ..training.precision import Precision
from .results import ResultsDB
from .system import tune_cpu_allocator

__all__ = ["run_compare", "environment", "atomic_save", "analyse_run", "certificate_formats",
           "open_run", "train_run", "record_failure", "run_name", "checkpoint_path", "Progress"]

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
          "kernel": _kernel.available(), "platform": platform.platform()}
    if torch.cuda.is_available():
        hw["cuda"] = torch.cuda.get_device_name(0)
    return {"versions": versions, "git": git, "hardware": hw}


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file, then rename: a reader sees the old or the new file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


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


def _prepare_out(out: Path, resume: bool) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise RunError(f"output folder {out} is not writable ({err.strerror or err})") from None
    db = out / "results.db"
    if db.exists() and not resume:
        raise RunError(f"{db} already exists: continue it with --resume, or choose another --out")
    (out / "checkpoints").mkdir(exist_ok=True)
    return db


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
    """rich progress bars: one overall, one per run in progress; nothing when quiet. Runs are
    named, so that runs executing at the same time (on a cluster) each have their bar."""

    def __init__(self, total_runs: int, quiet: bool) -> None:
        self.quiet = quiet
        self.bars: dict[str, int] = {}
        if quiet:
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as _Rich, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.p = _Rich(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
        self.overall = self.p.add_task("all runs", total=total_runs)

    def __enter__(self):
        if not self.quiet:
            self.p.__enter__()
        return self

    def __exit__(self, *exc):
        if not self.quiet:
            self.p.__exit__(*exc)

    def start_run(self, name: str, total_steps: int, done_steps: int = 0) -> None:
        if self.quiet:
            return
        if name in self.bars:
            self.p.remove_task(self.bars.pop(name))
        self.bars[name] = self.p.add_task(name, total=total_steps, completed=done_steps)

    def step(self, name: str, n: int = 1) -> None:
        if not self.quiet and name in self.bars:
            self.p.advance(self.bars[name], n)

    def run_done(self, name: str | None = None) -> None:
        if self.quiet:
            return
        if name in self.bars:
            self.p.remove_task(self.bars.pop(name))
        self.p.advance(self.overall, 1)


def run_name(policy: str, seed: int) -> str:
    """The key of a (policy, seed) run in results.db."""
    return f"{policy}|seed={seed}"


def checkpoint_path(out: Path, run_id: str) -> Path:
    return out / "checkpoints" / f"{_run_key(run_id)}.pt"


def open_run(db: ResultsDB, cfg: CompareConfig, policy: str, seed: int, out: Path,
             env: dict) -> bool:
    """The driver's half of a run, before it executes: False if it is already done; otherwise
    make sure results.db has its row. A run left 'running' keeps its row (and start time) and
    continues from its checkpoint; a new or failed one starts afresh (a stale checkpoint is
    removed, so that a checkpoint always belongs to the row that is in the database)."""
    run_id = run_name(policy, seed)
    existing = db.run(run_id)
    if existing and existing["status"] in ("finished", "diverged"):
        return False
    if existing and existing["status"] == "running":
        return True
    ckpt = checkpoint_path(out, run_id)
    if ckpt.exists():
        ckpt.unlink()
    db.start_run(run_id, policy=policy, policy_spec=parse_policy(policy).spec, seed=seed,
                 config=cfg.to_json(), versions=env["versions"], git=env["git"],
                 hardware=env["hardware"])
    return True


def train_run(cfg: CompareConfig, data: Dataset, policy: str, seed: int, out: Path, sink,
              progress) -> str:
    """The worker's half: train one (policy, seed) run whose row :func:`open_run` made.

    It never reads results.db: ``sink`` receives its writes (``set_backend``,
    ``record_memory``, ``truncate``, ``record_epoch``, ``record_analysis``, ``finish_run``,
    with ResultsDB's signatures) and is the database itself when the run executes in the
    driver, or a proxy that ships them to the driver (the Ray executor). The run continues
    from its checkpoint when there is one; the checkpoint is written atomically after every
    epoch, so that a run executed again after any interruption gives the same numbers."""
    run_id = run_name(policy, seed)
    ckpt_path = checkpoint_path(out, run_id)
    torch.manual_seed(seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    opt = _make_optimizer(cfg, model)
    prec = Precision(policy, seed=seed)
    model, opt = prec.setup(model, opt)
    x_train, y_train = data.x_train, data.y_train
    if cfg.train_subset:
        x_train, y_train = x_train[:cfg.train_subset], y_train[:cfg.train_subset]
    n = len(x_train)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    sink.set_backend(run_id, prec.backend)
    # the ledger's forward pass restores BatchNorm statistics; a checkpoint, when there is
    # one, is loaded after it and overrides all state anyway
    batch = (x_train[:cfg.batch_size].clone(), y_train[:cfg.batch_size].clone())
    sink.record_memory(run_id, prec.memory(model, batch, nn.functional.cross_entropy))
    start_epoch = 0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        prec.load_state_dict(ckpt["precision"])
        start_epoch = ckpt["epoch"] + 1
        sink.truncate(run_id, last_epoch=ckpt["epoch"], last_step=prec.steps - 1)
    else:
        # a new run, or one interrupted before its first checkpoint: redone from its first
        # epoch (its row and start time are kept; what it recorded is dropped)
        sink.truncate(run_id, last_epoch=-1, last_step=-1)
    name = f"{policy} seed {seed}"
    progress.start_run(name, cfg.epochs * steps_per_epoch, start_epoch * steps_per_epoch)

    status, diverged_step = "finished", None
    for epoch in range(start_epoch, cfg.epochs):
        # the order of an epoch depends only on (seed, epoch): resuming reproduces it
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, epoch)
        t0 = time.perf_counter()
        losses, trace_start = [], len(prec.trace)
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
            prec.step(opt)
            lv = loss.item()
            losses.append(lv)
            consecutive_bad = consecutive_bad + 1 if not math.isfinite(lv) else 0
            progress.step(name)
            params_bad = (prec.steps % 20 == 0 or i + cfg.batch_size >= n) and not all(
                torch.isfinite(p).all() for p in model.parameters())
            if params_bad or consecutive_bad >= 200:
                status, diverged_step = "diverged", prec.steps - 1
                break
        seconds = time.perf_counter() - t0
        finite = [v for v in losses if math.isfinite(v)]
        train_loss = sum(finite) / len(finite) if len(finite) == len(losses) else float("nan")
        if status == "diverged":
            test_loss, test_acc = float("nan"), float("nan")
        else:
            test_loss, test_acc = evaluate(model, prec, data.x_test, data.y_test)
        sink.record_epoch(run_id, epoch, train_loss=train_loss, test_loss=test_loss,
                        test_acc=test_acc, seconds=seconds, skipped=prec.skipped - skipped0,
                        nonfinite=prec.nonfinite - nonfinite0, loss_scale=prec.loss_scale.scale,
                        trace=prec.trace[trace_start:])
        if status == "diverged":
            break
        atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "precision": prec.state_dict(), "epoch": epoch}, ckpt_path)
    if status == "finished":
        try:
            analyse_run(sink, run_id, model, prec, data, x_train, y_train, cfg)
        except Exception as err:  # the run itself finished: keep it, record why analysis did not
            sink.record_analysis(run_id, "analysis_error", {"error": repr(err)})
    sink.finish_run(run_id, status, diverged_step=diverged_step)
    if ckpt_path.exists():
        ckpt_path.unlink()
    progress.run_done(name)
    return status



def run_compare(cfg: CompareConfig, executor=None) -> Path:
    """Train every policy x seed of ``cfg``, store the results, write the report.
    Returns the run folder.

    ``executor`` decides where the runs execute: None runs them one after another in this
    process; :class:`lowprec.experiments.executors.RayExecutor` runs each as a Ray task. Either
    way this process is the only writer of results.db."""
    cfg.validate()
    if len(split_models(cfg.model)) > 1:  # one comparison per architecture
        from .multi import run_models

        return run_models(cfg, executor)
    tune_cpu_allocator()
    out = Path(cfg.out)
    db_path = _prepare_out(out, cfg.resume)
    try:
        data = load_dataset(cfg.data, quiet=cfg.quiet)
    except ValueError as err:
        raise RunError(str(err)) from None
    try:
        build_model(cfg.model, data.input_shape, data.num_classes)
    except (ValueError, RuntimeError) as err:
        raise RunError(f"model {cfg.model!r} does not fit {data}: {err}") from None
    db = ResultsDB(db_path)
    env = environment()
    runs = [(p, s) for p in cfg.policies for s in cfg.seeds]
    try:
        with Progress(len(runs), cfg.quiet) as progress:
            todo = []
            for policy, seed in runs:
                if open_run(db, cfg, policy, seed, out, env):
                    todo.append((policy, seed))
                else:
                    progress.run_done()
            if executor is None:
                for policy, seed in todo:
                    try:
                        train_run(cfg, data, policy, seed, out, db, progress)
                    except KeyboardInterrupt:
                        raise
                    except Exception as err:  # a run's failure is recorded; the others go on
                        record_failure(db, policy, seed, err)
                        progress.run_done(f"{policy} seed {seed}")
            else:
                executor.execute(cfg, data, todo, db, out, progress)
        from .report import write_report

        write_report(out, db)
    finally:
        db.close()
    return out


def record_failure(db: ResultsDB, policy: str, seed: int, err: BaseException) -> None:
    """Mark a run failed with the one-line description of ``err``."""
    db.finish_run(run_name(policy, seed), "failed", error="".join(
        traceback.format_exception_only(type(err), err)).strip())
