"""What a Megatron-Core ``GPTModel`` must be built with to load an HF checkpoint, and refusals.

``spec_from_config(config, tp=2)`` reads ``config.json`` (a dict) and returns a frozen
:class:`MegatronSpec`; everything Megatron cannot represent is one :class:`InvalidInputError`
line (what, where, expected vs actual, what to do). Megatron has no K/V replication: the query
groups must divide by TP. Megatron pads the vocabulary to a multiple of
``make_vocab_size_divisible_by · tp`` (default 128): the padded size is part of the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardctl.errors import InvalidInputError

# Llama-like families whose tensors map one to one onto mcore's GPT layer spec.
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral",)
SUPPORTED = DENSE + MOE
VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by default


@dataclass(frozen=True)
class MegatronSpec:
    """The mcore model's shape: ``MegatronSpec("llama", layers=32, heads=32, groups=8, ...)``."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    groups: int  # num_query_groups (= HF num_key_value_heads)
    head_dim: int  # kv_channels
    ffn: int
    vocab: int  # the HF vocabulary
    padded_vocab: int  # Megatron's (multiple of 128·tp)
    tied: bool
    qkv_bias: bool  # qwen2: add_qkv_bias
    qk_norm: bool  # qwen3: qk_layernorm
    experts: int  # 0 = dense
    topk: int
    rope_theta: float
    eps: float
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.groups) * self.head_dim

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def padded_vocab(vocab: int, tp: int, divisor: int = VOCAB_DIVISOR) -> int:
    """Megatron's ``_vocab_size_with_padding``: up to a multiple of ``divisor · tp``."""
    multiple = divisor * tp
    return -(-vocab // multiple) * multiple


def _int(cfg: dict[str, Any], key: str, where: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise InvalidInputError(
            f"config.json {key}: expected a positive integer, got {v!r}",
            where=where,
            hint="fix config.json",
        )
    return v


def spec_from_config(
    cfg: dict[str, Any], *, tp: int = 1, pp: int = 1, ep: int = 1, where: str = "config.json"
) -> MegatronSpec:
    """The mcore spec for ``cfg`` at the given degrees; one-line refusals for what Megatron
    cannot load."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise InvalidInputError(
            f"format megatron: model_type {mt!r} is not supported "
            f"(supported: {', '.join(SUPPORTED)})",
            where=where,
            hint="write --format ranks or hf for this model",
        )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise InvalidInputError(
            f"format megatron: {mt} with attention_bias/mlp_bias has biases on o_proj/MLP that "
            "the Llama GPT spec (add_bias_linear=False) cannot hold",
            where=where,
            hint="write --format ranks or hf for this model",
        )
    layers = _int(cfg, "num_hidden_layers", where)
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = _int(cfg, "vocab_size", where)
    ffn = _int(cfg, "intermediate_size", where)
    experts = int(cfg.get("num_local_experts") or 0) if mt in MOE else 0
    topk = int(cfg.get("num_experts_per_tok") or 0) if experts else 0
    if heads % groups:
        raise InvalidInputError(
            f"config.json: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {groups}",
            where=where,
        )
    if groups % tp:
        raise InvalidInputError(
            f"format megatron: tp {tp} does not divide num_key_value_heads {groups} "
            "(Megatron has no K/V head replication)",
            where=where,
            hint=f"use a tp that divides {groups}: {_divisors(groups)}",
        )
    if ffn % tp:
        raise InvalidInputError(
            f"format megatron: tp {tp} does not divide intermediate_size {ffn}",
            where=where,
            hint=f"use a tp that divides {ffn}",
        )
    if layers % pp:
        raise InvalidInputError(
            f"format megatron: pp {pp} does not divide num_hidden_layers {layers} "
            "(Megatron splits layers evenly unless told otherwise)",
            where=where,
            hint=f"use a pp that divides {layers}: {_divisors(layers)}",
        )
    if ep > 1 and (not experts or experts % ep):
        raise InvalidInputError(
            f"format megatron: ep {ep} needs a number of experts it divides, got {experts}",
            where=where,
            hint="use --ep 1" if not experts else f"use an ep that divides {experts}",
        )
    return MegatronSpec(
        model_type=mt,
        layers=layers,
        hidden=hidden,
        heads=heads,
        groups=groups,
        head_dim=head_dim,
        ffn=ffn,
        vocab=vocab,
        padded_vocab=padded_vocab(vocab, tp),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2",
        qk_norm=mt == "qwen3",
        experts=experts,
        topk=topk,
        rope_theta=_rope_theta(cfg),
        eps=float(cfg.get("rms_norm_eps") or 1e-6),
        tp=tp,
        pp=pp,
        ep=ep,
    )


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta) if isinstance(theta, int | float) else 10000.0


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def load_flags(spec: MegatronSpec) -> str:
    """The Megatron-LM arguments that build the model this checkpoint holds."""
    flags = [
        f"--tensor-model-parallel-size {spec.tp}",
        f"--pipeline-model-parallel-size {spec.pp}",
        f"--num-layers {spec.layers}",
        f"--hidden-size {spec.hidden}",
        f"--ffn-hidden-size {spec.ffn}",
        f"--num-attention-heads {spec.heads}",
        f"--group-query-attention --num-query-groups {spec.groups}",
        f"--kv-channels {spec.head_dim}",
        "--normalization RMSNorm --swiglu --disable-bias-linear",
        "--position-embedding-type rope",
        f"--rotary-base {_num(spec.rope_theta)}",  # an int in Megatron-LM's arguments
        f"--norm-epsilon {spec.eps:g}",
        "--make-vocab-size-divisible-by 128",
        "--ckpt-format torch_dist --finetune --no-load-optim --no-load-rng",
    ]
    if not spec.tied:
        flags.append("--untie-embeddings-and-output-weights")
    if spec.qkv_bias:
        flags.append("--add-qkv-bias")
    if spec.qk_norm:
        flags.append("--qk-layernorm")
    if spec.moe:
        flags.append(
            f"--num-experts {spec.experts} --moe-router-topk {spec.topk} "
            f"--expert-model-parallel-size {spec.ep}"
        )
    return " ".join(flags)
