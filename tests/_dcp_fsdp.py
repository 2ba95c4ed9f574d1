"""Real FSDP2 training checkpoints for the DCP tests: one process per rank, gloo, CPU.

``python -m tests._dcp_fsdp save,HF,CKPT,WORLD,DUMP [load,...]`` runs jobs in turn (imports are
paid once: ranks are forked from this process). ``save``: load HF, ``fully_shard`` every decoder
layer and the model on WORLD ranks, take two AdamW steps, ``dcp.save`` model + optimizer as
``get_state_dict`` returns them. ``load HF CKPT WORLD DUMP``: build the model from HF's config on
WORLD ranks, ``dcp.load`` + ``set_state_dict``. Both then write (rank 0) the full state dict —
parameters, moments, step, param_groups — to DUMP with ``torch.save``, for a bitwise compare.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any


def _run(rank: int, mode: str, hf: str, ckpt: str, world: int, dump: str, store: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = AutoConfig.from_pretrained(hf)
    if mode == "save":
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    else:
        torch.manual_seed(1234)  # different weights: everything must come from the checkpoint
        model = AutoModelForCausalLM.from_config(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    if mode == "save":
        for step in range(2):
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=ckpt)
    else:
        msd, osd = get_state_dict(model, opt)
        sd: dict[str, Any] = {"model": msd, "optimizer": osd}
        dcp.load(sd, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    fm, fo = get_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": fm, "optimizer": fo}, dump)
    dist.barrier()
    dist.destroy_process_group()


def main(jobs: list[str]) -> None:
    import torch.distributed.checkpoint  # noqa: F401 - imported once, before forking
    import torch.multiprocessing as mp
    import transformers  # noqa: F401

    for job in jobs:
        mode, hf, ckpt, world, dump = job.split(",")
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            mp.start_processes(
                _run,
                args=(mode, hf, ckpt, int(world), dump, store),
                nprocs=int(world),
                start_method="fork",
            )


if __name__ == "__main__":
    main(sys.argv[1:])
