"""HF tensors <-> Megatron-Core ``torch_dist`` tensors, one *unit* (one DCP chunk) at a time.

mcore's ``GPTModel.sharded_state_dict()`` (local and TE layer specs alike) stores every layer
tensor as one global tensor with the layers stacked on a leading axis, one chunk per layer::

    decoder.layers.self_attention.linear_qkv.weight   [L, (heads + 2·groups)·d, H]
    decoder.layers.mlp.experts.experts.linear_fc1.weight   [L, E, 2·F, H]   (MoE, SequentialMLP)

``linear_qkv`` rows are interleaved per query group: group g holds its ``heads/groups`` q heads,
then its k head, then its v head. ``linear_fc1`` is ``[gate; up]`` over the whole F (mcore's
swiglu factory writes gate at rows [0, F), up at [F, 2F) of the global tensor). Input norms are
fused into the following linear as ``layer_norm_weight``. A unit is one chunk: ``(key, index)``
where ``index`` is ``()``, ``(layer,)`` or ``(layer, expert)``; ``pack`` builds its tensor from
HF tensors and ``unpack`` gives them back, bit for bit.

When dense and MoE layers are mixed (mcore's ``moe_layer_freq`` a list) mcore does not stack:
every key is per layer, ``decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight [E, 2·F, H]``
(index ``(expert,)``); MTP layers are ``mtp.layers.{k}.`` (never stacked). MLA layers copy
DeepSeek's projections one to one (``linear_q_down_proj`` = ``q_a_proj`` ...). Which HF module
holds the experts, the shared expert and its gate comes from the spec (the family's
``MegatronDecl``), never from a family name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardctl.errors import InvalidInputError
from shardctl.formats.megatron.spec import MegatronSpec

Get = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class Unit:
    """One DCP chunk of one mcore tensor and the HF tensors it is made of."""

    key: str
    index: tuple[int, ...]  # leading (layer[, expert]) coordinates; () for a whole tensor
    global_shape: tuple[int, ...]
    hf: tuple[str, ...]  # the HF fqns it packs, in pack order
    kind: str  # "copy" | "qkv" | "cat" | "vocab"

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (1,) * len(self.index) + self.global_shape[len(self.index) :]

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.index + (0,) * (len(self.global_shape) - len(self.index))


def units(spec: MegatronSpec) -> list[Unit]:
    """Every chunk of the mcore checkpoint of ``spec``, in a fixed order."""
    s = spec
    H = s.hidden
    # an MTP layer's embed_tokens / shared_head.head are the main model's (mcore shares them):
    # stored once, given back under every name (pack checks they are equal)
    mtp = [f"model.layers.{s.layers + k}." for k in range(s.mtp_layers)]
    out: list[Unit] = [
        Unit(
            "embedding.word_embeddings.weight",
            (),
            (s.padded_vocab, H),
            ("model.embed_tokens.weight", *(p + "embed_tokens.weight" for p in mtp)),
            "vocab",
        )
    ]
    for i in range(s.layers):
        out += [u for u, _ in _layer_units(s, i)]
    out.append(Unit("decoder.final_layernorm.weight", (), (H,), ("model.norm.weight",), "copy"))
    for k in range(s.mtp_layers):
        out += [u for u, _ in _mtp_units(s, k)]
    if not s.tied:
        heads = ("lm_head.weight", *(p + "shared_head.head.weight" for p in mtp))
        out.append(Unit("output_layer.weight", (), (s.padded_vocab, H), heads, "vocab"))
    return out


def _mtp_units(s: MegatronSpec, k: int) -> list[tuple[Unit, bool]]:
    """MTP layer ``k`` (HF ``model.layers.{layers + k}``): mcore's ``mtp.layers.{k}``, its
    transformer layer built like the last decoder layer, never stacked."""
    H = s.hidden
    p = f"model.layers.{s.layers + k}."
    m = f"mtp.layers.{k}."
    out = [
        (Unit(m + "enorm.weight", (), (H,), (p + "enorm.weight",), "copy"), False),
        (Unit(m + "hnorm.weight", (), (H,), (p + "hnorm.weight",), "copy"), False),
        (Unit(m + "eh_proj.weight", (), (H, 2 * H), (p + "eh_proj.weight",), "copy"), True),
    ]
    sparse = s.is_moe_layer(s.layers - 1)
    out += _layer_units(s, s.layers + k, key=m + "transformer_layer.", sparse=sparse)
    norm = (p + "shared_head.norm.weight",)
    out.append((Unit(m + "final_layernorm.weight", (), (H,), norm, "copy"), False))
    return out


def _layer_units(
    s: MegatronSpec, i: int, *, key: str = "", sparse: bool | None = None
) -> list[tuple[Unit, bool]]:
    """Layer ``i``'s units, each with whether its linear layer has an ``_extra_state``.

    Stacked (every layer alike): ``decoder.layers.X`` with the layer on a leading axis; else
    (dense and MoE layers mixed: mcore's ``moe_layer_freq`` list) ``decoder.layers.{i}.X``."""
    L, H, d = s.layers, s.hidden, s.head_dim
    p = f"model.layers.{i}."
    att = p + "self_attn."
    out: list[tuple[Unit, bool]] = []

    stacked = s.stacked and not key
    key = key or f"decoder.layers.{i}."

    def lay(name: str, shape: tuple[int, ...], hf: tuple[str, ...], kind: str, ex: bool) -> None:
        if stacked:
            out.append((Unit("decoder.layers." + name, (i,), (L, *shape), hf, kind), ex))
        else:
            out.append((Unit(key + name, (), shape, hf, kind), ex))

    def exp(name: str, e: int, shape: tuple[int, ...], hf: tuple[str, ...], kind: str) -> None:
        E = s.experts
        if stacked:
            out.append((Unit("decoder.layers." + name, (i, e), (L, E, *shape), hf, kind), True))
        else:
            out.append((Unit(key + name, (e,), (E, *shape), hf, kind), True))

    sa = "self_attention."
    if s.mla:
        n = s.heads
        lay("input_layernorm.weight", (H,), (p + "input_layernorm.weight",), "copy", False)
        lay(sa + "linear_q_down_proj.weight", (s.q_lora_rank, H), (att + "q_a_proj.weight",),
            "copy", True)  # fmt: skip
        lay(sa + "q_layernorm.weight", (s.q_lora_rank,), (att + "q_a_layernorm.weight",),
            "copy", False)  # fmt: skip
        lay(sa + "linear_q_up_proj.weight", (n * (s.qk_nope + s.qk_rope), s.q_lora_rank),
            (att + "q_b_proj.weight",), "copy", True)  # fmt: skip
        lay(sa + "linear_kv_down_proj.weight", (s.kv_lora_rank + s.qk_rope, H),
            (att + "kv_a_proj_with_mqa.weight",), "copy", True)  # fmt: skip
        lay(sa + "kv_layernorm.weight", (s.kv_lora_rank,), (att + "kv_a_layernorm.weight",),
            "copy", False)  # fmt: skip
        lay(sa + "linear_kv_up_proj.weight", (n * (s.qk_nope + s.v_head_dim), s.kv_lora_rank),
            (att + "kv_b_proj.weight",), "copy", True)  # fmt: skip
        lay(sa + "linear_proj.weight", (H, n * s.v_head_dim), (att + "o_proj.weight",),
            "copy", True)  # fmt: skip
        lay("pre_mlp_layernorm.weight", (H,), (p + "post_attention_layernorm.weight",),
            "copy", False)  # fmt: skip
    else:
        lay(sa + "linear_qkv.layer_norm_weight", (H,), (p + "input_layernorm.weight",),
            "copy", False)  # fmt: skip
        qkv = tuple(att + f"{x}_proj.weight" for x in "qkv")
        lay(sa + "linear_qkv.weight", (s.qkv_rows, H), qkv, "qkv", True)
        if s.qkv_bias:
            bias = tuple(att + f"{x}_proj.bias" for x in "qkv")
            lay(sa + "linear_qkv.bias", (s.qkv_rows,), bias, "qkv", False)
        if s.qk_norm:
            for x in "qk":
                lay(sa + f"{x}_layernorm.weight", (d,), (att + f"{x}_norm.weight",),
                    "copy", False)  # fmt: skip
        lay(sa + "linear_proj.weight", (H, s.heads * d), (att + "o_proj.weight",), "copy", True)
        # the local spec maps pre_mlp_layernorm onto linear_fc1's fused norm (MoE layers too)
        lay("mlp.linear_fc1.layer_norm_weight", (H,), (p + "post_attention_layernorm.weight",),
            "copy", False)  # fmt: skip
    if not (s.is_moe_layer(i) if sparse is None else sparse):
        mlp = p + "mlp."
        lay("mlp.linear_fc1.weight", (2 * s.ffn, H),
            (mlp + "gate_proj.weight", mlp + "up_proj.weight"), "cat", True)  # fmt: skip
        lay("mlp.linear_fc2.weight", (H, s.ffn), (mlp + "down_proj.weight",), "copy", True)
        return out
    moe = f"{p}{s.hf_moe}."
    lay("mlp.router.weight", (s.experts, H), (moe + "gate.weight",), "copy", False)
    if s.router_bias:
        lay("mlp.router.expert_bias", (s.experts,), (moe + "gate.e_score_correction_bias",),
            "copy", False)  # fmt: skip
    F = s.expert_ffn
    g, u, dn = s.hf_expert
    for e in range(s.experts):
        ex = f"{moe}experts.{e}."
        exp("mlp.experts.experts.linear_fc1.weight", e, (2 * F, H),
            (f"{ex}{g}.weight", f"{ex}{u}.weight"), "cat")  # fmt: skip
        exp("mlp.experts.experts.linear_fc2.weight", e, (H, F), (f"{ex}{dn}.weight",), "copy")
    if s.shared_ffn:
        sh = f"{moe}{s.hf_shared}."
        Fs = s.shared_ffn
        lay("mlp.shared_experts.linear_fc1.weight", (2 * Fs, H),
            (sh + "gate_proj.weight", sh + "up_proj.weight"), "cat", True)  # fmt: skip
        lay("mlp.shared_experts.linear_fc2.weight", (H, Fs), (sh + "down_proj.weight",),
            "copy", True)  # fmt: skip
        if s.shared_gate:
            lay("mlp.shared_experts.gate_weight", (1, H), (f"{moe}{s.hf_shared_gate}.weight",),
                "copy", False)  # fmt: skip
    return out


def extra_state_keys(spec: MegatronSpec) -> list[tuple[str, tuple[int, ...]]]:
    """The ``_extra_state`` ShardedObjects mcore's linear layers declare: (unique key, index).

    DCP stores each as a ``BYTE_IO`` item named ``{key}/shard_{offset}_{shape}`` (mcore's
    ``ShardedObject.unique_key``), holding ``torch.save([None])`` for non-TE layers. The
    object's shape is the unit's leading (layer[, expert]) axes, or ``1`` for a lone layer."""
    out: list[tuple[str, tuple[int, ...]]] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    layer_units = [_layer_units(spec, i) for i in range(spec.layers)]
    layer_units += [_mtp_units(spec, k) for k in range(spec.mtp_layers)]
    for units_of_layer in layer_units:
        for u, ex in units_of_layer:
            if not ex:
                continue
            base = u.key.rsplit(".", 1)[0] + "._extra_state"
            shape = u.global_shape[: len(u.index)] or (1,)
            index = u.index or (0,)
            if (base, index) in seen:
                continue
            seen.add((base, index))
            name = f"{base}/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, shape))}"
            out.append((name, u.index))
    return out


def pack(unit: Unit, spec: MegatronSpec, get: Get) -> torch.Tensor:
    """The unit's chunk (shape ``unit.chunk_shape``) from its HF tensors."""
    parts = [get(n) for n in unit.hf]
    if unit.kind == "copy":
        t = parts[0]
    elif unit.kind == "cat":
        t = torch.cat(parts, dim=0)
    elif unit.kind == "qkv":
        t = _interleave(parts[0], parts[1], parts[2], spec)
    else:  # vocab: zero rows up to Megatron's padded vocabulary
        t = parts[0]
        for name, dup in zip(unit.hf[1:], parts[1:], strict=True):
            if dup.dtype != t.dtype or not torch.equal(dup, t):
                raise InvalidInputError(
                    f"format megatron: {name!r} differs from {unit.hf[0]!r}; Megatron-Core "
                    "shares one tensor between the model and its MTP layers",
                    where=name,
                    hint="write --format ranks or hf for this checkpoint",
                )
        pad = spec.padded_vocab - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))], dim=0)
    return t.reshape(unit.chunk_shape).contiguous()


