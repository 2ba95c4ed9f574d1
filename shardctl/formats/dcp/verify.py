"""``verify`` with a DCP training checkpoint on either side.

Design: a DCP side is presented to the existing levels as HF-named global tensors — its model
weights are streamed (one tensor at a time, by :class:`~shardctl.formats.dcp.read.DcpReader`,
which reads chunks through the metadata independently of how they were written) into a
temporary HF directory (``$TMPDIR/shardctl-verify-dcp-*``, reaped if the run is killed), and
structure, bitwise and forward run on it unchanged. When both sides carry optimizer state (DCP,
or HF with the ``optimizer.safetensors`` sidecar), the bitwise level also compares every
optimizer tensor (``exp_avg``, ``exp_avg_sq``, ``step``, ...) bit for bit and every
``param_groups`` value; with optimizer state on one side only it says so in its figures.
A DeepSpeed ZeRO-1/2 directory is presented the same way.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardctl.errors import EnvironmentFailure, InvalidInputError
from shardctl.formats.dcp.metadata import is_dcp
from shardctl.formats.dcp.state import open_state
from shardctl.formats.dcp.write_hf import write_hf
from shardctl.formats.dcp.zero import is_zero
from shardctl.io.checksum import default_hash
from shardctl.io.tempdirs import owned_tempdir


def _training(path: Path) -> bool:
    return is_dcp(path) or is_zero(path)


def involves_dcp(src: Path, dst: Path) -> bool:
    """Either side is a DCP or a DeepSpeed ZeRO training checkpoint."""
    return _training(src) or _training(dst)


@contextmanager
def as_hf(path: Path) -> Iterator[Path]:
    """``path`` itself, or for a DCP (or ZeRO) checkpoint a temporary HF copy of its weights."""
    if not _training(path):
        yield path
        return
    state = open_state(path)
    try:
        if "config.json" not in state.carried:
            raise InvalidInputError(
                "no config.json in the DCP checkpoint directory; verify needs the model's config",
                where=str(path),
                hint="copy the model's config.json into it",
            )
        with owned_tempdir("shardctl-verify-dcp-") as out:
            try:
                write_hf(state, out, optimizer=False, hash_name=default_hash())
                for name in state.carried:
                    shutil.copyfile(path / name, out / name)
            except OSError as exc:
                raise EnvironmentFailure(
                    f"could not write the DCP checkpoint's weights to {out}: {exc.strerror or exc}",
                    hint="set TMPDIR to a directory with room for one copy of the weights",
                ) from None
            state.close()
            yield out
    finally:
        state.close()


def verify_dcp(src: Path, dst: Path, run: Callable[[Path, Path], Any]) -> Any:
    """Run the levels (``run(src, dst)``) on the HF views of ``src`` and ``dst``."""
    with as_hf(src) as s, as_hf(dst) as d:
        result = run(s, d)
    result.src, result.dst = str(src), str(dst)
    bitwise = result.levels[1]
    if bitwise.status != "not-run" and bitwise.ok:
        compare_optimizer(src, dst, bitwise)
        bitwise.close()
        if not bitwise.ok:  # the levels after a failed one do not count
            for later in result.levels[2:]:
                later.status = "not-run"
    return result


def compare_optimizer(src: Path, dst: Path, level: Any) -> None:
    """Optimizer tensors and objects of both sides, bit for bit, one tensor at a time."""
    import torch

    a, b = open_state(src), open_state(dst)
    try:
        ia = {i.key: i for i in a.items if not i.is_model}
        ib = {i.key: i for i in b.items if not i.is_model}
        if not ia or not ib:
            side = "neither side" if not ia and not ib else ("SRC" if ia else "DST") + " only"
            level.figures["optimizer_state"] = f"{side}; not compared"
            return
        missing, extra = sorted(set(ia) - set(ib)), sorted(set(ib) - set(ia))
        if missing or extra:
            level.fail(
                f"optimizer state keys differ: {len(missing)} only in SRC "
                f"{missing[:3]}, {len(extra)} only in DST {extra[:3]}"
            )
            return
        for key, item in ia.items():
            if item.shape is None:
                if a.obj(key) != b.obj(key):
                    level.fail(
                        f"optimizer value differs: {a.obj(key)!r} vs {b.obj(key)!r}", fqn=key
                    )
                continue
            ta, tb = a.tensor(key), b.tensor(key)
            same = (
                ta.dtype == tb.dtype
                and ta.shape == tb.shape
                and torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8))
            )
            if not same:
                level.fail("optimizer tensor differs", fqn=key)
        level.figures["optimizer_state"] = f"{len(ia)} entries compared"
    finally:
        a.close()
        b.close()
