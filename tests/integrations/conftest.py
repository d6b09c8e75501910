import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: with two OpenMP threads on a loaded 2-core machine a BERT step took 2 s
    instead of 25 ms (spinning threads); one thread per test process."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
