"""Two CPU processes under torchrun (gloo): identical parameters and loss-scale traces for every
policy, an Inf planted on one rank included."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowprec import POLICIES

WORKER = Path(__file__).parent.parent / "support" / "ddp_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(3600)  # hang guards only: a loaded machine is slow, not hung
def test_two_ranks_end_identical_with_an_inf_on_one_rank(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           f"--master_port={_free_port()}", "--master_addr=127.0.0.1", str(WORKER), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert set(r0) == set(POLICIES)
    for name in POLICIES:
        a, b = r0[name], r1[name]
        for pa, pb in zip(a["params"], b["params"]):
            assert torch.equal(pa, pb), name
        assert a["trace"] == b["trace"], name
        assert a["scale"] == b["scale"]
        skipped = [t["step"] for t in a["trace"] if t["skipped"]]
        assert skipped == [3], (name, a["trace"])  # rank 1 skipped rank 0's Inf step too
        assert all(torch.isfinite(p).all() for p in a["params"])
