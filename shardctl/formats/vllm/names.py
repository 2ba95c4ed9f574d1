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
  ``_filter_subtensors`` keeps the smaller key, ``lm_head.weight`` (Gemma-2 and Cohere have no
  lm_head module: ``model.embed_tokens.weight``);
- MoE experts (``FusedMoE``, no EP): ``experts.routed_experts.w13_weight [E, 2·I/tp, H]``
  = per expert ``[gate_r; up_r]``, ``….w2_weight [E, H, I/tp]`` = per expert ``down[:, r·I/tp..]``;
- everything else (norms, routers) whole on every rank;
- a module registered twice (MoE routers and shared experts on vLLM's MoE runner, MLA
  projections on its wrapper): ``_filter_subtensors`` keeps the smaller name;
- every attention layer's ``…attn._{k,v,q,prob}_scale``: float32 scalars, 1.0 for an
  unquantized model — persistent buffers of vLLM's ``Attention`` (``set_default_quant_scales(
  register_buffer=True)``, vLLM 0.32), so they are in the state dict the loader fills and it
  reports them missing otherwise. They belong to no HF tensor: written in a last part per rank.

Which of these applies to which tensor is the family's declaration (``Family.vllm``, a
:class:`~shardctl.formats.vllm.spec.VllmNames` of rules; this module names no family). A
:class:`Part` says which box of which HF tensor lands where in a vLLM local tensor; the same
table drives the writer (``write.py``) and the reader (``read.py``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from shardctl.errors import InvalidInputError, UsageError
from shardctl.formats.vllm.spec import ORDER, VllmNames
from shardctl.model.types import ModelDims, ModelInfo, TensorInfo

VOCAB_PAD = 64  # vllm vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


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


def spec_for(model: ModelInfo) -> VllmNames:
    """The family's declaration (``Family.vllm``); refuses, one line, a family without one."""
    from shardctl.archs import SUPPORTED, find

    fam = find(model.architecture)
    spec = fam.vllm if fam is not None else None
    if spec is None or spec.refused or model.dims is None:
        have = [t for t in SUPPORTED if (f := find(t)) and f.vllm and not f.vllm.refused]
        why = (
            spec.refused if spec is not None and spec.refused else (f"it writes {', '.join(have)}")
        )
        raise InvalidInputError(
            f"vLLM format: architecture {model.architecture!r} is not one shardctl writes for "
            f"vLLM ({why})",
            where="config.json model_type",
            hint="use --format ranks or hf",
        )
    return spec


def check_supported(model: ModelInfo, tp: int) -> tuple[ModelDims, VllmNames]:
    """Refuse, one line each, what vLLM cannot load as ``sharded_state`` at this ``tp``."""
    spec = spec_for(model)
    arch = model.architecture
    d = model.dims
    assert d is not None
    for key, value, why in spec.unsupported:
        bad = value(model.config) if callable(value) else model.config.get(key) == value
        if bad:
            raise InvalidInputError(
                f"vLLM format: {arch} with {key}={json.dumps(model.config.get(key))} — {why}",
                where=f"config.json {key}",
                hint="use --format ranks or hf",
            )
    extra = {
        int(m.group(1))
        for t in model.tensors
        if (m := re.match(r"model\.layers\.(\d+)\.", t.fqn)) and int(m.group(1)) >= d.num_layers
    }
    if extra:
        raise InvalidInputError(
            f"vLLM format: the checkpoint holds {len(extra)} multi-token-prediction layer(s) "
            "— vLLM loads them as a separate draft model, not from the main model's "
            "sharded_state",
            where="config.json num_nextn_predict_layers",
            hint="use --format ranks or hf",
        )
    if not spec.lm_head and not d.tie_word_embeddings:
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
        ("padded vocab (multiple of 64)", padded_vocab(d.vocab_size),
         padded_vocab(d.vocab_size) % tp == 0),
    ]  # fmt: skip
    for what, n, ok in checks:
        if not ok:
            raise _indivisible(tp, what, n)
    return d, spec


