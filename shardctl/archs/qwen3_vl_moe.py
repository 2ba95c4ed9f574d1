"""Qwen3-VL-MoE (``qwen3_vl_moe``, ``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B,
Qwen3-VL-235B-A22B): Qwen3-VL's tower (:mod:`shardctl.archs.qwen3_vl`) beside a Qwen3-MoE
language model whose experts are stored packed, one tensor per layer and matrix::

    model.language_model.layers.{i}.mlp.gate.weight           [E, H]      replicated
    model.language_model.layers.{i}.mlp.experts.gate_up_proj  [E, H, 2I]  S(2), [gate | up]
    model.language_model.layers.{i}.mlp.experts.down_proj     [E, I, H]   S(1)
    (dense layers, mlp_only_layers: mlp.gate_proj / up_proj / down_proj as Qwen3-MoE's)

``I`` is ``moe_intermediate_size``. That is the layout of the published releases and the one
vLLM loads: its ``Qwen3VLMoeDecoderLayer`` builds ``Qwen3MoeDecoderLayer`` with
``is_fused_checkpoint_transposed=True`` (``qwen3_vl_moe.py``), so each expert's
``[H, 2I]`` is transposed to ``FusedMoE``'s ``w13`` and cut over tp along ``2I`` (gate and up
halves each), its ``[I, H]`` down projection along ``I``; experts split dim 0 over ``ep``.
Everything else is placed as Qwen3-MoE's text model (vLLM ``Qwen3MoeLLMForCausalLM``) and
Qwen3-VL's tower are.

transformers 5 holds the experts the other way round in memory (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``): it transposes the published files on load
(``conversion_mapping.py``, ``Transpose(1, 2)`` when the shapes differ) and its own
``save_pretrained`` writes its in-memory layout back. A checkpoint in that layout is refused
with one line (vLLM would transpose it again); :func:`check_layout`.

The forward level runs the text model as ``qwen3_moe`` (whose router renormalizes its top-k
weights, as ``Qwen3VLMoeTextTopKRouter`` always does: ``norm_topk_prob`` true), each rank's
packed experts transposed into transformers' layout as they load (``ExpertSpec.transposed``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from shardctl.archs import _qwen_moe as moe
from shardctl.archs import qwen2_5_vl, qwen3_moe, qwen3_vl
from shardctl.archs._family import Config, ForwardSpec, Shapes
from shardctl.archs._multimodal import section, text_dims
from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

LM = qwen3_vl.LM
V = qwen3_vl.V
_X = "model.layers.*.mlp.experts"
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
EXPERT_RULES: tuple[RuleSpec, ...] = (
    RuleSpec(f"{_X}.gate_up_proj", tp="S(2)", parts=("intermediate", "intermediate"), expert=True),
    RuleSpec(f"{_X}.down_proj", tp="S(1)", expert=True),
)
# Qwen3-MoE's rules but its per-expert ones, the packed experts' first, all under the prefix
_TEXT_RULES = EXPERT_RULES + tuple(
    r for r in qwen3_moe.FAMILY.rules if r not in moe.EXPERT_RULES or r.match.endswith("gate.*")
)
RULES: tuple[RuleSpec, ...] = (
    tuple(qwen3_vl.text_rule(r) for r in _TEXT_RULES) + qwen3_vl.VISION_RULES
)

REFUSED = {
    "qwen3_omni_moe": (
        "that is the omni-modal Qwen3-Omni-MoE (Qwen3OmniMoeForConditionalGeneration: a "
        "'thinker' Qwen3-VL-MoE-like model with an audio tower beside a 'talker' and a "
        "code-to-wave decoder, nested as thinker_config / talker_config), which shardctl does "
        "not place (it places Qwen3-VL-MoE, model_type 'qwen3_vl_moe', and Qwen3-MoE text "
        "checkpoints, 'qwen3_moe'); place its tensors with manifest rules "
        "(`shardctl inspect CHECKPOINT` suggests rules for its own tensor names)"
    )
}

# Qwen3VLMoeTextConfig's defaults (transformers 5.24) for keys a section leaves out
TEXT_DEFAULTS: Config = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "vocab_size": 151936,
    "max_position_embeddings": 128000,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 4,
    "mlp_only_layers": [],
}
DEFAULT_EXPERTS = 60  # num_experts (transformers 5 writes it as num_local_experts)


def text_config(config: Config, where: str = "config") -> Config:
    """The language model's config as ``qwen3_moe``'s: the ``text_config`` section over the
    config class's defaults (the top-level tie; the multimodal rotary as one rotary), its
    router renormalizing as Qwen3-VL-MoE's always does."""
    nested = section(config, "text_config", f"{where}: text_config", "Qwen3-VL-MoE", required=True)
    text = {**TEXT_DEFAULTS, **nested}
    if nested.get("num_experts") is None and nested.get("num_local_experts") is None:
        text["num_experts"] = DEFAULT_EXPERTS
    text.setdefault("num_key_value_heads", text["num_attention_heads"])
    merged = {**config, "text_config": text}
    out = qwen2_5_vl.text_section(merged, where, "qwen3_moe", "Qwen3-VL-MoE", ())
    # Qwen3VLMoeTextTopKRouter renormalizes its top-k weights, whatever the config says
    return {**out, "norm_topk_prob": True}


