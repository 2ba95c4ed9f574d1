"""What a family declares for vLLM ``sharded_state``: how vLLM names and fuses its tensors.

A family file sets ``Family.vllm`` to a :class:`VllmNames` (one delimited block at its end);
``formats/vllm`` names no family itself. A family without one is refused by ``--format vllm``
(with its ``refused`` line when vLLM cannot serve it, e.g. served by vLLM's Transformers
backend, whose parameter names are not vLLM's fused modules).

A rule is ``(HF name regex, vLLM name template, kind template)``: the first rule whose regex
fully matches an HF tensor name places it; both templates are expanded with the match
(``re.Match.expand``: ``\\g<p>`` is the layer prefix of :data:`L`). Kinds — what vLLM's weight
loader does with the tensor on TP rank ``r`` of ``tp`` (read in ``vllm/model_executor/layers``):

- ``rep``: whole on every rank (norms, routers, row-parallel biases, replicated linears);
- ``col``: rows ``r·n/tp``.. (``ColumnParallelLinear``); ``row``: last dim split
  (``RowParallelLinear``); ``vocab``: padded to a multiple of 64, then rows split;
- ``kvcol``: rows per KV head, split like K (one replicated head each when ``tp >= kv``);
- ``qkv.q|k|v``: sections of ``QKVParallelLinear`` (each split by tp, K/V replicated when
  ``tp >= kv``), concatenated per rank in that order; ``qkv.blocks|neox|groups``: the same tensor
  fused on disk, HF rows ``[Q; K; V]`` (Phi-3), per head ``[q; k; v]`` (GPT-NeoX, Falcon MHA) or
  per KV group ``[q…; k; v]`` (Falcon-40B);
- ``mc.<section>``: sections of ``MergedColumnParallelLinear`` (each split by tp) in
  :data:`ORDER`; ``mc.halves``: fused on disk as two equal halves (``gate_up_proj``);
- ``mr.<section>``: sections of a merged *replicated* linear (MLA's ``fused_qkv_a_proj``);
- ``w13.<section>`` / ``w2``: ``FusedMoE`` experts, the expert index in group ``e``:
  ``w13_weight [E, 2·I/tp, H]`` (gate rows then up rows per expert), ``w2_weight [E, H, I/tp]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardctl.archs._family import Family

L = r"(?P<p>model\.layers\.\d+)\."  # a decoder layer's prefix, group ``p``
KEEP = r"\g<0>"  # the vLLM name is the HF name
# Section order inside a fused vLLM tensor.
ORDER = ("q", "k", "v", "gate", "up", "q_a", "kv_a")

Rule = tuple[str, str, str]


@dataclass(frozen=True)
class VllmNames:
    """How vLLM (0.32) names one family's tensors in ``sharded_state``; see the module doc."""

    rules: tuple[Rule, ...] = ()
    # False: vLLM's model has no lm_head module (logits from embed_tokens): an untied
    # checkpoint is refused, a tied one keeps ``model.embed_tokens.weight``.
    lm_head: bool = True
    # Each attention layer's module holding vLLM's ``_{k,v,q,prob}_scale`` buffers.
    attention: str = "model.layers.{i}.self_attn.attn"
    # Set: vLLM cannot load this family as shardctl would write it; the one-line reason.
    refused: str = ""
    # (config key, value or predicate on the config, why): a config vLLM's model would
    # compute wrong or not build; refused.
    unsupported: tuple[tuple[str, object, str], ...] = ()
    # The token embedding's HF name (a tied head is stored once, as ``lm_head.weight``).
    embed: str = "model.embed_tokens.weight"


def _decoder_rules(extra: tuple[Rule, ...] = ()) -> tuple[Rule, ...]:
    """A family's own rules first (the first match wins), then the Llama-like decoder's."""
    return (
        *extra,
        (r"model\.embed_tokens\.weight", KEEP, "vocab"),
        (r"lm_head\.weight", KEEP, "vocab"),
        (r"model\.norm\.(?:weight|bias)", KEEP, "rep"),
        (
            L + r"self_attn\.(?P<s>[qkv])_proj\.(?P<w>weight|bias)",
            r"\g<p>.self_attn.qkv_proj.\g<w>",
            r"qkv.\g<s>",
        ),
        (L + r"self_attn\.qkv_proj\.(?:weight|bias)", KEEP, "qkv.blocks"),  # Phi-3
        (L + r"self_attn\.o_proj\.weight", KEEP, "row"),
        (
            L + r"mlp\.(?P<s>gate|up)_proj\.(?P<w>weight|bias)",
            r"\g<p>.mlp.gate_up_proj.\g<w>",
            r"mc.\g<s>",
        ),
        (L + r"mlp\.gate_up_proj\.(?:weight|bias)", KEEP, "mc.halves"),  # Phi-3, GLM-4
        (L + r"mlp\.down_proj\.weight", KEEP, "row"),
        (L + r"(?:self_attn\.o_proj|mlp\.down_proj)\.bias", KEEP, "rep"),
        (L + r"(?:[a-z_]*norm|[a-z_]*layernorm)\.(?:weight|bias)", KEEP, "rep"),
        (L + r"self_attn\.[qk]_norm\.(?:weight|bias)", KEEP, "rep"),  # per-head (Qwen3, Gemma-3)
    )