def _indivisible(tp: int, what: str, n: int) -> UsageError:
    return UsageError(
        f"vLLM format: tp {tp} does not split {what} {n} the way vLLM requires "
        "(vLLM's divide() asserts)",
        hint="pick a tp that divides it (kv heads: or a multiple of them)",
    )


def _rows(total: int, tp: int, r: int) -> tuple[int, int]:
    per = total // tp
    return r * per, per


def _kv_rows(d: ModelDims, hd: int, tp: int, r: int) -> tuple[int, int]:
    """(first row, rows) of rank r's K (or V) slice of ``hd`` rows per kv head; one
    replicated head when tp >= kv."""
    if tp >= d.num_kv_heads:
        head = r // (tp // d.num_kv_heads)
        return head * hd, hd
    return _rows(d.num_kv_heads * hd, tp, r)


def _box(start: int, rows: int, shape: tuple[int, ...], dim: int = 0) -> tuple[tuple, tuple]:
    lo = tuple(start if i == dim else 0 for i in range(len(shape)))
    sz = tuple(rows if i == dim else n for i, n in enumerate(shape))
    return lo, sz


def rank_tensors(model: ModelInfo, tp: int) -> list[list[VTensor]]:
    """For each TP rank, its vLLM tensors in name order (the same names on every rank)."""
    d, spec = check_supported(model, tp)
    by_name = {t.fqn: t for t in model.tensors}
    groups = _groups(model, spec)
    ranks: list[list[VTensor]] = []
    for r in range(tp):
        out = [_build(name, members, by_name, d, tp, r) for name, members in groups]
        ranks.append(out)
    return ranks


@dataclass(frozen=True)
class Member:
    kind: str  # "rep", "col", "qkv.k", "w13.gate", ... (spec.py)
    fqn: str  # the HF tensor
    expert: int = -1


def _groups(model: ModelInfo, spec: VllmNames) -> list[tuple[str, list[Member]]]:
    """vLLM name -> its HF members, sorted by vLLM name; refuses tensors no rule places."""
    groups: dict[str, list[Member]] = {}
    names = {t.fqn for t in model.tensors}
    tied = "lm_head.weight" not in names
    rules = [(re.compile(rx), name, kind) for rx, name, kind in spec.rules]
    for t in model.tensors:
        f = t.fqn
        if f == spec.embed and tied and spec.lm_head:
            # tied: one tensor, ``_filter_subtensors`` keeps the smaller key, ``lm_head.weight``
            groups.setdefault("lm_head.weight", []).append(Member("vocab", f))
            continue
        for rx, name, kind in rules:
            m = rx.fullmatch(f)
            if m:
                e = m.groupdict().get("e")
                member = Member(m.expand(kind), f, int(e) if e is not None else -1)
                groups.setdefault(m.expand(name), []).append(member)
                break
        else:
            raise InvalidInputError(
                f"vLLM format: no vLLM parameter for tensor {f!r} of a {model.architecture} "
                "checkpoint",
                where=f,
                hint="use --format ranks or hf",
            )
    for vname, members in list(groups.items()):
        if len(members) == 1 and members[0].kind.startswith("mr."):
            # a merged replicated linear with one section is the plain ReplicatedLinear under
            # its own name (DeepSeek-V2-Lite: no q LoRA, ``kv_a_proj_with_mqa`` itself)
            del groups[vname]
            groups[members[0].fqn] = [Member("rep", members[0].fqn)]
    return sorted(groups.items())


