"""Small helpers shared across modules."""

from __future__ import annotations

import importlib
import os
import sys


__all__ = ["import_callable", "short", "describe_error", "USER_ERRORS"]

#: What a user's function (``--data``/``--model`` module:function) may raise that becomes a
#: one-line error: any Exception, and SystemExit (a sys.exit() in user code must not end the
#: command silently with its code). KeyboardInterrupt is left to propagate: it is the user's
#: Ctrl-C, which the CLI reports as an interruption.
USER_ERRORS = (Exception, SystemExit)


def short(text: object, limit: int = 80) -> str:
    """repr of a user's value, cut in the middle when long (error lines stay bounded)."""
    s = repr(text) if not isinstance(text, str) else repr(text)
    return s if len(s) <= limit else f"{s[:limit // 2]}...{s[-limit // 2:]} ({len(str(text))} chars)"


def describe_error(err: BaseException, limit: int = 200) -> str:
    """'TypeError: message' on one bounded line."""
    if isinstance(err, SystemExit):  # user code calling sys.exit(code)
        return f"SystemExit: sys.exit({err.code!r:.40}) was called"
    msg = " ".join(str(err).split())
    if len(msg) > limit:
        msg = msg[:limit] + "..."
    return f"{type(err).__name__}: {msg}" if msg else type(err).__name__


def _import_from_here(mod_name: str):
    """``importlib.import_module``; a module found nowhere on ``sys.path`` is looked for in the
    current directory too, as ``python -m lowprec`` finds it (the ``lowprec`` console script
    does not put that directory on the path: ``lowprec compare --data mymods:data`` run beside
    mymods.py could not import it)."""
    try:
        return importlib.import_module(mod_name)
    except ModuleNotFoundError as err:
        here = os.getcwd()
        if err.name != mod_name.partition(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, here)
        return importlib.import_module(mod_name)


def import_callable(spec: str, what: str, error: type[Exception] = ValueError):
    """``module:function`` -> the function; ``error`` names the spec when it cannot be found."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = _import_from_here(mod_name)
    except (Exception, SystemExit) as err:  # ImportError, the module raising or exiting
        raise error(f"{what} {short(spec)}: cannot import {short(mod_name)} "
                    f"({describe_error(err)})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise error(f"{what} {short(spec)}: {short(mod_name)} has no function {short(fn_name)}")
    return fn
