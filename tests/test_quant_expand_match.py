"""The inventory expansion's name tests, one compiled regex per call (``globs.first_match``,
``expand._ignorer``), against the per-entry rules they replace (fnmatch per glob;
``modules_to_not_convert`` / ``ignore`` entry by entry).

A quantized config's inventory (``plan`` on a manifest) tests each of ~90,000 names against the
family's quantizable globs and the config's ignore list; those tests are one regex call each now
(DeepSeek-V3-FP8: the inventory 0.6-0.7 s -> 0.3 s). Here they are held to the plain definitions,
written out again below, on drawn names and entries, and on a real 61-layer config.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from shardctl.archs import family_for
from shardctl.globs import first_match
from shardctl.model.archs import tensors_from_config
from shardctl.quant.config import QuantConfig
from shardctl.quant.expand import _ignorer

PART = st.sampled_from(["model", "layers", "mlp", "experts", "gate", "lm_head", "w1", "w12"])
NUM = st.integers(0, 120).map(str)
NAME = st.lists(st.one_of(PART, NUM), min_size=1, max_size=7).map(".".join)
GLOB = st.lists(
    st.one_of(PART, NUM, st.sampled_from(["*", "?", "w[123]", "*_proj", "[!0-9]*", "1?"])),
    min_size=1,
    max_size=5,
).map(".".join)


def _ignored_by_entry(fqn: str, ignore: tuple[str, ...]) -> bool:
    """The rule as documented, one entry at a time: ``re:`` patterns matched at the module's
    start; a name covers the module and everything inside it; a glob the module or its
    insides."""
    module = fqn.rsplit(".", 1)[0]
    for name in ignore:
        if name.startswith("re:"):
            if re.match(name[3:], module):
                return True
        elif module == name or module.endswith(f".{name}") or f".{name}." in f".{module}.":
            return True
        elif any(ch in name for ch in "*?[") and (
            fnmatch.fnmatchcase(module, name) or fnmatch.fnmatchcase(module, f"{name}.*")
        ):
            return True
    return False


@given(names=st.lists(NAME, min_size=1, max_size=30), globs=st.lists(GLOB, max_size=4))
def test_first_match_is_the_first_fnmatch_glob(names: list[str], globs: list[str]) -> None:
    first = first_match(tuple(globs))
    for name in names:
        want = next((i for i, g in enumerate(globs) if fnmatch.fnmatchcase(name, g)), None)
        assert first(name) == want, (name, globs)


ENTRY = st.one_of(
    NAME, GLOB, st.sampled_from(["re:.*gate$", r"re:model\.layers\.1\d\.", "re:lm_", "gate"])
)


@given(names=st.lists(NAME, min_size=1, max_size=30), ignore=st.lists(ENTRY, max_size=4))
def test_ignorer_is_the_per_entry_rule(names: list[str], ignore: list[str]) -> None:
    qc = QuantConfig(method="fp8", bits=8, group_size=-1, ignore=tuple(ignore))
    ignored = _ignorer(qc)
    for name in names:
        assert ignored(name) == _ignored_by_entry(name, qc.ignore), (name, ignore)


def test_deepseek_v3_fp8_inventory_is_the_per_tensor_rules() -> None:
    """A 61-layer DeepSeek-V3 FP8 config with a mixed ignore list (88,109 stored tensors; 91,991
    without it): the stored inventory has an F8 weight and an F32 block scale exactly where the
    per-entry rules quantize, and the family's kept dtypes where its globs say."""
    config = {
        "model_type": "deepseek_v3",
        "vocab_size": 129_280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["gate", "model.layers.7.self_attn", "re:.*\\.1[0-2]\\.mlp"],
        },
    }
    family = family_for("deepseek_v3")
    plain = tensors_from_config(
        {k: v for k, v in config.items() if k != "quantization_config"}, "BF16"
    )
    stored = {t.fqn: t for t in tensors_from_config(config, "BF16")}
    assert len(stored) == 88_109  # 91,991 less the ignored weights' scales
    ignore = tuple(config["quantization_config"]["modules_to_not_convert"])  # type: ignore[index]
    quantized = 0
    for t in plain:
        want_q = (
            len(t.shape) == 2
            and any(fnmatch.fnmatchcase(t.fqn, g) for g in family.quantizable)
            and not _ignored_by_entry(t.fqn, ignore)
        )
        base = t.fqn.removesuffix(".weight")
        assert (f"{base}.weight_scale_inv" in stored) == want_q, t.fqn
        if want_q:
            quantized += 1
            assert stored[t.fqn].dtype == "F8_E4M3"
            assert stored[f"{base}.weight_scale_inv"].dtype == "F32"
        else:
            kept = next(
                (d for g, d in family.quantized_dtypes if fnmatch.fnmatchcase(t.fqn, g)), t.dtype
            )
            assert stored[t.fqn] == replace(t, dtype=kept), t.fqn
    assert len(stored) == len(plain) + quantized
    # each entry kind left something unquantized that the family would quantize
    for module in ("model.layers.7.self_attn.q_a_proj", "model.layers.11.mlp.experts.5.up_proj"):
        assert f"{module}.weight_scale_inv" not in stored
    assert "model.layers.13.mlp.experts.5.up_proj.weight_scale_inv" in stored
