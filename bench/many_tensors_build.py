"""Build a Mixtral-shaped many-tensor checkpoint with transformers' ``save_pretrained``.

    python bench/many_tensors_build.py DIR EXPERTS LAYERS HIDDEN INTERMEDIATE [MAX_SHARD_SIZE]

Random bf16 weights (meta-device init, then filled); never downloaded. Each layer holds
``3 × EXPERTS`` expert tensors plus 7 others, so 256 × 16 gives 12,403 tensors and
1,000 × 30 gives 90,213. ``MAX_SHARD_SIZE`` (default ``2GB``, e.g. ``40MB``) is
``save_pretrained``'s: a smaller one writes the checkpoint in many files with an index, as
real checkpoints come (DeepSeek-V3: 163 files).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

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
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    tmp.rename(out)


if __name__ == "__main__":
    main()
