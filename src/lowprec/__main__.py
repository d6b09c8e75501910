"""``python -m lowprec``: the ``lowprec`` command (see lowprec_cmd, the console script's entry)."""

import sys

from lowprec_cmd import main

if __name__ == "__main__":
    sys.exit(main())
