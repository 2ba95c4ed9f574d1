"""Compare the memory model with ``torch.cuda.max_memory_allocated`` on a real GPU
(issue 3 item 11). Target: total within 5 %.

Runs a small Llama-architecture model (random weights, bf16, built from a config — nothing
downloaded) at a planned workload: prefill of ``batch × seq`` tokens with a static KV cache
(allocated up front, as serving engines do), measured component by component:

- weights: allocated bytes after ``model.to("cuda")``;
- kv_cache: allocated bytes after creating the ``StaticCache``;
- activations: ``max_memory_allocated`` during the prefill forward minus the two above
  (compared with the estimate's prefill peak + logits; HF computes logits for the last
  position only with ``logits_to_keep=1``);
- total: the peak. Runtime overhead (CUDA context, NCCL, fragmentation) is outside
  ``max_memory_allocated`` and is excluded from both sides.

Without CUDA it says so and exits 0.

    python bench/gpu_memory.py [--batch 8] [--seq 2048] [--hidden 2048] [--layers 8]
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--attn", default="sdpa", help="sdpa (flash kernels) or eager")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("skipped: torch is not installed (pip install -e '.[torch]')")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA device; this bench needs a GPU")
        return 0
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from shardctl.layout.types import Mesh
    from shardctl.model.types import ModelDims, ModelInfo
    from shardctl.plan.memory import OverheadSpec, Workload, estimate
    from shardctl.plan.memory.shapes import split_layers

    h, layers = args.hidden, args.layers
    heads, kv_heads = h // 128, max(h // 512, 1)
    cfg = LlamaConfig(
        hidden_size=h,
        intermediate_size=int(h * 3.5),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=32000,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    cfg._attn_implementation = args.attn
    dims = ModelDims(h, layers, heads, kv_heads, 128, cfg.intermediate_size, 32000, False)
    plan = estimate(
        ModelInfo("llama", dims, (), "BF16", "inline"),
        Mesh(),
        split_layers(layers, 1),
        workload=Workload(
            batch_size=args.batch,
            sequence_length=args.seq,
            flash_attention=args.attn != "eager",
            max_num_batched_tokens=None,
        ),
        overhead=OverheadSpec(cuda_context=0, nccl_buffers=0, framework=0, fragmentation=0.0),
    )
    est = plan.coords[(0, 0, 0)]

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16).eval()
    weights = torch.cuda.memory_allocated() - base
    cache = StaticCache(
        config=cfg,
        max_batch_size=args.batch,
        max_cache_len=args.seq,
        device="cuda",
        dtype=torch.bfloat16,
    )
    kv = torch.cuda.memory_allocated() - base - weights
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    acts = peak - weights - kv - ids.numel() * 8

    rows = [
        ("weights", weights, est.weights),
        ("kv_cache", kv, est.kv_cache),
        ("activations", acts, est.activations),
        ("total", peak, est.weights + est.kv_cache + est.activations),
    ]
    print(
        f"{torch.cuda.get_device_name()}  batch {args.batch}  seq {args.seq}  "
        f"hidden {h}  layers {layers}  attn {args.attn}"
    )
    print(f"{'component':<12} {'measured':>14} {'estimate':>14} {'error':>8}")
    for name, got, want in rows:
        err = (want - got) / got if got else 0.0
        print(f"{name:<12} {got:>14,} {want:>14,} {err:>+8.1%}")
    total_err = abs(rows[-1][2] - rows[-1][1]) / rows[-1][1]
    print(f"total within 5 %: {'yes' if total_err <= 0.05 else 'NO'} ({total_err:.1%})")
    return 0 if total_err <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
