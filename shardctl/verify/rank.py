"""One rank of the forward level: load its files, build its model, run its stage.

A :class:`RankJob` is plain JSON-able data, so the same job runs in a spawned process, under
``torchrun``, or as a thread of the in-process simulation. Pipeline stages pass activations::

    stage 0:  ids -> embeddings -> layers[a..b] -> send h to (pp+1, same ep, same tp)
    stage k:  recv h -> layers[c..d] -> send
    last:     recv h -> layers -> norm -> lm_head (all-gather over tp) -> logits

A later stage runs transformers' own model forward with ``inputs_embeds`` (so masks and rotary
embeddings come from the model itself) and swaps the received activations in with a pre-hook
on its first layer.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from shardctl.verify import routing
from shardctl.verify.comm import Comm, Topology
from shardctl.verify.routing import Routing
from shardctl.verify.tp_model import Role, build_rank_model


@dataclass(frozen=True)
class RankJob:
    rank: int  # model-parallel rank, ordered (pp, ep, tp)
    topo: tuple[int, int, int]  # pp, ep, tp
    config: dict[str, Any]
    files: tuple[str, ...]
    first_layer: int
    num_layers: int
    device: str
    seed: int
    batch: int
    seq_len: int
    # MoE expert choices of the float64 reference, imposed on this rank (verify/routing.py)
    routing: Routing | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.routing is not None:  # JSON object keys are strings
            data["routing"] = {str(k): v for k, v in self.routing.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankJob:
        data = dict(data)
        data["topo"] = tuple(data["topo"])
        data["files"] = tuple(data["files"])
        if data.get("routing") is not None:
            data["routing"] = {int(k): v for k, v in data["routing"].items()}
        return cls(**data)


@dataclass
class RankOutcome:
    rank: int
    problems: list[str] = field(default_factory=list)
    logits: torch.Tensor | None = None  # only on (last stage, ep 0, tp 0)
    load_s: float = 0.0
    forward_s: float = 0.0


def input_ids(seed: int, batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    """The seeded random token ids every rank (and the reference) feeds."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len), generator=g)


def read_tensors(files: tuple[str, ...]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def compute_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The checkpoint's floating dtype (the one most elements have)."""
    count: dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.is_floating_point():
            count[t.dtype] = count.get(t.dtype, 0) + t.numel()
    return max(count, key=lambda k: count[k]) if count else torch.float32


def run_rank(job: RankJob, comm: Comm) -> RankOutcome:
    topo = Topology(*job.topo)
    pp, ep, tp = topo.coord(job.rank)
    role = Role(
        rank=job.rank,
        pp=pp,
        ep=ep,
        tp=tp,
        pp_size=topo.pp,
        ep_size=topo.ep,
        tp_size=topo.tp,
        first_layer=job.first_layer,
        num_layers=job.num_layers,
    )
    outcome = RankOutcome(job.rank)
    t0 = time.perf_counter()
    device = torch.device(job.device)
    built = None
    try:
        tensors = read_tensors(job.files)
        config = job.config
        if config.get("quantization_config") is not None:
            # each rank dequantizes what it holds: a misplaced scale gives wrong weights here
            from shardctl.quant.dequant import dequantize, model_dtype, without_quant

            tensors = dequantize(tensors, config, model_dtype(config))
            config = without_quant(config)
        built = build_rank_model(
            config, role, tensors, comm, dtype=compute_dtype(tensors), device=device
        )
        outcome.problems = built.problems
    except Exception as exc:  # reported by every rank's agreement below, never left hanging
        outcome.problems = [f"could not build its model: {type(exc).__name__}: {exc}"]
    if not comm.agree(not outcome.problems) or built is None or built.model is None:
        return outcome
    outcome.load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.inference_mode():
        outcome.logits = _run_stage(job, role, built.model, built.adapter.layer_prefix, comm)
    outcome.forward_s = time.perf_counter() - t1
    return outcome


def _run_stage(
    job: RankJob, role: Role, model: nn.Module, layer_prefix: str, comm: Comm
) -> torch.Tensor | None:
    topo = Topology(*job.topo)
    device = torch.device(job.device)
    vocab = int(job.config["vocab_size"])
    hidden = int(job.config.get("hidden_size") or job.config["n_embd"])
    ids = input_ids(job.seed, job.batch, job.seq_len, vocab).to(device)
    layers = model.get_submodule(layer_prefix)
    assert isinstance(layers, nn.ModuleList)
    dtype = next(model.parameters()).dtype
    shape = (job.batch, job.seq_len, hidden)
    handles = []
    captured: list[torch.Tensor] = []
    if not role.first_stage:
        prev = topo.rank(role.pp - 1, role.ep, role.tp)
        received = comm.recv(torch.empty(shape, dtype=dtype, device=device), prev)

        def swap_in(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args:
                return (received, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": received}

        handles.append(layers[0].register_forward_pre_hook(swap_in, with_kwargs=True))
    if not role.last_stage:

        def capture(_m: nn.Module, _a: Any, output: Any) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)

        handles.append(layers[len(layers) - 1].register_forward_hook(capture))
    pinned = routing.pin(
        layers,
        job.routing or {},
        normalize=routing.normalizes(job.config),
        first_layer=job.first_layer,
        weigh=routing.weigher(job.config),
    )
    try:
        with pinned:
            if role.first_stage:
                out = model(input_ids=ids, use_cache=False)
            else:
                zeros = torch.zeros(shape, dtype=dtype, device=device)
                out = model(inputs_embeds=zeros, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if not role.last_stage:
        comm.send(captured[-1], topo.rank(role.pp + 1, role.ep, role.tp))
        return None
    if role.ep == 0 and role.tp == 0:
        return out.logits.detach().to("cpu", torch.float64)  # exact for every float dtype
    return None
