"""Hand-built inventories (on-disk names and shapes per architecture) for the layout tests.

Written from the hub files' layouts, independently of ``shardctl.model.archs``, so the layout
tests do not depend on the inventory code they would otherwise be checking against.
"""

from __future__ import annotations

from typing import Any

from shardctl.model.types import ModelDims, ModelInfo, TensorInfo


def inventory(
    arch: str,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    head_dim: int | None = None,
    tied: bool = False,
    experts: int = 0,
    qkv_bias: bool = False,
    dtype: str = "BF16",
    positions: int = 64,
) -> ModelInfo:
    """A ModelInfo with the exact tensor names ``save_pretrained`` writes for ``arch``."""
    hd = head_dim or hidden // heads
    q, kv = heads * hd, kv_heads * hd
    t: list[tuple[str, tuple[int, ...]]] = []
    if arch == "gpt2":
        kv_heads, tied = heads, True
        t += [
            ("transformer.wte.weight", (vocab, hidden)),
            ("transformer.wpe.weight", (positions, hidden)),
        ]
        for i in range(layers):
            p = f"transformer.h.{i}."
            t += [
                (p + "ln_1.weight", (hidden,)),
                (p + "ln_1.bias", (hidden,)),
                (p + "attn.c_attn.weight", (hidden, 3 * hidden)),
                (p + "attn.c_attn.bias", (3 * hidden,)),
                (p + "attn.c_proj.weight", (hidden, hidden)),
                (p + "attn.c_proj.bias", (hidden,)),
                (p + "ln_2.weight", (hidden,)),
                (p + "ln_2.bias", (hidden,)),
                (p + "mlp.c_fc.weight", (hidden, inter)),
                (p + "mlp.c_fc.bias", (inter,)),
                (p + "mlp.c_proj.weight", (inter, hidden)),
                (p + "mlp.c_proj.bias", (hidden,)),
            ]
        t += [("transformer.ln_f.weight", (hidden,)), ("transformer.ln_f.bias", (hidden,))]
    else:
        t.append(("model.embed_tokens.weight", (vocab, hidden)))
        for i in range(layers):
            p = f"model.layers.{i}."
            t.append((p + "input_layernorm.weight", (hidden,)))
            if arch == "phi3":
                t.append((p + "self_attn.qkv_proj.weight", (q + 2 * kv, hidden)))
            else:
                t += [
                    (p + "self_attn.q_proj.weight", (q, hidden)),
                    (p + "self_attn.k_proj.weight", (kv, hidden)),
                    (p + "self_attn.v_proj.weight", (kv, hidden)),
                ]
                if qkv_bias:
                    t += [
                        (p + "self_attn.q_proj.bias", (q,)),
                        (p + "self_attn.k_proj.bias", (kv,)),
                        (p + "self_attn.v_proj.bias", (kv,)),
                    ]
            t.append((p + "self_attn.o_proj.weight", (hidden, q)))
            t.append((p + "post_attention_layernorm.weight", (hidden,)))
            if arch == "mixtral":
                m = p + "block_sparse_moe."
                t.append((m + "gate.weight", (experts, hidden)))
                for e in range(experts):
                    t += [
                        (m + f"experts.{e}.w1.weight", (inter, hidden)),
                        (m + f"experts.{e}.w2.weight", (hidden, inter)),
                        (m + f"experts.{e}.w3.weight", (inter, hidden)),
                    ]
            elif arch == "phi3":
                t.append((p + "mlp.gate_up_proj.weight", (2 * inter, hidden)))
                t.append((p + "mlp.down_proj.weight", (hidden, inter)))
            else:
                t += [
                    (p + "mlp.gate_proj.weight", (inter, hidden)),
                    (p + "mlp.up_proj.weight", (inter, hidden)),
                    (p + "mlp.down_proj.weight", (hidden, inter)),
                ]
        t.append(("model.norm.weight", (hidden,)))
        if not tied:
            t.append(("lm_head.weight", (vocab, hidden)))
    dims = ModelDims(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hd,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        num_experts=experts,
        gated_mlp=arch != "gpt2",
    )
    tensors = tuple(TensorInfo(name, shape, dtype) for name, shape in t)
    return ModelInfo(arch, dims, tensors, dtype, "inline")


def llama3_8b(**kw: Any) -> ModelInfo:
    return inventory(
        "llama", hidden=4096, layers=32, heads=32, kv_heads=8, inter=14336, vocab=128256, **kw
    )


def llama31_405b(**kw: Any) -> ModelInfo:
    return inventory(
        "llama", hidden=16384, layers=126, heads=128, kv_heads=8, inter=53248, vocab=128256, **kw
    )


def mixtral_8x7b(**kw: Any) -> ModelInfo:
    return inventory(
        "mixtral",
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        inter=14336,
        vocab=32000,
        experts=8,
        **kw,
    )