def _build(
    vname: str,
    members: list[Member],
    by_name: dict[str, TensorInfo],
    d: ModelDims,
    tp: int,
    r: int,
) -> VTensor:
    dtypes = {by_name[m.fqn].dtype for m in members}
    if len(dtypes) != 1:
        raise InvalidInputError(
            f"vLLM format: the HF tensors fused into {vname} have different dtypes "
            f"{sorted(dtypes)}",
            where=vname,
        )
    dtype = dtypes.pop()
    first = by_name[members[0].fqn]
    kind = members[0].kind
    shape = first.shape
    if kind.startswith(("w13.", "w2")):
        return _experts(vname, dtype, members, by_name, tp, r)
    if len(members) == 1 and kind in ("rep", "col", "row", "kvcol", "vocab"):
        if kind == "rep":
            return VTensor(vname, dtype, shape, (_whole(first),))
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
        dim = len(shape) - 1 if kind == "row" else 0
        if kind == "kvcol":
            start, rows = _kv_rows(d, shape[0] // d.num_kv_heads, tp, r)
        else:
            if shape[dim] % tp:
                raise _indivisible(tp, f"{first.fqn} dim {dim}", shape[dim])
            start, rows = _rows(shape[dim], tp, r)
        lo, sz = _box(start, rows, shape, dim=dim)
        z = (0,) * len(shape)
        return VTensor(vname, dtype, sz, (Part(first.fqn, lo, sz, z, z),))
    return _fused(vname, dtype, members, by_name, d, tp, r)


def _whole(t: TensorInfo) -> Part:
    z = (0,) * len(t.shape)
    return Part(t.fqn, z, t.shape, z, z)


def _section_rows(
    section: str, total: int, d: ModelDims, hd: int, tp: int, r: int
) -> tuple[int, int]:
    """(first row, rows) of rank r's slice of one section of ``total`` rows."""
    if section in ("k", "v"):
        return _kv_rows(d, hd, tp, r)
    if total % tp:
        raise _indivisible(tp, f"{section} rows", total)
    return _rows(total, tp, r)


def _fused(
    vname: str,
    dtype: str,
    members: list[Member],
    by_name: dict[str, TensorInfo],
    d: ModelDims,
    tp: int,
    r: int,
) -> VTensor:
    """Sections on dim 0 (``qkv_proj``, ``gate_up_proj``, ``fused_qkv_a_proj``), each cut for
    rank r on its own (or whole: ``mr``), concatenated per rank in :data:`ORDER`."""
    kinds = {m.kind for m in members}
    trailing = by_name[members[0].fqn].shape[1:]
    z = (0,) * len(trailing)
    # (HF fqn, first row in it, rows, origin row of the HF tensor in the virtual tensor)
    boxes: list[tuple[str, int, int, int]] = []
    if len(members) == 1 and members[0].kind.startswith("qkv."):  # fused on disk
        m = members[0]
        boxes = [(m.fqn, lo, n, 0) for lo, n in _disk_qkv(m, by_name, d, tp, r)]
    elif len(members) == 1 and members[0].kind == "mc.halves":
        m = members[0]
        half = by_name[m.fqn].shape[0] // 2
        for base in (0, half):
            start, rows = _section_rows("gate", half, d, 0, tp, r)
            boxes.append((m.fqn, base + start, rows, 0))
    else:
        sections = sorted(members, key=lambda m: ORDER.index(m.kind.split(".")[1]))
        if len(kinds) != len(members) or any("." not in k for k in kinds):
            raise InvalidInputError(
                f"vLLM format: {vname} would fuse {[m.fqn for m in members]}: not one tensor "
                "per section",
                where=vname,
            )
        origin = 0
        k_rows = next((by_name[m.fqn].shape[0] for m in members if m.kind == "qkv.k"), 0)
        hd = k_rows // d.num_kv_heads if k_rows else 0
        for m in sections:
            total = by_name[m.fqn].shape[0]
            if m.kind.startswith("mr."):
                start, rows = 0, total
            else:
                start, rows = _section_rows(m.kind.split(".")[1], total, d, hd, tp, r)
            boxes.append((m.fqn, start, rows, origin))
            origin += total
    parts: list[Part] = []
    cursor = 0
    for fqn, start, rows, origin_row in boxes:
        lo, sz = _box(start, rows, by_name[fqn].shape)
        parts.append(Part(fqn, lo, sz, (cursor, *z), (origin_row, *z)))
        cursor += rows
    return VTensor(vname, dtype, (cursor, *trailing), tuple(parts))


def _disk_qkv(
    m: Member, by_name: dict[str, TensorInfo], d: ModelDims, tp: int, r: int
) -> list[tuple[int, int]]:
    """Rank r's ``[q; k; v]`` rows of a QKV tensor fused on disk, as (HF row, rows) runs."""
    heads, kv = d.num_heads, d.num_kv_heads
    total = by_name[m.fqn].shape[0]
    hd, rest = divmod(total, heads + 2 * kv)
    if rest or hd == 0:
        raise InvalidInputError(
            f"vLLM format: {m.fqn} has {total} rows, not (heads {heads} + 2 × kv heads {kv}) "
            "× head_dim",
            where=m.fqn,
            hint="config.json and the weights disagree",
        )
    layout = m.kind.split(".")[1]
    qpg = heads // kv

    def row(section: str, h: int) -> int:
        if layout == "neox":  # per head [q; k; v]
            return (h * 3 + "qkv".index(section)) * hd
        if layout == "groups":  # per kv group [q × heads/kv; k; v]
            if section == "q":
                return ((h // qpg) * (qpg + 2) + h % qpg) * hd
            return (h * (qpg + 2) + qpg + (section == "v")) * hd
        base = {"q": 0, "k": heads * hd, "v": (heads + kv) * hd}[section]  # [Q; K; V]
        return base + h * hd

    q0, qn = _rows(heads, tp, r)
    if tp >= kv:
        kv_heads = [r // (tp // kv)]
    else:
        k0, kn = _rows(kv, tp, r)
        kv_heads = list(range(k0, k0 + kn))
    runs: list[tuple[int, int]] = []
    for section, hs in (("q", range(q0, q0 + qn)), ("k", kv_heads), ("v", kv_heads)):
        first = len(runs)  # merged within a section only: replicated K/V runs stay identical
        for h in hs:
            at = row(section, h)
            if len(runs) > first and runs[-1][0] + runs[-1][1] == at:
                runs[-1] = (runs[-1][0], runs[-1][1] + hd)
            else:
                runs.append((at, hd))
    return runs


def _experts(
    vname: str,
    dtype: str,
    members: list[Member],
    by_name: dict[str, TensorInfo],
    tp: int,
    r: int,
) -> VTensor:
    """FusedMoE: ``w13_weight [E, 2·I/tp, H]`` (gate then up), ``w2_weight [E, H, I/tp]``."""
    e_total = 1 + max(m.expert for m in members)
    w2 = members[0].kind == "w2"
    out_rows, hidden = by_name[members[0].fqn].shape
    inter = hidden if w2 else out_rows  # w2 is [H, I]
    hidden = out_rows if w2 else hidden
    if inter % tp:
        raise _indivisible(tp, f"{members[0].fqn} experts' intermediate size", inter)
    start, rows = _rows(inter, tp, r)
    parts: list[Part] = []
    for m in members:
        e = m.expert
        if w2:
            parts.append(Part(m.fqn, (0, start), (hidden, rows), (e, 0, 0), (e, 0, 0)))
        else:
            up = m.kind in ("w13.up", "w13.w3")
            parts.append(
                Part(
                    m.fqn,
                    (start, 0),
                    (rows, hidden),
                    (e, rows if up else 0, 0),
                    (e, inter if up else 0, 0),
                )
            )
    local = (e_total, hidden, rows) if w2 else (e_total, 2 * rows, hidden)
    need = e_total * (1 if w2 else 2)
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
SCALE_NAME = re.compile(r"attn\._(k|v|q|prob)_scale$")  # use .search


def attention_scales(model: ModelInfo) -> list[str]:
    """The scale buffers of every attention layer (``VllmNames.attention``), sorted by name."""
    spec = spec_for(model)
    layers = model.dims.num_layers if model.dims else 0
    return sorted(f"{spec.attention.format(i=i)}.{b}" for i in range(layers) for b in SCALE_BUFFERS)
