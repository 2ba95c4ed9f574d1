"""The peers shardctl is measured against (bench/reshard.py runs them); Llama TP rules only.

python bench/peers.py naive-split  SRC DST TP    load everything, chunk, save per rank
python bench/peers.py naive-merge  SRC DST       load every rank file, cat, save
python bench/peers.py stream-split SRC DST TP    safe_open().get_slice per rank
python bench/peers.py dcp-split    SRC DST TP    (under torchrun, TP processes) DTensor load
                                                  from HF through DCP, DCP save
python bench/peers.py hf-resave    SRC DST       transformers from_pretrained + save_pretrained
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROW = (".o_proj.weight", ".down_proj.weight")  # S(1): rowwise
REPL = ("norm.weight",)  # R


def dim_of(name: str) -> int | None:
    if name.endswith(REPL):
        return None
    return 1 if name.endswith(ROW) else 0


def shards(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors"))


def naive_split(src: Path, dst: Path, tp: int) -> None:
    from safetensors.torch import load_file, save_file

    state = {}
    for f in shards(src):
        state.update(load_file(f))
    dst.mkdir()
    for r in range(tp):
        part = {}
        for k, v in state.items():
            d = dim_of(k)
            part[k] = v if d is None else v.chunk(tp, dim=d)[r].contiguous()
        save_file(part, dst / f"rank-{r:05d}-of-{tp:05d}.safetensors", metadata={"format": "pt"})


def naive_merge(src: Path, dst: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    ranks = [load_file(f) for f in shards(src)]
    out = {}
    for k in ranks[0]:
        d = dim_of(k)
        out[k] = ranks[0][k] if d is None else torch.cat([r[k] for r in ranks], dim=d)
    dst.mkdir()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})


def stream_split(src: Path, dst: Path, tp: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir()
    for r in range(tp):
        part = {}
        for f in shards(src):
            with safe_open(f, framework="pt") as fh:
                for k in fh.keys():
                    sl = fh.get_slice(k)
                    shape = sl.get_shape()
                    d = dim_of(k)
                    if d is None:
                        part[k] = fh.get_tensor(k)
                        continue
                    n = shape[d] // tp
                    idx = [slice(None)] * len(shape)
                    idx[d] = slice(r * n, (r + 1) * n)
                    part[k] = sl[tuple(idx)].contiguous()
        save_file(part, dst / f"rank-{r:05d}-of-{tp:05d}.safetensors", metadata={"format": "pt"})


def dcp_split(src: Path, dst: Path, tp: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (tp,))
    rank = dist.get_rank()
    state = {}
    for f in shards(src):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for k, info in header.items():
            if k == "__metadata__":
                continue
            shape = list(info["shape"])
            dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[
                info["dtype"]
            ]
            d = dim_of(k)
            local = list(shape)
            if d is not None:
                local[d] //= tp
            t = torch.empty(local, dtype=dtype)
            place = [Replicate()] if d is None else [Shard(d)]
            state[k] = DTensor.from_local(
                t,
                mesh,
                place,
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(src)))
    dcp.save(state, storage_writer=FileSystemWriter(str(dst)))
    dist.barrier()
    if rank == 0:
        print("dcp ok", file=sys.stderr)
    dist.destroy_process_group()


def hf_resave(src: Path, dst: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(dst)


def main() -> None:
    cmd, src, dst, *rest = sys.argv[1:]
    fn = {
        "naive-split": naive_split,
        "naive-merge": naive_merge,
        "stream-split": stream_split,
        "dcp-split": dcp_split,
        "hf-resave": hf_resave,
    }[cmd]
    fn(Path(src), Path(dst), *map(int, rest))  # type: ignore[operator]
    os.sync() if os.environ.get("PEER_SYNC") else None


if __name__ == "__main__":
    main()
