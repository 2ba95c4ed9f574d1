"""The search's closed-form weights equal the layout engine's exact bytes, rank by rank."""

from __future__ import annotations

import itertools

import pytest

from shardctl.archs import family_for
from shardctl.errors import LayoutError
from shardctl.layout.engine import rank_weight_bytes
from shardctl.layout.types import LayoutOptions, Mesh
from shardctl.model.inventory import from_config
from shardctl.plan.memory.shapes import shape_from_model, split_layers, stage_counts
from tests._models import CONFIGS

# Families whose file opts out of the closed form (Family.closed_form = False: DeepSeek's MLA,
# Qwen2-MoE / Llama-4 shared experts and dense layers, gpt-oss' biases and sinks, the multimodal
# Llama-4) are counted from the engine itself (tests/test_families_mla_manifests.py,
# tests/test_flagships.py); without tensors the plan labels the closed form approximate.
PRESET_ARCHS = [
    n
    for n in CONFIGS
    if not n.startswith(("gemma2", "qwen3")) and family_for(CONFIGS[n]["model_type"]).closed_form
]


@pytest.mark.parametrize("name", PRESET_ARCHS)
@pytest.mark.parametrize("padding", ["tp", "megatron"])
def test_closed_form_equals_engine(name: str, padding: str) -> None:
    model = from_config(dict(CONFIGS[name]))
    assert model.dims is not None
    shape = shape_from_model(model, vocab_padding=padding)
    options = LayoutOptions(pipeline="tensorrt-llm", vocab_padding=padding)
    compared = 0
    for tp, pp, ep in itertools.product([1, 2, 4, 8], [1, 2], [1, 2, 4]):
        mesh = Mesh(tp=tp, pp=pp, ep=ep)
        try:
            exact = rank_weight_bytes(model, mesh, options=options)
        except LayoutError:
            continue  # an invalid mesh for this model (heads, experts)
        stages = split_layers(model.dims.num_layers, pp, "tensorrt-llm")
        for (p, e, t), nbytes in exact.items():
            assert stage_counts(shape, stages[p], pp, tp, ep).total * 2 == nbytes, (p, e, t)
        compared += 1
    assert compared >= 4


def test_closed_form_from_config_flags_matches_inventory_flags() -> None:
    # Without tensors (a bare config), flags come from config fields; same counts.
    for name in ("qwen2", "gpt2", "llama-bias-headdim"):
        model = from_config(dict(CONFIGS[name]))
        bare = type(model)(model.architecture, model.dims, (), model.dtype, "inline", model.config)
        a, b = shape_from_model(model), shape_from_model(bare)
        st = split_layers(model.dims.num_layers, 1)[0]  # type: ignore[union-attr]
        assert stage_counts(a, st, 1, 2).total == stage_counts(b, st, 1, 2).total, name
