"""Mixed precision at real size: Meta's Llama-3.1-405B-Instruct-FP8 at TP8 against vLLM's
log, and ``quantization.overrides`` inside ``plan --search`` and ``plan --search --quant``.

Source of the figure: issue 15's accuracy table, "FP8 checkpoints with 16-bit attention (Meta's
405B-FP8: 57.75 GB per rank at TP8 in vLLM's log, shardctl 47.74 GiB)"; the log line is vLLM
0.5.x ``model_runner.py`` "Loading model weights took 57.75 GB", whose "GB" is bytes / 2**30
(vLLM issue #6746, "The 8xH100 device failed to run
meta-llama/Meta-Llama-3.1-405B-Instruct-FP8"). The recipe is the checkpoint's config.json
``quantization_config``: ``quant_method: fbgemm_fp8`` (F8_E4M3 weights, an F32
``weight_scale`` ``[out, 1]`` per row) with ``modules_to_not_convert`` naming every layer's
``self_attn.{q,k,v,o}_proj``, ``model.layers.{0,125}.mlp.{gate,up,down}_proj`` and ``lm_head``
(assumed from the published list's pattern: those names, no others).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import shardctl

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
VLLM_405B_FP8_TP8 = 57.75 * GIB
L405 = ROOT / "manifests" / "llama-3.1-405b-tp8-pp2.yaml"
FP8_MANIFEST = ROOT / "manifests" / "llama-3.1-405b-fp8-tp8.yaml"
L8B = (ROOT / "manifests" / "llama-3-8b-tp1.yaml").read_text()


def _config_405b_fp8(tmp_path: Path) -> Path:
    cfg: dict[str, Any] = yaml.safe_load(L405.read_text())["model"]
    kept = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(126) for p in "qkvo"]
    kept += [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 125) for p in ("gate", "up", "down")]
    cfg["quantization_config"] = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": [*kept, "lm_head"],
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _rank_weights(plan: Any) -> list[int]:
    return [r.memory["weights"] for r in plan.ranks]


def test_405b_fp8_tp8_within_3_percent_of_vllm(tmp_path: Path) -> None:
    cfg = _config_405b_fp8(tmp_path)
    m = tmp_path / "m.yaml"
    m.write_text(
        f"model: {{config: {cfg}}}\nmesh: {{tp: 8}}\nhardware: {{gpu: h100-sxm}}\n"
        "workload: {mode: weights-only}\n"
    )
    from_config = _rank_weights(shardctl.plan(m))
    assert len(set(from_config)) == 1
    ours = from_config[0]
    assert abs(ours - VLLM_405B_FP8_TP8) <= 0.03 * VLLM_405B_FP8_TP8, ours / GIB
    # The bundled manifest (bf16 config + overrides) prices the same bytes on every rank.
    assert _rank_weights(shardctl.plan(FP8_MANIFEST, only_weights=True)) == from_config
    # Without the bf16 attention (all matrices fp8), the old answer is 17 % short.
    all_fp8 = FP8_MANIFEST.read_text().split("  overrides:")[0]
    flat = tmp_path / "all.yaml"
    flat.write_text(all_fp8)
    short = _rank_weights(shardctl.plan(flat, only_weights=True))[0]
    assert short < 0.85 * VLLM_405B_FP8_TP8


def _with_quant(tmp_path: Path, quant: str, name: str, nodes: int = 1) -> Path:
    path = tmp_path / name
    hardware = f"hardware: {{gpu: h100-sxm, nodes: {nodes}}}"
    path.write_text(re.sub(r"(?m)^hardware:.*$", hardware, L8B) + quant)
    return path


OVERRIDES = """
quantization:
  method: fp8
  overrides:
    - {match: "*.self_attn.*", dtype: bf16}
    - {match: "model.layers.0.*", method: none}