# Llama and the families vLLM builds from the same modules (Mistral, Qwen2/3, Gemma, Phi-3,
# Granite, GLM-4, Gemma-3 text): ``qkv_proj``, ``gate_up_proj``, ``o_proj``, ``down_proj``.
DECODER = VllmNames(_decoder_rules())
NO_LM_HEAD = VllmNames(_decoder_rules(), lm_head=False)  # Gemma-2

# Mixtral: ``FusedMoE`` experts under the MoE runner's ``routed_experts`` (vLLM 0.32).
MIXTRAL = VllmNames(
    _decoder_rules(
        (
            (
                L + r"block_sparse_moe\.experts\.(?P<e>\d+)\.w(?P<s>[13])\.weight",
                r"\g<p>.block_sparse_moe.experts.routed_experts.w13_weight",
                r"w13.w\g<s>",
            ),
            (
                L + r"block_sparse_moe\.experts\.(?P<e>\d+)\.w2\.weight",
                r"\g<p>.block_sparse_moe.experts.routed_experts.w2_weight",
                "w2",
            ),
            (L + r"block_sparse_moe\.gate\.weight", KEEP, "rep"),
        )
    )
)

_QWEN_EXPERTS: tuple[Rule, ...] = (
    (
        L + r"mlp\.experts\.(?P<e>\d+)\.(?P<s>gate|up)_proj\.weight",
        r"\g<p>.mlp.experts.routed_experts.w13_weight",
        r"w13.\g<s>",
    ),
    (
        L + r"mlp\.experts\.(?P<e>\d+)\.down_proj\.weight",
        r"\g<p>.mlp.experts.routed_experts.w2_weight",
        "w2",
    ),
    # the router ``mlp.gate`` is also registered on the MoE runner (``mlp.experts.gate``):
    # ``_filter_subtensors`` keeps the smaller of the two names
    (L + r"mlp\.gate\.weight", r"\g<p>.mlp.experts.gate.weight", "rep"),
)
QWEN3_MOE = VllmNames(_decoder_rules(_QWEN_EXPERTS))

# Qwen2-MoE: the shared expert and its sigmoid gate are handed to the MoE runner
# (``FusedMoEFactory(shared_experts=…)``: ``SharedExperts._layer``), so each has two names and
# ``_filter_subtensors`` keeps the runner's (``mlp.experts…`` < ``mlp.shared_expert…``); the
# router ``mlp.gate`` stays where it is.
_SHARED = r"\g<p>.mlp.experts._shared_experts._layer"
QWEN2_MOE = VllmNames(
    _decoder_rules(
        (
            *_QWEN_EXPERTS[:2],
            (L + r"mlp\.gate\.weight", KEEP, "rep"),
            (
                L + r"mlp\.shared_expert\.(?P<s>gate|up)_proj\.weight",
                _SHARED + ".gate_up_proj.weight",
                r"mc.\g<s>",
            ),
            (L + r"mlp\.shared_expert\.down_proj\.weight", _SHARED + ".down_proj.weight", "row"),
            (L + r"mlp\.shared_expert_gate\.weight", _SHARED + ".expert_gate.weight", "rep"),
        )
    )
)


def declare(family: Family, names: VllmNames) -> Family:
    """``family`` with its vLLM declaration (the one line a family file adds)."""
    return dataclasses.replace(family, vllm=names)


# Cohere (Command-R): no lm_head (logits from embed_tokens); per-head q/k LayerNorm weights
# ``[heads, head_dim]`` loaded by ``row_parallel_weight_loader``: rows ``r·n/tp``.. (vLLM's
# k_norm takes ``kv/tp`` heads from ``r·kv/tp``: no replication, so tp must divide kv heads).
COHERE = VllmNames(
    _decoder_rules(((L + r"self_attn\.[qk]_norm\.weight", KEEP, "col"),)), lm_head=False
)
# StableLM: vLLM's model has neither the per-head q/k LayerNorms nor the parallel residual.
STABLELM = VllmNames(
    _decoder_rules(),
    unsupported=(
        ("use_parallel_residual", True, "vLLM's StableLM runs attention and MLP sequentially"),
        ("qk_layernorm", True, "vLLM's StableLM has no per-head q/k LayerNorm"),
    ),
)

