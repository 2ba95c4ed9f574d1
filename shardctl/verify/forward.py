"""The forward level: run the sharded checkpoint as a sharded model and compare its logits.

Where the ranks run::

    device cpu                      one process per rank, gloo
    device cuda, GPUs >= ranks      one process per rank, NCCL, rank r on cuda:r
    device cuda, GPUs <  ranks      simulation: every rank a thread of this process on cuda:0

The reference is transformers' own model class loaded from SRC: once in the checkpoint's dtype
(the *unsharded* model, whose error is the dtype's own noise) and once upcast to float64 (the
*reference*). The tolerance is a multiple of that noise (see ``metrics``). A SRC that is itself
a shardctl layout is first reassembled into a temporary HF directory (``reference``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardctl.errors import EnvironmentFailure
from shardctl.verify import metrics, routing
from shardctl.verify.adapters import adapter_for
from shardctl.verify.launch import ProcessWorld, run_processes, run_threads, starting_world
from shardctl.verify.rank import RankJob, RankOutcome, input_ids
from shardctl.verify.result import LevelResult
from shardctl.verify.routing import Routing
from shardctl.verify.sharded import ShardedCheckpoint
from shardctl.verify.tp_model import implementations

BATCH = 4
SEQ_LEN = 32


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise EnvironmentFailure(
            "--device cuda: no CUDA device is available", hint="use --device cpu or auto"
        )
    return device


def plan_run(device: str, world: int, simulate: bool | None) -> dict[str, Any]:
    """Where the ranks run: backend, whether simulated, and each rank's device."""
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if simulate is None:
        simulate = device == "cuda" and gpus < world
    backend = "threads" if simulate else ("nccl" if device == "cuda" else "gloo")
    return {
        "device": device,
        "backend": backend,
        "world_size": world,
        "simulated": simulate,
        "gpus": gpus,
        "torch": torch.__version__,
    }


def make_jobs(ck: ShardedCheckpoint, *, device: str, simulated: bool, seed: int) -> list[RankJob]:
    mesh = ck.layout.mesh
    seq = min(SEQ_LEN, _max_positions(ck.config))
    jobs = []
    for rank in range(ck.world):
        pp = rank // (mesh.ep * mesh.tp)
        stage = ck.layout.stages[pp]
        first, count = (stage.layers[0], stage.num_layers) if stage.layers else (0, 0)
        dev = "cpu" if device == "cpu" else ("cuda:0" if simulated else f"cuda:{rank}")
        jobs.append(
            RankJob(
                rank=rank,
                topo=(mesh.pp, mesh.ep, mesh.tp),
                config=ck.config,
                files=tuple(str(f) for f in ck.files.get(rank, ())),
                first_layer=first,
                num_layers=count,
                device=dev,
                seed=seed,
                batch=BATCH,
                seq_len=seq,
            )
        )
    return jobs


def _max_positions(cfg: dict[str, Any]) -> int:
    return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or SEQ_LEN)


def run_sharded(
    jobs: list[RankJob], env: dict[str, Any], world: ProcessWorld | None = None
) -> list[RankOutcome]:
    if any(j.num_layers == 0 for j in jobs):
        raise EnvironmentFailure("forward level cannot run a pipeline stage with no layers")
    if env["simulated"]:
        return run_threads(jobs)
    if world is not None:
        return world.run(jobs)
    return run_processes(jobs, backend=env["backend"])


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No transformers progress bar ("Loading weights") in verify's output; restored after.

    Uses transformers' own switch (``transformers.utils.logging``), which its tqdm bars obey.
    """
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@dataclass
class Reference:
    """SRC's unsharded model on the job's input: its logits in the checkpoint dtype and in
    float64, and (MoE) the float64 model's expert choices that both other runs are pinned to."""

    unsharded: torch.Tensor
    reference: torch.Tensor
    dtype: str
    routing: Routing = field(default_factory=dict)
    flips: int = 0  # token-layer choices the unpinned dtype model would have made differently


