"""`lowprec compare --executor ray`: every run a Ray task on a local instance with 2 CPUs; the
numbers equal the local executor's, a killed worker is retried from its checkpoint."""

import sqlite3

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'lowprec[ray]' "
                                        "(make test installs it)")

from lowprec.cli import main  # noqa: E402
from lowprec.experiments import CompareConfig, run_compare  # noqa: E402
from lowprec.experiments import executors  # noqa: E402
from lowprec.experiments.executors import FAULT_ENV, RayExecutor, start_local_ray  # noqa: E402
from lowprec.experiments.results import ResultsDB  # noqa: E402

POLICIES = ("32-true", "bf16-true")


@pytest.fixture(scope="module")
def local_ray():
    """One Ray instance for the module (starting one costs seconds)."""
    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


def tiny(out, **kw):
    base = dict(data="digits", model="mlp", policies=POLICIES, seeds=(0, 1), epochs=2,
                batch_size=64, out=str(out), quiet=True)
    base.update(kw)
    return CompareConfig(**base)


def stored(path):
    """Everything a run stores that must not depend on where it ran (not wall-clock times)."""
    c = sqlite3.connect(path / "results.db")
    out = {
        "runs": c.execute("SELECT run_id, policy, policy_spec, seed, backend, status, "
                          "diverged_step, error FROM runs ORDER BY run_id").fetchall(),
        "epochs": c.execute("SELECT run_id, epoch, train_loss, test_loss, test_acc, skipped, "
                            "nonfinite, loss_scale FROM epochs ORDER BY run_id, epoch"
                            ).fetchall(),
        "memory": c.execute("SELECT * FROM memory ORDER BY run_id").fetchall(),
        "trace": c.execute("SELECT * FROM scale_trace ORDER BY run_id, step").fetchall(),
        "steps": c.execute("SELECT * FROM steps ORDER BY run_id, step").fetchall(),
        "analysis": c.execute("SELECT * FROM analysis ORDER BY run_id, kind").fetchall(),
    }
    c.close()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The local executor with its defaults (torch's thread count of this process)."""
    return stored(run_compare(tiny(tmp_path_factory.mktemp("local") / "r")))


def test_ray_stores_the_same_numbers_as_the_local_executor(local_ray, reference, tmp_path):
    # a run's numbers do not depend on the CPUs Ray reserves for it: the thread count is the
    # comparison's (CompareConfig.threads, default this process's), not the reservation's
    cpus = 1 if torch.get_num_threads() != 1 else 2
    out = run_compare(tiny(tmp_path / "r"), RayExecutor(cpus_per_run=cpus, max_retries=1))
    got = stored(out)
    assert [r[5] for r in got["runs"]] == ["finished"] * 4
    assert len(got["epochs"]) == 8 and len(got["analysis"]) > 8
    assert got == reference
    assert not list((out / "checkpoints").glob("*.pt"))  # finished runs leave no checkpoint
    assert not (out / executors.TOKEN_FILE).exists()
    assert "| bf16-true |" in (out / "report.md").read_text()


def test_a_killed_worker_is_retried_and_resumes_from_its_checkpoint(local_ray, reference,
                                                                    tmp_path, monkeypatch):
    killed = f"{POLICIES[1]}|seed=1"
    monkeypatch.setenv(FAULT_ENV, f"{killed}@0")  # after epoch 0's checkpoint
    truncations = []
    original = ResultsDB.truncate

    def spy(self, run_id, *, last_epoch, last_step):  # the driver applies what tasks send
        truncations.append((run_id, last_epoch))
        return original(self, run_id, last_epoch=last_epoch, last_step=last_step)

    monkeypatch.setattr(ResultsDB, "truncate", spy)
    out = run_compare(tiny(tmp_path / "r"), RayExecutor(cpus_per_run=1, max_retries=2))
    marker = next((out / "checkpoints").glob("*.killed"))  # the worker did die
    assert marker.read_text() == killed.replace("|seed=", " seed ")
    # first attempt from scratch, the retry from the checkpoint of epoch 0
    assert [e for r, e in truncations if r == killed] == [-1, 0]
    assert stored(out) == reference


def test_retries_spent_is_a_failed_run_and_the_others_finish(local_ray, tmp_path,
                                                             monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "32-true|seed=0@0")
    out = run_compare(tiny(tmp_path / "r", seeds=(0,), epochs=2),
                      RayExecutor(cpus_per_run=1, max_retries=0))
    db = ResultsDB(out / "results.db", create=False)
    status = {r["run_id"]: (r["status"], r["error"]) for r in db.runs()}
    db.close()
    assert status["32-true|seed=0"][0] == "failed" and status["32-true|seed=0"][1]
    assert status["bf16-true|seed=0"] == ("finished", None)


def test_a_run_folder_the_workers_cannot_see_is_one_line_error(local_ray, tmp_path,
                                                               monkeypatch, capsys):
    # the driver writes its token where the workers do not look: as a folder not shared
    monkeypatch.setattr(executors, "TOKEN_FILE", ".token-only-the-driver-sees")
    out = tmp_path / "r"
    code = main(["compare", "--executor", "ray", "--data", "digits", "--model", "mlp",
                 "--policies", "32-true", "--seeds", "1", "--epochs", "1", "--out", str(out),
                 "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert str(out) in err and "not shared with the Ray worker" in err


def test_cli_compare_on_ray_prints_the_summary(local_ray, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["compare", "--executor", "ray", "--cpus-per-run", "1", "--data", "digits",
                 "--model", "mlp", "--policies", "32-true", "--seeds", "1", "--epochs", "1",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "32-true" in text and "test acc" in text and "report" in text


@pytest.mark.parametrize("args, needle", [
    (["--ray-address", "auto"], "--ray-address needs --executor ray"),
    (["--executor", "spark"], "executor='spark'; accepted: local, ray"),
    (["--executor", "ray", "--cpus-per-run", "0"], "cpus_per_run=0.0 is not valid"),
    (["--executor", "ray", "--gpus-per-run", "-1"], "gpus_per_run=-1.0 is not valid"),
    (["--executor", "ray", "--ray-address", "auto", "--ray-num-cpus", "2"],
     "num_cpus is for a local Ray instance"),
])
def test_bad_executor_flags_are_one_line(args, needle, tmp_path, capsys):
    code = main(["compare", "--data", "digits", "--out", str(tmp_path / "r"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "r").exists()  # nothing started


def test_the_thread_count_is_stored_and_honoured(local_ray, tmp_path):
    threads = 1 if torch.get_num_threads() != 1 else 2
    caller = torch.get_num_threads()
    local = run_compare(tiny(tmp_path / "local", policies=("32-true",), seeds=(0,), epochs=1,
                             threads=threads))
    assert torch.get_num_threads() == caller  # the caller's count is given back
    # a Ray task reserving another number of CPUs still runs the comparison's thread count
    on_ray = run_compare(tiny(tmp_path / "ray", policies=("32-true",), seeds=(0,), epochs=1,
                              threads=threads), RayExecutor(cpus_per_run=2 if threads == 1
                                                            else 1, max_retries=0))
    for out in (local, on_ray):
        db = ResultsDB(out / "results.db", create=False)
        try:
            assert db.stored_config()["threads"] == threads
            run = db.runs()[0]
            assert run["config"]["threads"] == threads
            # measured in the process that trained the run
            assert db.analysis(run["run_id"], "threads") == {"threads": threads}
        finally:
            db.close()
    assert stored(local) == stored(on_ray)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", [
    (["--gpus-per-run", str(torch.cuda.device_count() + 1)], "gpus_per_run="),
    (["--ray-address", "127.0.0.1:1"], "127.0.0.1:1"),
    (["--cpus-per-run", "4", "--ray-num-cpus", "2"], "cpus_per_run=4"),
    (["--cpus-per-run", "inf"], "cpus_per_run=inf"),
    (["--gpus-per-run", "inf"], "gpus_per_run=inf"),
], ids=["gpus-absent", "address-closed", "cpus-over-instance", "cpus-inf", "gpus-inf"])
def test_a_run_ray_cannot_schedule_is_refused_not_waited_for(args, needle, tmp_path, capsys):
    out = tmp_path / "r"
    code = main(["compare", "--executor", "ray", "--data", "digits", "--model", "mlp",
                 "--policies", "32-true", "--seeds", "1", "--epochs", "1", "--out", str(out),
                 "--quiet", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("lowprec compare: error: ") and needle in err, err
    assert "Traceback" not in err
    assert not out.exists()  # refused before anything was created


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag, needle", [
    ("--gpus-per-run", "gpus_per_run="), ("--cpus-per-run", "cpus_per_run=")])
def test_more_than_the_running_instance_has_is_refused(local_ray, flag, needle, tmp_path,
                                                       capsys):
    have = ray.cluster_resources().get("GPU" if "gpus" in flag else "CPU", 0)
    out = tmp_path / "r"
    code = main(["compare", "--executor", "ray", flag, str(int(have) + 1), "--data", "digits",
                 "--model", "mlp", "--policies", "32-true", "--seeds", "1", "--epochs", "1",
                 "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


DRIVER = ("import sys; from lowprec.cli import main; sys.exit(main(sys.argv[1:]))")
#: the driver stops itself (SIGSTOP) as soon as it has stored its first epoch row: from then on
#: it stores nothing, as a driver that hangs or is about to die, whatever else its task sent
STOPPING_DRIVER = """
import os, signal, sys
from lowprec.cli import main
from lowprec.experiments.results import ResultsDB
record_epoch = ResultsDB.record_epoch
def stop_after(self, *args, **kwargs):
    record_epoch(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGSTOP)
ResultsDB.record_epoch = stop_after
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_a_killed_driver_resumes_to_the_numbers_of_an_uninterrupted_run(local_ray, tmp_path):
    """The driver stops storing after epoch 0's row (it SIGSTOPs itself right after storing it,
    as a driver that is slow or about to die), its task goes on to the checkpoint of epoch 2
    and its process dies there (FAULT_ENV), then the driver and its Ray instance are
    SIGKILLed: the checkpoint is two epochs ahead of results.db, every time. --resume gives
    back every number of an uninterrupted comparison."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    from lowprec.experiments.checkpoints import checkpoint_path

    run_id = "q6.10-sr|seed=0"
    flags = dict(policies=("q6.10-sr",), seeds=(0,), epochs=4, batch_size=16, train_subset=512)
    out = tmp_path / "r"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    env[FAULT_ENV] = f"{run_id}@2"  # the task's process dies after its checkpoint of epoch 2
    argv = ["compare", "--executor", "ray", "--ray-num-cpus", "1", "--cpus-per-run", "1",
            "--max-retries", "0", "--data", "digits", "--model", "mlp", "--policies",
            "q6.10-sr", "--seeds", "1", "--epochs", "4", "--batch-size", "16",
            "--train-subset", str(flags["train_subset"]), "--out", str(out), "--quiet"]
    proc = subprocess.Popen([sys.executable, "-c", STOPPING_DRIVER, *argv], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ckpt = checkpoint_path(out, run_id)
    marker = ckpt.with_suffix(".killed")

    def rows():
        c = sqlite3.connect(f"file:{out / 'results.db'}?mode=ro", uri=True, timeout=5)
        try:
            return [e for (e,) in c.execute("SELECT epoch FROM epochs ORDER BY epoch")]
        finally:
            c.close()

    try:
        deadline = time.monotonic() + 180
        # the task's marker is written just before its process exits; the driver stops itself
        # after its first row whenever it drains it (before it looks at the task's end)
        while not (marker.exists() and
                   psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED):
            assert proc.poll() is None, "the driver ended before its task died"
            assert time.monotonic() < deadline, (
                f"no stopped driver and dead task in 180 s (task died: {marker.exists()})")
            time.sleep(0.05)
    finally:
        family = [proc.pid] + ([c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
                               if proc.poll() is None else [])
        for pid in reversed(family):  # the driver and the Ray instance it started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    assert rows() == [0]  # the driver stored epoch 0's row and nothing after it
    assert torch.load(ckpt, weights_only=False)["epoch"] == 2  # two epochs ahead of it
    marker.unlink()

    run_compare(tiny(out, resume=True, **flags), RayExecutor(cpus_per_run=1, max_retries=0))
    reference = run_compare(tiny(tmp_path / "local", **flags))
    got, want = stored(out), stored(reference)
    assert [r[:2] for r in got["epochs"]] == [r[:2] for r in want["epochs"]]
    assert got == want


def test_the_local_instance_runs_its_workers_at_the_drivers_priority(local_ray):
    """Ray starts workers at niceness 15: on a loaded machine the runs (the command's whole
    job) starved (941 s for one test beside four busy processes, 2-core AMD EPYC with AVX2);
    lowprec's local instance asks for the driver's priority."""
    import os

    @ray.remote
    def niceness():
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)


class _QuietHTTP(__import__("http.server").server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    """An HTTP server on a free port of this machine, in a thread: an open port that is not
    Ray (Ray's connect waited for it for ever)."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHTTP)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(120)
def test_an_address_whose_port_is_not_ray_is_refused_in_one_line(http_server, tmp_path,
                                                                 capsys):
    out = tmp_path / "r"
    code = main(["compare", "--executor", "ray", "--ray-address", http_server, "--data",
                 "digits", "--model", "mlp", "--policies", "32-true", "--seeds", "1",
                 "--epochs", "1", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("lowprec compare: error: cannot connect to the Ray cluster at "
                          f"'{http_server}': the server at {http_server} is not Ray: "), err
    assert "HTML" in err and "not HTTP/2" in err, err
    assert not out.exists()  # refused before anything was created
    # the connect itself (a Ray client address here) is refused the same way, before ray.init
    with pytest.raises(executors.RunError, match=f"'ray://{http_server}': the server at "
                       f"{http_server} is not Ray: it answered with HTML"):
        RayExecutor(f"ray://{http_server}")._connect(ray)


@pytest.mark.timeout(120)
def test_a_grpc_server_that_is_not_rays_gcs_is_refused():
    from concurrent import futures

    grpc = pytest.importorskip("grpc")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(executors.RunError, match=rf"127.0.0.1:{port} is not Ray's GCS: its "
                           "gRPC answer to GetClusterId was UNIMPLEMENTED"):
            RayExecutor(f"127.0.0.1:{port}").preflight()
    finally:
        server.stop(None)


@pytest.mark.timeout(120)
def test_a_port_that_accepts_and_stays_silent_is_refused(monkeypatch):
    import socket

    monkeypatch.setattr(executors, "PROBE_TIMEOUT", 0.5)
    with socket.socket() as silent:  # listening: the kernel accepts, nobody ever answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        with pytest.raises(executors.RunError, match="is not Ray: it said nothing in 0.5 s"):
            RayExecutor(f"127.0.0.1:{port}").preflight()


def test_the_address_check_accepts_a_real_gcs(local_ray):
    """The check refuses no real cluster: the running instance's GCS (with Ray's token
    authentication, on by default in Ray 2.60, the question is answered or refused as Ray's)."""
    executors._probe(ray.get_runtime_context().gcs_address)


def test_a_run_stored_on_a_backend_that_cannot_run_it_is_redone_by_the_driver(local_ray,
                                                                             tmp_path):
    """As the local executor: a stochastic-rounding run stored as native (an older rule's
    choice) is redone from its start, emulated, with a warning and its reason stored; and a
    run that resumes gets its stored choice in the task (the sink answers with its row's)."""
    import json
    from dataclasses import replace

    cfg = tiny(tmp_path / "r", policies=("p=bf16,c=bf16:sr,g=bf16",), seeds=(0,))
    executor = RayExecutor(cpus_per_run=1, max_retries=0)
    out = run_compare(cfg, executor)
    before = stored(out)
    c = sqlite3.connect(out / "results.db")
    c.execute("UPDATE runs SET status = 'running', finished = NULL")
    c.execute("DELETE FROM epochs WHERE epoch > 0")
    hw = json.loads(c.execute("SELECT hardware FROM runs").fetchone()[0])
    hw["backend_choice"] = {"backend": "native", "reason": "fast", "automatic": True}
    c.execute("UPDATE runs SET hardware = ?", (json.dumps(hw),))
    c.commit()
    c.close()
    with pytest.warns(UserWarning, match="redone from its start: .*nearest-even"):
        run_compare(replace(cfg, resume=True), executor)
    after = stored(out)
    assert after["epochs"] == before["epochs"] and after["runs"] == before["runs"]
    db = ResultsDB(out / "results.db", create=False)
    run = db.runs()[0]
    assert run["backend"] == "emulated" and "nearest-even" in db.analysis(
        run["run_id"], "redone")["reason"]
    sink = executors._QueueSink(None, out, None, {k: run[k] for k in ("hardware", "backend")})
    assert sink.run(run["run_id"])["hardware"]["backend_choice"]["backend"] == "emulated"
