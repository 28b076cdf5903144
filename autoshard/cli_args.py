"""Small argument and output helpers shared by the CLI's command modules (``cli``, ``cli_search``,
``cli_ppo``), so that none of them imports another for them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def print_json(data: Any) -> None:
    """Write ``data`` (or JSON text, written as is) to stdout: the whole output of a ``--json`` command."""
    text = data if isinstance(data, str) else json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"
    sys.stdout.write(text)
    sys.stdout.flush()


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a positive integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


__all__ = ["positive_int", "print_json"]
