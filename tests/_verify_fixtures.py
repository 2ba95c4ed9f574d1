"""Shared fixtures of the verify tests: tiny checkpoints and layouts, made once per session."""

from __future__ import annotations

import shutil
from pathlib import Path

from shardctl.layout.types import Mesh
from tests._models import make_checkpoint
from tests._split import split_checkpoint, write_record


class Checkpoints:
    """``ckpt(name)``: a tiny HF checkpoint; ``resharded`` / ``hand_split``: layouts of it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def ckpt(self, name: str, dtype: str = "bfloat16") -> Path:
        path = self.root / f"hf-{name}-{dtype}"
        if not path.exists():
            make_checkpoint(name, path, dtype=dtype)
        return path

    def resharded(self, name: str, mesh: Mesh, dtype: str = "bfloat16") -> Path:
        """Split by shardctl's own reshard (a fresh copy each call: tests mutate it)."""
        from shardctl.reshard.api import reshard

        key = f"{name}-{dtype}-{mesh.pp}{mesh.ep}{mesh.tp}"
        cached = self.root / f"rs-{key}"
        if not cached.exists():
            reshard(self.ckpt(name, dtype), cached, mesh=mesh)
        out = self.root / f"copy-{key}-{len(list(self.root.iterdir()))}"
        shutil.copytree(cached, out)
        return out

    def hand_split(self, name: str, mesh: Mesh, fault: str | None = None) -> Path:
        """Split by the test-only splitter, recorded so the record describes it exactly."""
        out = self.root / f"hs-{name}-{mesh.pp}{mesh.ep}{mesh.tp}-{fault}"
        if not out.exists():
            src = self.ckpt(name)
            layout, files = split_checkpoint(src, out, mesh, fault=fault)
            write_record(src, out, layout, files)
        return out
