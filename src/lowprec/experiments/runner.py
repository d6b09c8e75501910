"""The run loop: one (policy, seed) run trained, evaluated, recorded and checkpointed after
every epoch; and one model's comparison (every policy x seed) run into its run folder.

``run_model(config)`` trains each (policy, seed) run with :class:`lowprec.Precision`,
evaluates on the test split after every epoch, and writes everything to ``results.db`` in the
run folder (see :mod:`lowprec.experiments.results`). After each epoch the run's state (model, optimizer,
precision, generators) is checkpointed atomically; an interrupted compare continues with
``resume=True``: finished runs are kept, unfinished ones restart from their last checkpoint
and give the same numbers as an uninterrupted run. A run whose parameters become non-finite is
recorded as diverged, with its step, and the comparison goes on. The entry point, which also
runs several models, is :func:`lowprec.experiments.compare.run_compare`.
"""

from __future__ import annotations

import copy
import json
import math
import sqlite3
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..training.caller import warn
from ..training.backends import BackendChoice
from ..training.optim import SGD, Adam
from ..training.plan import is_plan_spec, load_plan
from ..training.policy import Backend, Policy
from ..training.precision import Precision
from .checkpoints import atomic_save, checkpoint_path, resumable, run_id_of
from .config import CompareConfig, RunError, lr_at
from .data import Dataset, load_checked_dataset
from .environment import environment
from .models import MODELS, build_checked_model, channels_last, layout_of
from .progress import Progress
from .report import write_report
from .results import (NOT_REQUESTED, ResultsDB, is_blank, read_run_statuses,
                      read_stored_config, read_stored_plans)
from .run_analyses import analyse_run
from .runfolder import (CONFIG_FILE, WRITE_PROBE, FolderLock, RunIOError, atomic_write_bytes,
                        busy_writer, enclosing_run, foreign_entry, io_error, remove_stale_temps,
                        temp_path)
from .system import tune_cpu_allocator
from .timing import EpochMeter
from .util import short

__all__ = ["run_model", "train_run", "evaluate", "config_differences", "check_policies",
           "failed_runs", "start_run_record", "failure_message", "mark_unrequested",
           "refuse_foreign", "refuse_nested", "record_config_file", "check_resume",
           "check_inputs"]


