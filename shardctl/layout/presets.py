"""Per-architecture rule presets, as data: ordered ``fqn`` globs → placement (first match wins).

Default TP style is Megatron's / vLLM's: embedding and ``lm_head`` vocab-parallel (``S(0)``),
q/k/v, gate/up and the experts' w1/w3 column-parallel, o/down and w2 row-parallel (their biases
``R``), norms and routers replicated. Names are the on-disk (hub) names, not transformers 5's
in-memory ones (DESIGN.md: Mixtral experts are packed differently in memory).

``stage`` for tensors outside the decoder layers: ``first``, ``last``, ``all``, or
``embedding`` = first, and also last when the head is tied (no ``lm_head.weight`` on disk and
``pp > 1``: the last stage needs the table for its logits).
"""

from __future__ import annotations

from shardctl.layout.types import RuleSpec

# Architectures whose linear layers are GPT-2 ``Conv1D`` (weights stored ``[in, out]``).
CONV1D_ARCHS: frozenset[str] = frozenset({"gpt2"})

_R = "R"

# Attention of every Llama-like model: q/k/v split by whole heads, o by q heads along its input.
_LLAMA_ATTN: tuple[RuleSpec, ...] = (
    RuleSpec("model.layers.*.self_attn.q_proj.*", tp="colwise", heads="q"),
    RuleSpec("model.layers.*.self_attn.k_proj.*", tp="colwise", heads="kv"),
    RuleSpec("model.layers.*.self_attn.v_proj.*", tp="colwise", heads="kv"),
    RuleSpec("model.layers.*.self_attn.o_proj.*", tp="rowwise", heads="q"),
)
_LLAMA_MLP: tuple[RuleSpec, ...] = (
    RuleSpec("model.layers.*.mlp.gate_proj.*", tp="colwise"),
    RuleSpec("model.layers.*.mlp.up_proj.*", tp="colwise"),
    RuleSpec("model.layers.*.mlp.down_proj.*", tp="rowwise"),
)
# input_layernorm, post_attention_layernorm, Gemma-2's pre/post_feedforward_layernorm, q/k norms.
_LLAMA_NORMS: tuple[RuleSpec, ...] = (
    RuleSpec("model.layers.*layernorm.*", tp=_R),
    RuleSpec("model.layers.*.self_attn.[qk]_norm.*", tp=_R),
)
_LLAMA_ENDS: tuple[RuleSpec, ...] = (
    RuleSpec("model.embed_tokens.weight", tp="vocab", stage="embedding"),
    RuleSpec("model.norm.*", tp=_R, stage="last"),
    RuleSpec("lm_head.weight", tp="vocab", stage="last"),
)

LLAMA: tuple[RuleSpec, ...] = _LLAMA_ENDS + _LLAMA_ATTN + _LLAMA_MLP + _LLAMA_NORMS

MIXTRAL: tuple[RuleSpec, ...] = (
    _LLAMA_ENDS
    + _LLAMA_ATTN
    + (
        # experts.{e}.w1/w3: [I, H] column-parallel; w2: [H, I] row-parallel; e picks the ep rank.
        RuleSpec("model.layers.*.block_sparse_moe.experts.*.w1.*", tp="colwise", expert=True),
        RuleSpec("model.layers.*.block_sparse_moe.experts.*.w3.*", tp="colwise", expert=True),
        RuleSpec("model.layers.*.block_sparse_moe.experts.*.w2.*", tp="rowwise", expert=True),
        RuleSpec("model.layers.*.block_sparse_moe.gate.*", tp=_R),  # router [E, H]
    )
    + _LLAMA_NORMS
)

PHI3: tuple[RuleSpec, ...] = (
    *_LLAMA_ENDS,
    # qkv_proj [(nh + 2·nkv)·hd, H] = [Q; K; V]; gate_up_proj [2·I, H] = [gate; up].
    RuleSpec("model.layers.*.self_attn.qkv_proj.*", tp="colwise", parts=("q", "kv", "kv")),
    RuleSpec("model.layers.*.self_attn.o_proj.*", tp="rowwise", heads="q"),
    RuleSpec(
        "model.layers.*.mlp.gate_up_proj.*", tp="colwise", parts=("intermediate", "intermediate")
    ),
    RuleSpec("model.layers.*.mlp.down_proj.*", tp="rowwise"),
    *_LLAMA_NORMS,
)

# GPT-2: hub files name tensors ``h.0...`` (old) or ``transformer.h.0...`` (save_pretrained);
# the leading ``*`` takes both. Conv1D storage: c_attn weight [H, 3H] = [Q | K | V] along dim 1.
GPT2: tuple[RuleSpec, ...] = (
    RuleSpec("*wte.weight", tp="vocab", stage="embedding"),
    RuleSpec("*wpe.weight", tp=_R, stage="first"),
    RuleSpec("*h.*.attn.c_attn.*", tp="colwise", parts=("q", "kv", "kv")),
    RuleSpec("*h.*.attn.c_proj.*", tp="rowwise", heads="q"),
    RuleSpec("*h.*.mlp.c_fc.*", tp="colwise"),
    RuleSpec("*h.*.mlp.c_proj.*", tp="rowwise"),
    RuleSpec("*h.*.ln_[12].*", tp=_R),
    RuleSpec("*h.*.attn.bias", tp=_R),  # causal-mask buffer in old checkpoints
    RuleSpec("*h.*.attn.masked_bias", tp=_R),
    RuleSpec("*ln_f.*", tp=_R, stage="last"),
    RuleSpec("lm_head.weight", tp="vocab", stage="last"),
)

PRESETS: dict[str, tuple[RuleSpec, ...]] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "gemma": LLAMA,
    "gemma2": LLAMA,  # + pre/post_feedforward_layernorm: caught by the layernorm glob
    "gemma3_text": LLAMA,  # + q_norm/k_norm
    "qwen3": LLAMA,  # + q_norm/k_norm
    "mixtral": MIXTRAL,
    "phi3": PHI3,
    "gpt2": GPT2,
}


def preset(architecture: str) -> tuple[RuleSpec, ...]:
    """The preset rules of an architecture; ``()`` for an unknown one (the manifest's rules)."""
    return PRESETS.get(architecture, ())
