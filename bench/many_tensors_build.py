"""Build a many-tensor MoE checkpoint with transformers' ``save_pretrained``.

    python bench/many_tensors_build.py DIR EXPERTS LAYERS HIDDEN INTERMEDIATE [MAX_SHARD_SIZE]
    python bench/many_tensors_build.py --deepseek-v3-fp8 DIR [MAX_SHARD_SIZE]

Random bf16 weights (meta-device init, then filled); never downloaded. Each layer holds
``3 × EXPERTS`` expert tensors plus 7 others, so 256 × 16 gives 12,403 tensors and
1,000 × 30 gives 90,213. ``MAX_SHARD_SIZE`` (default ``2GB``, e.g. ``40MB``) is
``save_pretrained``'s: a smaller one writes the checkpoint in many files with an index, as
real checkpoints come (DeepSeek-V3: 163 files).

``--deepseek-v3-fp8`` writes the shape the scale issue names: DeepSeek-V3's tensor count
(61 layers, the first 3 dense, 256 routed experts and one shared, MLA attention) with shrunk
widths, every decoder linear then quantized as the release stores it (``F8_E4M3`` weight and an
``F32`` ``weight_scale_inv`` per 128x128 block, ``quantization_config`` fp8 e4m3 block
[128, 128]), in ``MAX_SHARD_SIZE`` files (default ``30MB``: 176 files) with their index:
90,427 tensors, 1.6 GB. Widths keep whole blocks on every rank of ``--ep 8`` (16 heads: also
``--tp 2`` for attention and the dense layers; the 128-wide experts do not split ``tp``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main() -> None:
    if sys.argv[1] == "--deepseek-v3-fp8":
        deepseek_v3_fp8(Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "30MB")
        return
    from transformers import MixtralConfig

    out = Path(sys.argv[1])
    experts, layers, hidden, inter = map(int, sys.argv[2:6])
    max_shard_size = sys.argv[6] if len(sys.argv) > 6 else "2GB"
    cfg = MixtralConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=experts,
        num_experts_per_tok=2,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    model = random_model(cfg)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    tmp.rename(out)


def random_model(cfg: object) -> object:
    """``cfg``'s model with random bf16 weights: built on the meta device, then filled (no
    initializer runs over 90,000 tensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02)
    return model


def deepseek_v3_fp8(out: Path, max_shard_size: str, block: int = 128) -> None:
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=61,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=129280,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        moe_intermediate_size=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    model = random_model(cfg)
    bf16 = out.with_name(out.name + ".bf16")
    tmp = out.with_name(out.name + ".tmp")
    for d in (bf16, tmp):
        shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(bf16, max_shard_size=max_shard_size)
    del model

    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = w.shape
        br, bc = -(-rows // block), -(-cols // block)
        padded = torch.zeros(br * block, bc * block)
        padded[:rows, :cols] = w.float()
        blocks = padded.view(br, block, bc, block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # e4m3's largest
        q = (blocks / scale[:, None, :, None]).view(br * block, bc * block)[:rows, :cols]
        return q.to(torch.float8_e4m3fn), scale.contiguous()

    tmp.mkdir()
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    weight_map = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors = {}
        for k, t in load_file(bf16 / name).items():
            # the release quantizes every decoder linear (kv_a_proj_with_mqa too) but the
            # router (mlp.gate.weight)
            linear = k.endswith(("proj.weight", "proj_with_mqa.weight"))
            if k.startswith("model.layers.") and linear and t.dim() == 2:
                tensors[k], tensors[k[: -len("weight")] + "weight_scale_inv"] = quantize(t)
            else:
                tensors[k] = t
        save_file(tensors, tmp / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index["weight_map"] = weight_map
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(bf16 / "generation_config.json", tmp)
    shutil.rmtree(bf16)
    tmp.rename(out)
    print(f"{out}: {len(weight_map)} tensors in {len(set(weight_map.values()))} files")


if __name__ == "__main__":
    main()
