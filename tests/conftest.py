"""Hypothesis runs derandomized by default: CI and the README's test command then run the
same examples every time, so a green run stays green and a red one reproduces. One run once
found a manifest spelling no earlier run had drawn, and failed CI on a change that did not
touch manifests. ``HYPOTHESIS_PROFILE=explore`` draws fresh random examples (run it when
changing a property or the code under one; what it finds becomes a fixed test)."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
