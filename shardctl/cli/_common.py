"""Helpers shared by the command modules."""

from __future__ import annotations

import json
import sys


def emit_json(payload: object) -> None:
    """One JSON document on stdout (the ``--json`` form of every command)."""
    sys.stdout.write(json.dumps(payload, indent=2, sort_keys=False) + "\n")
