"""``--format megatron`` for the MoE families beyond Mixtral: Qwen2-MoE (shared expert + its
sigmoid gate), Qwen3-MoE (q/k norms, a dense layer among MoE ones) and DeepSeek-V3 (MLA, a dense
first layer, shared experts, the router's ``e_score_correction_bias``, an MTP layer).

- megatron-core 0.16.1's own ``dist_checkpointing.load`` reads the output strictly into a
  ``GPTModel`` it builds on CPU from its local (non-TE) specs at TP 2 / EP 2 on two gloo
  processes; the logits match transformers' on the HF original. A negative control (the router
  bias written as zeros) loads just as strictly and fails the logits check, so it can fail.
- PP 2: DeepSeek-V3's stages (5 layers: 3 + 2, Megatron's uneven split) load strictly and
  hold their HF layers (and the MTP layer) bit for bit.
- HF -> megatron -> HF is byte-identical; verify accepts torch_dist on either side; plan prints
  the command; refusals are one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardctl.api import reshard
from tests._hostile import cli, one_line
from tests._models import make_checkpoint
from tests.test_families_mla_real import _with_mtp
from tests.test_formats_megatron import HAVE_MCORE, LOGITS_TOL, _mcore

FAMILIES = ("qwen2_moe", "qwen3_moe", "deepseek_v3")


def _mg(src: Path, dst: Path, **mesh: int) -> Path:
    reshard(src, dst, format="megatron", mesh=mesh or None)
    return dst


def _deepseek_v3(out: Path, **overrides: Any) -> Path:
    """The tiny DeepSeek-V3 with a non-zero ``e_score_correction_bias`` (transformers leaves
    the buffer at zeros, where a dropped or misplaced bias could not show), saved again by
    ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    base = make_checkpoint("deepseek_v3", out.parent / (out.name + "-zero-bias"), **overrides)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=g))
            # transformers >= 5.24 keeps the router weight in F32 (random F32 values); the
            # published checkpoints store it BF16 and Megatron-Core holds it in params_dtype
            # (BF16 here), so it gets BF16 values, stored as transformers stores them
            gate = layer.mlp.gate.weight
            gate.copy_(gate.to(torch.bfloat16).to(gate.dtype))
    model.save_pretrained(out)
    return out


def _hf(name: str, out: Path) -> Path:
    """DeepSeek-V3 with a non-zero router bias and its multi-token-prediction layer (appended
    in the published layout: transformers does not write one); ``qwen2_moe-all``: every layer
    MoE, as the published Qwen-MoE models (mcore stacks the layers then); the others as in
    tests/_models.py (a dense layer among MoE ones: per-layer keys)."""
    if name == "deepseek_v3":
        return _with_mtp(_deepseek_v3(out))
    if name == "qwen2_moe-all":
        return make_checkpoint("qwen2_moe", out, mlp_only_layers=[])
    return make_checkpoint(name, out)


def _spec(mg: Path) -> dict[str, Any]:
    return dict(json.loads((mg / "shardctl.megatron.json").read_text())["spec"])