def unpack(unit: Unit, spec: MegatronSpec, chunk: torch.Tensor) -> dict[str, torch.Tensor]:
    """The unit's HF tensors from its chunk (inverse of :func:`pack`)."""
    t = chunk.reshape(unit.global_shape[len(unit.index) :])
    if unit.kind == "copy":
        return {unit.hf[0]: t}
    if unit.kind == "cat":
        a, b = t.chunk(2, dim=0)
        return {unit.hf[0]: a, unit.hf[1]: b}
    if unit.kind == "qkv":
        q, k, v = _deinterleave(t, spec)
        return dict(zip(unit.hf, (q, k, v), strict=True))
    return dict.fromkeys(unit.hf, t[: spec.vocab])


def _interleave(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MegatronSpec
) -> torch.Tensor:
    # q [heads·d, ...], k/v [groups·d, ...] -> per group g: [q heads of g; k_g; v_g]
    g, d = spec.groups, spec.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, (spec.heads // g) * d, *rest)
    kg = k.reshape(g, d, *rest)
    vg = v.reshape(g, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(spec.qkv_rows, *rest)


def _deinterleave(
    t: torch.Tensor, spec: MegatronSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = spec.groups, spec.head_dim
    per = spec.heads // g
    rest = t.shape[1:]
    grouped = t.reshape(g, (per + 2) * d, *rest)
    q = grouped[:, : per * d].reshape(spec.heads * d, *rest)
    k = grouped[:, per * d : (per + 1) * d].reshape(g * d, *rest)
    v = grouped[:, (per + 1) * d :].reshape(g * d, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()
