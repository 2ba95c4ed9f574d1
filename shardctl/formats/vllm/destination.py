"""``verify`` with a vLLM ``sharded_state`` directory on either side.

- structure and bitwise: the directory read as HF-named shards (``read.py``) — a
  :class:`~shardctl.verify.dst.Destination` whose layout is the TP ranks vLLM's loaders would
  fill, so coverage, replicas (K/V heads when ``tp > kv heads``) and every byte are checked by
  the existing levels. vLLM's zero vocab padding rows belong to no HF tensor and are not read
  (vLLM drops those logits: ``LogitsProcessor`` keeps ``[:vocab_size]``).
- forward: the forward level's ranks load tensors by HF name, so the directory is first
  converted to shardctl ``ranks`` at the same TP degree in a temporary directory (the same
  boxes the bitwise level has just compared with SRC), then run sharded as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shardctl.formats.vllm.read import is_vllm_dir, read_vllm, vllm_layout
from shardctl.io.tempdirs import owned_tempdir
from shardctl.layout.types import Layout
from shardctl.verify.dst import Destination, DstShard, _config


@dataclass
class VllmDestination(Destination):
    vllm: Layout | None = None

    @property
    def layout(self) -> Layout | None:
        return self.vllm


def vllm_destination(root: Path) -> VllmDestination:
    ck = read_vllm(root)
    shards: dict[str, list[DstShard]] = {}
    for r, mine in enumerate(ck.shards):
        for fqn, s in mine:
            shards.setdefault(fqn, []).append(
                DstShard(
                    fqn, s.dtype, s.local_shape, s.pieces, s.begin, path=ck.files[s.file], rank=r
                )
            )
    return VllmDestination(
        root,
        "vllm",
        {t.fqn: t for t in ck.model.tensors},
        shards,
        list(ck.files),
        _config(root),
        None,
        vllm=vllm_layout(ck),
    )


@contextmanager
def as_ranks(root: Path) -> Iterator[Path]:
    """``root`` itself, or for a vLLM directory a temporary shardctl ``ranks`` copy of it."""
    if not is_vllm_dir(Path(root)):
        yield Path(root)
        return
    from shardctl.layout.types import Mesh
    from shardctl.reshard.api import reshard

    tp = read_vllm(root).tp
    with owned_tempdir("shardctl-verify-vllm-") as tmp:
        out = Path(tmp) / "ranks"
        reshard(Path(root), out, mesh=Mesh(tp=tp), fmt="ranks" if tp > 1 else "hf", resume=False)
        yield out
