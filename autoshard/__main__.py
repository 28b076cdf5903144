"""``python -m autoshard``: the ``autoshard`` command (``autoshard/cli.py``)."""

import sys

from autoshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
