"""``python -m lowprec.cli``: the command without lowprec_cmd's start-up signal handling."""

import sys

from . import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
