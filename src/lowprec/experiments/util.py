"""Small helpers shared across modules."""

from __future__ import annotations

import importlib


__all__ = ["import_callable"]


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
