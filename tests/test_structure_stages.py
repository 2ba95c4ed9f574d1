"""structure's stage check (``_stages``): each layer's shards only on its stage, an after-stack
layer (MTP) only on the last, whichever tp rank holds them (a layer is looked up once per fqn
and checked on every rank)."""

from __future__ import annotations

from types import SimpleNamespace as NS

from shardctl.verify.result import LevelResult
from shardctl.verify.structure import _stages


def _run(ranks: list[tuple[int, list[str]]]) -> list[tuple[str, str, int]]:
    stages = [NS(index=0, layers=(0, 1)), NS(index=1, layers=(2, 3))]
    layout = NS(
        stages=stages,
        ranks=[
            NS(pp=pp, tp=i, shards=[NS(fqn=f) for f in fqns]) for i, (pp, fqns) in enumerate(ranks)
        ],
    )
    level = LevelResult("structure")
    _stages(level, layout, NS(config={"num_hidden_layers": 4}))  # type: ignore[arg-type]
    return [(f.message, f.fqn or "", f.rank if f.rank is not None else -1) for f in level.findings]


def test_layers_on_their_stage_pass() -> None:
    a, b = "model.layers.1.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight"
    assert (
        _run(
            [(0, [a, "model.embed_tokens.weight"]), (0, [a]), (1, [b, "lm_head.weight"]), (1, [b])]
        )
        == []
    )


def test_a_layer_on_the_wrong_stage_is_named_on_every_rank_holding_it() -> None:
    wrong = "model.layers.3.self_attn.q_proj.weight"  # layer 3 belongs to stage 1
    got = _run([(0, [wrong]), (0, [wrong]), (1, ["model.layers.2.mlp.up_proj.weight"])])
    assert got == [
        ("layer 3 on stage 0 (layers [0, 1])", wrong, 0),
        ("layer 3 on stage 0 (layers [0, 1])", wrong, 1),
    ]


def test_an_after_stack_layer_belongs_on_the_last_stage() -> None:
    mtp = "model.layers.4.eh_proj.weight"  # layer 4 of a 4-layer stack: MTP
    assert _run([(1, [mtp])]) == []
    got = _run([(0, [mtp]), (1, [mtp])])
    assert got == [("layer 4 (after the 4 decoder layers) on stage 0, not the last", mtp, 0)]
