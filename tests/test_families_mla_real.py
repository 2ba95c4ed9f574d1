"""DeepSeek (MLA + MoE) at the sizes users have, with the multi-token-prediction layer.

- The forward level through the real CLI on a real gloo process group, with DeepSeek-V3's
  vocabulary (129,280) and head count (128 MLA heads; n_group 8 / topk_group 4 / 8 experts per
  token), shrunk only in width and depth (head dims 8+4 / 8, two layers: one dense, one MoE):
  each of the TP4 ranks holds 32 heads of q_b_proj / kv_b_proj / o_proj and the full
  replicated q_a / kv_a projections.
- A checkpoint that carries the MTP layer the published DeepSeek-V3 has (``model.layers.{L}``:
  transformers' ``save_pretrained`` does not write it, so these tests append those tensors to a
  save_pretrained checkpoint with safetensors): inventory, plan, reshard onto the last
  pipeline stage, verify, merge back byte-identical.
- A self-consistent but wrong MLA layout (the replicated kv_a_proj_with_mqa split by rows,
  recorded as such) passes structure and bitwise and fails the forward level.
"""

from __future__ import annotations

import json
from operator import attrgetter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardctl.layout.engine import build_layout
from shardctl.layout.types import Mesh, RuleSpec
from shardctl.model.inventory import from_checkpoint, from_config
from shardctl.reshard.api import reshard
from shardctl.verify.api import verify
from tests._cli import run_cli as _cli
from tests._models import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent

# DeepSeek-V3's vocabulary, heads and routing groups; widths shrunk (hidden 256 = 128 × 2).
V3_REAL = dict(
    vocab_size=129_280,
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
)


def test_deepseek_v3_forward_at_real_vocabulary_and_heads_tp4_gloo(tmp_path: Path) -> None:
    src = make_checkpoint("deepseek_v3", tmp_path / "hf", **V3_REAL)
    dst = tmp_path / "tp4"
    done = _cli("reshard", str(src), str(dst), "--tp", "4", "--quiet")
    assert done.returncode == 0, done.stderr
    done = _cli("verify", str(src), str(dst), "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    data = json.loads(done.stdout)
    assert [lv["status"] for lv in data["levels"]] == ["pass", "pass", "pass"]
    env = data["environment"]
    assert (env["backend"], env["world_size"], env["simulated"]) == ("gloo", 4, False)
    forward = next(lv for lv in data["levels"] if lv["name"] == "forward")
    tokens = forward["figures"]["batch"] * forward["figures"]["seq_len"]
    assert tokens * V3_REAL["vocab_size"] * 8 > 8 * 2**20  # logits above TCPStore's 8 MiB
    # rank 0 really held 32 of the 128 heads of the by-head projections, all of the low-rank
    with safe_open(dst / "rank-00000-of-00004.safetensors", "pt") as f:
        shape = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    attn = "model.layers.1.self_attn"
    assert shape[f"{attn}.kv_b_proj.weight"] == (32 * (8 + 8), 32)
    assert shape[f"{attn}.q_b_proj.weight"] == (32 * (8 + 4), 48)
    assert shape[f"{attn}.o_proj.weight"] == (256, 32 * 8)
    assert shape[f"{attn}.kv_a_proj_with_mqa.weight"] == (32 + 4, 256)
    assert shape[f"{attn}.q_a_proj.weight"] == (48, 256)


# ---- the multi-token-prediction layer -------------------------------------------------------

MTP_EXTRA = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")


def _with_mtp(src: Path) -> Path:
    """Append DeepSeek-V3's MTP layer ``model.layers.{L}`` to a save_pretrained checkpoint: a
    decoder layer (layer L-1's tensors, perturbed) plus embed_tokens, enorm, hnorm, eh_proj
    [H, 2H], shared_head.norm and shared_head.head — the names README_WEIGHTS.md documents."""
    cfg = json.loads((src / "config.json").read_text())
    last, mtp = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"]
    h = cfg["hidden_size"]
    path = src / "model.safetensors"
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    gen = torch.Generator().manual_seed(7)
    extra: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix = f"model.layers.{last}."
        if name.startswith(prefix):
            noise = torch.randn(t.shape, generator=gen).to(t.dtype) * 0.01
            extra[f"model.layers.{mtp}." + name[len(prefix) :]] = (t + noise).contiguous()
    p = f"model.layers.{mtp}"
    dtype = tensors["model.norm.weight"].dtype
    extra[f"{p}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    extra[f"{p}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"{p}.{norm}.weight"] = torch.ones(h, dtype=dtype)
    extra[f"{p}.eh_proj.weight"] = (torch.randn(h, 2 * h, generator=gen) / h).to(dtype)
    save_file({**tensors, **extra}, str(path), metadata={"format": "pt"})
    return src


# per family, MTP-layer attention tensors split by heads at tp 2 / kept whole (replicated)
MTP_ATTENTION = {
    "deepseek_v3": (("self_attn.kv_b_proj.weight",), ("self_attn.kv_a_proj_with_mqa.weight",)),
    "glm4_moe": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.bias"),
        ("self_attn.q_norm.weight",),
    ),
}


