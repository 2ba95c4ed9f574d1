"""Pipeline stage assignment: conventions against the engines' own formulas, and errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardctl.errors import LayoutError
from shardctl.layout.pipeline import assign_layers, layer_index


def counts(num_layers: int, pp: int, convention: str) -> list[int]:
    return [s.num_layers for s in assign_layers(num_layers, pp, convention)]


def vllm_get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """vLLM ``vllm/distributed/utils.py::get_pp_indices`` (no env override), transliterated."""
    per = num_layers // pp_size
    partitions = [per for _ in range(pp_size)]
    if remaining := num_layers % pp_size:
        for i in range(2, remaining + 2):
            partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def trtllm_pp_layers(num_layers: int, pp_rank: int, pp_size: int) -> list[int]:
    """TensorRT-LLM ``Mapping.pp_layers``: ``torch.tensor_split(arange(L), pp)[rank]``."""
    torch = pytest.importorskip("torch")
    return torch.tensor_split(torch.arange(num_layers), pp_size)[pp_rank].tolist()


@pytest.mark.parametrize(
    ("num_layers", "pp", "convention", "expected"),
    [
        (126, 4, "vllm", [31, 32, 32, 31]),
        (126, 4, "tensorrt-llm", [32, 32, 31, 31]),
        (30, 4, "vllm", [7, 8, 8, 7]),
        (30, 4, "tensorrt-llm", [8, 8, 7, 7]),
        (32, 3, "vllm", [11, 11, 10]),
        (32, 3, "tensorrt-llm", [11, 11, 10]),
        (7, 4, "vllm", [2, 2, 2, 1]),  # remainder pp-1 reaches the first stage too
        (7, 4, "tensorrt-llm", [2, 2, 2, 1]),
        (5, 4, "vllm", [1, 1, 2, 1]),
        (5, 4, "tensorrt-llm", [2, 1, 1, 1]),
        (32, 4, "even", [8, 8, 8, 8]),
        (32, 4, "megatron", [8, 8, 8, 8]),
        (126, 2, "even", [63, 63]),
    ],
)
def test_conventions_on_concrete_numbers(
    num_layers: int, pp: int, convention: str, expected: list[int]
) -> None:
    assert counts(num_layers, pp, convention) == expected


@given(st.integers(1, 200), st.integers(1, 16))
def test_vllm_matches_get_pp_indices(num_layers: int, pp: int) -> None:
    if pp > num_layers:
        return
    stages = assign_layers(num_layers, pp, "vllm")
    for s in stages:
        start, end = vllm_get_pp_indices(num_layers, s.index, pp)
        assert s.layers == (start, end - 1)


@settings(deadline=None)  # the first example pays torch's import
@given(st.integers(1, 200), st.integers(1, 16))
def test_tensorrt_llm_matches_tensor_split(num_layers: int, pp: int) -> None:
    if pp > num_layers:
        return
    for s in assign_layers(num_layers, pp, "tensorrt-llm"):
        layers = trtllm_pp_layers(num_layers, s.index, pp)
        assert s.layers == (layers[0], layers[-1])


@given(st.integers(1, 300), st.integers(1, 32), st.sampled_from(["vllm", "tensorrt-llm"]))
def test_stages_are_contiguous_and_cover_every_layer(num_layers: int, pp: int, conv: str) -> None:
    if pp > num_layers:
        with pytest.raises(LayoutError, match=f"pp={pp} is larger than num_layers={num_layers}"):
            assign_layers(num_layers, pp, conv)
        return
    stages = assign_layers(num_layers, pp, conv)
    flat = [i for s in stages if s.layers for i in range(s.layers[0], s.layers[1] + 1)]
    assert flat == list(range(num_layers))
    sizes = [s.num_layers for s in stages]
    assert max(sizes) - min(sizes) <= 1


def test_even_error_prints_numbers_and_working_conventions() -> None:
    with pytest.raises(LayoutError) as err:
        assign_layers(30, 4, "even")
    msg = str(err.value)
    assert "num_layers=30 is not divisible by pp=4" in msg
    assert "{1, 2, 3, 5, 6, 10, 15, 30}" in msg
    assert "vllm gives [7, 8, 8, 7]" in msg and "tensorrt-llm gives [8, 8, 7, 7]" in msg
    assert "[8, 8, 8, 6]" in msg


def test_megatron_requires_divisibility_and_names_its_flags() -> None:
    with pytest.raises(LayoutError) as err:
        assign_layers(30, 4, "megatron")
    msg = str(err.value)
    assert "Megatron requires num_layers % pp == 0" in msg and "leaves 2" in msg
    assert "--decoder-last-pipeline-num-layers 6" in msg


def test_explicit_layers_per_stage() -> None:
    stages = assign_layers(30, 4, "even", [8, 8, 8, 6])
    assert [s.layers for s in stages] == [(0, 7), (8, 15), (16, 23), (24, 29)]
    # 0 is allowed: a stage holding only the embedding (or only the head)
    stages = assign_layers(4, 3, "even", [0, 2, 2])
    assert stages[0].layers is None and stages[0].num_layers == 0
    with pytest.raises(LayoutError, match=r"sums to 29, expected num_layers=30.*-?\+1"):
        assign_layers(30, 4, "even", [8, 8, 7, 6])
    with pytest.raises(LayoutError, match=r"3 entries \[10, 10, 10\] for pp=4"):
        assign_layers(30, 4, "even", [10, 10, 10])
    with pytest.raises(LayoutError, match="negative"):
        assign_layers(30, 2, "even", [31, -1])


def test_other_errors() -> None:
    with pytest.raises(LayoutError, match="pp=5 is larger than num_layers=4"):
        assign_layers(4, 5, "vllm")
    with pytest.raises(LayoutError, match="unknown convention 'deepspeed'"):
        assign_layers(4, 2, "deepspeed")


def test_layer_index() -> None:
    assert layer_index("model.layers.12.mlp.up_proj.weight") == 12
    assert layer_index("transformer.h.3.attn.c_attn.bias") == 3
    assert layer_index("h.0.ln_1.weight") == 0
    assert layer_index("model.norm.weight") is None
    assert layer_index("lm_head.weight") is None
