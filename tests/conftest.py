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