@pytest.mark.parametrize(
    ("name", "mesh"),
    [
        ("qwen2_moe", {"tp": 2, "ep": 2}),
        ("qwen2_moe-all", {"ep": 2}),
        ("qwen3_moe", {"ep": 4}),
        ("deepseek_v3", {"tp": 2, "ep": 2, "pp": 2}),
    ],
)
def test_roundtrip_is_byte_identical(tmp_path: Path, name: str, mesh: dict[str, int]) -> None:
    hf = _hf(name, tmp_path / "hf")  # DeepSeek-V3: a float32 router bias among bf16, MTP
    mg = _mg(hf, tmp_path / "mg", **mesh)
    reshard(mg, tmp_path / "back", format="hf")
    names = sorted(p.name for p in hf.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "back").iterdir())
    for n in names:
        assert (tmp_path / "back" / n).read_bytes() == (hf / n).read_bytes(), n


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_layout_of_the_moe_and_mla_tensors(tmp_path: Path) -> None:
    """Mixed dense/MoE layers are per-layer keys (``decoder.layers.{i}.``, mcore's
    ``moe_layer_freq`` list); the shared expert is ``[gate; up]``, its gate ``gate_weight``;
    DeepSeek's router bias is ``router.expert_bias``; MLA's projections are copied as they are."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    q2 = make_checkpoint("qwen2_moe", tmp_path / "q2")
    mg = _mg(q2, tmp_path / "q2-mg", tp=2)
    ref = load_file(q2 / "model.safetensors")
    p = "decoder.layers.3.mlp."
    state = {
        p + "shared_experts.linear_fc1.weight": torch.empty(160, 64),
        p + "shared_experts.gate_weight": torch.empty(1, 64),
        p + "experts.experts.linear_fc2.weight": torch.empty(4, 64, 48),
        "decoder.layers.2.mlp.linear_fc1.weight": torch.empty(320, 64),  # the dense layer
    }
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    dcp.load(state, checkpoint_id=str(mg / "release"), no_dist=True)
    h = "model.layers.3.mlp."
    fc1 = state[p + "shared_experts.linear_fc1.weight"]
    assert torch.equal(fc1[:80], ref[h + "shared_expert.gate_proj.weight"])
    assert torch.equal(fc1[80:], ref[h + "shared_expert.up_proj.weight"])
    assert torch.equal(
        state[p + "shared_experts.gate_weight"], ref[h + "shared_expert_gate.weight"]
    )
    assert torch.equal(
        state[p + "experts.experts.linear_fc2.weight"][3], ref[h + "experts.3.down_proj.weight"]
    )
    dense = state["decoder.layers.2.mlp.linear_fc1.weight"]
    assert torch.equal(dense[160:], ref["model.layers.2.mlp.up_proj.weight"])

    ds = _deepseek_v3(tmp_path / "ds")
    mg = _mg(ds, tmp_path / "ds-mg")
    ref = load_file(ds / "model.safetensors")
    state = {
        "decoder.layers.2.self_attention.linear_kv_up_proj.weight": torch.empty(80, 16),
        "decoder.layers.2.self_attention.kv_layernorm.weight": torch.empty(16),
        "decoder.layers.0.pre_mlp_layernorm.weight": torch.empty(64),
    }
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    # transformers keeps this buffer in float32 beside bf16 weights: stored as float32
    state["decoder.layers.2.mlp.router.expert_bias"] = torch.empty(8)
    dcp.load(state, checkpoint_id=str(mg / "release"), no_dist=True)
    a = "model.layers.2."
    bias = ref[a + "mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0 and torch.equal(
        state["decoder.layers.2.mlp.router.expert_bias"], bias
    )
    kv = state["decoder.layers.2.self_attention.linear_kv_up_proj.weight"]
    assert torch.equal(kv, ref[a + "self_attn.kv_b_proj.weight"])
    norm = state["decoder.layers.2.self_attention.kv_layernorm.weight"]
    assert torch.equal(norm, ref[a + "self_attn.kv_a_layernorm.weight"])
    pre = state["decoder.layers.0.pre_mlp_layernorm.weight"]
    assert torch.equal(pre, ref["model.layers.0.post_attention_layernorm.weight"])
    flags = json.loads((mg / "shardctl.megatron.json").read_text())["load_flags"]
    for want in (
        "--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 8",
        "--moe-layer-freq '[0,1,1,1]'",
        "--moe-shared-expert-intermediate-size 64",
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias",
        "--moe-router-num-groups 2 --moe-router-group-topk 1",
        "--moe-router-topk-scaling-factor 2.5",
        "--transformer-impl local",  # the local spec's keys (the TE spec's MLA norms differ)
    ):
        assert want in flags, flags


@pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core not installed (dev extra)")
def test_megatron_core_loads_strictly_and_logits_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pairs: list[tuple[Path, Path]] = []
    # stacked layers with the shared expert and its gate; per-layer keys with q/k norms; MLA
    for name in ("qwen2_moe-all", "qwen3_moe", "deepseek_v3"):
        hf = _hf(name, tmp_path / f"{name}-hf")
        pairs.append((_mg(hf, tmp_path / f"{name}-mg", tp=2, ep=2), hf))
    # negative control: DeepSeek-V3's router bias written as zeros loads strictly (the key is
    # there) but routes differently: the logits check must fail
    from shardctl.formats.megatron import names

    orig = names.pack

    def zero_bias(unit: names.Unit, spec: Any, get: Any) -> torch.Tensor:
        t = orig(unit, spec, get)
        return torch.zeros_like(t) if unit.key.endswith("router.expert_bias") else t

    monkeypatch.setattr(names, "pack", zero_bias)
    ds = pairs[-1][1]
    pairs.append((_mg(ds, tmp_path / "bad-mg", tp=2, ep=2), ds))
    monkeypatch.undo()
    *good, bad = _mcore(pairs, MCORE_TP="2", MCORE_EP="2", MCORE_ETP="1")
    assert good[-1]["mtp_tensors"] > 20, good[-1]  # DeepSeek-V3's MTP layer loaded strictly
    for row in good:
        assert (row["tp"], row["ep"]) == (2, 2), row
        assert row["max_abs"] < LOGITS_TOL, row
        assert row["argmax_equal"] and row["padded_rows_zero"], row
    assert bad["max_abs"] > 100 * LOGITS_TOL, bad


@pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core not installed (dev extra)")
def test_megatron_core_loads_pipeline_stages_strictly(tmp_path: Path) -> None:
    # DeepSeek-V3 with 5 layers (like the real 61, pp does not divide them: stages of 3 and 2,
    # --decoder-last-pipeline-num-layers 2): per-layer keys (dense layer 0, MoE 1..4) split
    # over the stages; the MTP layer (mtp.layers.0) on the last stage, its tensors bit for bit
    hf = _with_mtp(_deepseek_v3(tmp_path / "hf", num_hidden_layers=5))
    pairs = [(_mg(hf, tmp_path / "mg", pp=2), hf)]
    flags = json.loads((tmp_path / "mg" / "shardctl.megatron.json").read_text())["load_flags"]
    assert "--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 2" in flags
    for row in _mcore(pairs, MCORE_PP="2"):
        stages = row["stages"]
        assert [s["stage"] for s in stages] == [0, 1], row
        spec = _spec(Path(row["dir"]))
        assert [s["layers"] for s in stages] == [3, 2] and spec["layers"] == 5, row
        assert all(all(s["equal"]) and s["equal"] for s in stages), row


def test_cli_verify_either_side(tmp_path: Path) -> None:
    hf = make_checkpoint("deepseek_v3", tmp_path / "hf")
    mg, ranks = tmp_path / "mg", tmp_path / "r"
    code, _, err = cli("reshard", str(hf), str(mg), "--format", "megatron", "--ep", "2")
    assert code == 0, err
    code, _, err = cli("reshard", str(mg), str(ranks), "--tp", "2", "--ep", "2")
    assert code == 0, err
    for a, b in [(hf, mg), (mg, ranks), (mg, hf)]:
        code, out, err = cli("verify", str(a), str(b), "--level", "bitwise", "--json")
        assert code == 0, err
        assert json.loads(out)["ok"], out


@pytest.mark.parametrize(
    ("name", "overrides", "args", "needle"),
    [
        ("deepseek_v2", {}, [], "model_type 'deepseek_v2' is not supported"),
        ("deepseek_v3", {"norm_topk_prob": False}, [], "norm_topk_prob false"),
        ("deepseek_v3", {"n_group": 4, "topk_group": 2}, [], "group-limited routing"),
        ("qwen2_moe", {}, ["--ep", "3"], "ep 3 needs a number of experts"),
        ("qwen3_moe", {}, ["--tp", "4"], "tp 4 does not divide num_key_value_heads 2"),
    ],
)
def test_refusals_are_one_line(
    tmp_path: Path, name: str, overrides: dict[str, Any], args: list[str], needle: str
) -> None:
    hf = make_checkpoint(name, tmp_path / "hf", **overrides)
    dst = tmp_path / "mg"
    code, _, err = cli("reshard", str(hf), str(dst), "--format", "megatron", *args)
    one_line(code, err, 3)
    assert needle in err, err
    assert not dst.exists()


MANIFEST = """\
model:
  checkpoint: {ckpt}
