"""Assertions and the training loop the tests share (imported as ``helpers``)."""

import functools

import numpy as np
import pytest
import torch
from torch import nn

from lowprec.numerics import kernel

IMPLS = ["kernel", "torch"] if kernel.available() else ["torch"]


def native(policy: str) -> str:
    """``policy`` forced onto the native backend (``auto`` emulates 16-bit formats on CPUs
    without fast kernels for them): for tests of what native runs do, on any CPU."""
    import dataclasses

    from lowprec import parse_policy
    from lowprec.training.policy import Backend

    return dataclasses.replace(parse_policy(policy), backend=Backend.NATIVE).spec


def assert_same_values(got, expected, context=""):
    """Equal values, equal signs of zero, NaN where NaN; reports the first mismatches."""
    got = np.asarray(got.double().cpu() if torch.is_tensor(got) else got, dtype=np.float64).ravel()
    expected = np.asarray(expected.double().cpu() if torch.is_tensor(expected) else expected,
                          dtype=np.float64).ravel()
    both_nan = np.isnan(got) & np.isnan(expected)
    ok = both_nan | ((got == expected) & (np.signbit(got) == np.signbit(expected)))
    if not ok.all():
        i = np.nonzero(~ok)[0][:8]
        raise AssertionError(
            f"{context}: {(~ok).sum()} of {ok.size} differ; got {got[i]} expected {expected[i]}")


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, context=""):
    """Identical float32 bit patterns (NaN payloads included)."""
    ia = a.float().contiguous().view(torch.int32)
    ib = b.float().contiguous().view(torch.int32)
    if not torch.equal(ia, ib):
        i = torch.nonzero(ia != ib)[:8].flatten()
        raise AssertionError(f"{context}: bits differ at {i.tolist()}: {a.flatten()[i]} vs "
                             f"{b.flatten()[i]}")


def train_steps(prec, model, opt, x, y, steps: int) -> list[float]:
    """The training loop every policy shares; returns the losses."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with prec.autocast():
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        prec.backward(loss)
        prec.step(opt)
        losses.append(loss.item())
    return losses


def small_cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 3 * 3, 16), nn.ReLU(), nn.Linear(16, 10))


def small_mlp(seed=0, d_in=20, hidden=32, d_out=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def cnn_batch(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: with two OpenMP threads on a loaded 2-core machine a BERT step took 2 s
    instead of 25 ms (spinning threads); one thread per test process. A conftest that imports
    this fixture applies it to its folder."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@functools.lru_cache(maxsize=None)
def native_conv_is_reference(dtype=torch.float16) -> bool:
    """Whether torch runs its reference kernel (slow_conv2d) for a 16-bit CPU convolution here:
    on CPUs with AVX512-FP16, oneDNN's convolution runs instead and sums in its own order."""
    from torch.profiler import profile

    x, w = torch.ones(1, 2, 4, 4, dtype=dtype), torch.ones(2, 2, 3, 3, dtype=dtype)
    with profile() as prof:
        torch.nn.functional.conv2d(x, w)
    return any("slow_conv2d" in e.name for e in prof.events())
