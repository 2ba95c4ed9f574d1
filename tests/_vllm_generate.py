"""Run by a Python that has vLLM (``pytest -m vllm``): greedy tokens from one model directory.

    python _vllm_generate.py MODEL_DIR LOAD_FORMAT TP  ->  prints {"tokens": [[...], ...]}

Prompts are token ids (the tiny test checkpoints have no tokenizer). Nothing from shardctl is
imported: this is vLLM's own loader reading the directory.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, load_format, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's CPU workers bind threads per NUMA node; one node here: one core range per rank
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // tp)
        ranges = [cores[(i * per) % len(cores) : (i * per) % len(cores) + per] for i in range(tp)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(f"{r[0]}-{r[-1]}" for r in ranges)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        load_format=load_format,
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
        # on the CPU backend the fraction of host memory the engine may claim at start-up
        gpu_memory_utilization=0.05,
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in ([1, 5, 9, 13, 2], [7, 3, 11])]
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    outs = llm.generate(prompts, params)
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs]}))


if __name__ == "__main__":
    main()
