"""Run by a Python that has vLLM (``pytest -m vllm``): the state dict vLLM's ``sharded_state``
loader would fill for one HF model directory, with the values vLLM's own weight loaders put in.

    python _vllm_state.py HF_DIR OUT_DIR  ->  OUT_DIR/state.safetensors

vLLM (tp 1, engine in this process) loads HF_DIR with ``load_format="auto"``; right after its
weight loading and before ``process_weights_after_loading`` (where the CPU backend repacks linear
and expert weights for its kernels, or drops them), ``ShardedStateLoader._filter_subtensors(
model.state_dict())`` — exactly the dict ``ShardedStateLoader.load_weights`` fills — is saved.
Nothing from shardctl is imported.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model lives in this process
    import vllm.model_executor.model_loader.base_loader as base
    from safetensors.torch import save_file
    from vllm import LLM
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    process = base.process_weights_after_loading

    def snapshot(m, *args, **kwargs):  # type: ignore[no-untyped-def]
        state = ShardedStateLoader._filter_subtensors(m.state_dict())
        os.makedirs(out, exist_ok=True)
        tensors = {n: t.detach().clone().contiguous() for n, t in state.items()}
        save_file(tensors, os.path.join(out, "state.safetensors"))
        return process(m, *args, **kwargs)

    base.process_weights_after_loading = snapshot
    LLM(
        model=model,
        load_format="auto",
        tensor_parallel_size=1,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
        gpu_memory_utilization=0.05,
    )


if __name__ == "__main__":
    main()
