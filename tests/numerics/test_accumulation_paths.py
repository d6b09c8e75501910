"""Every instruction-set build of the accumulation kernel gives the plain-torch path's bits: the
AVX2 clone the other tests run, and the baseline x86-64 (SSE2) build, the scalar-ish fallback
(and AVX-512 where this CPU has it). The builds come from test_kernel_paths' fixtures."""

import math

import pytest
import torch

from lowprec.numerics.accumulation import gemm_acc
from lowprec.numerics.quantize import quantize
from test_kernel_paths import on_path, path_lib  # noqa: F401  (fixtures: one build per -march)

SPECS = [
    "fp16:chunk16",        # float64 lanes, fast path and general path
    "fp16:chunk16:sr",
    "bf16:pairwise:sr6",
    "e8m13:rz",            # general path only
    "e5m0:chunk4",         # no mantissa bit: ties round up in magnitude
    "q6.10:chunk8",        # fixed point, saturating
    "fp32", "fp32:chunk32",  # the plain float32 loop
]


def _operands(short: bool):
    g = torch.Generator().manual_seed(13)
    a = torch.randn(2, 3, 40, generator=g) * torch.exp2(torch.randint(-8, 9, (2, 3, 40),
                                                                    generator=g).float())
    b = torch.randn(2, 40, 260, generator=g)  # two column tiles of the kernel
    a[0, 1, 2] = math.inf
    if short:  # fp16 values: the float32 lanes
        a, b = quantize(a, "fp16"), quantize(b, "fp16")
    return a, b


_TORCH: dict = {}  # the torch path's results, computed once for every build


@pytest.mark.usefixtures("on_path")
@pytest.mark.parametrize("short", [False, True])
def test_every_build_gives_the_torch_paths_bits(short):
    a, b = _operands(short)
    for spec in SPECS:
        ker = gemm_acc(a, b, spec, seed=(4, 5), impl="kernel")
        if (short, spec) not in _TORCH:
            _TORCH[short, spec] = gemm_acc(a, b, spec, seed=(4, 5), impl="torch")
        tor = _TORCH[short, spec]
        same = (ker == tor) | (torch.isnan(ker) & torch.isnan(tor))
        assert bool(same.all()), spec