def _dequantized_reference(path: Path, config: dict[str, Any]) -> nn.Module:
    """The unsharded model with every quantized weight dequantized (shardctl/quant/dequant.py):
    the reference a rank's dequantized shards must reproduce. Written as a temporary BF16
    checkpoint and loaded by ``from_pretrained``, so transformers maps on-disk names (per-expert
    tensors) to its in-memory modules exactly as for an unquantized SRC."""
    import json

    from safetensors.torch import save_file

    from shardctl.io.tempdirs import owned_tempdir
    from shardctl.quant.dequant import dequantize, model_dtype, without_quant
    from shardctl.verify.rank import read_tensors

    files = tuple(str(f) for f in sorted(Path(path).glob("*.safetensors")))
    state = dequantize(read_tensors(files), config, model_dtype(config))
    with owned_tempdir("shardctl-verify-dequant-") as out:
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
        del state
        (out / "config.json").write_text(json.dumps(without_quant(config)))
        return _auto(config).from_pretrained(out, dtype="auto", **implementations(config))


def _auto(config: dict[str, Any]) -> Any:
    """The transformers auto class that builds the family's unsharded reference
    (``ForwardSpec.reference_auto``)."""
    import transformers

    return getattr(transformers, adapter_for(str(config.get("model_type"))).reference_auto)


def reference_logits(src: Path, job: RankJob, figures: dict[str, Any] | None = None) -> Reference:
    """Run SRC unsharded (an HF checkpoint, or a shardctl layout merged first; ``figures`` gets
    how and how long): float64 first, recording MoE routing, then the checkpoint dtype with that
    routing imposed (verify/routing.py says why)."""
    from shardctl.verify.reference import hf_reference

    with hf_reference(src, figures) as path, quiet_transformers():
        try:
            model: nn.Module
            if job.config.get("quantization_config") is not None:
                model = _dequantized_reference(path, job.config)
            else:
                model = _auto(job.config).from_pretrained(
                    path, dtype="auto", **implementations(job.config)
                )
        except (OSError, ValueError) as exc:
            raise EnvironmentFailure(
                f"could not load the reference model: {exc}", where=str(src)
            ) from exc
    device = torch.device(job.device)
    model = model.to(device).eval()
    dtype = next(model.parameters()).dtype
    spec = adapter_for(str(job.config.get("model_type")))
    layers = model.get_submodule(spec.reference_layers or spec.layer_prefix)
    assert isinstance(layers, nn.ModuleList)
    ids = input_ids(job.seed, job.batch, job.seq_len, int(job.config["vocab_size"])).to(device)
    chosen: Routing = {}
    own: Routing = {}
    with torch.inference_mode():
        # bf16/fp16/fp32 -> float64 -> back is exact, so one loaded copy serves both runs
        model = model.to(torch.float64)
        with routing.record(layers, chosen):
            reference = model(input_ids=ids, use_cache=False).logits.to("cpu", torch.float64)
        model = model.to(dtype)
        with routing.pin(
            layers,
            chosen,
            normalize=routing.normalizes(job.config),
            own=own,
            weigh=routing.weigher(job.config),
        ):
            unsharded = model(input_ids=ids, use_cache=False).logits.to("cpu", torch.float64)
    return Reference(
        unsharded,
        reference,
        str(dtype).removeprefix("torch."),
        chosen,
        routing.disagreements(chosen, own),
    )