_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def _text_tensors(text: Config, d: ModelDims, where: str) -> Shapes:
    """Qwen3-MoE's tensors with each sparse layer's experts packed, as the releases store
    them (module docstring)."""
    h, i, e = d.hidden_size, d.intermediate_size, d.num_experts
    out: Shapes = []
    for name, shape in qwen3_moe.FAMILY.tensors(text, d, where):
        if _EXPERT.search(name):
            continue
        out.append((name, shape))
        if name.endswith(".mlp.gate.weight"):  # the router: a sparse layer
            p = name[: -len("mlp.gate.weight")]
            out += [(p + GATE_UP, (e, h, 2 * i)), (p + DOWN, (e, i, h))]
    return out


def _tensors(config: Config, d: ModelDims, where: str) -> Shapes:
    text = _text_tensors(text_config(config, where), d, f"{where}: text_config")
    moved = [(LM + n[len("model.") :] if n.startswith("model.") else n, s) for n, s in text]
    return moved + qwen3_vl.vision_shapes(config, d.hidden_size, where)


def check_layout(shapes: Iterable[tuple[str, tuple[int, ...]]], config: Config, where: str) -> None:
    """Refuse packed experts in transformers 5's in-memory layout (``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``, what its ``save_pretrained`` writes) in one line: vLLM loads the
    published ``[E, H, 2I]`` / ``[E, I, H]`` and would transpose these again. A square model
    (``H`` = ``2I``) has the same shapes either way, as transformers itself assumes."""
    d = text_dims(qwen3_moe.FAMILY, text_config)(config, False, where)
    h, i, e = d.hidden_size, d.intermediate_size, d.num_experts
    if h == 2 * i:
        return
    for name, shape in shapes:
        if name.endswith("." + GATE_UP) and tuple(shape) == (e, 2 * i, h):
            raise InvalidInputError(
                f"packed experts stored [E, 2I, H] = {list(shape)}, transformers 5's in-memory "
                f"layout (its save_pretrained writes it); the published Qwen3-VL-MoE files and "
                f"vLLM (is_fused_checkpoint_transposed) use [E, H, 2I] = {[e, h, 2 * i]}",
                where=name,
                hint="transpose dims 1 and 2 of every mlp.experts.gate_up_proj and down_proj "
                "(the published layout) before resharding",
            )


def _forward() -> ForwardSpec:
    spec = qwen3_vl.vl_forward(qwen3_moe.FAMILY, text_config)
    assert spec.experts is not None
    experts = dataclasses.replace(spec.experts, transposed=(GATE_UP, DOWN))
    return dataclasses.replace(spec, experts=experts)


FAMILY = qwen3_vl.vl_family(
    "qwen3_vl_moe",
    qwen3_moe.FAMILY,
    text_config,
    tensors=_tensors,
    rules=RULES,
    forward=_forward(),
    follows="vLLM qwen3_vl_moe.py (Qwen3VLMoeForConditionalGeneration, FusedMoE)",
    check_tensors=check_layout,
)