mesh: {{tp: 2, pp: 2, ep: 2}}
workload:
  engine: megatron
  mode: training
  sequence_length: 64
training:
  optimizer: adamw
"""


@pytest.mark.parametrize("name", FAMILIES)
def test_plan_prints_the_command(tmp_path: Path, name: str) -> None:
    hf = make_checkpoint(name, tmp_path / "hf")
    m = tmp_path / "m.yaml"
    m.write_text(MANIFEST.format(ckpt=hf))
    code, out, err = cli("plan", str(m), "--json")
    assert code == 0, err
    got = json.loads(out)["reshard"]
    want = (
        f"shardctl reshard {hf} {hf.parent}/hf-megatron-tp2-pp2-ep2 --format megatron "
        "--tp 2 --pp 2 --ep 2"
    )
    assert (got["engine"], got["command"], got["refused"]) == ("megatron", want, None)
    assert "--expert-model-parallel-size 2" in got["load_flags"]


def test_plan_with_mtp_layers(tmp_path: Path) -> None:
    """A manifest that counts DeepSeek-V3's multi-token-prediction layers: the command and
    Megatron-LM's --mtp-num-layers."""
    m = tmp_path / "m.yaml"
    hf = make_checkpoint("deepseek_v3", tmp_path / "hf")
    cfg = dict(json.loads((hf / "config.json").read_text()))
    cfg["include_mtp_layers"] = True
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    config = f"config: {tmp_path / 'cfg'}/config.json"
    m.write_text(MANIFEST.format(ckpt="X").replace("checkpoint: X", config))
    code, out, err = cli("plan", str(m), "--json")
    assert code == 0, err
    got = json.loads(out)["reshard"]
    assert got["refused"] is None and "--format megatron" in got["command"], got
    assert "--mtp-num-layers 1" in got["load_flags"], got


