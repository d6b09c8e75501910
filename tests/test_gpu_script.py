"""benchmarks/gpu.py, the one command a session lent a GPU runs: here in its dry mode (tiny
sizes, on the CPU) so that it cannot rot, and its answer on a machine without CUDA."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env)


@pytest.mark.timeout(1800)
def test_dry_run_writes_every_section(tmp_path):
    res = _run("--dry", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["dry"] is True and data["errors"] == {}
    steps = data["steps"]
    assert {r["policy"] for r in steps} == {"32-true", "16-true", "16-mixed", "bf16-true",
                                            "16-master"}
    assert all(r["ms_per_step"] > 0 for r in steps)
    assert all(r["vs_32_true"] == 1.0 for r in steps if r["policy"] == "32-true")
    fid = data["fidelity"]
    assert {(r["model"], r["policy"], r["part"]) for r in fid} >= {
        ("gpt", "16-true", "forward"), ("gpt", "bf16-true", "grads")}
    # on the CPU the "device" emulation is the CPU emulation: the same bits
    assert all(r["emulated_cpu_vs_gpu"] == 0.0 for r in fid)
    cert = data["certificate"]
    assert cert and all(r["violations"] == 0 for r in cert)
    assert all(r["certified"] <= r["inputs"] for r in cert)
    ops = {r["op"] for r in data["quantize"]}
    assert {"x.clone()", "x.half().float()", "quantize fp16 nearest"} <= ops
    # op by op: on the CPU the "device" is the CPU, so its native kernels are the CPU's
    oprows = data["ops"]
    assert not [r for r in oprows if str(r["part"]).startswith("error")], oprows
    assert {r["op"] for r in oprows} >= {"linear", "conv3x3", "layernorm", "softmax"}
    assert {r["op"] for r in oprows} >= {"log_softmax"}
    assert all(r["native_cpu_eq_native_gpu"] == 1.0 and
               r["emu_cpu_gpu_eq_native_gpu"] == r["emu_cpu_cpu_eq_native_cpu"] and
               r["emu_cuda_gpu_eq_native_gpu"] == r["emu_cuda_cpu_eq_native_gpu"]
               for r in oprows)
    # the rounding compiled (C++ here, Triton on a GPU) has the eager and kernel bits
    fused = data["fused"]
    assert fused and all(r["compiled_vs_eager_gpu"] == "identical" ==
                         r["compiled_gpu_vs_cpu_kernel"] for r in fused)
    (comp,) = data["compiled"]
    assert comp["bits"] == "bit-identical" and comp["emulated_compiled"] > 0
    md = (tmp_path / "gpu.md").read_text()
    for title in ("Step time", "Fidelity", "Certificate", "quantize throughput",
                  "op by op", "Fused rounding compiled", "Compiled emulation"):
        assert title in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path):
    res = _run("--out", str(tmp_path / "gpu"))
    assert res.returncode == 0
    assert len(res.stdout.strip().splitlines()) == 1 and "no CUDA" in res.stdout
    assert not (tmp_path / "gpu").exists()