"""


def test_search_prices_the_overrides_as_plan_does(tmp_path: Path) -> None:
    mixed = _with_quant(tmp_path, OVERRIDES, "mixed.yaml")
    flat = _with_quant(tmp_path, "quantization: {method: fp8}\n", "flat.yaml")
    found = shardctl.search(mixed, gpus=4)
    assert found.candidates
    flat_peaks = {c.mesh: c.peak for c in shardctl.search(flat, gpus=4).candidates}
    for cand in found.candidates:
        plan = shardctl.plan(mixed, mesh=cand.mesh)
        assert max(r.total for r in plan.ranks) == cand.peak, cand.mesh
        assert cand.peak > flat_peaks[cand.mesh], cand.mesh  # bf16 attention costs bytes


def test_quant_search_keeps_the_overrides(tmp_path: Path) -> None:
    mixed = _with_quant(tmp_path, OVERRIDES, "mixed.yaml")
    args = ["plan", str(mixed), "--search", "--quant", "bf16,fp8,nvfp4", "--gpus", "2", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    for fmt in ("fp8", "nvfp4"):
        row = next(r for r in rows if r["format"] == fmt)
        variant = _with_quant(
            tmp_path, OVERRIDES.replace("method: fp8", f"method: {fmt}"), "v.yaml"
        )
        plan = shardctl.plan(variant, mesh=row["mesh"])
        assert row["weights_per_rank_bytes"] == max(_rank_weights(plan)), fmt
        flat = _with_quant(tmp_path, f"quantization: {{method: {fmt}}}\n", "f.yaml")
        assert row["weights_per_rank_bytes"] > max(
            _rank_weights(shardctl.plan(flat, mesh=row["mesh"]))
        )


def test_a_split_that_cuts_groups_is_refused_and_searched_around(tmp_path: Path) -> None:
    """AWQ groups of 1024 along down_proj's 14336 in-features: tp 8 leaves 1792 per rank."""
    quant = (
        "quantization:\n  method: fp8\n  overrides:\n"
        '    - {match: "*.down_proj.*", method: awq, group_size: 1024}\n'
    )
    path = _with_quant(tmp_path, quant, "g.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(path), "--tp", "8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "model.layers.0.mlp.down_proj.weight" in proc.stderr and "cuts a group" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    found = shardctl.search(path, gpus=8)
    assert found.candidates and all(c.mesh.tp < 8 for c in found.candidates)
    assert found.rejected.get("layout_refused")
    # tp 2 keeps whole groups (7168 = 7 × 1024) and is priced
    assert shardctl.plan(path, mesh={"tp": 2}).ranks


@given(
    tp=st.sampled_from([1, 2, 4, 8, 16]),
    pp=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
@settings(max_examples=12, deadline=None)
def test_dense_overrides_are_the_layout_engines_bytes(tp: int, pp: int, dtype: str) -> None:
    """A dense-dtype override over every tensor prices each rank's local elements at that
    width: the layout engine's bf16 bytes, doubled for float32, on every rank of any mesh."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        base = _with_quant(Path(d), "", "b.yaml", nodes=8)
        over = _with_quant(
            Path(d),
            f'quantization:\n  method: none\n  overrides: [{{match: "*", dtype: {dtype}}}]\n',
            "o.yaml",
            nodes=8,
        )
        mesh = {"tp": tp, "pp": pp}
        want = _rank_weights(shardctl.plan(base, mesh=mesh, only_weights=True))
        got = _rank_weights(shardctl.plan(over, mesh=mesh, only_weights=True))
    factor = 2 if dtype == "float32" else 1
    assert got == [w * factor for w in want]


def test_training_takes_overrides_only_on_a_frozen_base(tmp_path: Path) -> None:
    train = (ROOT / "manifests" / "llama-3-8b-train-zero3-dp8.yaml").read_text()
    keep_attn = '  overrides: [{match: "*.self_attn.*", method: none}]\n'
    full = tmp_path / "full.yaml"
    full.write_text(
        train + 'quantization:\n  method: none\n  overrides: [{match: "*", dtype: fp32}]\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(full)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 3 and "quantization.overrides" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    qlora = train.replace("  master_weights: true", "  master_weights: true\n  lora_rank: 16")
    plain, mixed = tmp_path / "q.yaml", tmp_path / "m.yaml"
    plain.write_text(qlora + "quantization:\n  method: nf4\n")
    mixed.write_text(qlora + "quantization:\n  method: nf4\n" + keep_attn)
    w_plain = max(_rank_weights(shardctl.plan(plain)))
    w_mixed = max(_rank_weights(shardctl.plan(mixed)))
    assert w_mixed > w_plain  # the bf16 attention of the frozen base


def test_gpt_oss_recipe_mxfp4_experts_over_bf16(tmp_path: Path) -> None:
    """openai/gpt-oss-120b as published: experts in MXFP4, attention, router, embeddings and
    head in bf16 (config.json quantization_config, modules_to_not_convert). The bf16 manifest
    plus one override prices the bytes the published config expands to, on every rank; tp 8
    cuts the 2880 in-features into 360 (not whole blocks of 32): both refuse."""
    src = (ROOT / "manifests" / "gpt-oss-120b-tp8.yaml").read_text()
    cfg: dict[str, Any] = yaml.safe_load(src)["model"]
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tail = "hardware: {gpu: h100-sxm, nodes: 1}\nworkload: {mode: weights-only}\n"
    published = tmp_path / "published.yaml"
    published.write_text(f"model: {{config: {tmp_path / 'config.json'}}}\nmesh: {{tp: 1}}\n" + tail)
    ours = tmp_path / "ours.yaml"
    ours.write_text(
        re.sub(r"(?ms)^mesh:.*", "", src)
        + "mesh: {tp: 1}\n"
        + tail
        + "quantization:\n  method: none\n"
        + '  overrides: [{match: "*.mlp.experts.*", method: mxfp4}]\n'
    )
    for mesh in ({"tp": 1}, {"tp": 2}, {"ep": 2}, {"pp": 2, "ep": 2}):
        want = _rank_weights(shardctl.plan(published, mesh=mesh))
        assert _rank_weights(shardctl.plan(ours, mesh=mesh)) == want, mesh
    # = the published model.safetensors.index.json total_size (tests/test_flagships.py cites it)
    assert _rank_weights(shardctl.plan(ours, mesh={"tp": 1})) == [65_248_815_744]
    for path in (published, ours):
        proc = subprocess.run(
            [sys.executable, "-m", "shardctl", "plan", str(path), "--tp", "8"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert proc.returncode == 3 and "360 per rank" in proc.stderr, proc.stderr


def test_first_match_wins_then_keep_then_method() -> None:
    from shardctl.model.types import TensorInfo
    from shardctl.plan.memory.precision import AS_STORED, tensor_format
    from shardctl.plan.memory.spec import QuantOverride, QuantSpec

    down = TensorInfo("model.layers.1.mlp.down_proj.weight", (64, 128), "BF16")
    up = TensorInfo("model.layers.1.mlp.up_proj.weight", (128, 64), "BF16")
    q_proj = TensorInfo("model.layers.1.self_attn.q_proj.weight", (64, 64), "BF16")
    norm = TensorInfo("model.layers.1.input_layernorm.weight", (64,), "BF16")
    router = TensorInfo("model.layers.1.mlp.gate.weight", (8, 64), "BF16")
    spec = QuantSpec(
        "awq",
        keep_16bit=("*.mlp.*",),
        overrides=(
            QuantOverride("*.down_proj.*", method="fp8", fp8_scaling="channel"),
            QuantOverride("*.mlp.*", dtype="F32"),  # after down_proj: takes up_proj only
        ),
    )
    assert tensor_format(down, spec, 8).formula == "fp8-channel"
    assert tensor_format(up, spec, 8).dtype == "F32"
    assert tensor_format(q_proj, spec, 8).formula == "awq"  # no override, no keep: method
    assert tensor_format(norm, spec, 8) == AS_STORED  # never quantized
    only_keep = QuantSpec("awq", keep_16bit=("*.mlp.*",))
    assert tensor_format(up, only_keep, 8) == AS_STORED
    assert tensor_format(router, QuantSpec("fp8"), 8) == AS_STORED  # [E, hidden] router


def test_a_keep_glob_shadowed_by_overrides_exits_3(tmp_path: Path) -> None:
    quant = (
        "quantization:\n  method: fp8\n"
        '  keep_16bit: ["*embed_tokens.*", "*.mlp.down_proj.*"]\n'
        '  overrides: [{match: "*.mlp.*", method: awq}]\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "shardctl", "plan", str(_with_quant(tmp_path, quant, "k.yaml"))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 3 and "never applies" in proc.stderr, proc.stderr
    assert "'*.mlp.down_proj.*'" in proc.stderr and "quantization.keep_16bit" in proc.stderr


def test_405b_recipe_as_510_literal_overrides(tmp_path: Path) -> None:
    """modules_to_not_convert pasted one module per override (510 entries over 1,137
    tensors) prices what the three globs do, on every rank of TP8."""
    kept = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(126) for p in "qkvo"]
    kept += [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 125) for p in ("gate", "up", "down")]
    lines = "".join(f'    - {{match: "{m}.*", method: none}}\n' for m in kept)
    body = FP8_MANIFEST.read_text().split("  overrides:")[0]
    literal = tmp_path / "literal.yaml"
    literal.write_text(body + "  overrides:\n" + lines)
    want = _rank_weights(shardctl.plan(FP8_MANIFEST, only_weights=True))
    assert _rank_weights(shardctl.plan(literal, only_weights=True)) == want
