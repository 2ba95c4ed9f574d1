"""Stored quantized tensors grouped under the unquantized weight they encode; no torch.

A quantized linear is several tensors on disk; the rules place the *logical* weight (the name
and shape the unquantized checkpoint has, so every family's rules apply unchanged) and each
stored *member* follows it. A member says, per stored dim, which logical dim it runs along and
how many logical indices one stored index covers (:class:`Axis`)::

    GPTQ (AutoGPTQ QuantLinear; TheBloke/Llama-2-7B-GPTQ: down_proj.qweight I32 [1376, 4096],
    qzeros I32 [86, 512], scales F16 [86, 4096], g_idx I32 [11008]), logical [out, in]:
        qweight [in/8, out]        (Axis(1, 8), Axis(0))      8 int4 per int32 along in
        qzeros  [in/g, out/8]      (Axis(1, g), Axis(0, 8))
        scales  [in/g, out]        (Axis(1, g), Axis(0))
        g_idx   [in]               (Axis(1),)
    AWQ (AutoAWQ WQLinear_GEMM): qweight [in, out/8] (Axis(1), Axis(0, 8)); qzeros / scales
        as GPTQ; no g_idx.
    FP8 block (DeepSeek-V3, Qwen3-FP8): weight F8_E4M3 [out, in]; weight_scale_inv F32
        [ceil(out/128), ceil(in/128)] (Axis(0, 128), Axis(1, 128)).
    FP8 per-tensor / per-channel: weight_scale [] / [1] (replicated) or [out, 1] (Axis(0), R);
        input_scale replicated.
    compressed-tensors int-quantized (RedHatAI W8A8 / W8A16 INT8): weight I8 [out, in];
        weight_scale [1], [out, 1] or per group [out, in/g] (Axis(0), Axis(1, g));
        weight_zero_point I8 shaped and split as the scale (asymmetric); input_scale /
        input_zero_point [1] replicated (static activations).
    compressed-tensors pack-quantized: weight_packed I32 [out, in/8] (Axis(0), Axis(1, 8));
        weight_scale [out, in/g]; weight_zero_point [out/8, in/g]; weight_shape I64 [2]
        (replicated: it holds the global shape); weight_g_idx [in].
    compressed-tensors NVFP4: weight_packed U8 [out, in/2]; weight_scale F8_E4M3 [out, in/16];
        weight_global_scale / input_global_scale F32 [1] (replicated).
    MXFP4 (gpt-oss): X_blocks U8 [*lead, out, in/32, 16]; X_scales U8 (e8m0) [*lead, out, in/32];
        logical X as the bf16 checkpoint stores it, [*lead, in, out].

Sharding a logical dim then splits each member's matching dim at ``offset / factor``; a rank
boundary that is not a multiple of the group's coarsest factor would cut an int32, a group or a
block, and is refused (:mod:`shardctl.layout.split`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from shardctl.errors import InvalidInputError, ShardctlError
from shardctl.gcpause import gc_paused
from shardctl.model.types import TensorInfo
from shardctl.quant.config import QuantConfig, read_quant


class Axis(NamedTuple):
    """One stored dim: the logical dim it runs along (None: none) and logical indices per index.

    A named tuple, not a dataclass: 45,000 FP8 experts' groups are checked and keyed by their
    axes (``_check``, ``resolve_rules``), and a tuple hashes and compares in C."""

    dim: int | None
    factor: int = 1
    unit: str = ""  # for messages: "int32 packing (8 per int32)", "group_size 128"


@dataclass(frozen=True)
class Member:
    info: TensorInfo
    role: str  # "qweight", "scales", "weight_scale_inv", ...
    axes: tuple[Axis, ...]


@dataclass(frozen=True)
class QuantGroup:
    """One quantized weight: its logical tensor (what the rules place) and its stored members."""

    scheme: str  # "fp8-block", "fp8", "gptq", "awq", "ct-pack", "nvfp4", "ct-fp8", "ct-int",
    # "mxfp4"
    logical: TensorInfo  # dtype: the members' payload dtype
    members: tuple[Member, ...]
    dim_names: tuple[str, ...]  # ("out-features", "in-features") for messages

    def constraint(self, dim: int) -> tuple[int, str]:
        """The coarsest granularity along logical ``dim`` and its name, e.g. (128, "group_size
        128"): rank boundaries on ``dim`` must be multiples of it."""
        best, unit, top = 1, "", 1
        for m in self.members:
            for a in m.axes:
                if a.dim == dim and a.factor > 1:
                    best = math.lcm(best, a.factor)
                    if a.factor > top:
                        top, unit = a.factor, a.unit
        return best, unit


SCHEME_NAMES: dict[str, str] = {
    "fp8-block": "FP8 block",
    "fp8": "FP8",
    "ct-fp8": "compressed-tensors FP8",
    "ct-int": "compressed-tensors INT8",
    "gptq": "GPTQ",
    "awq": "AWQ",
    "ct-pack": "compressed-tensors pack-quantized",
    "nvfp4": "NVFP4",
    "mxfp4": "MXFP4",
}
LINEAR = ("out-features", "in-features")


@gc_paused  # ~200,000 acyclic objects for an FP8 MoE of 90,000 tensors
def group_tensors(
    tensors: Iterable[TensorInfo], config: Mapping[str, Any], *, where: str = "checkpoint"
) -> dict[str, QuantGroup]:
    """Every stored member fqn → its group; ``{}`` for an unquantized checkpoint.

    The config's ``quantization_config`` decides the scheme; a checkpoint without one is
    recognized by the names alone for FP8 block scales and MXFP4 (the unambiguous ones).
    """
    return _walk(tensors, read_quant(config, where=f"{where}/config.json"), where)


def _walk(
    tensors: Iterable[TensorInfo], qc: QuantConfig | None, where: str
) -> dict[str, QuantGroup]:
    by_name = {t.fqn: t for t in tensors}
    out: dict[str, QuantGroup] = {}
    for fqn in by_name:
        if not fqn.endswith(ANCHOR_ENDS):
            continue  # _group_at's own first test, once per name (90,000 experts: 5 calls each)
        group = _group_at(fqn, by_name, qc, where)
        if group is not None:
            for m in group.members:
                if m.info.fqn in out:
                    continue
                out[m.info.fqn] = group
    return out


# Every anchor _group_at recognizes ends with one of these: a model whose names end with none
# has no group (callers skip group_tensors' walk on that test).
ANCHOR_ENDS = (".weight_scale_inv", ".qweight", ".weight_packed", ".weight_scale", "_blocks")


class StemKinds(NamedTuple):
    """:func:`group_tensors`' answer by *stem kind*, without a group per weight.

    A group's tensors share their *stem* (the name up to its last dot: ``...experts.7.w1``
    holds ``weight`` and ``weight_scale_inv``; gpt-oss's ``...experts`` holds
    ``gate_up_proj_blocks`` and ``gate_up_proj_scales``), and which groups a stem holds depends
    only on its tensors' leaves, shapes and dtypes, in order — its *kind*. 45,000 FP8 experts'
    stems are a handful of kinds, grouped once each (in the kind's first stem).
    """

    stems: list[tuple[str, int, list[int]]]  # (stem, kind, tensor indexes) per anchored stem
    groups: list[tuple[QuantGroup | None, ...]]  # per kind: the group at each place in its stem
    first: list[int]  # per kind: its first stem (an index into ``stems``)
    qc: QuantConfig | None

    def stem_groups(
        self, s: int, tensors: Sequence[TensorInfo], *, where: str = "checkpoint"
    ) -> dict[str, QuantGroup]:
        """Stem ``s``'s own groups (of its own tensor objects), as the whole walk makes them:
        for a caller that must hold a real group (placing a class's first tensor)."""
        return _walk([tensors[i] for i in self.stems[s][2]], self.qc, where)

    def tensor_keys(
        self, n: int, key: Callable[[QuantGroup], Hashable]
    ) -> tuple[list[int | None], list[int]]:
        """For each of the ``n`` tensors: its group's ``key`` as a small int (equal keys, equal
        ints; None: in no group), and its stem (an index into ``stems``; -1: no anchored
        stem). Small ints, because hashing 90,000 nested keys into class keys took ~40 ms."""
        number: dict[Hashable, int] = {}
        key_of = [
            tuple(None if g is None else number.setdefault(key(g), len(number)) for g in kind)
            for kind in self.groups
        ]
        keys: list[int | None] = [None] * n
        stem_of = [-1] * n
        for s, (_, kind, at) in enumerate(self.stems):
            for i, k in zip(at, key_of[kind], strict=True):
                keys[i] = k
                stem_of[i] = s
        return keys, stem_of


@gc_paused
def group_kinds(
    tensors: Sequence[TensorInfo], config: Mapping[str, Any], *, where: str = "checkpoint"
) -> StemKinds:
    """The stems that hold a group anchor, each with its kind, and each kind's groups as
    :func:`group_tensors` makes them for the kind's first stem (``groups[k][p]``: the group of
    place ``p`` of the stem's tensors, None for a tensor in no group). Any stem of a kind is
    grouped alike: stem ``s`` of kind ``k`` has, at place ``p``, the group of
    ``groups[k][p]`` with ``s`` for the first stem's name. Errors are
    :func:`group_tensors`' own, naming the tensor it names."""
    qc = read_quant(config, where=f"{where}/config.json")
    names = [t.fqn for t in tensors]
    anchored = dict.fromkeys(fqn.rpartition(".")[0] for fqn in names if fqn.endswith(ANCHOR_ENDS))
    if not anchored:
        return StemKinds([], [], [], qc)  # no group (an unquantized checkpoint)
    by_stem: dict[str, list[int]] = {}
    for i, stem in enumerate([fqn.rpartition(".")[0] for fqn in names]):
        at = by_stem.get(stem)
        if at is None:
            by_stem[stem] = [i]
        else:
            at.append(i)
    kinds: dict[tuple[tuple[str, tuple[int, ...], str], ...], int] = {}
    groups: list[tuple[QuantGroup | None, ...]] = []
    stems: list[tuple[str, int, list[int]]] = []
    first: list[int] = []
    for stem in anchored:
        at = by_stem[stem]
        cut = len(stem)
        sig = tuple([(tensors[i].fqn[cut:], tensors[i].shape, tensors[i].dtype) for i in at])
        kind = kinds.get(sig)
        if kind is None:
            members = [tensors[i] for i in at]
            try:
                found = _walk(members, qc, where)
            except ShardctlError:
                group_tensors(tensors, config, where=where)  # the error the whole walk gives
                raise
            kind = kinds[sig] = len(groups)
            groups.append(tuple(found.get(t.fqn) for t in members))
            first.append(len(stems))
        stems.append((stem, kind, at))
    return StemKinds(stems, groups, first, qc)


def _group_at(
    fqn: str, t: Mapping[str, TensorInfo], qc: QuantConfig | None, where: str
) -> QuantGroup | None:
    """The group whose *anchor* tensor is ``fqn`` (qweight, weight_packed, weight_scale_inv,
    weight_scale next to an F8 weight, X_blocks), else None."""
    method = qc.method if qc else ""
    if fqn.endswith(".weight_scale_inv"):
        return _fp8_block(fqn[: -len(".weight_scale_inv")], t, qc, where)
    if fqn.endswith(".qweight"):
        base = fqn[: -len(".qweight")]
        if method == "awq" or (not method and _looks_awq(base, t)):
            return _awq(base, t, qc, where)
        return _gptq(base, t, qc, where)
    if fqn.endswith(".weight_packed"):
        return _ct_pack(fqn[: -len(".weight_packed")], t, qc, where)
    if fqn.endswith(".weight_scale") and f"{fqn[: -len('_scale')]}" in t:
        base = fqn[: -len(".weight_scale")]
        dtype = t[f"{base}.weight"].dtype
        if dtype.startswith("F8"):
            return _scaled(base, t, qc, where, "ct-fp8" if _ct(qc) else "fp8")
        if dtype == "I8":  # compressed-tensors int-quantized / naive-quantized
            return _scaled(base, t, qc, where, "ct-int")
    if fqn.endswith("_blocks") and f"{fqn[: -len('_blocks')]}_scales" in t:
        return _mxfp4(fqn[: -len("_blocks")], t, where)
    return None


def _need(t: Mapping[str, TensorInfo], name: str, scheme: str, where: str) -> TensorInfo:
    info = t.get(name)
    if info is None:
        raise InvalidInputError(
            f"{SCHEME_NAMES[scheme]} weight without its {name.rsplit('.', 1)[-1]!r} tensor",
            where=f"{where}: {name}",
            hint="the checkpoint is incomplete; re-export it with all quantization tensors",
        )
    return info


# (axes, stored shape, logical shape) already proven consistent by ``_check``: the 45,000
# groups of an FP8 MoE checkpoint are a handful of such triples.
_CHECKED: dict[tuple[tuple[Axis, ...], tuple[int, ...], tuple[int, ...]], None] = {}
_CHECKED_MAX = 4096


def _check(m: Member, logical: tuple[int, ...], scheme: str, where: str) -> Member:
    """A member's shape must be what its axes say (``ceil(logical / factor)`` per mapped dim)."""
    key = (m.axes, m.info.shape, logical)
    if key in _CHECKED:
        return m
    _check_shape(m, logical, scheme, where)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED[key] = None
    return m


def _check_shape(m: Member, logical: tuple[int, ...], scheme: str, where: str) -> None:
    if len(m.axes) != len(m.info.shape):
        raise InvalidInputError(
            f"{SCHEME_NAMES[scheme]} {m.role} has {len(m.info.shape)} dims "
            f"{list(m.info.shape)}, expected {len(m.axes)}",
            where=f"{where}: {m.info.fqn}",
        )
    for i, (a, size) in enumerate(zip(m.axes, m.info.shape, strict=True)):
        if a.dim is None:
            continue
        want = -(-logical[a.dim] // a.factor)
        if size != want:
            raise InvalidInputError(
                f"{SCHEME_NAMES[scheme]} {m.role} {list(m.info.shape)}: dim {i} is {size}, "
                f"expected {want} for weight {list(logical)}"
                + (f" with {a.unit}" if a.unit else ""),
                where=f"{where}: {m.info.fqn}",
                hint="the quantization_config does not match the tensors",
            )


def _group(
    scheme: str,
    logical: TensorInfo,
    members: list[Member],
    where: str,
    dim_names: tuple[str, ...] = LINEAR,
) -> QuantGroup:
    checked = tuple(_check(m, logical.shape, scheme, where) for m in members)
    return QuantGroup(scheme, logical, checked, dim_names)


def _optional(
    t: Mapping[str, TensorInfo], base: str, role: str, axes: tuple[Axis, ...]
) -> list[Member]:
    info = t.get(f"{base}.{role}")
    return [] if info is None else [Member(info, role, axes[: len(info.shape)])]


def _scalar_members(t: Mapping[str, TensorInfo], base: str, roles: Iterable[str]) -> list[Member]:
    out = []
    for role in roles:
        info = t.get(f"{base}.{role}")
        if info is not None:
            out.append(Member(info, role, tuple(Axis(None) for _ in info.shape)))
    return out


def _fp8_block(
    base: str, t: Mapping[str, TensorInfo], qc: QuantConfig | None, where: str
) -> QuantGroup:
    weight = _need(t, f"{base}.weight", "fp8-block", where)
    block = qc.block if qc and qc.block else (128, 128)
    scale_axes = _FP8_BLOCK_AXES.get(block)
    if scale_axes is None:
        bo, bi = block
        unit_o, unit_i = f"FP8 block {bo}x{bi} (rows)", f"FP8 block {bo}x{bi} (columns)"
        scale_axes = _FP8_BLOCK_AXES[block] = (Axis(0, bo, unit_o), Axis(1, bi, unit_i))
    members = [
        Member(weight, "weight", _WHOLE_2D),
        Member(t[f"{base}.weight_scale_inv"], "weight_scale_inv", scale_axes),
    ]
    members += _scalar_members(t, base, ("input_scale",))
    return _group("fp8-block", weight, members, where)  # the logical weight is the stored one


_WHOLE_2D = (Axis(0), Axis(1))
_FP8_BLOCK_AXES: dict[tuple[int, int], tuple[Axis, Axis]] = {}  # block -> weight_scale_inv's


def _ct(qc: QuantConfig | None) -> bool:
    return qc is not None and qc.method == "compressed-tensors"


def _scaled(
    base: str, t: Mapping[str, TensorInfo], qc: QuantConfig | None, where: str, scheme: str
) -> QuantGroup:
    """A weight stored one value per element (F8 or I8) with ``weight_scale``: per-tensor
    ``[]``/``[1]``, per-channel ``[out, 1]``/``[out]``, per group of in-features ``[out, in/g]``
    or per block ``[ceil(out/b), ceil(in/b)]`` (compressed-tensors strategies); an asymmetric
    one's ``weight_zero_point`` is shaped and split as its scale."""
    weight = t[f"{base}.weight"]
    scale = t[f"{base}.weight_scale"]
    out_f, in_f = weight.shape
    shape = scale.shape
    if math.prod(shape) == 1:
        axes: tuple[Axis, ...] = tuple(Axis(None) for _ in shape)
    elif shape in ((out_f, 1), (out_f,)):
        axes = (Axis(0), Axis(None))[: len(shape)]
    elif len(shape) == 2:
        name = SCHEME_NAMES[scheme]
        if qc is not None and qc.strategy == "group":
            g = qc.group_size
            axes = (Axis(0), Axis(1, g, f"{name} group_size {g}"))
        else:
            bo, bi = -(-out_f // shape[0]), -(-in_f // shape[1])
            b = qc.block if qc and qc.block else (bo, bi)
            unit = f"{name} block {b[0]}x{b[1]}"
            axes = (Axis(0, b[0], f"{unit} (rows)"), Axis(1, b[1], f"{unit} (columns)"))
    else:
        raise InvalidInputError(
            f"{SCHEME_NAMES[scheme]} weight_scale {list(shape)} is neither per-tensor, "
            f"per-channel [{out_f}, 1], per-group nor block-shaped",
            where=f"{where}: {scale.fqn}",
        )
    members = [Member(weight, "weight", (Axis(0), Axis(1))), Member(scale, "weight_scale", axes)]
    zp = t.get(f"{base}.weight_zero_point")
    if zp is not None:
        if zp.shape != shape:
            raise InvalidInputError(
                f"{SCHEME_NAMES[scheme]} weight_zero_point {list(zp.shape)}: expected the "
                f"shape of its weight_scale {list(shape)}",
                where=f"{where}: {zp.fqn}",
                hint="the checkpoint is inconsistent; re-export it",
            )
        members.append(Member(zp, "weight_zero_point", axes))
    members += _scalar_members(t, base, ("input_scale", "input_zero_point"))
    return _group(scheme, TensorInfo(weight.fqn, weight.shape, weight.dtype), members, where)


def _pack(qc: QuantConfig | None) -> int:
    return 32 // (qc.bits if qc else 4)


def _groups_axis(
    in_f: int, n_groups: int, qc: QuantConfig | None, scheme: str, where: str, fqn: str
) -> Axis:
    """The groups dim of scales / zeros: ``Axis(1, g)``; replicated for one group or act-order
    (vLLM ``gptq.py``: with desc_act a row-parallel rank keeps every group, since g_idx
    scatters them over the in-features)."""
    if n_groups == 1 or (qc is not None and qc.desc_act):
        return Axis(None)
    g = qc.group_size if qc and qc.group_size > 0 else -(-in_f // n_groups)
    if -(-in_f // g) != n_groups:
        raise InvalidInputError(
            f"{SCHEME_NAMES[scheme]}: {n_groups} groups, but in-features {in_f} with "
            f"group_size {g} give {-(-in_f // g)}",
            where=f"{where}: {fqn}",
            hint="the quantization_config's group_size does not match the tensors",
        )
    return Axis(1, g, f"{SCHEME_NAMES[scheme]} group_size {g}")


def _gptq(base: str, t: Mapping[str, TensorInfo], qc: QuantConfig | None, where: str) -> QuantGroup:
    qweight = t[f"{base}.qweight"]
    scales = _need(t, f"{base}.scales", "gptq", where)
    pack = _pack(qc)
    if len(qweight.shape) != 2 or len(scales.shape) != 2:
        raise InvalidInputError(
            f"GPTQ qweight {list(qweight.shape)} / scales {list(scales.shape)} must be 2-D",
            where=f"{where}: {base}",
        )
    in_f, out_f = qweight.shape[0] * pack, scales.shape[1]
    packing = f"GPTQ int32 packing ({pack} per int32)"
    gaxis = _groups_axis(in_f, scales.shape[0], qc, "gptq", where, scales.fqn)
    members = [
        Member(qweight, "qweight", (Axis(1, pack, packing), Axis(0))),
        Member(scales, "scales", (gaxis, Axis(0))),
    ]
    members += _optional(t, base, "qzeros", (gaxis, Axis(0, pack, packing)))
    members += _optional(t, base, "g_idx", (Axis(1),))
    return _group(
        "gptq", TensorInfo(f"{base}.weight", (out_f, in_f), qweight.dtype), members, where
    )


def _looks_awq(base: str, t: Mapping[str, TensorInfo]) -> bool:
    q, s = t[f"{base}.qweight"], t.get(f"{base}.scales")
    return s is not None and len(q.shape) == 2 and len(s.shape) == 2 and q.shape[1] != s.shape[1]


def _awq(base: str, t: Mapping[str, TensorInfo], qc: QuantConfig | None, where: str) -> QuantGroup:
    qweight = t[f"{base}.qweight"]
    scales = _need(t, f"{base}.scales", "awq", where)
    pack = _pack(qc)
    in_f, out_f = qweight.shape[0], scales.shape[1]
    packing = f"AWQ int32 packing ({pack} per int32)"
    gaxis = _groups_axis(in_f, scales.shape[0], qc, "awq", where, scales.fqn)
    members = [
        Member(qweight, "qweight", (Axis(1), Axis(0, pack, packing))),
        Member(scales, "scales", (gaxis, Axis(0))),
    ]
    members += _optional(t, base, "qzeros", (gaxis, Axis(0, pack, packing)))
    return _group("awq", TensorInfo(f"{base}.weight", (out_f, in_f), qweight.dtype), members, where)


def _ct_pack(
    base: str, t: Mapping[str, TensorInfo], qc: QuantConfig | None, where: str
) -> QuantGroup:
    packed = t[f"{base}.weight_packed"]
    nvfp4 = packed.dtype == "U8" or (qc is not None and qc.fmt == "nvfp4-pack-quantized")
    scheme = "nvfp4" if nvfp4 else "ct-pack"
    pack = 2 if nvfp4 else _pack(qc)
    out_f, in_f = packed.shape[0], packed.shape[1] * pack
    scale = _need(t, f"{base}.weight_scale", scheme, where)
    name = SCHEME_NAMES[scheme]
    packing = f"{name} packing ({pack} per {'byte' if nvfp4 else 'int32'})"
    if nvfp4:
        g = 16
    elif scale.shape[-1] == 1:
        g = in_f
    else:
        g = qc.group_size if qc and qc.group_size > 0 else -(-in_f // scale.shape[-1])
    gaxis = Axis(None) if g >= in_f else Axis(1, g, f"{name} group_size {g}")
    if qc is not None and qc.desc_act and not nvfp4:
        gaxis = Axis(None)
    members = [
        Member(packed, "weight_packed", (Axis(0), Axis(1, pack, packing))),
        Member(scale, "weight_scale", (Axis(0), gaxis)),
    ]
    members += _optional(
        t, base, "weight_zero_point", (Axis(0, 32 // (qc.bits if qc else 4), packing), gaxis)
    )
    members += _optional(t, base, "weight_g_idx", (Axis(1),))
    members += _scalar_members(
        t, base, ("weight_shape", "weight_global_scale", "input_global_scale", "input_scale")
    )
    logical = TensorInfo(f"{base}.weight", (out_f, in_f), packed.dtype)
    return _group(scheme, logical, members, where)


def _mxfp4(base: str, t: Mapping[str, TensorInfo], where: str) -> QuantGroup:
    blocks, scales = t[f"{base}_blocks"], t[f"{base}_scales"]
    if len(blocks.shape) < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise InvalidInputError(
            f"MXFP4 blocks {list(blocks.shape)} / scales {list(scales.shape)}: expected "
            "[..., out, in/32, 16] and [..., out, in/32]",
            where=f"{where}: {base}",
        )
    lead = len(blocks.shape) - 3
    out_f, in_f = blocks.shape[-3], blocks.shape[-2] * 32
    unit = "MXFP4 block of 32"
    # logical as gpt-oss's bf16 checkpoint stores it: [*lead, in, out]
    o, i = lead + 1, lead
    lead_axes = tuple(Axis(k) for k in range(lead))
    members = [
        Member(blocks, "blocks", (*lead_axes, Axis(o), Axis(i, 32, unit), Axis(None))),
        Member(scales, "scales", (*lead_axes, Axis(o), Axis(i, 32, unit))),
    ]
    logical = TensorInfo(base, (*blocks.shape[:lead], in_f, out_f), blocks.dtype)
    names = (*(f"dim {k}" for k in range(lead)), "in-features", "out-features")
    return _group("mxfp4", logical, members, where, names)


_INDEX = re.compile(r"\.\d+\.")


@gc_paused
def describe_model(
    tensors: Iterable[TensorInfo], config: Mapping[str, Any], *, where: str = "checkpoint"
) -> dict[str, Any] | None:
    """``inspect``'s view: the method and, per tensor group (layer/expert indices as ``*``),
    the scheme, how many weights, and each stored member's dtype and shape; None if unquantized.

    >>> describe_model(tensors, config)["groups"][0]                      # doctest: +SKIP
    {'pattern': 'model.layers.*.mlp.down_proj.weight', 'scheme': 'gptq', 'count': 2,
     'members': {'qweight': 'I32 [64, 256]', 'scales': 'F16 [4, 256]', ...}, 'bytes': 37888}
    """
    tensors = tuple(tensors)
    kinds = group_kinds(tensors, config, where=where)
    qc = kinds.qc
    if qc is None and not any(g is not None for kind in kinds.groups for g in kind):
        return None
    # 45,000 groups of a few kinds: each kind's groups described once (its first stem's),
    # then counted per stem; a member's description and bytes once per (role, dtype, shape)
    described: dict[tuple[str, str, tuple[int, ...]], tuple[tuple[str, str], int]] = {}
    size_of: dict[tuple[str, tuple[int, ...]], int] = {}
    per_kind: list[tuple[list[tuple[str, str, tuple[tuple[str, str], ...], int]], int]] = []
    for k, kind in enumerate(kinds.groups):
        first_stem, _, stem_tensors = kinds.stems[kinds.first[k]]
        distinct: dict[str, tuple[str, str, tuple[tuple[str, str], ...], int]] = {}
        for g in kind:
            if g is None:
                continue
            suffix = g.logical.fqn[len(first_stem) :]  # "." and the logical weight's leaf
            if suffix in distinct:
                continue
            members, size = [], 0
            for m in g.members:
                info = m.info
                key_m = (m.role, info.dtype, info.shape)
                hit = described.get(key_m)
                if hit is None:
                    text = f"{info.dtype} {list(info.shape)}"
                    hit = described[key_m] = ((m.role, text), _nbytes(info, size_of))
                members.append(hit[0])
                size += hit[1]
            distinct[suffix] = (suffix, g.scheme, tuple(members), size)
        # the bytes of the stem's tensors that are in a group (the same places in every stem)
        grouped = sum(
            _nbytes(tensors[i], size_of)
            for i, g in zip(stem_tensors, kind, strict=True)
            if g is not None
        )
        per_kind.append((list(distinct.values()), grouped))
    rows: dict[tuple[str, str, tuple[tuple[str, str], ...]], list[int]] = {}
    weights = quantized = 0
    # The pattern of stem.leaf is the stem's, then the leaf: the leaf holds no dot, so
    # _INDEX's matches (which may end at the dot before it) never reach into it. Every
    # stem's, with its final dot, in one pass (a match never crosses a newline).
    text = "".join([stem + ".\n" for stem, _, _ in kinds.stems])
    if text.count("\n") == len(kinds.stems):
        heads = _INDEX.sub(".*.", text).split("\n")
    else:  # a name holds a newline (JSON allows it): stem by stem
        heads = [_INDEX.sub(".*.", stem + ".") for stem, _, _ in kinds.stems]
    # Stems of one pattern and kind add the same rows: counted per (pattern, kind) in C, each
    # pair's rows added once (DeepSeek-V3 FP8: 45,000 stems, 139 -> 126 ms for the whole call)
    stem_kinds = map(itemgetter(1), kinds.stems)
    per_head = Counter(zip(heads[: len(kinds.stems)], stem_kinds, strict=True))
    for (head, k), count in per_head.items():
        distinct_groups, grouped = per_kind[k]
        if not distinct_groups:
            continue
        head = head[:-1]
        for suffix, scheme, described_members, size in distinct_groups:
            key = (head + suffix, scheme, described_members)
            row = rows.get(key)
            if row is None:
                row = rows[key] = [0, 0]
            row[0] += count
            row[1] += size * count
        weights += len(distinct_groups) * count
        quantized += grouped * count
    total = sum(
        _nbytes(TensorInfo("", shape, dtype), size_of) * count
        for (dtype, shape), count in Counter(
            zip(map(attrgetter("dtype"), tensors), map(attrgetter("shape"), tensors), strict=True)
        ).items()
    )
    return {
        "method": qc.describe() if qc else "from tensor names",
        "quantized_weights": weights,
        "quantized_bytes": quantized,
        "unquantized_bytes": total - quantized,
        "groups": [
            {"pattern": p, "scheme": s, "count": n, "members": dict(m), "bytes": b}
            for (p, s, m), (n, b) in sorted(rows.items())
        ],
    }


def _nbytes(info: TensorInfo, size_of: dict[tuple[str, tuple[int, ...]], int]) -> int:
    """``info.nbytes``, computed once per ``(dtype, shape)`` in ``size_of``."""
    key = (info.dtype, info.shape)
    n = size_of.get(key)
    if n is None:
        n = size_of[key] = info.nbytes
    return n
