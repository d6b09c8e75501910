"""Where the runs of a comparison execute: on a Ray cluster, each (policy, seed) run a Ray task.

``run_compare(cfg)`` runs every run in its own process, one after another (the local executor,
the default). ``run_compare(cfg, RayExecutor(...))`` submits every run as a task of Ray
(Moritz et al. 2018, the engine under Ray Tune), with the resources asked for (CPUs, GPUs)
and ``max_retries``: Ray schedules them over the cluster, and runs again a task whose worker
died. lowprec writes no scheduler of its own.

The division of labour:

* the **driver** (the ``lowprec compare`` process) opens every run's row in results.db, ships
  the dataset once through Ray's object store, and is the only writer of results.db: SQLite has
  one writer, and a network file system is no place for SQLite's locks;
* a **task** checks that it sees the run folder (a token file the driver wrote), trains the run
  with :func:`lowprec.experiments.runner.train_run` and sends every write it would have made
  (epochs, memory ledger, analyses, status) and its progress to the driver through a Ray queue;
* **checkpoints** are written by the task into the run folder (``checkpoints/``, atomic
  rename), after every epoch: a retried task, or a later ``--resume``, continues from them and
  gives the same numbers as an uninterrupted run. The run folder must therefore be on storage
  that every node of the cluster mounts at the same path (NFS, a cluster file system);
  a task that cannot read the token fails the comparison with a one-line error naming it.
"""

from __future__ import annotations

import math
import os
import secrets
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from .config import RunError
from .runfolder import SHARED_TOKEN
from .checkpoints import checkpoint_path, resumable, run_id_of
from .progress import Progress
from .runner import failure_message, redo_reason, start_run_record, train_run, warn_redone

__all__ = ["RayExecutor", "SharedStorageError", "make_executor", "start_local_ray",
           "EXECUTORS", "TOKEN_FILE", "FAULT_ENV"]

EXECUTORS = ("local", "ray")
TOKEN_FILE = SHARED_TOKEN  # a run folder may hold it (runfolder.RUN_FILES)
#: test hook: "RUN_ID@EPOCH" makes the task of that run kill its own process once, after the
#: checkpoint of EPOCH (0-based) is written, as a node failure would (read by the driver)
FAULT_ENV = "LOWPREC_RAY_TEST_KILL"


