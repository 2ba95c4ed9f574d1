"""Inventory dispatch and config validation, without transformers (fast, pure)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from shardctl.errors import InvalidInputError
from shardctl.io.safetensors_header import HeaderEntry, header_bytes
from shardctl.model.archs import SUPPORTED, dims_from_config, tensors_from_config
from shardctl.model.inventory import (
    from_checkpoint,
    from_config,
    from_config_file,
    from_parameters,
)

LLAMA: dict[str, Any] = dict(
    model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
)  # fmt: skip


def test_supported_list_covers_the_issue() -> None:
    assert {"llama", "mistral", "qwen2", "mixtral", "gpt2", "phi3", "gemma"} <= set(SUPPORTED)


def test_unknown_model_type_names_supported_list() -> None:
    with pytest.raises(InvalidInputError) as info:
        from_config({**LLAMA, "model_type": "bloom"})
    msg = str(info.value)
    assert "unsupported model_type 'bloom'" in msg
    assert all(name in msg for name in SUPPORTED)
    with pytest.raises(InvalidInputError, match="missing 'model_type'"):
        from_config({k: v for k, v in LLAMA.items() if k != "model_type"})


def test_unknown_model_type_names_closest_family_and_rules() -> None:
    with pytest.raises(InvalidInputError) as info:
        from_config({**LLAMA, "model_type": "qwen3_next"})  # (qwen3_moe has a file now)
    msg = str(info.value)
    assert "\n" not in msg
    assert "closest known family: 'qwen3_moe'" in msg and "manifest rules:" in msg


@pytest.mark.parametrize(
    "field",
    ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"],
)
def test_missing_field_is_named(field: str) -> None:
    config = {k: v for k, v in LLAMA.items() if k != field}
    with pytest.raises(InvalidInputError, match=f"missing '{field}'"):
        tensors_from_config(config, "BF16")


@pytest.mark.parametrize("field", ["n_embd", "n_layer", "n_head", "n_positions", "vocab_size"])
def test_gpt2_missing_field_is_named(field: str) -> None:
    config = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=99)
    del config[field]
    with pytest.raises(InvalidInputError, match=f"missing '{field}'"):
        dims_from_config(config)


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", True), ("hidden_size", 0), ("hidden_size", -64), ("hidden_size", 64.0),
     ("num_hidden_layers", "2"), ("tie_word_embeddings", "yes"), ("attention_bias", 1)],
)  # fmt: skip
def test_wrong_field_types(field: str, value: object) -> None:
    with pytest.raises(InvalidInputError, match=field):
        from_config({**LLAMA, field: value})


def test_head_dim_must_divide_when_derived() -> None:
    with pytest.raises(InvalidInputError, match="not divisible"):
        from_config({**LLAMA, "num_attention_heads": 6, "num_key_value_heads": 6})
    info = from_config({**LLAMA, "num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 8})
    assert info.tensor("model.layers.0.self_attn.q_proj.weight").shape == (48, 64)


def test_defaults_follow_transformers() -> None:
    minimal = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    dims = dims_from_config(minimal)
    assert dims.num_kv_heads == dims.num_heads == 8 and dims.head_dim == 8
    assert not dims.tie_word_embeddings  # llama default
    gemma = {**LLAMA, "model_type": "gemma"}
    assert dims_from_config(gemma).tie_word_embeddings  # gemma default
    names = {t.fqn for t in from_config(gemma).tensors}
    assert "lm_head.weight" not in names


@pytest.mark.parametrize(
    ("config", "expected"),
    [({}, "BF16"), ({"torch_dtype": "float16"}, "F16"), ({"dtype": "float32"}, "F32"),
     ({"dtype": "auto"}, "BF16"), ({"torch_dtype": None, "dtype": "bfloat16"}, "BF16")],
)  # fmt: skip
def test_dtype_resolution(config: dict[str, Any], expected: str) -> None:
    info = from_config({**LLAMA, **config})
    assert info.dtype == expected
    assert {t.dtype for t in info.tensors} == {expected}
    assert from_config({**LLAMA, **config}, dtype="fp8").dtype == "F8_E4M3"


def test_unknown_dtype() -> None:
    with pytest.raises(InvalidInputError, match="unknown dtype 'float13'"):
        from_config({**LLAMA, "torch_dtype": "float13"})


def test_config_view_is_read_only() -> None:
    info = from_config(LLAMA, source="inline")
    assert info.source == "inline" and info.config["hidden_size"] == 64
    with pytest.raises(TypeError):
        info.config["hidden_size"] = 1  # type: ignore[index]


def test_from_config_file_strict(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64, "hidden_size": 32}')
    with pytest.raises(InvalidInputError, match="duplicate key 'hidden_size'"):
        from_config_file(path)
    path.write_text("[]")
    with pytest.raises(InvalidInputError, match="not a JSON object"):
        from_config_file(path)
    path.write_text(json.dumps(LLAMA))
    assert from_config_file(path).architecture == "llama"
    with pytest.raises(InvalidInputError, match=re.escape(str(tmp_path / "nope.json"))):
        from_config_file(tmp_path / "nope.json")


def test_from_parameters() -> None:
    info = from_parameters(7_000_000_000, "bfloat16")
    assert (info.parameters, info.weight_bytes, info.tensors, info.dims) == (
        7_000_000_000,
        14_000_000_000,
        (),
        None,
    )
    assert from_parameters(7.5e9, "fp32").parameters == 7_500_000_000  # type: ignore[arg-type]
    for bad in (0, -1, True, 1.5, float("nan"), "7e9"):
        with pytest.raises(InvalidInputError, match="positive integer"):
            from_parameters(bad, "bf16")  # type: ignore[arg-type]


def _tiny_checkpoint(root: Path, config: dict[str, Any] | None) -> Path:
    root.mkdir()
    entries = [
        HeaderEntry("blocks.0.w", "F32", (2, 2), 0, 16),
        HeaderEntry("blocks.0.b", "BF16", (2,), 16, 20),
    ]
    (root / "model.safetensors").write_bytes(header_bytes(entries) + bytes(20))
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


def test_unknown_architecture_still_inventories(tmp_path: Path) -> None:
    info = from_checkpoint(_tiny_checkpoint(tmp_path / "a", {"model_type": "bloom"}))
    assert (info.architecture, info.dims, info.dtype) == ("bloom", None, "F32")
    assert [str(t) for t in info.tensors] == ["blocks.0.w [2, 2] F32", "blocks.0.b [2] BF16"]
    assert info.weight_bytes == 20
    bare = from_checkpoint(_tiny_checkpoint(tmp_path / "b", None))
    assert (bare.architecture, bare.dims) == ("unknown", None)


def test_checkpoint_with_broken_config(tmp_path: Path) -> None:
    root = _tiny_checkpoint(tmp_path / "a", {"model_type": "llama", "hidden_size": 8})
    with pytest.raises(
        InvalidInputError, match=re.escape("config.json: missing 'num_attention_heads'")
    ):
        from_checkpoint(root)


def test_shardctl_layout_is_not_an_hf_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "shardctl.layout.json").write_text("{}")
    with pytest.raises(InvalidInputError, match="shardctl"):
        from_checkpoint(tmp_path)


def test_checkpoint_with_fifo_shard_does_not_hang(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(InvalidInputError, match="not a regular file"):
        from_checkpoint(tmp_path)


def test_no_torch_import() -> None:
    import subprocess
    import sys

    code = (
        "import sys, shardctl.model.inventory, shardctl.checkpoint.hf;"
        "sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


_ROUTER = {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}


@pytest.mark.parametrize(
    ("family", "version", "dtype", "f32"),
    [
        # transformers 5.24 keeps DeepSeek's router (V3: and its bias) in F32 when it saves a
        # 16-bit model (_keep_in_fp32_modules_strict); 5.23 and older saved them as the model
        ("deepseek_v3", "5.24.0", "bfloat16", _ROUTER),
        ("deepseek_v3", "5.25.0.dev0", "float16", _ROUTER),
        ("deepseek_v3", "6.0.0", "bfloat16", _ROUTER),
        ("deepseek_v2", "5.24.0", "bfloat16", {"mlp.gate.weight"}),
        ("deepseek_v3", "5.23.0", "bfloat16", set()),
        ("deepseek_v3", "4.46.3", "bfloat16", set()),
        ("deepseek_v3", None, "bfloat16", set()),  # no writer named: as the older ones
        ("deepseek_v3", "not a version", "bfloat16", set()),
        ("deepseek_v3", "5.24.0", "float32", set()),  # everything F32 already
        ("qwen3_moe", "5.24.0", "bfloat16", set()),  # a family without such modules
    ],
)  # fmt: skip
def test_config_inventory_follows_the_writers_fp32_modules(
    family: str, version: str | None, dtype: str, f32: set[str]
) -> None:
    from tests._models import CONFIGS

    config: dict[str, Any] = {**CONFIGS[family], "torch_dtype": dtype}
    if version is not None:
        config["transformers_version"] = version
    code = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[dtype]
    tensors = tensors_from_config(config, code)
    kept = {t.fqn.split(".", 3)[3] for t in tensors if t.dtype == "F32" and code != "F32"}
    assert kept == f32
    if f32:  # every MoE layer's router, none of the dense layer 0
        routers = [t for t in tensors if t.fqn.endswith(".mlp.gate.weight")]
        assert len(routers) == 3 and all(t.dtype == "F32" for t in routers)


def test_quantized_config_keeps_the_writers_fp32_router() -> None:
    # an FP8 config written by transformers 5.24 (a model quantized after from_pretrained):
    # the router F32 as 5.24 keeps it; the published release's (4.33) router BF16, bias F32
    from tests._models import CONFIGS

    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
           "activation_scheme": "dynamic"}  # fmt: skip
    base = {**CONFIGS["deepseek_v3"], "torch_dtype": "bfloat16", "quantization_config": fp8}
    for version, router in (("5.24.0", "F32"), ("4.33.1", "BF16")):
        tensors = tensors_from_config({**base, "transformers_version": version}, "BF16")
        dtypes = {t.fqn: t.dtype for t in tensors}
        assert dtypes["model.layers.1.mlp.gate.weight"] == router
        assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
        assert dtypes["model.layers.1.mlp.experts.0.up_proj.weight"] == "F8_E4M3"
