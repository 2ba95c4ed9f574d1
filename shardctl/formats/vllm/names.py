"""HF tensors -> vLLM ``sharded_state`` tensors of each TP rank: names, shapes, which HF rows.

What ``ShardedStateLoader.save_model`` writes is each worker's ``model.state_dict()`` after
vLLM's own weight loaders filled it from the HF checkpoint. Read from vLLM's source
(``model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``, ``fused_moe/layer.py``,
``models/llama.py``), for TP rank ``r`` of ``tp``:

- ``qkv_proj`` (``QKVParallelLinear``) = ``[q_r; k_r; v_r]`` on dim 0: q rows ``r·Q/tp``..;
  with ``tp >= kv heads`` each rank holds ONE kv head, head ``r // (tp / kv)`` (replicas);
- ``gate_up_proj`` (``MergedColumnParallelLinear``) = ``[gate_r; up_r]``;
- ``o_proj`` / ``down_proj`` (``RowParallelLinear``): columns ``r·in/tp``..; their bias whole;
- embeddings and LM head (``VocabParallelEmbedding``): the vocab padded to a multiple of 64,
  then split evenly — rank r holds padded rows ``[r·per, (r+1)·per)``, rows past the real vocab
  zero (vocab 32,001 at tp 2: padded 32,064, rank 1 starts at row 16,032);
- tied embeddings: ``lm_head.weight`` and ``model.embed_tokens.weight`` share one tensor and
  ``_filter_subtensors`` keeps the smaller key, ``lm_head.weight`` (Gemma-2 has no lm_head
  module: ``model.embed_tokens.weight``);
- Mixtral experts (``FusedMoE``, no EP): ``experts.routed_experts.w13_weight [E, 2·I/tp, H]``
  = per expert ``[w1_r; w3_r]``, ``….w2_weight [E, H, I/tp]`` = per expert ``w2[:, r·I/tp..]``;
- everything else (norms, the router) whole on every rank;
- every attention layer's ``self_attn.attn._{k,v,q,prob}_scale``: float32 scalars, 1.0 for an
  unquantized model — persistent buffers of vLLM's ``Attention`` (``set_default_quant_scales(
  register_buffer=True)``, vLLM 0.32), so they are in the state dict the loader fills and it
  reports them missing otherwise. They belong to no HF tensor: written in a last part per rank.

A :class:`Part` says which box of which HF tensor lands where in a vLLM local tensor; the same
table drives the writer (``write.py``) and the reader (``read.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from shardctl.errors import InvalidInputError, UsageError
from shardctl.model.types import ModelDims, ModelInfo, TensorInfo

VOCAB_PAD = 64  # vllm vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
# Families whose vLLM module tree uses these names (vllm/model_executor/models/<family>.py).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral", "granite")
# vLLM 0.32: FusedMoEFactory returns a MoERunner whose RoutedExperts module holds the weights
# (``...block_sparse_moe.experts.routed_experts.w13_weight``; older vLLM: ``experts.w13_weight``)
MOE_EXPERTS = "experts.routed_experts"
NO_LM_HEAD = ("gemma2",)  # logits from embed_tokens; vLLM (0.32) has no lm_head parameter

_LAYER = re.compile(r"^(model\.layers\.\d+)\.(.+)$")
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_REPLICATED = re.compile(
    r"^(.*norm\.weight|.*norm\.bias|self_attn\.o_proj\.bias|mlp\.down_proj\.bias"
    r"|block_sparse_moe\.gate\.weight)$"
)


@dataclass(frozen=True, slots=True)
class Part:
    """Box ``src_lo``/``sizes`` of HF tensor ``hf`` at ``dst_lo`` of the vLLM local tensor.

    ``origin``: where the whole HF tensor sits in the vLLM tensor's *virtual global* tensor
    (the unsplit fused tensor: ``[Q; K; V]``, or ``[E, 2I, H]`` for ``w13``); the local tensor
    may have one more (leading) dim than the HF tensor (the expert index)."""

    hf: str
    src_lo: tuple[int, ...]
    sizes: tuple[int, ...]
    dst_lo: tuple[int, ...]
    origin: tuple[int, ...]

    @property
    def lead(self) -> int:
        return len(self.dst_lo) - len(self.sizes)

    def virtual_offsets(self) -> tuple[int, ...]:
        pad = (0,) * self.lead + self.src_lo
        return tuple(o + p for o, p in zip(self.origin, pad, strict=True))

    def local_sizes(self) -> tuple[int, ...]:
        return (1,) * self.lead + self.sizes


@dataclass(frozen=True)
class VTensor:
    """One tensor of one vLLM rank file: name, dtype, local shape, and its HF parts."""

    name: str
    dtype: str
    local_shape: tuple[int, ...]
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        from shardctl.dtypes import nbytes

        return nbytes(self.dtype, math.prod(self.local_shape))


def padded_vocab(vocab: int) -> int:
    """vLLM's ``pad_vocab_size``: up to a multiple of 64 (32,001 -> 32,064)."""
    return -(-vocab // VOCAB_PAD) * VOCAB_PAD


def check_supported(model: ModelInfo, tp: int) -> ModelDims:
    """Refuse, one line each, what vLLM cannot load as ``sharded_state`` at this ``tp``."""
    arch = model.architecture
    if arch not in FAMILIES or model.dims is None:
        raise InvalidInputError(
            f"vLLM format: architecture {arch!r} is not one shardctl writes for vLLM "
            f"(it writes {', '.join(FAMILIES)})",
            where="config.json model_type",
            hint="use --format ranks or hf",
        )
    d = model.dims
    if arch in NO_LM_HEAD and not d.tie_word_embeddings:
        raise InvalidInputError(
            f"vLLM format: {arch} with tie_word_embeddings=false — vLLM's {arch} has no lm_head "
            "and would compute logits from embed_tokens, silently dropping lm_head.weight",
            where="config.json tie_word_embeddings",
            hint="use --format ranks or hf",
        )
    checks = [
        ("num_attention_heads", d.num_heads, d.num_heads % tp == 0),
        (
            "num_key_value_heads",
            d.num_kv_heads,
            d.num_kv_heads % tp == 0 if d.num_kv_heads >= tp else tp % d.num_kv_heads == 0,
        ),
        ("intermediate_size", d.intermediate_size, d.intermediate_size % tp == 0),
        ("padded vocab (multiple of 64)", padded_vocab(d.vocab_size),
         padded_vocab(d.vocab_size) % tp == 0),
    ]  # fmt: skip
    for what, n, ok in checks:
        if not ok:
            raise UsageError(
                f"vLLM format: tp {tp} does not split {what} {n} the way vLLM requires "
                "(vLLM's divide() asserts)",
                hint="pick a tp that divides it (kv heads: or a multiple of them)",
            )
    return d


def _rows(total: int, tp: int, r: int) -> tuple[int, int]:
    per = total // tp
    return r * per, per


def _kv_rows(d: ModelDims, tp: int, r: int) -> tuple[int, int]:
    """(first row, rows) of rank r's K (or V) slice; one replicated head when tp >= kv."""
    if tp >= d.num_kv_heads:
        head = r // (tp // d.num_kv_heads)
        return head * d.head_dim, d.head_dim
    return _rows(d.num_kv_heads * d.head_dim, tp, r)


def _box(start: int, rows: int, shape: tuple[int, ...], dim: int = 0) -> tuple[tuple, tuple]:
    lo = tuple(start if i == dim else 0 for i in range(len(shape)))
    sz = tuple(rows if i == dim else n for i, n in enumerate(shape))
    return lo, sz


def rank_tensors(model: ModelInfo, tp: int) -> list[list[VTensor]]:
    """For each TP rank, its vLLM tensors in name order (the same names on every rank)."""
    d = check_supported(model, tp)
    by_name = {t.fqn: t for t in model.tensors}
    groups = _groups(model, d)
    ranks: list[list[VTensor]] = []
    for r in range(tp):
        out = [_build(name, kind, members, by_name, d, tp, r) for name, (kind, members) in groups]
        ranks.append(out)
    return ranks


Members = list[tuple[str, str]]  # (role, hf fqn)


def _groups(model: ModelInfo, d: ModelDims) -> list[tuple[str, tuple[str, Members]]]:
    """vLLM name -> (kind, its HF members), sorted by vLLM name; refuses unknown tensors."""
    groups: dict[str, tuple[str, Members]] = {}
    names = {t.fqn for t in model.tensors}
    tied = "lm_head.weight" not in names

    def add(vname: str, kind: str, role: str, fqn: str) -> None:
        groups.setdefault(vname, (kind, []))[1].append((role, fqn))

    for t in model.tensors:
        f = t.fqn
        if f == "model.embed_tokens.weight":
            keep = tied and model.architecture not in NO_LM_HEAD
            add("lm_head.weight" if keep else f, "vocab", "", f)
            continue
        if f == "lm_head.weight":
            add(f, "vocab", "", f)
            continue
        if f == "model.norm.weight":
            add(f, "rep", "", f)
            continue
        m = _LAYER.match(f)
        rest = m.group(2) if m else ""
        p = m.group(1) if m else ""
        em = _EXPERT.match(rest)
        attn = re.match(r"^self_attn\.([qkv])_proj\.(weight|bias)$", rest)
        mlp = re.match(r"^mlp\.(gate|up)_proj\.(weight|bias)$", rest)
        if m is None:
            pass
        elif attn:
            add(f"{p}.self_attn.qkv_proj.{attn.group(2)}", "qkv", attn.group(1), f)
            continue
        elif rest in ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"):
            add(f"{p}.{rest}", "qkv", "qkv", f)  # Phi-3: fused on disk already
            continue
        elif mlp:
            add(f"{p}.mlp.gate_up_proj.{mlp.group(2)}", "gate_up", mlp.group(1), f)
            continue
        elif rest == "mlp.gate_up_proj.weight":
            add(f"{p}.{rest}", "gate_up", "gate_up", f)
            continue
        elif rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            add(f, "row", "", f)
            continue
        elif em:
            w = "w2_weight" if em.group(2) == "w2" else "w13_weight"
            v = f"{p}.block_sparse_moe.{MOE_EXPERTS}.{w}"
            add(v, "experts", f"{em.group(2)}:{em.group(1)}", f)
            continue
        elif _REPLICATED.match(rest):
            add(f, "rep", "", f)
            continue
        raise InvalidInputError(
            f"vLLM format: no vLLM parameter for tensor {f!r} of a {model.architecture} checkpoint",
            where=f,
            hint="use --format ranks or hf",
        )
    return sorted(groups.items())


def _build(
    vname: str,
    kind: str,
    members: Members,
    by_name: dict[str, TensorInfo],
    d: ModelDims,
    tp: int,
    r: int,
) -> VTensor:
    first = by_name[members[0][1]]
    dtypes = {by_name[f].dtype for _, f in members}
    if len(dtypes) != 1:
        raise InvalidInputError(
            f"vLLM format: the HF tensors fused into {vname} have different dtypes "
            f"{sorted(dtypes)}",
            where=vname,
        )
    dtype = first.dtype
    shape = first.shape
    if kind == "rep":
        return VTensor(vname, dtype, shape, (_whole(first),))
    if kind == "row":
        lo, sz = _box(*_rows(shape[1], tp, r), shape, dim=1)
        return VTensor(vname, dtype, sz, (Part(first.fqn, lo, sz, (0,) * len(sz), (0, 0)),))
    if kind == "vocab":
        per = padded_vocab(d.vocab_size) // tp
        start = r * per
        real = max(0, min(per, shape[0] - start))
        local = (per, *shape[1:])
        parts: tuple[Part, ...] = ()
        if real:
            lo, sz = _box(start, real, shape)
            parts = (Part(first.fqn, lo, sz, (0,) * len(sz), (0,) * len(sz)),)
        return VTensor(vname, dtype, local, parts)
    if kind == "experts":
        return _experts(vname, dtype, members, by_name, d, tp, r)
    return _fused(vname, kind, dtype, members, by_name, d, tp, r)


def _whole(t: TensorInfo) -> Part:
    z = (0,) * len(t.shape)
    return Part(t.fqn, z, t.shape, z, z)


def _fused(
    vname: str,
    kind: str,
    dtype: str,
    members: Members,
    by_name: dict[str, TensorInfo],
    d: ModelDims,
    tp: int,
    r: int,
) -> VTensor:
    """qkv / gate_up: sections on dim 0, each split on its own, concatenated per rank."""
    q, kv, inter = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.intermediate_size
    role_of = dict(members)
    # (role, hf fqn, row of the section inside that HF tensor, origin row of that HF tensor)
    sections: list[tuple[str, str, int, int]] = []
    if kind == "qkv":
        if "qkv" in role_of:
            sections = [(s, role_of["qkv"], b, 0) for s, b in (("q", 0), ("k", q), ("v", q + kv))]
        else:
            sections = [("q", role_of["q"], 0, 0), ("k", role_of["k"], 0, q),
                        ("v", role_of["v"], 0, q + kv)]  # fmt: skip
    else:
        if "gate_up" in role_of:
            g = role_of["gate_up"]
            sections = [("gate", g, 0, 0), ("up", g, inter, 0)]
        else:
            sections = [("gate", role_of["gate"], 0, 0), ("up", role_of["up"], 0, inter)]
    expect = {"q": q, "k": kv, "v": kv, "gate": inter, "up": inter}
    total = sum(expect[s] for s, *_ in sections)
    hf_rows = sum(by_name[f].shape[0] for f in {f for _, f, _, _ in sections})
    if hf_rows != total:
        raise InvalidInputError(
            f"vLLM format: {vname} sections add up to {hf_rows} rows, the config says {total}",
            where=vname,
            hint="config.json and the weights disagree",
        )
    parts: list[Part] = []
    cursor = 0
    trailing = by_name[sections[0][1]].shape[1:]
    for section, fqn, base, origin_row in sections:
        if section in ("k", "v"):
            start, rows = _kv_rows(d, tp, r)
        else:
            start, rows = _rows(expect[section], tp, r)
        shape = by_name[fqn].shape
        lo, sz = _box(base + start, rows, shape)
        dst = (cursor,) + (0,) * len(trailing)
        parts.append(Part(fqn, lo, sz, dst, (origin_row,) + (0,) * len(trailing)))
        cursor += rows
    return VTensor(vname, dtype, (cursor, *trailing), tuple(parts))


def _experts(
    vname: str,
    dtype: str,
    members: Members,
    by_name: dict[str, TensorInfo],
    d: ModelDims,
    tp: int,
    r: int,
) -> VTensor:
    """FusedMoE: ``w13_weight [E, 2·I/tp, H]`` (w1 then w3), ``w2_weight [E, H, I/tp]``."""
    inter, hidden, e_total = d.intermediate_size, d.hidden_size, d.num_experts
    start, rows = _rows(inter, tp, r)
    parts: list[Part] = []
    for role, fqn in members:
        w, e = role.split(":")
        expert = int(e)
        if w == "w2":
            parts.append(Part(fqn, (0, start), (hidden, rows), (expert, 0, 0), (expert, 0, 0)))
        else:
            up = w == "w3"
            parts.append(
                Part(
                    fqn,
                    (start, 0),
                    (rows, hidden),
                    (expert, rows if up else 0, 0),
                    (expert, inter if up else 0, 0),
                )
            )
    local = (e_total, hidden, rows) if vname.endswith("w2_weight") else (e_total, 2 * rows, hidden)
    need = e_total * (1 if vname.endswith("w2_weight") else 2)
    if len(parts) != need:
        raise InvalidInputError(
            f"vLLM format: {vname} needs {need} expert tensors, the checkpoint has {len(parts)}",
            where=vname,
        )
    return VTensor(vname, dtype, local, tuple(parts))


def hf_order(tensors: Sequence[TensorInfo]) -> list[TensorInfo]:
    """The order safetensors' ``save_file`` lays tensors out in: alignment desc, then name."""
    from shardctl.dtypes import itemsize

    return sorted(tensors, key=lambda t: (-itemsize(t.dtype), t.fqn))


SCALE_BUFFERS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
SCALE_NAME = re.compile(r"^model\.layers\.\d+\.self_attn\.attn\._(k|v|q|prob)_scale$")


def attention_scales(num_layers: int) -> list[str]:
    """The scale buffers of every attention layer, sorted by name."""
    return sorted(
        f"model.layers.{i}.self_attn.attn.{b}" for i in range(num_layers) for b in SCALE_BUFFERS
    )
