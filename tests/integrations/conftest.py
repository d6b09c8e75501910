"""One OpenMP thread per test in this folder (see helpers.one_thread)."""

from helpers import one_thread  # noqa: F401 - an autouse fixture for this folder