def test_mtp_embedding_copy_must_equal_the_model_s(tmp_path: Path) -> None:
    """mcore shares the embedding and head with the MTP layers: a checkpoint whose MTP copy
    differs cannot be written (one line, exit 3, nothing written)."""
    from safetensors.torch import load_file, save_file

    hf = _with_mtp(make_checkpoint("deepseek_v3", tmp_path / "hf"))
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.4.shared_head.head.weight"][0, 0] += 1
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    dst = tmp_path / "mg"
    code, _, err = cli("reshard", str(hf), str(dst), "--format", "megatron")
    one_line(code, err, 3)
    assert "model.layers.4.shared_head.head.weight" in err and "MTP" in err, err
    assert not dst.exists()


def test_foreign_checkpoint_without_sidecar_reads_moe_mla_mtp(tmp_path: Path) -> None:
    """A torch_dist checkpoint Megatron wrote has no sidecar: per-layer keys, MLA, the router
    bias and the MTP layer are read from config.json and the keys present; tensors equal."""
    from safetensors.torch import load_file

    hf = _hf("deepseek_v3", tmp_path / "hf")
    mg = _mg(hf, tmp_path / "mg", ep=2)
    (mg / "shardctl.megatron.json").unlink()
    reshard(mg, tmp_path / "back", format="hf")
    got, want = (
        load_file(tmp_path / "back" / "model.safetensors"),
        load_file(hf / "model.safetensors"),
    )
    assert got.keys() == want.keys() and any(k.startswith("model.layers.4.") for k in want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