# Falcon (7B MQA, 40B/180B grouped, classic MHA): vLLM's loader views ``query_key_value`` as
# ``[kv, q/kv + 2, head_dim]`` rows for every layout (MQA: one group ``[Q; k; v]``; MHA: per
# head ``[q; k; v]``) and re-fuses ``[Q; K; V]`` for ``QKVParallelLinear``.
_FL = r"(?P<p>transformer\.h\.\d+)\."
FALCON = VllmNames(
    (
        (r"transformer\.word_embeddings\.weight", KEEP, "vocab"),
        (r"lm_head\.weight", KEEP, "vocab"),
        (r"transformer\.ln_f\.(?:weight|bias)", KEEP, "rep"),
        (_FL + r"self_attention\.query_key_value\.(?:weight|bias)", KEEP, "qkv.groups"),
        (_FL + r"self_attention\.dense\.weight", KEEP, "row"),
        (_FL + r"mlp\.dense_h_to_4h\.(?:weight|bias)", KEEP, "col"),
        (_FL + r"mlp\.dense_4h_to_h\.weight", KEEP, "row"),
        (_FL + r"(?:self_attention\.dense|mlp\.dense_4h_to_h)\.bias", KEEP, "rep"),
        (_FL + r"(?:input|post_attention)_layernorm\.(?:weight|bias)", KEEP, "rep"),
        (_FL + r"ln_(?:attn|mlp)\.(?:weight|bias)", KEEP, "rep"),
    ),
    attention="transformer.h.{i}.self_attention.attn",
    embed="transformer.word_embeddings.weight",
    unsupported=(
        (
            "ffn_hidden_size",
            lambda c: c.get("ffn_hidden_size") not in (None, 4 * c.get("hidden_size", 0)),
            "vLLM's Falcon MLP is always 4 × hidden_size wide",
        ),
    ),
)

# Declared refusals (one line each, shown by ``--format vllm``).
TRANSFORMERS_BACKEND = VllmNames(
    refused="vLLM 0.32 serves it through its Transformers backend (TransformersForCausalLM), "
    "whose parameters are not vLLM's fused qkv_proj/gate_up_proj modules; shardctl does not "
    "write that layout"
)
TRANSPOSED_EXPERTS = VllmNames(
    refused="vLLM's FusedMoE keeps these packed experts transposed (w13_weight [E, 2I/tp, H] "
    "from the checkpoint's gate_up_proj [E, H, 2I]); shardctl's copy moves boxes and does not "
    "transpose"
)

# DeepSeek-V2/V3 (MLA + MoE). The MLA wrapper (``self_attn.mla_attn``) registers the projections
# again, so each has two names and ``_filter_subtensors`` keeps the smaller: ``fused_qkv_a_proj``,
# ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` under ``self_attn``, but ``o_proj``,
# ``q_a_layernorm``, ``q_b_proj`` / ``q_proj`` under ``self_attn.mla_attn``. ``fused_qkv_a_proj``
# (q_lora_rank set) = ``[q_a_proj; kv_a_proj_with_mqa]`` replicated; without q LoRA (V2-Lite)
# ``kv_a_proj_with_mqa`` stays a plain ``ReplicatedLinear`` (an ``mr`` group of one section keeps
# its own name). ``kv_b_proj`` / ``q_b_proj`` are column-parallel (whole heads per rank). Router
# and ``e_score_correction_bias`` are aliased on the MoE runner (``mlp.experts.gate``), the shared
# experts as in Qwen2-MoE.
_MLA = r"\g<p>.self_attn.mla_attn"
DEEPSEEK = VllmNames(
    _decoder_rules(
        (
            (
                L + r"self_attn\.(?P<s>q_a|kv_a)_proj(?:_with_mqa)?\.weight",
                r"\g<p>.self_attn.fused_qkv_a_proj.weight",
                r"mr.\g<s>",
            ),
            (L + r"self_attn\.kv_b_proj\.weight", KEEP, "col"),
            (L + r"self_attn\.(?P<n>q_b_proj|q_proj)\.weight", _MLA + r".\g<n>.weight", "col"),
            (L + r"self_attn\.o_proj\.weight", _MLA + ".o_proj.weight", "row"),
            (L + r"self_attn\.q_a_layernorm\.weight", _MLA + ".q_a_layernorm.weight", "rep"),
            (L + r"self_attn\.kv_a_layernorm\.weight", KEEP, "rep"),
            *_QWEN_EXPERTS,
            (
                L + r"mlp\.gate\.e_score_correction_bias",
                r"\g<p>.mlp.experts.gate.e_score_correction_bias",
                "rep",
            ),
            (
                L + r"mlp\.shared_experts\.(?P<s>gate|up)_proj\.weight",
                _SHARED + ".gate_up_proj.weight",
                r"mc.\g<s>",
            ),
            (L + r"mlp\.shared_experts\.down_proj\.weight", _SHARED + ".down_proj.weight", "row"),
        )
    ),
    attention="model.layers.{i}.self_attn.mla_attn.mla_attn",
)
# V3 (and V2 with noaux_tc): vLLM builds ``e_score_correction_bias`` only for
# ``topk_method: noaux_tc`` (as the published V3 configs set it).
DEEPSEEK_V3 = dataclasses.replace(
    DEEPSEEK,
    unsupported=(
        (
            "topk_method",
            lambda c: c.get("topk_method") != "noaux_tc",
            "vLLM's DeepSeek has no e_score_correction_bias parameter unless topk_method is "
            "noaux_tc (the published DeepSeek-V3 configs set it)",
        ),
    ),
)
