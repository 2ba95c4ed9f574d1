"""The structure level's name checks on columns: layer numbers read in one regular-expression
pass over all names joined by newlines (the same answers as one match per name, including
names without a layer, several matches in one name and a name holding a newline: then the
per-name loop runs), and names, shapes and dtypes compared whole before tensor by tensor."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.verify.structure import _LAYER, _layer_numbers

_PARTS = st.sampled_from(
    [
        "model",
        "layers",
        "transformer",
        "h",
        "decoder",
        "experts",
        "mlp",
        "w1",
        "weight",
        "7",
        "12",
        "0",
        "x\ny",
        "",
    ]
)
_NAMES = st.lists(st.lists(_PARTS, min_size=1, max_size=7).map(".".join), max_size=40)


@settings(max_examples=400, deadline=None)
@given(_NAMES)
def test_columns_agree_with_one_match_per_name(names: list[str]) -> None:
    layers = [int(m.group(1)) if (m := _LAYER.match(f)) else -1 for f in names]
    assert _layer_numbers(names).tolist() == layers


def test_a_deepseek_sized_name_list() -> None:
    names = [
        f"model.layers.{i}.mlp.experts.{e}.{w}.weight"
        for i in range(61)
        for e in range(64)
        for w in ("gate_proj", "up_proj", "down_proj")
    ] + ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    got = _layer_numbers(names)
    assert got[:-3].tolist() == [i for i in range(61) for _ in range(64 * 3)]
    assert (got[-3:] == -1).all()


def test_a_source_of_another_dtype_is_named_tensor_by_tensor(tmp_path: Path) -> None:
    """Same names, other dtypes (the output of a bf16 checkpoint checked against an f16 one):
    the names' fast compare must not pass it; every tensor is named with both sides."""
    from shardctl.layout.types import Mesh
    from shardctl.reshard.api import reshard
    from shardctl.verify.api import verify
    from tests._models import make_checkpoint

    out = reshard(make_checkpoint("llama", tmp_path / "bf16"), tmp_path / "s", mesh=Mesh(tp=2))
    f16 = make_checkpoint("llama", tmp_path / "f16", dtype="float16")
    result = verify(f16, out.dst, level="structure")
    st = result.level_result("structure")
    assert st.status == "fail"
    named = [f for f in st.findings if "BF16, source" in f.message and "F16" in f.message]
    assert len(named) == len(st.findings) > 0
    assert "model.norm.weight" in {f.fqn for f in named}
