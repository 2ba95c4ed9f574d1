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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardctl.formats.megatron.spec import MegatronSpec

Get = Callable[[str], torch.Tensor]

EXTRA_STATE_DENSE = (
    "decoder.layers.self_attention.linear_qkv._extra_state",
    "decoder.layers.self_attention.linear_proj._extra_state",
    "decoder.layers.mlp.linear_fc1._extra_state",
    "decoder.layers.mlp.linear_fc2._extra_state",
)
EXTRA_STATE_MOE = (
    "decoder.layers.self_attention.linear_qkv._extra_state",
    "decoder.layers.self_attention.linear_proj._extra_state",
    "decoder.layers.mlp.experts.experts.linear_fc1._extra_state",
    "decoder.layers.mlp.experts.experts.linear_fc2._extra_state",
)


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
    L, H, d = s.layers, s.hidden, s.head_dim
    out: list[Unit] = [
        Unit(
            "embedding.word_embeddings.weight",
            (),
            (s.padded_vocab, H),
            ("model.embed_tokens.weight",),
            "vocab",
        )
    ]
    for i in range(L):
        p = f"model.layers.{i}."
        att = p + "self_attn."
        lay = "decoder.layers."
        out.append(
            Unit(
                lay + "self_attention.linear_qkv.layer_norm_weight",
                (i,),
                (L, H),
                (p + "input_layernorm.weight",),
                "copy",
            )
        )
        qkv = tuple(att + f"{x}_proj.weight" for x in "qkv")
        out.append(
            Unit(lay + "self_attention.linear_qkv.weight", (i,), (L, s.qkv_rows, H), qkv, "qkv")
        )
        if s.qkv_bias:
            bias = tuple(att + f"{x}_proj.bias" for x in "qkv")
            out.append(
                Unit(lay + "self_attention.linear_qkv.bias", (i,), (L, s.qkv_rows), bias, "qkv")
            )
        if s.qk_norm:
            for x in "qk":
                out.append(
                    Unit(
                        lay + f"self_attention.{x}_layernorm.weight",
                        (i,),
                        (L, d),
                        (att + f"{x}_norm.weight",),
                        "copy",
                    )
                )
        out.append(
            Unit(
                lay + "self_attention.linear_proj.weight",
                (i,),
                (L, H, s.heads * d),
                (att + "o_proj.weight",),
                "copy",
            )
        )
        out.append(
            Unit(
                lay + "mlp.linear_fc1.layer_norm_weight",
                (i,),
                (L, H),
                (p + "post_attention_layernorm.weight",),
                "copy",
            )
        )
        if not s.moe:
            mlp = p + "mlp."
            out.append(
                Unit(
                    lay + "mlp.linear_fc1.weight",
                    (i,),
                    (L, 2 * s.ffn, H),
                    (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                    "cat",
                )
            )
            out.append(
                Unit(
                    lay + "mlp.linear_fc2.weight",
                    (i,),
                    (L, H, s.ffn),
                    (mlp + "down_proj.weight",),
                    "copy",
                )
            )
            continue
        moe = p + "block_sparse_moe."
        out.append(
            Unit(
                lay + "mlp.router.weight",
                (i,),
                (L, s.experts, H),
                (moe + "gate.weight",),
                "copy",
            )
        )
        E = s.experts
        for e in range(E):
            ex = f"{moe}experts.{e}."
            out.append(
                Unit(
                    lay + "mlp.experts.experts.linear_fc1.weight",
                    (i, e),
                    (L, E, 2 * s.ffn, H),
                    (ex + "w1.weight", ex + "w3.weight"),
                    "cat",
                )
            )
            out.append(
                Unit(
                    lay + "mlp.experts.experts.linear_fc2.weight",
                    (i, e),
                    (L, E, H, s.ffn),
                    (ex + "w2.weight",),
                    "copy",
                )
            )
    out.append(Unit("decoder.final_layernorm.weight", (), (H,), ("model.norm.weight",), "copy"))
    if not s.tied:
        out.append(
            Unit("output_layer.weight", (), (s.padded_vocab, H), ("lm_head.weight",), "vocab")
        )
    return out


def extra_state_keys(spec: MegatronSpec) -> list[tuple[str, tuple[int, ...]]]:
    """The ``_extra_state`` ShardedObjects mcore's linear layers declare: (unique key, index).

    DCP stores each as a ``BYTE_IO`` item named ``{key}/shard_{offset}_{shape}`` (mcore's
    ``ShardedObject.unique_key``), holding ``torch.save([None])`` for non-TE layers."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for key in EXTRA_STATE_MOE if spec.moe else EXTRA_STATE_DENSE:
        per_expert = ".experts.experts." in key
        for i in range(spec.layers):
            for e in range(spec.experts) if per_expert else (None,):
                if e is None:
                    out.append((f"{key}/shard_{i}_{spec.layers}", (i,)))
                else:
                    out.append((f"{key}/shard_{i}.{e}_{spec.layers}.{spec.experts}", (i, e)))
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
    return {unit.hf[0]: t[: spec.vocab]}


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