class SharedStorageError(RuntimeError):
    """A Ray task cannot see the run folder the driver writes to."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RunError("--executor ray needs Ray: pip install 'lowprec[ray]' (or pip install "
                       "ray)") from None
    return ray


@contextmanager
def _worker_pythonpath():
    """Workers of a local instance are spawned with this process's environment: make the
    copy of lowprec this process imported importable there too (a source checkout run with
    PYTHONPATH=src, or an installed package)."""
    import lowprec

    root = str(Path(lowprec.__file__).resolve().parent.parent)
    old = os.environ.get("PYTHONPATH")
    parts = [root] + ([old] if old else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def start_local_ray(num_cpus: int | None = None) -> None:
    """Start a Ray instance on this machine (``num_cpus`` defaults to every CPU), without the
    dashboard, its workers able to import this lowprec.

    Its workers run at the driver's priority (``RAY_worker_niceness=0`` unless the user set it,
    as Ray's own job manager does for its entrypoints): Ray starts workers at niceness 15, and
    on a machine loaded by other work the runs, which are this command's whole job, got almost
    no CPU (benchmarks/RESULTS.md, figure F29)."""
    import logging

    ray = _import_ray()
    had = os.environ.get("RAY_worker_niceness")
    os.environ.setdefault("RAY_worker_niceness", "0")
    try:
        with _worker_pythonpath():
            # "local": a new instance of this process's own, even where someone ran
            # `ray start` on this node or RAY_ADDRESS is set (ray.init() would join those)
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count(),
                     include_dashboard=False, logging_level=logging.WARNING,
                     configure_logging=True)
    finally:
        if had is None:
            os.environ.pop("RAY_worker_niceness", None)


class RayExecutor:
    """Each run a Ray task: ``num_cpus=cpus_per_run``, ``num_gpus=gpus_per_run``,
    ``max_retries`` (a task whose worker dies is run again, from its checkpoint).

    ``cpus_per_run`` is what Ray reserves, not what the run computes with: a run trains with
    the comparison's ``threads`` (CompareConfig.threads) wherever it runs, so its numbers do
    not depend on the reservation. Default: ``threads`` CPUs, at most those of the cluster's
    largest node (a run is never unschedulable by default).

    ``address`` connects to an existing cluster (``ray start --head`` printed it; "auto" finds
    one on this node); without it a local instance is started with ``num_cpus`` CPUs (default:
    every CPU of this machine) and stopped at the end. A Ray instance already initialized in
    this process is used as it is. A run that no node could ever hold (more CPUs or GPUs than
    the largest node has) is refused with RunError before any task is submitted: Ray would
    wait for such a node for ever."""

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None,
                 cpus_per_run: float | None = None, gpus_per_run: float = 0,
                 max_retries: int = 3):
        for name, value, ok, why in [
                ("cpus_per_run", cpus_per_run, cpus_per_run is None or (
                    _number(cpus_per_run) and cpus_per_run > 0), "a positive finite number"),
                ("gpus_per_run", gpus_per_run, _number(gpus_per_run) and gpus_per_run >= 0,
                 "a finite number >= 0"),
                ("max_retries", max_retries, isinstance(max_retries, int)
                 and not isinstance(max_retries, bool) and max_retries >= 0,
                 "an integer >= 0"),
                ("num_cpus", num_cpus, num_cpus is None or (
                    isinstance(num_cpus, int) and not isinstance(num_cpus, bool)
                    and num_cpus > 0), "a positive integer")]:
            if not ok:
                raise ValueError(f"{name}={value!r} is not valid (must be {why})")
        if address is not None and num_cpus is not None:
            raise ValueError("num_cpus is for a local Ray instance; a cluster at --ray-address "
                             "has its own CPUs")
        if num_cpus is not None and cpus_per_run is not None and cpus_per_run > num_cpus:
            raise ValueError(f"cpus_per_run={cpus_per_run:g} is more than the {num_cpus} CPUs "
                             "of the local Ray instance (num_cpus): no run could ever start")
        self.address, self.num_cpus = address, num_cpus
        self.cpus_per_run, self.gpus_per_run, self.max_retries = (cpus_per_run, gpus_per_run,
                                                                  max_retries)

    def __repr__(self) -> str:
        where = self.address or f"local, {self.num_cpus or os.cpu_count()} CPUs"
        cpus = "threads" if self.cpus_per_run is None else f"{self.cpus_per_run:g}"
        return (f"RayExecutor({where}; {cpus} CPU, {self.gpus_per_run:g} GPU per run, "
                f"{self.max_retries} retries)")

    def preflight(self) -> None:
        """Refuse, before a run folder is created or Ray started, what can never run: a
        cluster address where nothing listens or something other than Ray does (seconds of
        :func:`_probe`, not Ray's minutes of retries, or its wait for ever), more CPUs or GPUs
        per run than this machine (a local instance still to start) or the running instance's
        largest node has. RunError, one line."""
        ray = _import_ray()
        if self.address is not None:
            _probe(self.address)
        if ray.is_initialized():
            self.check_fits(_largest_node(ray), "the largest node of the running Ray instance")
        elif self.address is None:
            import torch

            have = {"CPU": self.num_cpus or os.cpu_count() or 1,
                    "GPU": torch.cuda.device_count() if torch.cuda.is_available() else 0}
            self.check_fits(have, "this machine (the local Ray instance to start)")

    def check_fits(self, have: dict, where: str) -> None:
        """RunError unless one node with ``have`` resources ({"CPU": n, "GPU": n}) can hold a
        run (a default cpus_per_run always fits)."""
        for key, name, want in (("CPU", "cpus_per_run", self.cpus_per_run),
                                ("GPU", "gpus_per_run", self.gpus_per_run)):
            if want and want > have.get(key, 0):
                flag = "--" + name.replace("_", "-")
                raise RunError(f"{name}={want:g} ({flag}) is more than the {have.get(key, 0):g} "
                               f"{key}s of {where}: no run could ever start")

    def _cpus_for(self, cfg, have: dict) -> float:
        if self.cpus_per_run is not None:
            return self.cpus_per_run
        return max(1, min(cfg.threads or 1, have.get("CPU", 1)))

    @contextmanager
    def connected(self):
        """Connected to Ray (started if need be) for the whole block: several comparisons
        share one instance (a comparison over several models)."""
        ray = _import_ray()
        if ray.is_initialized():
            yield
            return
        self._connect(ray)
        try:
            yield
        finally:
            ray.shutdown()

    def _connect(self, ray) -> None:
        if self.address is None:
            start_local_ray(self.num_cpus)
            return
        import logging

        _probe(self.address)
        from ray.exceptions import AuthenticationError

        try:
            ray.init(address=self.address, logging_level=logging.WARNING)
        except AuthenticationError as err:
            raise RunError(f"the Ray cluster at {self.address!r} asks for its token "
                           f"({str(err).splitlines()[0] if str(err) else err}): set "
                           "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the token `ray "
                           "get-auth-token` prints on the head node (docs/scaling.md)") from None
        except (ConnectionError, ValueError, RuntimeError) as err:
            raise RunError(f"cannot connect to the Ray cluster at {self.address!r}: "
                           f"{str(err).splitlines()[0] if str(err) else err}") from None

    def execute(self, cfg, data, db, out: Path, env: dict) -> None:
        """Run every (policy, seed) of ``cfg`` not yet finished as a task; write what the tasks
        send into ``db``; record a task that failed for good as failed. A run that starts
        afresh gets its row (and memory ledger) from this driver first, so that a task, and a
        task retried, only ever continues it: from its checkpoint when there is one."""
        runs = [(p, s) for p in cfg.policies for s in cfg.seeds]
        out = Path(out).resolve()
        with Progress(len(runs), cfg.quiet) as progress:
            todo = []
            for policy, seed in runs:
                existing = db.run(run_id_of(policy, seed))
                if existing and existing["status"] in ("finished", "diverged"):
                    progress.run_done(f"{policy} seed {seed}")
                    continue
                todo.append((policy, seed))
            if not todo:
                return
            ray = _import_ray()
            started = not ray.is_initialized()
            if started:
                self._connect(ray)
            try:
                have = _largest_node(ray)  # what the cluster is, before any run is opened
                self.check_fits(have, "the largest node of the Ray cluster")
                stored = {}  # run id -> its row's hardware and backend (the choice it resumes on)
                for policy, seed in todo:
                    run_id = run_id_of(policy, seed)
                    existing = db.run(run_id)
                    redo = redo_reason(existing, policy)  # stored on a backend it cannot run on
                    if redo is not None:
                        warn_redone(policy, seed, redo)
                    if redo is not None or not (resumable(existing) and
                                                db.memory(run_id) is not None):
                        checkpoint_path(out, run_id).unlink(missing_ok=True)  # not this row's
                        start_run_record(db, cfg, data, policy, seed, env)
                        if redo is not None:
                            db.record_analysis(run_id, "redone", {"reason": redo})
                    row = db.run(run_id) or {}
                    stored[run_id] = {k: row.get(k) for k in ("hardware", "backend")}
                self._execute(ray, cfg, data, todo, db, out, progress,
                              self._cpus_for(cfg, have), stored)
            finally:
                if started:
                    ray.shutdown()

    def _execute(self, ray, cfg, data, todo, db, out: Path, progress, cpus: float,
                 stored: dict) -> None:
        from ray.util.queue import Queue

        token = secrets.token_hex(16)
        token_path = out / TOKEN_FILE
        token_path.write_text(token)
        fault = os.environ.get(FAULT_ENV) or None
        queue = Queue(actor_options={"num_cpus": 0})
        task = ray.remote(_run_task).options(num_cpus=cpus, num_gpus=self.gpus_per_run,
                                             max_retries=self.max_retries)
        data_ref = ray.put(data)  # once in the object store, not once per task
        pending = {task.remote(cfg, data_ref, policy, seed, str(out), token, queue, fault,
                               stored.get(run_id_of(policy, seed), {})):
                   (policy, seed) for policy, seed in todo}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
                _drain(queue, db, progress)
                for ref in ready:
                    policy, seed = pending.pop(ref)
                    try:
                        ray.get(ref)
                    except SharedStorageError as err:
                        raise RunError(str(getattr(err, "cause", None) or err).splitlines()[-1]
                                       ) from None
                    except Exception as err:  # failed for good (retries spent, or a bug)
                        _drain(queue, db, progress)
                        db.finish_run(run_id_of(policy, seed), "failed", error=failure_message(
                            getattr(err, "cause", None) or err))
                        progress.run_done(f"{policy} seed {seed}")
            _drain(queue, db, progress)
        finally:
            for ref in pending:  # interrupted or failed: stop what still runs
                ray.cancel(ref, force=True)
            if pending:
                _drain(queue, db, progress)
            queue.shutdown(force=True)
            token_path.unlink(missing_ok=True)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _largest_node(ray) -> dict:
    """The most CPUs and GPUs one live node of the connected cluster has: a task must fit on
    one node."""
    nodes = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]
    return {key: max((r.get(key, 0) for r in nodes), default=0) for key in ("CPU", "GPU")}


#: seconds each step of the check of --ray-address may take (the TCP connect, the HTTP/2
#: greeting, the question to Ray's GCS) before the address is refused
PROBE_TIMEOUT = 5.0

#: the HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113 3.4, 6.5): a
#: gRPC server, which Ray's GCS and its client server are, answers with a SETTINGS frame
_H2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _probe(address: str) -> None:
    """RunError, in seconds, unless a HOST:PORT address (also ray://HOST:PORT) is a Ray
    cluster's: something accepts a TCP connection there, answers HTTP/2 (gRPC) and, for a GCS
    address, knows the GCS's NodeInfoGcsService (a cluster asking for its token counts: the
    connect then says what to set). "auto" and other forms are left to Ray, which fails fast on
    them. Ray's own connect retries for minutes where nothing listens, and for ever where a
    server of another kind (an HTTP server) does."""
    where = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = where.rpartition(":")
    if not sep or not port.isdigit():
        return
    host = host.strip("[]") or "127.0.0.1"
    prefix = f"cannot connect to the Ray cluster at {address!r}:"
    try:
        sock = socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT)
    except (OSError, OverflowError, ValueError) as err:
        why = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise RunError(f"{prefix} nothing accepts a connection at {host}:{port} ({why}; "
                       f"waited at most {PROBE_TIMEOUT:g} s)") from None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        sock.close()  # a TLS handshake first: Ray's own connect checks the rest
        return
    try:
        found = _greeting(sock)
    finally:
        sock.close()
    if found:
        raise RunError(f"{prefix} the server at {host}:{port} is not Ray: {found}")
    if not address.startswith("ray://"):  # a GCS (the client server has other services)
        found = _gcs_question(f"{host}:{port}")
        if found:
            raise RunError(f"{prefix} the server at {host}:{port} is not Ray's GCS: {found}")


def _greeting(sock: socket.socket) -> str | None:
    """None if the server at the other end of ``sock`` answers an HTTP/2 greeting with
    HTTP/2's SETTINGS frame, else what it did, in a few words."""
    got = b""
    deadline = time.monotonic() + PROBE_TIMEOUT
    try:
        sock.sendall(_H2_HELLO)
        while len(got) < 9:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout
            sock.settimeout(left)
            chunk = sock.recv(256)
            if not chunk:
                break
            got += chunk
    except socket.timeout:
        if not got:
            return f"it said nothing in {PROBE_TIMEOUT:g} s to an HTTP/2 (gRPC) greeting"
    except OSError as err:
        if not got:
            return f"it closed the connection ({err.strerror or err}) at an HTTP/2 greeting"
    if len(got) >= 9 and got[3] == 4:  # a frame header whose type is SETTINGS
        return None
    if not got:
        return "it closed the connection at an HTTP/2 (gRPC) greeting"
    if got.startswith(b"HTTP/"):
        line = got.split(b"\r\n", 1)[0].decode("latin-1")[:80]
        return f"an HTTP/1 server answered ({line!r}), not HTTP/2 (gRPC)"
    if got.lstrip().startswith(b"<"):  # an HTTP server answering without a status line
        first = got.lstrip().split(b"\n", 1)[0].decode("latin-1").strip()[:40]
        return f"it answered with HTML ({first!r}: an HTTP server?), not HTTP/2 (gRPC)"
    return f"it answered {got[:24]!r}, not HTTP/2 (gRPC)"


def _gcs_question(target: str) -> str | None:
    """None if the gRPC server at ``target`` knows Ray's NodeInfoGcsService (its GetClusterId
    answers, or asks for the cluster's token), else what it said. None as well where this Ray
    has no such stub (another version): Ray's connect decides then."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
        stub_class = gcs_service_pb2_grpc.NodeInfoGcsServiceStub
        request = gcs_service_pb2.GetClusterIdRequest()
    except (ImportError, AttributeError):
        return None
    channel = grpc.insecure_channel(target)
    try:
        stub_class(channel).GetClusterId(request, timeout=PROBE_TIMEOUT)
    except grpc.RpcError as err:
        code = err.code() if callable(getattr(err, "code", None)) else None
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return None  # Ray, with token authentication: the connect says what to set
        name = getattr(code, "name", "an error")
        details = err.details() if callable(getattr(err, "details", None)) else ""
        return (f"its gRPC answer to GetClusterId was {name}"
                + (f" ({_first_line(details)[:120]})" if details else ""))
    finally:
        channel.close()
    return None


def _first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _drain(queue, db, progress) -> None:
    """Apply what the tasks sent, in the order each sent it."""
    while True:
        n = queue.qsize()
        if not n:
            return
        for kind, method, args, kwargs in queue.get_nowait_batch(n):
            target = db if kind == "db" else progress
            getattr(target, method)(*args, **kwargs)


# -- the task (runs in a Ray worker process) -------------------------------------------------

def _run_task(cfg, data, policy, seed: int, out: str, token: str, queue,
              fault: str | None, stored: dict | None = None) -> str:
    from .system import tune_cpu_allocator

    out_path = Path(out)
    _check_shared(out_path, token)
    tune_cpu_allocator()  # train_run sets cfg.threads, as in the driver's process
    sink = _QueueSink(queue, out_path, fault, stored)
    try:
        return train_run(cfg, data, policy, seed, sink, out_path, {}, sink)
    finally:
        sink.flush()


def _check_shared(out: Path, token: str) -> None:
    try:
        seen = (out / TOKEN_FILE).read_text()
    except OSError:
        seen = None
    if seen != token:
        raise SharedStorageError(
            f"the run folder {out} is not shared with the Ray worker on {socket.gethostname()} "
            f"(it cannot read {TOKEN_FILE} there): put --out on storage every node mounts at "
            "the same path")


class _QueueSink:
    """In a task: results.db for :func:`train_run` (its writes shipped to the driver; its two
    reads answered as for a run the driver opened: running, ledger recorded) and its progress
    bar (step counts batched: a few messages a second)."""

    _DB = ("set_backend", "record_memory", "truncate", "record_epoch", "record_analysis",
           "finish_run")

    def __init__(self, queue, out: Path, fault: str | None, stored: dict | None = None
                 ) -> None:
        self.queue, self.out = queue, out
        self.stored = stored or {}  # the row's hardware and backend: the choice it resumes on
        self.name = None
        self.pending = 0
        self.last = time.monotonic()
        self.fault_run, _, epoch = (fault or "").rpartition("@")
        self.fault_epoch = int(epoch) if fault else None
        self.armed = False

    # -- the two reads of train_run
    def run(self, run_id: str) -> dict:
        return {**self.stored, "run_id": run_id, "status": "running", "error": None}

    def memory(self, run_id: str) -> dict:
        return {"run_id": run_id}

    def _send(self, kind: str, method: str, *args, **kwargs) -> None:
        self.flush()
        self.queue.put((kind, method, args, kwargs))

    def flush(self) -> None:
        if self.pending and self.name is not None:
            self.queue.put(("progress", "step", (self.pending, self.name), {}))
        self.pending = 0
        self.last = time.monotonic()

    def __getattr__(self, method):
        if method in self._DB:
            return lambda *args, **kwargs: self._after(method, args, kwargs)
        raise AttributeError(method)

    def _after(self, method, args, kwargs) -> None:
        self._send("db", method, *args, **kwargs)
        if (method == "record_epoch" and args[0] == self.fault_run
                and args[1] == self.fault_epoch):
            self.armed = True  # the checkpoint of this epoch is written before the next step

    # -- the progress bar of train_run
    def start_run(self, name: str, total_steps: int, done_steps: int = 0) -> None:
        self.flush()
        self.name = name
        self._send("progress", "start_run", name, total_steps, done_steps)

    def step(self, n: int = 1) -> None:
        if self.armed:
            self._die_once()
        self.pending += n
        if time.monotonic() - self.last > 0.25:
            self.flush()

    def epoch_done(self, name: str, epoch: int, epochs: int, **numbers) -> None:
        self._send("progress", "epoch_done", name, epoch, epochs, **numbers)

    def run_done(self, name: str | None = None) -> None:
        self._send("progress", "run_done", name or self.name)

    def _die_once(self) -> None:
        self.armed = False
        marker = checkpoint_path(self.out, self.fault_run).with_suffix(".killed")
        if marker.exists():
            return
        marker.write_text(self.name or "")
        self.flush()
        os._exit(1)  # no cleanup, no exception: as a killed worker process


def make_executor(name: str = "local", *, address: str | None = None,
                  num_cpus: int | None = None, cpus_per_run: float | None = None,
                  gpus_per_run: float | None = None, max_retries: int | None = None):
    """The executor the CLI's flags describe: None for the local one."""
    if name not in EXECUTORS:
        raise ValueError(f"executor={name!r}; accepted: {', '.join(EXECUTORS)}")
    ray_only = {"--ray-address": address, "--ray-num-cpus": num_cpus,
                "--cpus-per-run": cpus_per_run, "--gpus-per-run": gpus_per_run,
                "--max-retries": max_retries}
    if name == "local":
        given = [flag for flag, v in ray_only.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} "
                             "--executor ray")
        return None
    kw = {k: v for k, v in (("cpus_per_run", cpus_per_run), ("gpus_per_run", gpus_per_run),
                            ("max_retries", max_retries)) if v is not None}
    return RayExecutor(address, num_cpus=num_cpus, **kw)
