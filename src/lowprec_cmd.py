"""The ``lowprec`` console script's entry point, outside the ``lowprec`` package on purpose.
# PYTHON_ARGCOMPLETE_OK (argcomplete: the lowprec command completes its flags and values)

Importing ``lowprec`` imports torch (its custom op is registered then, before any trace can
reach it), which takes a second or more on a loaded machine. A Ctrl-C or SIGTERM in that time
must end the command like one later: one line, exit code 130 or 143, no traceback and no
silent -15. This module imports only ``os``, ``signal`` and ``sys`` before it routes SIGTERM
and SIGINT to KeyboardInterrupt, records them, and catches both around the import of
:mod:`lowprec.cli` (an interrupt that some import swallowed still ends the command), whose
``main`` then takes over. Only the interpreter's own start-up, before this module runs, is out
of reach.

Shell completion (argcomplete sets ``_ARGCOMPLETE``) must answer a TAB at once, so it imports
neither torch nor the library: :func:`_complete` builds :func:`lowprec.cli.build_parser` (the
standard library, and :mod:`lowprec._names` for the values offered) with the package's
``__init__`` (which imports everything) left unrun, and exits once argcomplete has answered.
"""

import os
import signal
import sys

__all__ = ["main"]


class _StartupTerminated(KeyboardInterrupt):
    """SIGTERM while the command starts up."""


_RECEIVED: list[int] = []  # the signals that arrived during the import


def _on_signal(signum, frame):
    _RECEIVED.append(signum)
    raise _StartupTerminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _interrupted(terminated: bool) -> int:
    print("lowprec: interrupted", file=sys.stderr)
    return 143 if terminated else 130


def _complete() -> None:
    """Answer the shell's completion request without importing torch, and exit (argcomplete
    exits once it has written the completions). Returns where argcomplete is missing."""
    import importlib.util
    import types

    try:
        import argcomplete
    except ImportError:
        return
    spec = importlib.util.find_spec("lowprec")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return
    # an empty package object in its place: importing lowprec.cli runs the cli package alone; the
    # process ends in argcomplete, so nothing else ever sees this stand-in
    package = types.ModuleType("lowprec")
    package.__path__ = list(spec.submodule_search_locations)
    package.__version__ = ""  # --version is never run while completing
    sys.modules["lowprec"] = package
    from lowprec.cli import build_parser

    try:
        argcomplete.autocomplete(build_parser())  # exits, as _ARGCOMPLETE is set
    finally:  # were it to return: the command runs as usual, with the real package
        for name in [m for m in sys.modules if m == "lowprec" or m.startswith("lowprec.")]:
            del sys.modules[name]


def main(argv=None) -> int:
    if argv is None and "_ARGCOMPLETE" in os.environ:
        _complete()
    # SIGINT too: a library whose import swallows the KeyboardInterrupt (a bare except around
    # an optional import) would otherwise let the command run on; the record says it came
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {}
    try:
        for sig in handled:
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # a background job ignores Ctrl-C, as it should
            previous[sig] = signal.signal(sig, _on_signal)
    except ValueError:  # not the main thread: leave signals alone
        previous = {}
    try:
        try:
            from lowprec.cli import main as cli_main
        finally:  # cli.main installs its own handler (the same clean stop, with its exit code)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if _RECEIVED:  # raised during the import, and swallowed there
            return _interrupted(signal.SIGTERM in _RECEIVED)
        return cli_main(argv)
    except KeyboardInterrupt as err:  # only during the import: cli.main handles its own
        return _interrupted(isinstance(err, _StartupTerminated))


if __name__ == "__main__":
    sys.exit(main())
