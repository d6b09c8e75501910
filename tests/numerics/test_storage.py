"""Checkpoint dtypes: every value of a format goes to the torch dtype file_dtype names and back
bit for bit; values off the grid, and Inf where the dtype has none, stay float32. References:
torch's own dtypes (every bit pattern) and ml_dtypes' fp6/fp4 types (every bit pattern)."""

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_same_values

from lowprec import quantize
from lowprec.numerics.storage import compact, file_dtype

TORCH_DTYPES = [("fp16", torch.float16, torch.int16), ("bf16", torch.bfloat16, torch.int16),
                ("e4m3fn", torch.float8_e4m3fn, torch.int8),
                ("e5m2", torch.float8_e5m2, torch.int8),
                ("e4m3fnuz", torch.float8_e4m3fnuz, torch.int8),
                ("e5m2fnuz", torch.float8_e5m2fnuz, torch.int8)]


@pytest.mark.parametrize("spec,dtype,ints", TORCH_DTYPES, ids=[t[0] for t in TORCH_DTYPES])
def test_every_value_of_a_torch_dtype_goes_there_and_back(spec, dtype, ints):
    n = 2 ** (8 * torch.empty((), dtype=dtype).element_size())
    every = torch.arange(n, dtype=torch.int32).to(ints).view(dtype)  # every bit pattern
    carrier = every.float()
    assert file_dtype(spec) == dtype
    small = compact(carrier, spec)
    assert small.dtype == dtype
    assert_same_values(small.float(), carrier, spec)
    finite = torch.isfinite(carrier)
    assert torch.equal(small[finite].view(ints), every[finite].view(ints))


ML_SMALL = [("fp6_e2m3", ml_dtypes.float6_e2m3fn), ("fp6_e3m2", ml_dtypes.float6_e3m2fn),
            ("fp4_e2m1", ml_dtypes.float4_e2m1fn)]


@pytest.mark.parametrize("spec,mdtype", ML_SMALL, ids=[m[0] for m in ML_SMALL])
def test_fp6_and_fp4_are_stored_in_one_byte(spec, mdtype):
    bits = 6 if "6" in spec else 4
    every = np.arange(2**bits, dtype=np.uint8).view(mdtype).astype(np.float32)
    carrier = torch.from_numpy(every)
    small = compact(carrier, spec)
    assert file_dtype(spec) == torch.float8_e4m3fn and small.dtype == torch.float8_e4m3fn
    assert_same_values(small.float(), carrier, spec)


@pytest.mark.parametrize("spec,dtype", [("e5m10-nosub", torch.float16),
                                        ("e4m3fn-sat", torch.float8_e4m3fn),
                                        ("e3m4", torch.float16), ("e8m3", torch.bfloat16),
                                        ("tf32", torch.float32), ("fp32", torch.float32),
                                        ("q8.8", None), ("mxfp8_e4m3", None), ("dfxp<8>", None),
                                        ("binary", None)])
def test_the_narrowest_dtype_holding_the_format(spec, dtype):
    assert file_dtype(spec) == dtype
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 100
    q = quantize(x, spec) if dtype not in (None, torch.float32) else x
    out = compact(q, spec)
    assert out.dtype == (dtype if dtype is not None else torch.float32)
    assert torch.equal(out.float(), q)


def test_what_would_not_come_back_stays_float32():
    x = torch.tensor([1.0, 1.0 + 2.0**-12, -0.0])  # 1 + 2**-12 is not an fp16 value
    assert compact(x, "fp16") is x
    inf = torch.tensor([1.0, float("inf")])  # e4m3fn has no Inf (it would become NaN)
    assert compact(inf, "e4m3fn") is inf
    assert compact(torch.tensor([-0.0, 0.0]), "e4m3fnuz").dtype == torch.float32  # no -0
    signed = compact(torch.tensor([-0.0, float("nan"), float("-inf")]), "fp16")
    assert signed.dtype == torch.float16 and torch.signbit(signed[0]) and signed[1].isnan()
    half = torch.ones(3, dtype=torch.float16)
    assert compact(half, "e4m3fn").dtype == torch.float8_e4m3fn  # any wider carrier
    assert compact(half, "fp16") is half and compact(torch.arange(3), "fp16").dtype == torch.int64
