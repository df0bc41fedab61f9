"""``python -m specdec_rt demo | generate | bench`` (see specdec_rt.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