def _prepare_out(out: Path) -> None:
    """Create the run folder, or check that an existing one holds nothing but a run of
    lowprec's (before anything is written there), and that it is writable."""
    if not str(out).strip():
        raise RunError("--out is empty: name a run folder")
    refuse_foreign(out)
    refuse_nested(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = temp_path(out / WRITE_PROBE)
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise RunError(f"output folder {str(out)[:200]} is not writable "
                       f"({err.strerror or err})") from None


def refuse_foreign(out: Path, **kind) -> None:
    """RunError when ``out`` holds a file or folder that is not part of a lowprec run folder:
    lowprec writes only into an empty or new folder, or one of its own runs; FolderBusy where
    the entry is the half-written temp file of the process holding the folder's lock."""
    try:
        found = foreign_entry(out, **kind)
    except OSError as err:
        raise RunError(f"cannot read the output folder {str(out)[:200]} "
                       f"({err.strerror or err})") from None
    if found == ".":
        raise RunError(f"--out {str(out)[:200]} is a file, not a folder: name a new folder")
    if found is not None:
        busy = busy_writer(out, found)
        if busy is not None:
            raise busy
        raise RunError(f"--out {str(out)[:200]} holds {found[:120]!r}, which is not part of a "
                       "lowprec run folder: lowprec writes only into a new or empty folder, or "
                       "one of its own runs; choose another --out")


def refuse_nested(out: Path) -> None:
    """RunError when ``out`` lies inside another run folder (``--out RUN/checkpoints``)."""
    inside = enclosing_run(out)
    if inside is not None:
        raise RunError(f"--out {str(out)[:200]} lies inside the run folder {str(inside)[:200]}: "
                       "a run folder holds one comparison; choose a folder outside it")


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


#: settings a forced resume may change even when runs are finished: the runs asked for (new
#: ones are added, dropped ones marked) and the thread count (speed, recorded per run)
_FORCE_ANYTIME = ("policies", "seeds", "threads")


def check_resume(out: Path, cfg: CompareConfig, force_config: bool = False) -> None:
    """Refuse, before anything is written, what a comparison in ``out`` cannot do: start over a
    stored one without ``resume``; continue with another configuration without
    ``force_config``; or force a training setting onto runs that already finished (their
    results were trained with the stored value: the stored configuration would no longer be
    theirs). Reads the database without changing it."""
    db_path = Path(out) / "results.db"
    if not db_path.is_file() or is_blank(db_path):
        return
    if not cfg.resume:
        raise RunError(f"{db_path} already exists: continue it with --resume, or choose "
                       "another --out")
    stored = read_stored_config(db_path)
    if stored is None:
        return
    resolved = cfg.resolve_threads(stored)
    diffs = config_differences(stored, resolved)
    if diffs and not force_config:
        raise RunError("--resume with another configuration (" + "; ".join(diffs) +
                       "): drop those flags to continue as stored, or add --force-config")
    if not force_config:
        _check_plans(db_path, cfg)
    given = resolved.to_json()
    changed = [k for k in _HYPER if k not in _FORCE_ANYTIME and stored.get(k) != given.get(k)]
    # every finished run of the folder, asked for again or not: the stored configuration is
    # the folder's, and would no longer be theirs
    done = [run_id for run_id, status in read_run_statuses(db_path).items()
            if status in ("finished", "diverged")]
    if changed and done:
        raise RunError(f"--force-config would change {', '.join(changed)} of runs already "
                       f"finished ({', '.join(done[:3])}{', ...' if len(done) > 3 else ''}), "
                       "whose results were trained with the stored values: drop those flags, "
                       "or start a new --out")


def _json_text(obj) -> str:
    return json.dumps(obj, sort_keys=True)


def _check_plans(db_path: Path, cfg: CompareConfig) -> None:
    """A resumed comparison's plan files hold the plans its runs started with: a plan edited
    since (its runs would train under two plans; a new user's resumed run took the edited
    plan from its next epoch and diverged) is refused like any other changed setting."""
    stored = read_stored_plans(db_path)
    for p in cfg.policies:
        name = str(p)
        if name in stored and _json_text(load_plan(name).to_json()) != _json_text(stored[name]):
            raise RunError(f"--resume with another plan: {short(name, 80)} is not the plan "
                           "its runs started with (stored in the database): restore the file "
                           "to continue as stored, or add --force-config to continue with it")


def check_policies(cfg: CompareConfig) -> None:
    """Every policy can be set up on this machine (e.g. b=native needs native formats)."""
    for p in cfg.policies:
        try:
            Precision(p).resolve_backend(torch.device("cpu"))
        except ValueError as err:
            raise RunError(str(err)) from None


def check_inputs(cfg: CompareConfig, models) -> Dataset:
    """The policies, the dataset and each of ``models`` can be set up (RunError naming what
    cannot): checked before any folder is made. Returns the dataset."""
    check_policies(cfg)
    try:
        data = load_checked_dataset(cfg.data, quiet=cfg.quiet)
        for model in models:
            build_checked_model(model, data)
    except ValueError as err:
        raise RunError(str(err)) from None
    return data


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


def _set_up(cfg: CompareConfig, data: Dataset, policy: Policy, seed: int,
            choice: BackendChoice | None = None):
    """The model, optimizer, Precision and training split of a run, as every run builds them;
    ``choice``: the backend a resumed run was started on (ValueError where this Precision
    cannot run it)."""
    torch.manual_seed(seed)
    model = build_checked_model(cfg.model, data)
    if cfg.model in MODELS:  # a user's model keeps its layout (its code may .view() NCHW)
        channels_last(model)  # oneDNN's fast CPU layout for convolutions, for every policy
    opt = _make_optimizer(cfg, model)
    backend = choice.backend if choice is not None else \
        Precision(policy).resolve_backend(torch.device("cpu"))
    compiled = cfg.compile and backend == Backend.EMULATED
    prec = Precision(policy, seed=seed, compile=compiled)
    model, opt = prec.setup(model, opt, choice=choice)
    x_train, y_train = data.x_train, data.y_train
    if cfg.train_subset:
        x_train, y_train = x_train[:cfg.train_subset], y_train[:cfg.train_subset]
    return model, opt, prec, x_train, y_train


def _record_start(db: ResultsDB, cfg: CompareConfig, policy: Policy, seed: int, env: dict,
                  prec: Precision, model: nn.Module, x_train, y_train) -> None:
    """A fresh run's row, backend and memory ledger (measured without a trace)."""
    run_id = run_id_of(policy, seed)
    db.start_run(run_id, policy=str(policy), policy_spec=prec.policy.spec, seed=seed,
                 config=cfg.to_json(), versions=env["versions"], git=env["git"],
                 hardware={**env.get("hardware", {}), "torch_threads": _threads(cfg),
                           "backend_choice": prec.backend_choice.to_json(),
                           # whose 16-bit kernels an emulated run follows where CPU and CUDA
                           # round differently (Precision(target=); the device's by default)
                           "kernel_target": prec.kernel_target,
                           "layout": layout_of(model)})
    db.set_backend(run_id, prec.backend)
    if is_plan_spec(str(policy)):  # the plan as this run read it, for the report's section
        db.record_analysis(run_id, "plan", load_plan(str(policy)).to_json())
    batch = (x_train[:cfg.batch_size].clone(), y_train[:cfg.batch_size].clone())
    db.record_memory(run_id, _measure_memory(prec, model, batch))
    _record_coverage(db, run_id, prec)  # after the measured step's forward


def _record_coverage(db: ResultsDB, run_id: str, prec: Precision) -> None:
    """The modules a scaled-GEMM recipe cast (and the convolutions it left alone) in the
    forwards run so far, for the report and --json (analysis kind ``recipe_coverage``)."""
    coverage = prec.recipe_coverage()
    if coverage is not None and coverage["forwards"]:
        db.record_analysis(run_id, "recipe_coverage", coverage)


def start_run_record(db: ResultsDB, cfg: CompareConfig, data: Dataset, policy: Policy, seed: int,
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


def train_run(cfg: CompareConfig, data: Dataset, policy: Policy, seed: int, db: ResultsDB,
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


def _train_run(cfg: CompareConfig, data: Dataset, policy: Policy, seed: int, db: ResultsDB,
               out: Path, env: dict, progress: "Progress | None") -> str:
    progress = progress or Progress(1, True)
    run_id = run_id_of(policy, seed)
    ckpt_path = checkpoint_path(out, run_id)
    existing = db.run(run_id)
    if existing and existing["status"] in ("finished", "diverged"):
        progress.run_done(f"{policy} seed {seed}")
        return existing["status"]

    # a resumed run goes on with the backend it started on (auto's rule, or the CPU, may have
    # changed since); one this lowprec cannot run as stored (a stochastic-rounding policy an
    # older rule ran natively, without its roundings) is redone from its start
    stored, redo = _stored_choice(existing, policy)
    if redo is not None:
        warn_redone(policy, seed, redo)
        ckpt_path.unlink(missing_ok=True)  # (a later resume must not load the old run's)
        existing = None
    model, opt, prec, x_train, y_train = _set_up(cfg, data, policy, seed, stored)
    steps_per_epoch = math.ceil(len(x_train) / cfg.batch_size)
    start_epoch, records = _resume(db, cfg, policy, seed, env, existing, ckpt_path, model, opt,
                                   prec, x_train, y_train)
    if redo is not None:
        db.record_analysis(run_id, "redone", {"reason": redo})
    # the thread count this run trains with, measured where it trains
    db.record_analysis(run_id, "threads", {"threads": torch.get_num_threads()})
    progress.start_run(f"{policy} seed {seed}", cfg.epochs * steps_per_epoch,
                       start_epoch * steps_per_epoch)

    status, diverged_step = "finished", None
    for epoch in range(start_epoch, cfg.epochs):
        record, diverged_step = _run_epoch(cfg, data, model, opt, prec, x_train, y_train, seed,
                                           epoch, progress)
        if diverged_step is not None:
            status = "diverged"
        _record_epoch(db, run_id, record)
        progress.epoch_done(f"{policy} seed {seed}", epoch + 1, cfg.epochs,
                            train_loss=record["train_loss"], test_acc=record["test_acc"],
                            seconds=record["seconds"])
        if status == "diverged":
            break
        records.append(record)
        # the weights as a native run stores them (emulated fp16 as float16: half the bytes);
        # load_state_dict copies them back into the float32 carriers exactly
        atomic_save({"model": prec.checkpoint_state_dict(), "optimizer": opt.state_dict(),
                     "precision": prec.state_dict(), "epoch": epoch,
                     "rng": torch.get_rng_state(), "records": records}, ckpt_path)
    _finish_run(cfg, data, db, run_id, status, diverged_step, model, prec, x_train, y_train,
                ckpt_path, progress)
    return status


def redo_reason(existing: dict | None, policy: Policy) -> str | None:
    """Why a stored run that would resume must be redone from its start instead: it was run
    on a backend this lowprec cannot run its policy on (None: it resumes, or starts afresh)."""
    return _stored_choice(existing, policy)[1]


def warn_redone(policy, seed: int, reason: str) -> None:
    warn(f"lowprec: run {policy} seed {seed} is redone from its start: {reason}")


def _stored_choice(existing: dict | None, policy: Policy
                   ) -> tuple[BackendChoice | None, str | None]:
    """(the backend choice a resuming run was started on, or None for a fresh run; why the
    run must be redone instead, or None). Runs stored before choices were give their
    ``backend`` column."""
    if not resumable(existing):
        return None, None
    stored = (existing.get("hardware") or {}).get("backend_choice")
    if stored:
        choice = BackendChoice.from_json(stored)
    elif existing.get("backend"):
        choice = BackendChoice(Backend.parse(existing["backend"]), "stored with the run", True)
    else:
        return None, None
    own = Precision(policy).choose_backend(torch.device("cpu"))
    if choice.backend is not own.backend and not own.automatic:
        return None, f"it was run {choice.backend}, which cannot run it ({own.reason})"
    return BackendChoice(choice.backend, f"kept from the run's start: {choice.reason}",
                         choice.automatic), None


def _resume(db: ResultsDB, cfg: CompareConfig, policy: Policy, seed: int, env: dict, existing,
            ckpt_path: Path, model: nn.Module, opt, prec: Precision, x_train, y_train
            ) -> tuple[int, list[dict]]:
    """Where a run starts (its checkpoint loaded, or redone, or recorded afresh): the first
    epoch to train and the epoch records so far."""
    run_id = run_id_of(policy, seed)
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
    return start_epoch, records


def _run_epoch(cfg: CompareConfig, data: Dataset, model: nn.Module, opt, prec: Precision,
               x_train, y_train, seed: int, epoch: int, progress: Progress
               ) -> tuple[dict, int | None]:
    """One epoch trained and evaluated: its record and the step it diverged at (None if not)."""
    # the order of an epoch depends only on (seed, epoch): resuming reproduces it
    perm = torch.randperm(len(x_train),
                          generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    for group in opt.param_groups:
        group["lr"] = lr_at(cfg, epoch)
    meter = EpochMeter().start()
    trace_start, skipped0, nonfinite0 = len(prec.trace), prec.skipped, prec.nonfinite
    losses, steps, diverged_step = _train_steps(cfg, model, opt, prec, x_train, y_train, perm,
                                                meter, progress)
    timing = meter.stop()  # the training steps' time; evaluation is not counted
    finite = [v for v in losses if math.isfinite(v)]
    train_loss = sum(finite) / len(finite) if len(finite) == len(losses) else float("nan")
    if diverged_step is not None:
        test_loss, test_acc = float("nan"), float("nan")
    else:
        test_loss, test_acc = evaluate(model, prec, data.x_test, data.y_test)
    record = dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss,
                  test_acc=test_acc, skipped=prec.skipped - skipped0,
                  nonfinite=prec.nonfinite - nonfinite0, loss_scale=prec.loss_scale.scale,
                  trace=prec.trace[trace_start:], steps=steps, **timing)
    return record, diverged_step


def _train_steps(cfg: CompareConfig, model: nn.Module, opt, prec: Precision, x_train, y_train,
                 perm: torch.Tensor, meter: EpochMeter, progress: Progress
                 ) -> tuple[list[float], list[dict], int | None]:
    """An epoch's steps in ``perm``'s order: losses, step records, the diverged step (or None)."""
    n = len(x_train)
    losses, steps = [], []
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
            return losses, steps, prec.steps - 1
    return losses, steps, None


def _finish_run(cfg: CompareConfig, data: Dataset, db: ResultsDB, run_id: str, status: str,
                diverged_step: int | None, model: nn.Module, prec: Precision, x_train, y_train,
                ckpt_path: Path, progress: Progress) -> None:
    """A run's end: its coverage and analyses recorded, its status stored, its checkpoint gone."""
    _record_coverage(db, run_id, prec)  # every forward of this run's training
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


def _disk_error(err: BaseException, db_path: Path) -> RunIOError:
    if isinstance(err, RunIOError):
        return err
    return io_error(db_path, "results", err)


def record_config_file(out: Path, text: str | None) -> None:
    """The ``--config`` file a comparison was started with, as given: ``OUT/run.toml`` (its
    effective configuration is in results.db)."""
    if text is not None:
        atomic_write_bytes(out / CONFIG_FILE, text.encode(), "the configuration file")


def run_model(cfg: CompareConfig, executor=None, *, force_config: bool = False,
              config_text: str | None = None) -> Path:
    """Train every policy x seed of ``cfg`` (one model), store the results, write the report.
    Returns the run folder.

    ``executor`` decides where the runs execute: None runs them one after another in this
    process; :class:`lowprec.experiments.executors.RayExecutor` runs each as a Ray task. Either
    way this process is the only writer of results.db.

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
    tune_cpu_allocator()
    out = Path(cfg.out)
    # every refusal comes before the first write: a refused command changes nothing (what
    # needs no folder is checked before one is made)
    data = check_inputs(cfg, [cfg.model])
    _prepare_out(out)
    with FolderLock(out, "lowprec compare"):
        check_resume(out, cfg, force_config)
        remove_stale_temps(out)
        record_config_file(out, config_text)
        db_path = out / "results.db"
        try:
            (out / "checkpoints").mkdir(exist_ok=True)
            db = ResultsDB(db_path)
        except OSError as err:
            raise io_error(out, "the run folder", err) from None
        except sqlite3.OperationalError as err:
            raise io_error(db_path, "the results database", err) from None
        try:
            cfg = _check_and_record_config(db, cfg, force_config)
            if executor is None:
                _train_all(cfg, data, db, out)
            else:
                mark_unrequested(db, cfg)
                executor.execute(cfg, data, db, out, environment())
            write_report(out, db)
        except (OSError, sqlite3.OperationalError) as err:
            raise _disk_error(err, db_path) from None
        finally:
            db.close()
    return out


def _check_and_record_config(db: ResultsDB, cfg: CompareConfig, force: bool) -> CompareConfig:
    """``cfg`` with its threads resolved, checked against the stored configuration and
    recorded."""
    stored = db.stored_config()
    cfg = cfg.resolve_threads(stored)
    if stored is None:
        db.set_meta("config", cfg.to_json())
        return cfg
    diffs = config_differences(stored, cfg)
    if diffs and not force:
        raise RunError("--resume with another configuration (" + "; ".join(diffs) +
                       "): drop those flags to continue as stored, or add --force-config")
    if diffs:
        history = db.meta("forced_config") or []
        history.append({"time": time.time(), "differences": diffs, "config": cfg.to_json()})
        db.set_meta("forced_config", history)
        db.set_meta("config", cfg.to_json())
    return cfg


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
                    db.start_run(run_id, policy=str(policy), policy_spec=str(policy), seed=seed,
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
