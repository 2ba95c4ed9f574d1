"""Build one rank of the sharded model from transformers' own classes and the rank's tensors.

Steps (all on the rank's own files; nothing global is ever materialized)::

    local config  ->  from_config (eager attention)  ->  local GPT-2 attention / local experts
                  ->  load local tensors by on-disk name  ->  wrap parallel modules

Loading is strict: every parameter this rank's stage uses must come from its files with exactly
the shape a correct tensor-parallel rank has, and every tensor in its files must land somewhere.
A mismatch is a *finding* (the layout does not compute as the model does), not a crash.
"""

from __future__ import annotations

import fnmatch
import importlib
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardctl.archs import find
from shardctl.verify.adapters import Adapter, Dims, adapter_for, dims_of, local_config
from shardctl.verify.comm import Comm
from shardctl.verify.parallel import (
    GatherHead,
    LocalExperts,
    RowParallel,
    StackedLocalExperts,
    VocabParallelEmbedding,
)

# transformers sets the process-wide default dtype while it builds a model, and imports model
# modules lazily: simulated ranks (threads) build one at a time, after warm_imports().
_BUILD_LOCK = threading.Lock()


def implementations(cfg: dict[str, Any]) -> dict[str, str]:
    """Eager attention (and eager experts: the grouped kernels lack float64) everywhere."""
    impl = {"attn_implementation": "eager"}
    family = find(str(cfg.get("model_type")))
    experts = family is not None and family.forward is not None and family.forward.experts
    if cfg.get("num_local_experts") or cfg.get("num_experts") or experts:
        impl["experts_implementation"] = "eager"
    return impl


def modeling_module(model_type: str) -> str:
    """The transformers module of ``model_type``'s classes: ``qwen3_moe`` ->
    ``transformers.models.qwen3_moe.modeling_qwen3_moe`` (gemma3_text, llama4_text: their
    modules are models.gemma3, models.llama4)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    return f"transformers.models.{module}.modeling_{module}"


def warm_imports(model_type: str) -> None:
    """Import transformers' classes for ``model_type`` now, in the calling thread."""
    import transformers

    transformers.AutoConfig  # noqa: B018 (resolves the lazy attribute)
    transformers.AutoModelForCausalLM  # noqa: B018
    importlib.import_module(modeling_module(model_type))


@dataclass
class RankModel:
    """A built rank: the model (``None`` when loading failed) and what went wrong."""

    model: nn.Module | None
    adapter: Adapter
    first_layer: int
    num_layers: int
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Role:
    rank: int
    pp: int
    ep: int
    tp: int
    pp_size: int
    ep_size: int
    tp_size: int
    first_layer: int
    num_layers: int

    @property
    def first_stage(self) -> bool:
        return self.pp == 0

    @property
    def last_stage(self) -> bool:
        return self.pp == self.pp_size - 1


def build_rank_model(
    cfg: dict[str, Any],
    role: Role,
    tensors: dict[str, torch.Tensor],
    comm: Comm,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> RankModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    ad = adapter_for(str(cfg.get("model_type")))
    d = dims_of(cfg)
    out = RankModel(None, ad, role.first_layer, role.num_layers)
    vocab_rows, vocab_sharded = _vocab(ad, d, tensors)
    local = local_config(
        cfg,
        tp=role.tp_size,
        ep=role.ep_size,
        first_layer=role.first_layer,
        num_layers=role.num_layers,
        vocab=vocab_rows,
    )
    local.pop("architectures", None)
    model_type = local.pop("model_type")
    config = AutoConfig.for_model(model_type, **local)
    config._attn_implementation = "eager"
    with _BUILD_LOCK, torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **implementations(cfg))
        if ad.localize is not None:
            ad.localize(model, config, d, role.tp_size, role.ep_size, dtype)
    model.eval()
    out.problems = _load(model, ad, d, role, tensors)
    if out.problems:
        return out
    _wrap(model, ad, d, role, comm, vocab_rows=vocab_rows, vocab_sharded=vocab_sharded)
    out.model = model
    return out


def _vocab(ad: Adapter, d: Dims, tensors: dict[str, torch.Tensor]) -> tuple[int, bool]:
    """Local vocab rows and whether the vocab is split over tp (rows < V)."""
    by_param = {ad.param(k): v for k, v in tensors.items()}
    for name in (f"{ad.embeddings[0]}.weight", f"{ad.lm_head}.weight"):
        if name in by_param and by_param[name].dim() == 2:
            rows = int(by_param[name].shape[0])
            return rows, rows < d.vocab_size
    return 1, False  # a middle pipeline stage: no embedding, no head


