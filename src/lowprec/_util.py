"""Small helpers shared across modules."""

from __future__ import annotations

import contextlib
import importlib

from torch import nn

__all__ = ["import_callable", "fresh_grads"]


def import_callable(spec: str, what: str, error: type[Exception] = ValueError):
    """``module:function`` -> the function; ``error`` names the spec when it cannot be found."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as err:
        raise error(f"{what} {spec!r}: cannot import {mod_name!r} ({err})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise error(f"{what} {spec!r}: {mod_name} has no function {fn_name!r}")
    return fn


@contextlib.contextmanager
def fresh_grads(model: nn.Module):
    """Run a measuring backward pass without touching the caller's gradients: they are set
    aside, cleared for the block, and put back afterwards."""
    saved = {p: p.grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.grad = None
        yield
    finally:
        for p, g in saved.items():
            p.grad = g
