"""A real DeepSpeed ZeRO-2 checkpoint for the ZeRO-input test (needs ``deepspeed``).

``python -m tests._deepspeed_zero HF OUT WORLD DUMP``: WORLD gloo ranks (forked) train HF's
model under ZeRO-2 with torch's AdamW for two steps and ``save_checkpoint(OUT)``; rank 0 then
writes DUMP: every parameter's full fp32 master weight and Adam moments as DeepSpeed's own
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` gather them from the live
engine — the oracle the converted checkpoint is compared with.
"""

from __future__ import annotations

import importlib
import os
import sys


def _run(rank: int, hf: str, out: str, world: int, dump: str, port: str) -> None:
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (C++, ~30 s on 2 idle
    # cores, ~90 s beside another test worker) on a machine without its build cache; gloo's
    # all-reduce gives the same sums for two ranks, and the checkpoint is what is under test.
    # (by sys.modules: the package's attribute ``torch`` is torch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
    )
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = AutoConfig.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_cfg
    )
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(out)
    oracle = {}
    for name, p in engine.module.named_parameters():
        oracle[f"model.{name}"] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            oracle[f"optimizer.state.{name}.{key}"] = safe_get_full_optimizer_state(p, key).clone()
    if rank == 0:
        torch.save(oracle, dump)
    torch.distributed.barrier()


def main(hf: str, out: str, world: str, dump: str) -> None:
    import socket

    import deepspeed  # noqa: F401 - imported once, before forking
    import torch.multiprocessing as mp
    import transformers  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    try:
        mp.start_processes(
            _run, args=(hf, out, int(world), dump, port), nprocs=int(world), start_method="fork"
        )
    finally:
        # DeepSpeed's CPU all-reduce leaves one shared-memory buffer per rank (~66 MB each)
        # named after the port; a test run must not leave them in /dev/shm.
        import glob

        for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            os.unlink(leftover)


if __name__ == "__main__":
    main(*sys.argv[1:])