SKIP = ("", ())  # a tensor the forward does not compute with (the bitwise level checks it)
GATE, UP = "gate", "up"  # which half of a packed gate_up_proj [E, 2I, H]
TRANSPOSED = ("T",)  # a packed tensor stored [E, in, out]: loaded transposed (ExpertSpec)


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    """A parameter, or a persistent buffer saved with the weights (DeepSeek-V3's router bias)."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def _index(dest: torch.Tensor, index: tuple[Any, ...]) -> torch.Tensor:
    if index and index[-1] in (GATE, UP):
        half = dest.shape[1] // 2  # the local I: moe_intermediate_size / tp
        part = slice(0, half) if index[-1] == GATE else slice(half, 2 * half)
        index = (*index[:-1], part)
    return dest[index] if index else dest


def _target(fqn: str, ad: Adapter, d: Dims, role: Role) -> tuple[str, tuple[Any, ...]] | str:
    """On-disk fqn -> (local parameter name, index into it), or a reason it has no place here."""
    fqn = ad.param(fqn)
    m = ad.layer_re.match(fqn)
    if m is None:
        return fqn, ()
    layer, rest = int(m.group(1)), m.group(2)
    if d.num_layers <= layer < d.num_layers + d.mtp_layers:
        return SKIP  # an MTP layer: transformers' model neither builds nor runs it
    if not role.first_layer <= layer < role.first_layer + role.num_layers:
        last = role.first_layer + role.num_layers - 1
        return f"layer {layer} is outside this stage (layers {role.first_layer}..{last})"
    prefix = f"{ad.layer_prefix}.{layer - role.first_layer}"
    ex = ad.experts
    if ex is None:
        return f"{prefix}.{rest}", ()
    if rest == ex.router:
        return f"{prefix}.{ex.router_param}", ()
    for disk, memory in ex.aliases:
        if rest == disk:
            return f"{prefix}.{memory}", ()
    if rest in ex.transposed:
        return f"{prefix}.{rest}", TRANSPOSED
    regex = ex.regex
    e = regex.match(rest) if regex is not None else None
    if e is None:  # not an expert, or experts packed on disk as in memory
        return f"{prefix}.{rest}", ()
    per_rank = d.num_experts // role.ep_size
    expert = int(e.group(1)) - role.ep * per_rank
    if not 0 <= expert < per_rank:
        return f"expert {e.group(1)} belongs to another ep rank (ep={role.ep} holds {per_rank})"
    w = e.group(2)
    if w == ex.down:
        return f"{prefix}.{ex.module}.down_proj", (expert,)
    # transformers packs [gate; up] along dim 1 of gate_up_proj [E, 2I, H]; _load halves it
    return f"{prefix}.{ex.module}.gate_up_proj", (expert, GATE if w == ex.gate else UP)


def _required(model: nn.Module, ad: Adapter, role: Role) -> dict[int, str]:
    """id(param) -> name, for every parameter (and persistent buffer) this rank's stage
    computes with."""
    skip: list[str] = []
    if not role.first_stage:
        skip += [f"{e}." for e in ad.embeddings]
    if not role.last_stage:
        skip += [f"{ad.final_norm}.", f"{ad.lm_head}."]
    needed: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not any(name.startswith(s) for s in skip):
            needed.setdefault(id(p), name)
    for path, module in model.named_modules():  # persistent buffers are saved weights too
        for leaf, buf in module.named_buffers(recurse=False):
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                needed.setdefault(id(buf), f"{path}.{leaf}" if path else leaf)
    # A tied head on a later stage still needs the table, whatever name it goes by.
    if not role.first_stage and role.last_stage:
        head = model.get_parameter(f"{ad.lm_head}.weight")
        needed[id(head)] = f"{ad.lm_head}.weight"
    return needed


def _load(
    model: nn.Module, ad: Adapter, d: Dims, role: Role, tensors: dict[str, torch.Tensor]
) -> list[str]:
    problems: list[str] = []
    needed = _required(model, ad, role)
    covered: dict[int, int] = {}  # id(param) -> elements loaded
    misfit: set[int] = set()  # reported once, as a shape mismatch, not again as missing
    for fqn, t in tensors.items():
        if any(fnmatch.fnmatchcase(fqn, g) for g in ad.recomputed):
            continue  # an old file's buffer the model recomputes (the family file says which)
        target = _target(fqn, ad, d, role)
        if isinstance(target, str):
            problems.append(f"{fqn}: unexpected on rank {role.rank}: {target}")
            continue
        if target == SKIP:
            continue
        name, index = target
        if index == TRANSPOSED:
            t, index = t.transpose(-1, -2), ()
        try:
            param = _tensor(model, name)
        except AttributeError:
            problems.append(f"{fqn}: unexpected on rank {role.rank}: the model has no {name}")
            continue
        dest = _index(param.data, index)
        if tuple(dest.shape) != tuple(t.shape):
            problems.append(
                f"{fqn}: rank {role.rank} holds {list(t.shape)}, a tp={role.tp_size} "
                f"ep={role.ep_size} rank of {ad.arch} computes with {list(dest.shape)}"
            )
            misfit.add(id(param))
            continue
        with torch.no_grad():
            dest.copy_(t)
        covered[id(param)] = covered.get(id(param), 0) + t.numel()
    for pid, name in needed.items():
        param = _tensor(model, name)
        if pid not in misfit and covered.get(pid, 0) < param.numel():
            problems.append(f"{name}: missing on rank {role.rank} (its stage computes with it)")
    return problems


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


def _wrap_experts(
    mlp: nn.Module, leaf: str, experts: nn.Module, ex: Any, d: Dims, role: Role, comm: Comm
) -> None:
    """Replace ``mlp.<leaf>`` by this rank's experts of it (ids outside go nowhere)."""
    if role.tp != 0:  # added after the sum over tp: rank 0 adds it for all
        for name in ex.once:
            experts.get_parameter(name).data.zero_()
    per_rank = d.num_experts // role.ep_size
    first = role.ep * per_rank
    local: nn.Module = (
        StackedLocalExperts(experts, comm, first=first, count=per_rank, total=d.num_experts)
        if ex.call == "stacked"
        else LocalExperts(experts, comm, first=first, count=per_rank)
    )
    setattr(mlp, leaf, local)


