"""The ``lowprec`` command's entry point (also ``python -m lowprec``).

Signals first: nothing but ``signal`` and ``sys`` is imported before SIGTERM is routed to the
same clean stop as Ctrl-C, so an interrupt while the command starts up (argparse, torch, the
library: a second or more on a loaded machine) ends as one line and exit code 130 or 143, not a
traceback or a silent -15. Only the interpreter's own start-up, before this module runs, is out
of reach.
"""

import signal
import sys

__all__ = ["main", "Terminated"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C (the same clean stop), with its own exit code."""


def on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:
        pass  # not the main thread: leave signals alone
    try:
        from .cli import main as cli_main

        return cli_main(argv)
    except KeyboardInterrupt as err:  # during start-up: cli.main handles the rest
        print("lowprec: interrupted", file=sys.stderr)
        return 143 if isinstance(err, Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
