"""Load shardctl's ``--format megatron`` output with megatron-core's own loader, run its forward.

Run as a script (fresh processes: mcore's model-parallel state is process-global)::

    python tests/_mcore_load.py MEGATRON_DIR HF_DIR [MEGATRON_DIR HF_DIR ...]
    MCORE_TP=2 torchrun --standalone --nproc-per-node 2 tests/_mcore_load.py ...   # TP 2
    MCORE_EP=2 torchrun --standalone --nproc-per-node 2 tests/_mcore_load.py ...   # EP 2

For each pair: build ``GPTModel`` on CPU from the sidecar's spec with mcore's transformer-engine
-free ``get_gpt_layer_local_spec``, ``dist_checkpointing.load`` the ``release/`` directory
strictly (``StrictHandling.RAISE_ALL``: any missing or unexpected key raises), copy the loaded
state into the model (``load_state_dict(strict=True)``), run a forward on fixed token ids and
compare the logits (gathered over TP ranks) with transformers' on the HF original. Rank 0
prints one JSON line per pair.

CPU patches (the only ones): ``torch.cuda.current_device`` returns ``"cpu"`` in this process,
because mcore's ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to the current CUDA device on
first use; mcore's CUDA RNG tracker ``fork()`` (entered around attention dropout, which is 0
here) is a null context, because it switches CUDA RNG states; ``moe_utils.te_general_gemm`` is
set to None, because megatron-core 0.16.1 without transformer-engine never defines that name
yet its router reads it (``NameError``); and ``moe_token_dispatcher_type="allgather"``
because the default ``alltoall`` dispatcher creates a ``torch.cuda.Stream`` at construction;
``Tensor.cuda`` returns the tensor itself, because with tied embeddings and PP > 1 mcore's
``LanguageModule`` moves the last stage's copy of the embedding to CUDA before its all-reduce.
MLA (DeepSeek-V3): ``multi_latent_attention.HAVE_TE`` is False, because without
transformer-engine mcore's TE extension still imports (a ``MagicMock`` in TE's place) and MLA
then calls ``isinstance`` with the mock; and the layer specs' ``core_attention`` is
:class:`CpuCoreAttention` (causal ``softmax(q·kᵀ·scale)·v``, no parameters), because the local
``DotProductAttention`` takes no ``k_channels``/``v_channels`` (MLA's q/k and v head dims
differ). ``sharded_state_dict`` gets ``metadata={"dp_cp_group": ...}`` as Megatron-LM passes
it (0.16.1 needs it to tie the embedding copy of an MTP stage). Mixed dense/MoE layers and MLA
build with ``get_gpt_decoder_block_spec`` (local layers, ``moe_layer_freq`` a list).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

CpuCoreAttention = None  # built in main() (torch imported there)


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    import torch
    import torch.distributed as dist

    torch.cuda.current_device = lambda: "cpu"  # see the module docstring
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]  # ditto
    # under torchrun: WORLD_SIZE ranks, model-parallel degrees from MCORE_TP / MCORE_EP
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=int(os.environ.get("MCORE_TP", "1")),
        pipeline_model_parallel_size=int(os.environ.get("MCORE_PP", "1")),
        expert_model_parallel_size=int(os.environ.get("MCORE_EP", "1")),
        expert_tensor_parallel_size=int(
            os.environ.get("MCORE_ETP", os.environ.get("MCORE_TP", "1"))
        ),
    )
    import contextlib

    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # see the docstring
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # see the docstring
    import megatron.core.transformer.multi_latent_attention as mla

    mla.HAVE_TE = False  # see the docstring
    global CpuCoreAttention
    CpuCoreAttention = _core_attention_class()
    for mg, hf in zip(argv[::2], argv[1::2], strict=True):
        pp = int(os.environ.get("MCORE_PP", "1"))
        row = check(Path(mg), Path(hf)) if pp == 1 else check_stage(Path(mg), Path(hf))
        if rank == 0:
            print(json.dumps(row), flush=True)
    # Teardown: without the barrier one rank could tear its gloo pairs down while the other
    # was still in its last collective, and about one run in 30 (PP 2) aborted at exit with
    # "terminate called without an active exception" after printing every row; 80 runs with
    # the barrier passed. os._exit skips the C++ static destructors once all is flushed.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build(spec: dict, dtype):  # type: ignore[no-untyped-def]
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    moe = spec["experts"] > 0
    mla = spec.get("kv_lora_rank", 0) > 0
    layers = spec["layers"]
    moe_layers = spec.get("moe_layers")
    kw = dict(
        num_layers=layers,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=(
            parallel_state.get_expert_model_parallel_world_size() if spec["experts"] else 1
        ),
        hidden_size=spec["hidden"],
        num_attention_heads=spec["heads"],
        ffn_hidden_size=spec["ffn"],
        normalization="RMSNorm",
        layernorm_epsilon=spec["eps"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec["qkv_bias"],
        qk_layernorm=spec["qk_norm"] or mla,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=spec["experts"] or None,
        moe_ffn_hidden_size=(spec.get("moe_ffn") or spec["ffn"]) if moe else None,
        moe_router_topk=spec["topk"] or 2,
        moe_router_pre_softmax=spec.get("router_pre_softmax", False),
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0,
        moe_layer_freq=([int(i in moe_layers) for i in range(layers)] if moe and moe_layers else 1),
        moe_shared_expert_intermediate_size=spec.get("shared_ffn") or None,
        moe_shared_expert_gate=spec.get("shared_gate", False),
        moe_router_score_function=spec.get("router_score", "softmax"),
        moe_router_enable_expert_bias=spec.get("router_bias", False),
        moe_router_num_groups=spec.get("router_groups") or None,
        moe_router_group_topk=spec.get("router_group_topk") or None,
        moe_router_topk_scaling_factor=(
            spec.get("router_scale") if spec.get("router_scale", 1.0) != 1.0 else None
        ),
    )
    if spec.get("mtp_layers"):
        kw["mtp_num_layers"] = spec["mtp_layers"]
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if layers % pp:  # Megatron-LM's --decoder-last-pipeline-num-layers (the sidecar's flags)
        kw["num_layers_in_last_pipeline_stage"] = layers - -(-layers // pp) * (pp - 1)
    if mla:
        cfg = MLATransformerConfig(
            **kw,
            q_lora_rank=spec["q_lora_rank"],
            kv_lora_rank=spec["kv_lora_rank"],
            qk_head_dim=spec["qk_nope"],
            qk_pos_emb_head_dim=spec["qk_rope"],
            v_head_dim=spec["v_head_dim"],
            rope_type="rope",
            rotary_base=spec["rope_theta"],
        )
    else:
        cfg = TransformerConfig(**kw, num_query_groups=spec["groups"], kv_channels=spec["head_dim"])
    if moe_layers or mla:  # mixed dense/MoE layers (or MLA): mcore's per-layer block spec
        layer_spec = get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=False, normalization="RMSNorm"
        )
        for ls in layer_spec.layer_specs:
            if mla:  # see the module docstring: the local DotProductAttention lacks k/v dims
                ls.submodules.self_attention.submodules.core_attention = CpuCoreAttention
    else:
        layer_spec = get_gpt_layer_local_spec(
            num_experts=spec["experts"] or None,
            moe_grouped_gemm=False,
            qk_layernorm=spec["qk_norm"],
        )
    extra = {}
    if spec.get("mtp_layers"):  # built like the last decoder layer, on the last stage
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        extra["mtp_block_spec"] = get_gpt_mtp_block_spec(
            cfg, layer_spec, use_transformer_engine=False
        )
    model = GPTModel(
        **extra,
        config=cfg,
        transformer_layer_spec=layer_spec,
        vocab_size=spec["padded_vocab"],
        max_sequence_length=128,
        position_embedding_type="rope",
        rotary_base=int(spec["rope_theta"]),
        share_embeddings_and_output_weights=spec["tied"],
        parallel_output=False,  # logits gathered over TP ranks
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    return model.eval()


def _core_attention_class():  # type: ignore[no-untyped-def]
    import torch

    class CpuCoreAttention(torch.nn.Module):
        """softmax(q·kᵀ·scale, causal)·v on [s, b, heads, dim] tensors; q/k and v head dims
        may differ (MLA). No parameters: the checkpoint's keys are unchanged."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type,  # type: ignore[no-untyped-def]
                     softmax_scale=None, **_):  # fmt: skip
            super().__init__()
            self.scale = softmax_scale

        def forward(self, q, k, v, attention_mask, **_):  # type: ignore[no-untyped-def]
            q, k, v = (t.permute(1, 2, 0, 3).float() for t in (q, k, v))
            s = (q @ k.transpose(-1, -2)) * (self.scale or q.shape[-1] ** -0.5)
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            o = s.softmax(-1) @ v
            return o.permute(2, 0, 1, 3).reshape(o.shape[2], o.shape[0], -1)

    return CpuCoreAttention


