"""A tiny test-only splitter: HF checkpoint -> per-rank safetensors + a shardctl ``Layout``.

Independent of ``shardctl.reshard`` on purpose (verify must not share the bugs it looks for).
Megatron's plan: q/k/v, gate/up colwise; o/down rowwise; vocab-parallel embeddings and head;
fused parts (Phi-3 ``qkv_proj`` / ``gate_up_proj``, GPT-2 ``c_attn`` in ``[in, out]``) split
part by part; kv heads replicated when ``tp > kv heads``; experts in contiguous blocks over ep.

``fault`` builds a *self-consistent but wrong* layout (its Layout describes exactly what the
files hold, so structure and bitwise pass): ``naive-fused``, ``swap-gate-up``,
``kv-replication``, ``rowwise-dim0``, ``drop-expert``.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardctl.layout.types import (
    Layout,
    LayoutOptions,
    Mesh,
    Piece,
    RankLayout,
    Shard,
    Stage,
)

_CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


@dataclass(frozen=True)
class Rule:
    dim: int
    parts: tuple[tuple[int, str | None], ...]  # (size, heads kind) along dim


def _dims(cfg: dict[str, Any]) -> dict[str, int]:
    if cfg["model_type"] == "gpt2":
        h = cfg["n_embd"]
        return dict(
            hidden=h,
            heads=cfg["n_head"],
            kv=cfg["n_head"],
            hd=h // cfg["n_head"],
            inter=cfg.get("n_inner") or 4 * h,
            layers=cfg["n_layer"],
            experts=0,
            vocab=cfg["vocab_size"],
        )
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    return dict(
        hidden=h,
        heads=heads,
        kv=cfg.get("num_key_value_heads") or heads,
        hd=cfg.get("head_dim") or h // heads,
        inter=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"],
        experts=cfg.get("num_local_experts") or 0,
        vocab=cfg["vocab_size"],
    )


def rule_for(fqn: str, shape: tuple[int, ...], d: dict[str, int], fault: str | None) -> Rule | None:
    q, kv, inter = d["heads"] * d["hd"], d["kv"] * d["hd"], d["inter"]
    whole = ((shape[0] if shape else 0, None),)
    if re.search(r"\.q_proj\.(weight|bias)$", fqn):
        return Rule(0, ((q, "q"),))
    if re.search(r"\.[kv]_proj\.(weight|bias)$", fqn):
        return Rule(0, ((kv, "kv"),))
    if fqn.endswith("qkv_proj.weight"):
        return Rule(0, ((q, "q"), (kv, "kv"), (kv, "kv")))
    if fqn.endswith("gate_up_proj.weight"):
        return Rule(0, ((inter, None), (inter, None)))
    if re.search(r"\.(gate_proj|up_proj|w1|w3)\.(weight|bias)$", fqn):
        return Rule(0, whole)
    if re.search(r"\.(o_proj|down_proj|w2)\.weight$", fqn):
        if fault == "rowwise-dim0" and "o_proj" in fqn:
            return Rule(0, whole)
        return Rule(1, ((shape[1], None),))
    if fqn.endswith(("embed_tokens.weight", "lm_head.weight", "wte.weight")):
        return Rule(0, whole)
    if fqn.endswith("c_attn.weight"):
        return Rule(1, ((q, "q"),) * 3)
    if fqn.endswith("c_attn.bias"):
        return Rule(0, ((q, "q"),) * 3)
    if fqn.endswith("c_fc.weight"):
        return Rule(1, ((shape[1], None),))
    if fqn.endswith("c_fc.bias"):
        return Rule(0, whole)
    if fqn.endswith("c_proj.weight"):  # GPT-2 rowwise: Conv1D [in, out] -> split dim 0
        return Rule(0, whole)
    return None


def shard_tensor(
    fqn: str,
    t: torch.Tensor,
    rule: Rule | None,
    tp: int,
    r: int,
    d: dict[str, int],
    fault: str | None,
) -> tuple[torch.Tensor, list[Piece], tuple[int, ...], str]:
    """(local tensor, pieces, padded global shape, placement) of rank ``r`` of ``tp``."""
    shape = tuple(t.shape)
    zeros = tuple(0 for _ in shape)
    if rule is None or tp == 1:
        return t.clone(), [Piece(zeros, shape, zeros)], shape, "R"
    dim = rule.dim
    parts = list(rule.parts)
    if fault == "naive-fused" and len(parts) > 1:
        parts = [(shape[dim], None)]
    padded = shape
    if len(parts) == 1 and shape[dim] % tp:  # vocab padding to a multiple of tp
        rows = -(-shape[dim] // tp)
        padded = tuple(rows * tp if i == dim else s for i, s in enumerate(shape))
        parts = [(padded[dim], None)]
    spans: list[tuple[int, int]] = []  # (offset, size) in the global tensor along dim
    part_offset = 0
    for size, heads in parts:
        if heads == "kv" and tp > d["kv"]:
            per = tp // d["kv"]
            head = r % d["kv"] if fault == "kv-replication" else r // per
            spans.append((part_offset + head * d["hd"], d["hd"]))
        else:
            spans.append((part_offset + r * (size // tp), size // tp))
        part_offset += size
    if fault == "swap-gate-up" and fqn.endswith("gate_up_proj.weight"):
        spans.reverse()
    local_len = sum(s for _, s in spans)
    local_shape = tuple(local_len if i == dim else s for i, s in enumerate(shape))
    local = torch.zeros(local_shape, dtype=t.dtype)
    pieces: list[Piece] = []
    at = 0
    for off, size in spans:
        real = max(0, min(size, shape[dim] - off))  # padding rows beyond the real tensor
        if real:
            local.narrow(dim, at, real).copy_(t.narrow(dim, off, real))
            offsets = tuple(off if i == dim else 0 for i in range(len(shape)))
            sizes = tuple(real if i == dim else s for i, s in enumerate(shape))
            loffs = tuple(at if i == dim else 0 for i in range(len(shape)))
            pieces.append(Piece(offsets, sizes, loffs))
        at += size
    placement = f"S({dim})" + (f"·parts{[p for p, _ in parts]}" if len(parts) > 1 else "")
    return local, pieces, padded, placement


def split_checkpoint(
    src: Path, out: Path, mesh: Mesh, *, fault: str | None = None
) -> tuple[Layout, dict[int, list[Path]]]:
    cfg = json.loads((src / "config.json").read_text())
    d = _dims(cfg)
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", out / "config.json")
    per_stage = d["layers"] // mesh.pp
    stages = tuple(Stage(p, (p * per_stage, (p + 1) * per_stage - 1)) for p in range(mesh.pp))
    tied = "lm_head.weight" not in tensors
    ranks: list[RankLayout] = []
    files: dict[int, list[Path]] = {}
    padded_shapes: dict[str, tuple[int, ...]] = {}
    for pp in range(mesh.pp):
        for ep in range(mesh.ep):
            for tp in range(mesh.tp):
                local: dict[str, torch.Tensor] = {}
                shards: list[Shard] = []
                for fqn, t in tensors.items():
                    if not _on_rank(fqn, d, mesh, stages[pp], pp, ep, tied, fault):
                        continue
                    rule = rule_for(fqn, tuple(t.shape), d, fault)
                    lt, pieces, padded, placement = shard_tensor(
                        fqn, t, rule, mesh.tp, tp, d, fault
                    )
                    if padded != tuple(t.shape):
                        padded_shapes[fqn] = padded
                    local[fqn] = lt.contiguous()
                    shards.append(
                        Shard(
                            fqn,
                            _CODES[t.dtype],
                            tuple(t.shape),
                            tuple(lt.shape),
                            tuple(pieces),
                            placement,
                        )
                    )
                rank = mesh.rank(pp=pp, ep=ep, tp=tp)
                path = out / f"rank{rank:05d}.safetensors"
                save_file(local, str(path))
                files[rank] = [path]
                ranks.append(RankLayout(pp, ep, tp, tuple(shards)))
    layout = Layout(cfg["model_type"], mesh, LayoutOptions(), stages, tuple(ranks), padded_shapes)
    return layout, files


def _on_rank(
    fqn: str,
    d: dict[str, int],
    mesh: Mesh,
    stage: Stage,
    pp: int,
    ep: int,
    tied: bool,
    fault: str | None,
) -> bool:
    m = re.match(r"^(?:model\.layers|transformer\.h)\.(\d+)\.", fqn)
    if m:
        assert stage.layers is not None
        if not stage.layers[0] <= int(m.group(1)) <= stage.layers[1]:
            return False
        e = re.search(r"\.experts\.(\d+)\.", fqn)
        if e:
            per = d["experts"] // mesh.ep
            expert = int(e.group(1))
            if fault == "drop-expert" and expert == d["experts"] - 1:
                return False
            return expert // per == ep
        return True
    first, last = pp == 0, pp == mesh.pp - 1
    if fqn.endswith(("embed_tokens.weight", "wte.weight")):
        return first or (last and tied)
    if fqn.endswith("wpe.weight"):
        return first
    return last  # final norm, lm_head


def write_record(src: Path, out: Path, layout: Layout, files: dict[int, list[Path]]) -> Path:
    """Record ``layout`` as reshard would (``shardctl.layout.json``), so ``verify`` can open it."""
    from shardctl.checkpoint import record as rec
    from shardctl.checkpoint import record_write
    from shardctl.checkpoint.source import open_source
    from shardctl.io.checksum import new_hash
    from shardctl.model.types import TensorInfo

    source = open_source(src)
    tensors = tuple(TensorInfo(t.fqn, t.shape, t.dtype) for t in source.model.tensors)
    shard_files = {
        (r, s.fqn): files[r][0].name for r, rl in enumerate(layout.ranks) for s in rl.shards
    }
    digests = []
    for r in sorted(files):
        path = files[r][0]
        h = new_hash("blake3")
        h.update(path.read_bytes())
        digests.append(rec.FileDigest(path.name, path.stat().st_size, h.hexdigest()))
    data = record_write.build(
        fmt="ranks",
        architecture=layout.architecture,
        layout=layout,
        tensors=tensors,
        padded_shapes=layout.padded_shapes,
        shard_files=shard_files,
        source=source.identity(),
        hash_name="blake3",
        files=digests,
        carried=["config.json"],
    )
    return record_write.write(out, data)