def compare(
    level: LevelResult, sharded: torch.Tensor, unsharded: torch.Tensor, reference: torch.Tensor
) -> dict[str, Any]:
    """Fill ``level`` with figures, one row per figure, and the verdict; return tolerances."""
    if sharded.shape != reference.shape:
        level.fail(f"sharded logits {list(sharded.shape)} vs {list(reference.shape)} expected")
        return {}
    err_s = metrics.errors(sharded, reference)
    err_u = metrics.errors(unsharded, reference)
    limit = metrics.bounds(err_u, reference)
    over = metrics.within(err_s, limit)
    level.figures.update(
        sharded=err_s.as_dict(),
        unsharded=err_u.as_dict(),
        bounds=limit,
        sharded_vs_unsharded=metrics.errors(sharded, unsharded).as_dict(),
    )
    rows = []
    for m, value in err_s.as_dict().items():
        rows.append(
            {
                "figure": m,
                "sharded": value,
                "unsharded": err_u.as_dict()[m],
                "bound": limit[m],
                "status": "fail" if m in over else "pass",
            }
        )
    level.rows = [*level.rows, *rows]
    if over:
        worst = over[0]
        level.fail(
            f"sharded logits differ from the float64 reference beyond the dtype's noise: "
            f"{worst} {err_s.as_dict()[worst]:.3g} > bound {limit[worst]:.3g} "
            f"({metrics.MULTIPLES[worst]:g}× the unsharded model's {err_u.as_dict()[worst]:.3g} "
            f"+ floor)"
        )
    return {"multiples": metrics.MULTIPLES, "floors": metrics.FLOORS, "bounds": limit}


_FQN = re.compile(r"^([\w.]+): ")


def check_forward(
    src: Path,
    ck: ShardedCheckpoint,
    *,
    device: str = "auto",
    seed: int = 0,
    simulate: bool | None = None,
    world: ProcessWorld | None = None,
) -> tuple[LevelResult, dict[str, Any], dict[str, Any]]:
    """Run the forward level: (level result, tolerances, environment).

    ``simulate`` forces (True) or forbids (False) the one-process simulation; ``world`` reuses
    running worker processes (tests run many layouts on one process group).
    """
    t0 = time.perf_counter()
    level = LevelResult("forward")
    dev = resolve_device(device)
    env = plan_run(dev, ck.world, simulate)
    jobs = make_jobs(ck, device=dev, simulated=env["simulated"], seed=seed)
    with ExitStack() as stack:
        ready = None
        early = env["backend"] == "gloo" and not env["simulated"]
        if world is None and early and all(j.num_layers for j in jobs):
            # CPU ranks start (imports, process group) while the reference runs; GPU ranks
            # after it, so the reference's float64 copy never shares a device with a rank
            ready = stack.enter_context(
                starting_world(
                    len(jobs),
                    backend=env["backend"],
                    model_type=str(jobs[0].config.get("model_type")),
                )
            )
        t1 = time.perf_counter()
        ref = reference_logits(src, jobs[0], level.figures)
        level.figures.update(dtype=ref.dtype, reference_s=time.perf_counter() - t1)
        if ref.routing:
            jobs = [replace(j, routing=ref.routing) for j in jobs]
            level.figures.update(
                routing="pinned to the float64 reference's expert choices",
                moe_layers=len(ref.routing),
                routing_ties_flipped=ref.flips,
            )
        outcomes = run_sharded(jobs, env, world if ready is None else ready())
    level.figures.update(
        seed=seed,
        batch=jobs[0].batch,
        seq_len=jobs[0].seq_len,
        load_s=max(o.load_s for o in outcomes),
        forward_s=max(o.forward_s for o in outcomes),
    )
    for o in outcomes:
        for problem in o.problems:
            m = _FQN.match(problem)
            level.fail(
                problem[m.end() :] if m else problem, fqn=m.group(1) if m else None, rank=o.rank
            )
    tolerances: dict[str, Any] = {}
    if not level.findings:
        logits = next((o.logits for o in outcomes if o.logits is not None), None)
        if logits is None:
            raise EnvironmentFailure("no rank returned logits (internal: output rank missing)")
        tolerances = compare(level, logits, ref.unsharded, ref.reference)
    level.seconds = time.perf_counter() - t0
    return level.close(), tolerances, env
