"""The ``lowprec`` console script's entry point, outside the ``lowprec`` package on purpose.
# PYTHON_ARGCOMPLETE_OK (argcomplete: the lowprec command completes its flags and values)

Importing ``lowprec`` imports torch (its custom op is registered then, before any trace can
reach it), which takes a second or more on a loaded machine. A Ctrl-C or SIGTERM in that time
must end the command like one later: one line, exit code 130 or 143, no traceback and no
silent -15. This module imports only ``signal`` and ``sys`` before it routes SIGTERM to
KeyboardInterrupt and catches both around the import of :mod:`lowprec.cli`, whose ``main``
then takes over. Only the interpreter's own start-up, before this module runs, is out of reach.
"""

import signal
import sys

__all__ = ["main"]


class _StartupTerminated(KeyboardInterrupt):
    """SIGTERM while the command starts up."""


def _on_sigterm(signum, frame):
    raise _StartupTerminated()


def main(argv=None) -> int:
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        try:
            from lowprec.cli import main as cli_main
        finally:  # cli.main installs its own handler (the same clean stop, with its exit code)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return cli_main(argv)
    except KeyboardInterrupt as err:  # only during the import: cli.main handles its own
        print("lowprec: interrupted", file=sys.stderr)
        return 143 if isinstance(err, _StartupTerminated) else 130


if __name__ == "__main__":
    sys.exit(main())
