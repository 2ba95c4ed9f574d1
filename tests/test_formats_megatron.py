"""``--format megatron``: HF -> Megatron-Core torch_dist -> HF, loaded by megatron-core itself.

- megatron-core 0.16.1's own ``dist_checkpointing.load`` reads the output strictly into a
  ``GPTModel`` it builds on CPU at TP 2 (Mixtral's experts at EP 2) on two gloo processes, its
  logits match transformers' on the HF original (``tests/_mcore_load.py`` under torchrun; a
  plain-concatenated ``[q; k; v]`` fails the same check, so it can fail); at PP 2 every stage
  loads strictly and holds its HF layers bit for bit.
- HF -> megatron -> HF is byte-identical (every file, also a split checkpoint with its index),
  for dense, tied, biased, qk-normed and MoE families, written for several TP/EP degrees.
- the CLI: reshard in and out (hf, ranks), verify with torch_dist on either side, refusals
  (one line, exit 3, nothing written), ``plan`` with ``workload.engine: megatron``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from shardctl.api import reshard
from tests._hostile import REPO, cli, one_line, sub
from tests._models import make_checkpoint

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and (
    importlib.util.find_spec("megatron.core") is not None
)
# float32 forward on both sides over the same bf16 weights: only the order of operations
# differs (measured max |Δlogit| 2.7e-6..5.8e-6 with |logits| up to ~4).
LOGITS_TOL = 1e-4


def _mg(src: Path, dst: Path, **mesh: int) -> Path:
    reshard(src, dst, format="megatron", mesh=mesh or None)
    return dst


@pytest.mark.parametrize(
    ("name", "mesh", "split"),
    [
        ("llama", {"tp": 2}, None),
        ("llama-tied-mha", {"tp": 4, "pp": 3}, None),
        ("qwen2", {}, None),
        ("mistral", {"tp": 2, "pp": 2}, None),
        ("qwen3", {"tp": 2}, None),
        ("mixtral", {"tp": 2, "ep": 4}, None),
        ("mixtral", {"ep": 2}, "100KB"),  # several files + index: the same files come back
    ],
)
def test_roundtrip_hf_megatron_hf_is_byte_identical(
    tmp_path: Path, name: str, mesh: dict[str, int], split: str | None
) -> None:
    hf = make_checkpoint(name, tmp_path / "hf", max_shard_size=split)
    mg = _mg(hf, tmp_path / "mg", **mesh)
    side = json.loads((mg / "shardctl.megatron.json").read_text())
    tp = mesh.get("tp", 1)
    vocab = side["spec"]["vocab"]
    padded = side["spec"]["padded_vocab"]
    assert padded % (128 * tp) == 0 and vocab <= padded < vocab + 128 * tp
    assert (mg / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert json.loads((mg / "release" / "metadata.json").read_text())["sharded_backend"] == (
        "torch_dist"
    )
    reshard(mg, tmp_path / "back", format="hf")
    names = sorted(p.name for p in hf.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "back").iterdir())
    assert len([n for n in names if n.endswith(".safetensors")]) == (1 if split is None else 5)
    for n in names:  # every weight file, the index, config.json: the same bytes
        assert (tmp_path / "back" / n).read_bytes() == (hf / n).read_bytes(), n


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_layout_of_the_dcp_tensors(tmp_path: Path) -> None:
    """Global tensors under mcore's names, layers stacked, qkv interleaved per query group,
    fc1 = [gate; up], vocab zero-padded to 128·tp — read back with torch DCP's own loader."""
    import torch.distributed.checkpoint as dcp

    hf = make_checkpoint("llama", tmp_path / "hf")  # 8 heads, 2 groups, head_dim 8, vocab 256
    mg = _mg(hf, tmp_path / "mg", tp=2)  # padded vocab 256 -> 256 (multiple of 256)
    ref = load_file(hf / "model.safetensors")
    state = {
        "decoder.layers.self_attention.linear_qkv.weight": torch.empty(4, (8 + 4) * 8, 64),
        "decoder.layers.mlp.linear_fc1.weight": torch.empty(4, 2 * 160, 64),
        "embedding.word_embeddings.weight": torch.empty(256, 64),
    }
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    dcp.load(state, checkpoint_id=str(mg / "release"), no_dist=True)
    qkv = state["decoder.layers.self_attention.linear_qkv.weight"][3]
    q = ref["model.layers.3.self_attn.q_proj.weight"]
    k = ref["model.layers.3.self_attn.k_proj.weight"]
    v = ref["model.layers.3.self_attn.v_proj.weight"]
    # group 1: q heads 4..7, then k head 1, then v head 1 (rows 48·1 .. 48·2)
    assert torch.equal(qkv[48 : 48 + 32], q[32:64])
    assert torch.equal(qkv[48 + 32 : 48 + 40], k[8:16])
    assert torch.equal(qkv[48 + 40 : 96], v[8:16])
    fc1 = state["decoder.layers.mlp.linear_fc1.weight"][2]
    assert torch.equal(fc1[:160], ref["model.layers.2.mlp.gate_proj.weight"])
    assert torch.equal(fc1[160:], ref["model.layers.2.mlp.up_proj.weight"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_vocab_padding_is_recorded_and_stripped(tmp_path: Path) -> None:
    hf = make_checkpoint("llama-tied-mha", tmp_path / "hf")  # vocab 200, tied
    mg = _mg(hf, tmp_path / "mg", tp=2)
    spec = json.loads((mg / "shardctl.megatron.json").read_text())["spec"]
    assert (spec["vocab"], spec["padded_vocab"], spec["tied"]) == (200, 256, True)
    import torch.distributed.checkpoint as dcp

    emb = {"embedding.word_embeddings.weight": torch.empty(256, 64, dtype=torch.bfloat16)}
    dcp.load(emb, checkpoint_id=str(mg / "release"), no_dist=True)
    table = emb["embedding.word_embeddings.weight"]
    assert torch.equal(
        table[:200], load_file(hf / "model.safetensors")["model.embed_tokens.weight"]
    )
    assert not table[200:].any()


def _mcore(pairs: list[tuple[Path, Path]], **env: str) -> list[dict[str, Any]]:
    """``tests/_mcore_load.py`` on two gloo processes (torchrun); rank 0's JSON rows."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"),
            *("2", str(REPO / "tests" / "_mcore_load.py")),
            *(str(p) for pair in pairs for p in pair),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(pairs), done.stdout
    return rows


def _qkv_rows(mg: str) -> int:
    spec = json.loads((Path(mg) / "shardctl.megatron.json").read_text())["spec"]
    return int((spec["heads"] + 2 * spec["groups"]) * spec["head_dim"])


@pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core not installed (dev extra)")
def test_megatron_core_loads_strictly_and_logits_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pairs: list[tuple[Path, Path]] = []
    for name, mesh in [
        ("llama", {"tp": 2}),  # GQA 8/2
        ("mixtral", {"tp": 2, "ep": 2}),  # MoE, SequentialMLP experts (TP-split at load)
        ("qwen2", {"tp": 2}),  # qkv bias
        ("qwen3", {}),  # q/k layernorm, head_dim != hidden/heads
        ("llama-tied-mha", {"tp": 2}),  # tied, vocab 200 padded to 256
    ]:
        hf = make_checkpoint(name, tmp_path / f"{name}-hf")
        pairs.append((_mg(hf, tmp_path / f"{name}-mg", **mesh), hf))
    # negative control: [q; k; v] plainly concatenated (the known trap) must fail the check
    from shardctl.formats.megatron import names

    monkeypatch.setattr(names, "_interleave", lambda q, k, v, spec: torch.cat([q, k, v], 0))
    pairs.append((_mg(pairs[0][1], tmp_path / "bad-mg", tp=2), pairs[0][1]))
    monkeypatch.undo()
    # TP 2 for every model; Mixtral's experts also split over EP 2 (expert TP 1): no expert
    # may be dropped or misplaced, or the logits differ
    rows = _mcore(pairs, MCORE_TP="2", MCORE_EP="2", MCORE_ETP="1")
    *good, bad = rows
    for row in good:
        assert (row["tp"], row["ep"]) == (2, 2), row
        assert row["local_qkv_rows"] * 2 == _qkv_rows(row["dir"]), row
        assert row["max_abs"] < LOGITS_TOL, row
        assert row["argmax_equal"] and row["padded_rows_zero"], row
        assert row["common"] == {"checkpoint_version": 3.0, "iteration": 0}, row
    assert bad["max_abs"] > 100 * LOGITS_TOL, bad


@pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core not installed (dev extra)")
def test_megatron_core_loads_pipeline_stages_strictly(tmp_path: Path) -> None:
    """PP 2: each stage's GPTModel (pre/post process) loads strictly; its layers are the HF
    layers of that stage, the first stage has the embedding, the last the head (or, tied, a
    copy of the embedding)."""
    pairs = []
    for name in ("llama", "qwen2-tied", "mixtral"):
        hf = make_checkpoint(name, tmp_path / f"{name}-hf")
        pairs.append((_mg(hf, tmp_path / f"{name}-mg", pp=2), hf))
    for row in _mcore(pairs, MCORE_PP="2"):
        stages = row["stages"]
        assert [s["stage"] for s in stages] == [0, 1], row
        spec = json.loads((Path(row["dir"]) / "shardctl.megatron.json").read_text())["spec"]
        assert sum(s["layers"] for s in stages) == spec["layers"], row
        assert all(all(s["equal"]) and s["equal"] for s in stages), row


def test_cli_in_and_out_and_verify_either_side(tmp_path: Path) -> None:
    hf = make_checkpoint("llama", tmp_path / "hf")
    mg, back, ranks = tmp_path / "mg", tmp_path / "back", tmp_path / "r2"
    done = sub("reshard", str(hf), str(mg), "--format", "megatron", "--tp", "2", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["format"] == "megatron" and out["mesh"]["tp"] == 2
    assert {"release/.metadata", "release/__0_0.distcp", "release/common.pt"} <= {
        f["name"] for f in out["files"]
    }
    # the rest in process (same console entry, exit-code mapping and streams)
    code, _, err = cli("reshard", str(mg), str(back))
    assert code == 0, err
    assert (back / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    code, out, err = cli("reshard", str(mg), str(ranks), "--tp", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["source_kind"] == "megatron"
    for a, b in [(hf, mg), (mg, ranks), (mg, hf)]:
        code, out, err = cli("verify", str(a), str(b), "--level", "bitwise", "--json")
        assert code == 0, err
        res = json.loads(out)
        assert res["ok"] and (res["src"], res["dst"]) == (str(a), str(b))


def test_verify_fails_on_a_damaged_megatron_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = make_checkpoint("llama", tmp_path / "hf")
    mg = _mg(hf, tmp_path / "mg")
    from shardctl.formats.megatron import names

    orig = names.pack

    def swapped(unit: names.Unit, spec: Any, get: Any) -> torch.Tensor:
        # layer 1's attention output projection written from layer 0's
        if unit.key.endswith("linear_proj.weight") and unit.index == (1,):
            unit = replace(unit, hf=("model.layers.0.self_attn.o_proj.weight",))
        return orig(unit, spec, get)

    monkeypatch.setattr(names, "pack", swapped)
    bad = _mg(hf, tmp_path / "bad")
    monkeypatch.undo()
    code, out, err = cli("verify", str(hf), str(bad), "--level", "bitwise")
    assert code == 1, (out, err)
    assert "o_proj" in out
    code, out, err = cli("verify", str(hf), str(mg), "--level", "bitwise")
    assert code == 0, (out, err)


@pytest.mark.slow
def test_verify_forward_with_megatron_dst(tmp_path: Path) -> None:
    hf = make_checkpoint("qwen2", tmp_path / "hf")
    mg = _mg(hf, tmp_path / "mg")
    done = sub("verify", str(hf), str(mg), "--level", "forward", "--json")
    assert done.returncode == 0, done.stderr
    levels = {lv["name"]: lv["status"] for lv in json.loads(done.stdout)["levels"]}
    assert levels.get("forward") == "pass", levels


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("llama", ["--tp", "4"], "tp 4 does not divide num_key_value_heads 2"),
        ("llama", ["--pp", "3"], "pp 3 cannot split num_hidden_layers 4"),
        ("llama", ["--ep", "2"], "ep 2 needs a number of experts"),
        ("gpt2", [], "model_type 'gpt2' is not supported"),
        ("llama-bias-headdim", [], "attention_bias/mlp_bias"),
    ],
)
def test_refusals_are_one_line_and_write_nothing(
    tmp_path: Path, name: str, args: list[str], needle: str
) -> None:
    hf = make_checkpoint(name, tmp_path / "hf")
    dst = tmp_path / "mg"
    code, _, err = cli("reshard", str(hf), str(dst), "--format", "megatron", *args)
    one_line(code, err, 3)
    assert needle in err, err
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_foreign_checkpoint_needs_config_and_reads_without_sidecar(tmp_path: Path) -> None:
    """A torch_dist checkpoint Megatron wrote has no shardctl sidecar: names come from
    config.json, tensors are the same (HF names sorted)."""
    hf = make_checkpoint("mixtral", tmp_path / "hf")
    mg = _mg(hf, tmp_path / "mg")
    (mg / "shardctl.megatron.json").unlink()
    reshard(mg, tmp_path / "back", format="hf")
    got, want = (
        load_file(tmp_path / "back" / "model.safetensors"),
        load_file(hf / "model.safetensors"),
    )
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    (mg / "config.json").unlink()
    code, _, err = cli("reshard", str(mg), str(tmp_path / "back2"))
    one_line(code, err, 3)
    assert "config.json" in err


def test_existing_output_and_force(tmp_path: Path) -> None:
    hf = make_checkpoint("qwen3", tmp_path / "hf")
    mg = _mg(hf, tmp_path / "mg")
    code, _, err = cli("reshard", str(hf), str(mg), "--format", "megatron")
    one_line(code, err, 4)
    code, _, err = cli("reshard", str(hf), str(mg), "--format", "megatron", "--tp", "2", "--force")
    assert code == 0, err
    assert json.loads((mg / "shardctl.megatron.json").read_text())["spec"]["tp"] == 2


MANIFEST = """\
model:
  checkpoint: {ckpt}
mesh: {{tp: {tp}, pp: 2}}
workload:
  engine: megatron
  mode: training
  sequence_length: 64
training:
  optimizer: adamw
"""


def test_plan_prints_the_reshard_command(tmp_path: Path) -> None:
    hf = make_checkpoint("llama", tmp_path / "hf")
    m = tmp_path / "m.yaml"
    m.write_text(MANIFEST.format(ckpt=hf, tp=2))
    code, out, err = cli("plan", str(m))
    assert code == 0, err
    want = f"shardctl reshard {hf} {hf.parent}/hf-megatron-tp2-pp2 --format megatron --tp 2 --pp 2"
    assert want in out.replace("\n", ""), out
    code, out, err = cli("plan", str(m), "--json")
    got = json.loads(out)["reshard"]
    assert (got["engine"], got["command"], got["refused"]) == ("megatron", want, None)
    flags = got["load_flags"]  # what Megatron-LM is launched with to load it
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in flags
    assert "--num-query-groups 2" in flags and "--untie-embeddings-and-output-weights" in flags
    # the printed command runs and writes what it says
    code, _, err = cli(*want.split()[1:])
    assert code == 0, err
    assert (hf.parent / "hf-megatron-tp2-pp2" / "release" / ".metadata").is_file()
    m.write_text(MANIFEST.format(ckpt=hf, tp=4))
    code, out, err = cli("plan", str(m), "--json")
    got = json.loads(out)["reshard"]
    assert got["command"] is None and "does not divide num_key_value_heads" in got["refused"]


@pytest.mark.parametrize("damage", ["truncate", "metadata", "tracker"])
def test_damaged_torch_dist_input_is_one_line_exit_3(tmp_path: Path, damage: str) -> None:
    hf = make_checkpoint("llama", tmp_path / "hf")
    mg = _mg(hf, tmp_path / "mg")
    if damage == "truncate":
        data = mg / "release" / "__0_0.distcp"
        os.truncate(data, data.stat().st_size // 2)
    elif damage == "metadata":
        (mg / "release" / ".metadata").write_bytes(b"not a pickle")
    else:
        (mg / "latest_checkpointed_iteration.txt").write_text("0\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = cli("reshard", str(mg), str(tmp_path / "back"))
    one_line(code, err, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_hostile_metadata_pickle_is_refused_not_run(tmp_path: Path) -> None:
    """DCP's ``.metadata`` is a pickle: one naming anything but DCP's classes is exit 3 and
    its payload never runs."""
    import pickle

    hf = make_checkpoint("llama", tmp_path / "hf")
    mg = _mg(hf, tmp_path / "mg")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (mg / "release" / ".metadata").write_bytes(pickle.dumps(Payload()))
    code, _, err = cli("reshard", str(mg), str(tmp_path / "back"))
    one_line(code, err, 3)
    assert "not plain DCP metadata" in err and "system" in err
    assert not marker.exists()


def test_inspect_names_the_format_and_the_conversion(tmp_path: Path) -> None:
    mg = _mg(make_checkpoint("llama", tmp_path / "hf"), tmp_path / "mg")
    code, _, err = cli("inspect", str(mg))
    one_line(code, err, 3)
    assert "Megatron-Core torch_dist" in err and "--format hf" in err


@given(
    groups=st.integers(1, 4),
    per_group=st.integers(1, 4),
    head_dim=st.integers(1, 8),
    cols=st.sampled_from([(), (3,)]),  # a weight [rows, H] or a bias [rows]
)
@settings(max_examples=60, deadline=None)
def test_qkv_interleave_property(
    groups: int, per_group: int, head_dim: int, cols: tuple[int, ...]
) -> None:
    """Group g of ``linear_qkv`` is [its q heads; k_g; v_g], and unpack(pack(x)) == x."""
    from shardctl.formats.megatron import names
    from shardctl.formats.megatron.spec import MegatronSpec

    heads = groups * per_group
    spec = MegatronSpec(
        "llama", 1, 8, heads, groups, head_dim, 8, 8, 128, False, True, False, 0, 0, 1e4, 1e-6
    )
    q = torch.randn(heads * head_dim, *cols)
    k = torch.randn(groups * head_dim, *cols)
    v = torch.randn(groups * head_dim, *cols)
    unit = names.Unit("k", (0,), (1, spec.qkv_rows, *cols), ("q", "k", "v"), "qkv")
    packed = names.pack(unit, spec, {"q": q, "k": k, "v": v}.__getitem__)[0]
    rows = (per_group + 2) * head_dim
    for g in range(groups):
        block = packed[g * rows : (g + 1) * rows]
        qg = q[g * per_group * head_dim : (g + 1) * per_group * head_dim]
        assert torch.equal(block[: per_group * head_dim], qg)
        assert torch.equal(
            block[per_group * head_dim : -head_dim], k[g * head_dim : (g + 1) * head_dim]
        )
        assert torch.equal(block[-head_dim:], v[g * head_dim : (g + 1) * head_dim])
    back = names.unpack(unit, spec, packed.unsqueeze(0))
    assert all(torch.equal(back[n], t) for n, t in zip("qkv", (q, k, v), strict=True))


@pytest.mark.parametrize(
    "edit",
    [
        lambda side: side["spec"].update(layers=10**9),
        lambda side: side["spec"].update(heads="8"),
        lambda side: side["spec"].update(bogus=1),
        lambda side: side.update(tensors=[["x", [1], "NOPE"]]),
    ],
)
def test_hostile_sidecar_is_one_line_exit_3(tmp_path: Path, edit: Any) -> None:
    mg = _mg(make_checkpoint("llama", tmp_path / "hf"), tmp_path / "mg")
    side = json.loads((mg / "shardctl.megatron.json").read_text())
    edit(side)
    (mg / "shardctl.megatron.json").write_text(json.dumps(side))
    code, _, err = cli("reshard", str(mg), str(tmp_path / "back"))
    one_line(code, err, 3)
    assert not (tmp_path / "back").exists()