@pytest.mark.parametrize("family", list(MTP_ATTENTION))
def test_mtp_layer_inventory_plan_reshard_verify_merge(tmp_path: Path, family: str) -> None:
    """DeepSeek-V3's and GLM-4.5's published MTP layer (``model.layers.{L}``, which
    save_pretrained does not write) through inventory, placement, plan, reshard, verify, merge."""
    src = _with_mtp(make_checkpoint(family, tmp_path / "hf"))
    cfg = json.loads((src / "config.json").read_text())
    layers, mtp = cfg["num_hidden_layers"], f"model.layers.{cfg['num_hidden_layers']}."
    # inventory: the headers have the MTP layer; the config alone counts it only when asked
    on_disk = from_checkpoint(src).tensors
    assert sum(t.fqn.startswith(mtp) for t in on_disk) > len(MTP_EXTRA)
    # in name order: a file holds its tensors by dtype, then name (safetensors' order), and
    # transformers >= 5.24 saves DeepSeek's router in F32 (first in the file)
    by_name = tuple(sorted(on_disk, key=attrgetter("fqn")))
    assert from_config({**cfg, "include_mtp_layers": True}).tensors == by_name
    plain = from_config(cfg).tensors
    assert not any(t.fqn.startswith(mtp) for t in plain)
    assert len(plain) < len(on_disk)
    # placement: the whole MTP layer on the last pipeline stage, TP like a decoder layer
    mesh = Mesh(pp=2, tp=2)
    layout = build_layout(from_checkpoint(src), mesh)
    for rank in layout.ranks:
        names = {s.fqn: s for s in rank.shards}
        has_mtp = [n for n in names if n.startswith(mtp)]
        if rank.pp == 0:
            assert not has_mtp
            continue
        assert len(has_mtp) == sum(t.fqn.startswith(mtp) for t in on_disk)
        eh = names[f"{mtp}eh_proj.weight"]
        assert eh.local_shape == eh.global_shape  # replicated, as vLLM deepseek_mtp.py
        head = names[f"{mtp}shared_head.head.weight"]
        assert head.local_shape[0] == head.global_shape[0] // 2  # vocab-parallel
        split_by_heads, whole = MTP_ATTENTION[family]
        for name in split_by_heads:
            s = names[mtp + name]
            assert s.local_shape[0] == s.global_shape[0] // 2, name
        for name in whole:
            s = names[mtp + name]
            assert s.local_shape == s.global_shape, name
    assert layout.stages[-1].layers == (layers // 2, layers - 1)
    # plan from the checkpoint directory prices those bytes on the last stage
    done = _cli("plan", str(src), "--pp", "2", "--tp", "2", "--json")
    assert done.returncode in (0, 1), done.stderr
    doc = json.loads(done.stdout)
    by_rank = {r["rank"]: r["memory"]["weights"] for r in doc["ranks"]}
    expected = {r: sum(s.nbytes for s in layout.ranks[r].shards) for r in range(4)}
    assert by_rank == expected
    # reshard, verify (the forward runs what transformers runs; bitwise covers MTP), merge
    split = tmp_path / "split"
    reshard(src, split, mesh=mesh)
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "pass"], [
        str(f) for lv in result.levels for f in lv.findings
    ]
    merged = tmp_path / "merged"
    reshard(split, merged)
    assert (merged / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_mtp_layer_beyond_the_config_is_refused(tmp_path: Path) -> None:
    """A checkpoint whose MTP layers exceed num_nextn_predict_layers: exit 3, one line."""
    src = _with_mtp(make_checkpoint("deepseek_v3", tmp_path / "hf"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (src / "config.json").write_text(json.dumps(cfg))
    done = _cli("plan", str(src), "--tp", "2")
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert f"model.layers.{cfg['num_hidden_layers']}." in done.stderr


# ---- a wrong MLA layout must fail the forward level -----------------------------------------


def test_split_low_rank_projection_fails_forward(tmp_path: Path) -> None:
    """kv_a_proj_with_mqa split by rows over tp (vLLM replicates it): every byte is where the
    record says, so structure and bitwise pass — the forward level must not."""
    src = make_checkpoint("deepseek_v3", tmp_path / "hf")
    split = tmp_path / "wrong"
    wrong = RuleSpec("model.layers.*.self_attn.kv_a_proj_with_mqa.weight", tp="S(0)")
    reshard(src, split, mesh=Mesh(tp=2), rules=[wrong])
    result = verify(src, split, device="cpu", simulate=True)
    assert [lv.status for lv in result.levels] == ["pass", "pass", "fail"]
    findings = " ".join(str(f) for f in result.levels[2].findings)
    assert "kv_a_proj_with_mqa" in findings, findings


# ---- routing weights at pinned experts --------------------------------------------------------


def test_route_weights_reproduce_transformers_routers() -> None:
    """verify pins expert choices and recomputes their weights with the family's rule
    (``ForwardSpec.route_weights``); at the router's own choices that rule must give exactly
    the router's weights (V2: softmax × scaling; V3: sigmoid, renormalized, × scaling), or the
    pinned unsharded and sharded runs would both drift from the float64 reference."""
    from transformers import AutoModelForCausalLM

    from shardctl.archs import family_for
    from tests._models import make_config

    for name in ("deepseek_v2", "deepseek_v3"):
        cfg = make_config(name)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        router = model.model.layers[1].mlp.gate
        with torch.no_grad():
            router.weight.normal_()
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.normal_(std=0.1)
            logits, weights, chosen = router(torch.randn(64, cfg.hidden_size))
        rule = family_for(name).forward.route_weights  # type: ignore[union-attr]
        assert rule is not None
        got = rule(logits, chosen, cfg.to_dict())
        torch.testing.assert_close(got, weights.float(), rtol=1e-6, atol=1e-6)
        assert not torch.allclose(got, torch.softmax(logits, -1).gather(-1, chosen))