def _wrap(
    model: nn.Module,
    ad: Adapter,
    d: Dims,
    role: Role,
    comm: Comm,
    *,
    vocab_rows: int,
    vocab_sharded: bool,
) -> None:
    layers = model.get_submodule(ad.layer_prefix)
    assert isinstance(layers, nn.ModuleList)
    for layer in layers:
        # A module a layer lacks is skipped: MoE families mix dense and sparse layers.
        for path in ad.row_parallel:
            parent_path, _, leaf = path.rpartition(".")
            parent = _submodule(layer, parent_path)
            if parent is not None and isinstance(getattr(parent, leaf, None), nn.Module):
                setattr(parent, leaf, RowParallel(getattr(parent, leaf), comm, conv1d=ad.conv1d))
        ex = ad.experts
        if ex is not None:
            mlp_path, _, leaf = ex.module.rpartition(".")
            mlp = _submodule(layer, mlp_path)
            experts = getattr(mlp, leaf, None) if mlp is not None else None
            if mlp is not None and isinstance(experts, nn.Module):
                _wrap_experts(mlp, leaf, experts, ex, d, role, comm)
        if ad.shard_layer is not None:
            ad.shard_layer(layer, comm, role.tp, role.tp_size, d)
    root, _, emb = ad.embeddings[0].rpartition(".")
    if vocab_sharded and role.first_stage:
        parent = model.get_submodule(root)
        start = role.tp * vocab_rows
        setattr(parent, emb, VocabParallelEmbedding(getattr(parent, emb), comm, start=start))
    if role.last_stage:
        weight = model.get_parameter(f"{ad.lm_head}.weight")
        bias = getattr(model.get_submodule(ad.lm_head), "bias", None)  # Phi-2: vocab-parallel
        setattr(
            model,
            ad.lm_head,
            GatherHead(weight, comm, vocab=d.vocab_size, sharded=vocab_sharded, bias=bias),
        )
    else:
        norm_root, _, norm = ad.final_norm.rpartition(".")
        setattr(model.get_submodule(norm_root), norm, nn.Identity())
        setattr(model, ad.lm_head, nn.Identity())