def check(mg: Path, hf: Path) -> dict:  # type: ignore[type-arg]
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from transformers import AutoModelForCausalLM

    side = json.loads((mg / "shardctl.megatron.json").read_text())
    spec = side["spec"]
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    # the MTP layers load strictly into model_bf; mcore 0.16.1's forward of an MTP model needs
    # labels (it returns the loss), so the logits come from the same weights without them
    model = build({**spec, "mtp_layers": 0}, torch.float32)
    # the checkpoint's dtype is bf16; mcore loads into the model's tensors: build in bf16, then
    # upcast for a float32 comparison with the float32 reference.
    model_bf = build(spec, torch.bfloat16)
    sharded = model_bf.sharded_state_dict(metadata=_metadata())
    loaded = dist_checkpointing.load(sharded, str(mg / "release"), strict=StrictHandling.RAISE_ALL)
    common = {k: loaded.pop(k) for k in ("checkpoint_version", "iteration")}
    model_bf.load_state_dict(loaded, strict=True)
    model.load_state_dict(
        {
            k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in model_bf.state_dict().items()
            if not k.startswith("mtp.")
        },
        strict=True,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, spec["vocab"], (2, 24))
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    mask = torch.triu(torch.ones(24, 24, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        got = model(ids, pos, mask)[..., : spec["vocab"]].float()
        want = ref(ids).logits.float()
    return {
        "dir": str(mg),
        "common": common,
        "mtp_tensors": sum(k.startswith("mtp.") and torch.is_tensor(v) for k, v in loaded.items()),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "local_qkv_rows": _local_rows(model.decoder.layers[0].self_attention),
        "max_abs": float((got - want).abs().max()),
        "ref_max": float(want.abs().max()),
        "argmax_equal": bool((got.argmax(-1) == want.argmax(-1)).all()),
        "padded_rows_zero": _padding_is_zero(model, spec["vocab"]),
    }


def check_stage(mg: Path, hf: Path) -> dict:  # type: ignore[type-arg]
    """PP > 1: each stage's model loads strictly; its layers equal the HF layers of that
    stage (global layer = stage offset + local index). Rows gathered to rank 0."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from safetensors import safe_open

    spec = json.loads((mg / "shardctl.megatron.json").read_text())["spec"]
    model = build(spec, torch.bfloat16)
    loaded = dist_checkpointing.load(
        model.sharded_state_dict(metadata=_metadata()),
        str(mg / "release"),
        strict=StrictHandling.RAISE_ALL,
    )
    for k in ("checkpoint_version", "iteration"):
        loaded.pop(k)
    model.load_state_dict(loaded, strict=True)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    per = -(-spec["layers"] // parallel_state.get_pipeline_model_parallel_world_size())
    ref = safe_open(str(hf / "model.safetensors"), framework="pt")
    equal = []
    for i, layer in enumerate(model.decoder.layers):
        g = stage * per + i
        want = ref.get_tensor(f"model.layers.{g}.self_attn.o_proj.weight")
        equal.append(torch.equal(layer.self_attention.linear_proj.weight.data, want))
        if spec["experts"] and g in (spec.get("moe_layers") or range(spec["layers"])):
            moe = f"model.layers.{g}.{spec.get('hf_moe', 'block_sparse_moe')}."
            down = spec.get("hf_expert", ["w1", "w3", "w2"])[2]
            want = ref.get_tensor(moe + "gate.weight")
            equal.append(torch.equal(layer.mlp.router.weight.data, want))
            for e, expert in enumerate(layer.mlp.experts.local_experts):
                want = ref.get_tensor(f"{moe}experts.{e}.{down}.weight")
                equal.append(torch.equal(expert.linear_fc2.weight.data, want))
            if spec.get("shared_ffn"):
                want = ref.get_tensor(f"{moe}{spec['hf_shared']}.down_proj.weight")
                equal.append(torch.equal(layer.mlp.shared_experts.linear_fc2.weight.data, want))
        else:
            want = ref.get_tensor(f"model.layers.{g}.mlp.down_proj.weight")
            equal.append(torch.equal(layer.mlp.linear_fc2.weight.data, want))
    if spec.get("mtp_layers") and parallel_state.is_pipeline_last_stage():
        for k, mtp in enumerate(model.mtp.layers):
            p = f"model.layers.{spec['layers'] + k}."
            pairs = [
                (mtp.eh_proj.weight, p + "eh_proj.weight"),
                (mtp.enorm.weight, p + "enorm.weight"),
                (mtp.final_layernorm.weight, p + "shared_head.norm.weight"),
                (mtp.transformer_layer.self_attention.linear_kv_up_proj.weight,
                 p + "self_attn.kv_b_proj.weight"),
                (mtp.transformer_layer.mlp.router.expert_bias,
                 p + "mlp.gate.e_score_correction_bias"),
            ]  # fmt: skip
            for got, name in pairs:
                equal.append(torch.equal(got.data.float(), ref.get_tensor(name).float()))
    if parallel_state.is_pipeline_first_stage():
        emb = model.embedding.word_embeddings.weight.data[: spec["vocab"]]
        equal.append(torch.equal(emb, ref.get_tensor("model.embed_tokens.weight")))
    if parallel_state.is_pipeline_last_stage():
        head = "model.embed_tokens.weight" if spec["tied"] else "lm_head.weight"
        out = model.shared_embedding_or_output_weight() if spec["tied"] else None
        out = model.output_layer.weight if out is None else out
        equal.append(torch.equal(out.data[: spec["vocab"]], ref.get_tensor(head)))
    rows: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(
        rows, {"stage": stage, "layers": len(model.decoder.layers), "equal": equal}
    )
    return {"dir": str(mg), "stages": rows}


def _metadata() -> dict:  # type: ignore[type-arg]
    """What Megatron-LM passes to ``sharded_state_dict``: mcore 0.16.1 reads ``dp_cp_group``
    to tie the embedding copy an MTP stage holds (it raises without one)."""
    from megatron.core import parallel_state

    return {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def _local_rows(att) -> int:  # type: ignore[no-untyped-def]
    """This TP rank's rows of the fused qkv (or, MLA, of linear_q_up_proj)."""
    lin = att.linear_qkv if hasattr(att, "linear_qkv") else att.linear_q_up_proj
    return int(lin.weight.shape[0])


def _padding_is_zero(model, vocab: int) -> bool:  # type: ignore[no-untyped-def]
    """Every embedding row past the HF vocabulary is zero, over all TP ranks' local rows."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    w = model.embedding.word_embeddings.weight
    start = parallel_state.get_tensor_model_parallel_rank() * w.shape[0]
    ok = torch.tensor([int(bool((w[max(0, vocab - start) :] == 0).all()))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


if __name__ == "__main__":
    main(sys.argv[1:])
