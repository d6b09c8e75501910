import pytest
from hypothesis import settings

# fixed seeds: hypothesis draws the same examples on every run (no flaky CI)
settings.register_profile("lowprec", derandomize=True, deadline=None, database=None)
settings.load_profile("lowprec")

from helpers import IMPLS


@pytest.fixture(params=IMPLS)
def impl(request):
    """Both quantization paths: the compiled kernel (when built) and the plain-torch one."""
    return request.param
