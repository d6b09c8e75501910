import pytest
from hypothesis import settings

# fixed seeds: hypothesis draws the same examples on every run (no flaky CI)
settings.register_profile("lowprec", derandomize=True, deadline=None, database=None)
settings.load_profile("lowprec")

from helpers import IMPLS, native_conv_is_reference


@pytest.fixture(params=IMPLS)
def impl(request):
    """Both quantization paths: the compiled kernel (when built) and the plain-torch one."""
    return request.param


@pytest.fixture
def reference_conv():
    """Skips the test unless torch runs its reference kernel (slow_conv2d) for fp16 CPU
    convolutions here: on CPUs with AVX512-FP16 oneDNN's convolution runs instead."""
    if not native_conv_is_reference():
        pytest.skip("this CPU's fp16 convolution is oneDNN's (AVX512-FP16), not torch's "
                    "reference kernel: no native order to compare with")


# -- pytest --device cuda: the device-independent tests on a GPU -----------------------------
# The numerics tests call lowprec.quantize on CPU tensors and compare with CPU references; with
# --device cuda every such call runs on the device (inputs moved there, results moved back), so
# the same references check the torch path on the GPU. The C kernel is CPU-only: its
# parameterisations ("kernel") are skipped there. Tests that build models and optimizers take
# the ``device`` fixture.

def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="where device-independent tests run: cpu (default) or cuda")


def pytest_configure(config):
    import torch

    _share_cores(torch)

    name = config.getoption("--device")
    if name not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device {name!r}; accepted: cpu, cuda")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda: torch sees no CUDA device here")
        _quantize_on("cuda")


def _share_cores(torch) -> None:
    """Under pytest-xdist, each worker computes with its share of the cores (and so do the
    processes it starts, through OMP_NUM_THREADS). Each torch takes every core by default: two
    workers then run four OpenMP threads on two cores, and a worker's parallel regions wait for
    threads the other worker has descheduled (benchmarks/RESULTS.md, figure F45). Tests that
    need another count set it themselves."""
    import os

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:  # alone, or the caller's choice
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)


def _quantize_on(device: str) -> None:
    """Route lowprec.quantize / quantize_ through ``device`` (before test modules import it)."""
    import functools
    import importlib

    import torch

    import lowprec
    import lowprec.numerics

    # the module: `from lowprec.numerics import quantize` is the function of that name
    qmod = importlib.import_module("lowprec.numerics.quantize")

    def wrap(fn, in_place):
        @functools.wraps(fn)
        def on_device(x, *args, **kwargs):
            if kwargs.get("impl") == "kernel":
                pytest.skip("the C kernel is CPU-only")
            if not torch.is_tensor(x) or x.device.type == device:
                return fn(x, *args, **kwargs)
            y = fn(x.to(device), *args, **kwargs).to(x.device)
            if in_place:
                x.copy_(y)
                return x
            return y
        return on_device

    for name, in_place in (("quantize", False), ("quantize_", True)):
        wrapped = wrap(getattr(qmod, name), in_place)
        setattr(qmod, name, wrapped)
        setattr(lowprec, name, wrapped)
        setattr(lowprec.numerics, name, wrapped)


@pytest.fixture
def device(request):
    """The device of ``pytest --device`` (cpu by default)."""
    import torch

    return torch.device(request.config.getoption("--device"))
