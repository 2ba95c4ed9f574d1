"""What PyTorch's CUDA caching allocator adds to the weights an engine loads.

vLLM's "Model loading took 67.8 GiB" is ``torch.cuda.memory_allocated`` after the load
(``DeviceMemoryProfiler``: ``reset_peak_memory_stats`` then ``max_memory_allocated``), and
SGLang's "Load weight end. … mem usage" is free device memory before minus after
(``get_available_gpu_memory``: ``empty_cache`` then ``mem_get_info``, i.e. what the allocator
holds from CUDA). Neither is the checkpoint's byte count: the caching allocator
(c10/cuda/CUDACachingAllocator.cpp, default settings: no expandable segments, no
``max_split_size``, no power-of-two rounding) hands out blocks, not bytes:

- a request is rounded up to 512 bytes (``round_size``);
- up to 1 MiB it comes from the small pool, carved out of 2 MiB segments (``kSmallBuffer``);
- above 1 MiB and under 10 MiB from 20 MiB segments (``kLargeBuffer``); from 10 MiB on from a
  segment of its own, rounded up to 2 MiB (``kRoundLarge``);
- a free block is taken best fit (the smallest that holds the request) and split only if what
  is left is over 1 MiB in the large pool (``should_split``: ``remaining > kSmallSize``), at
  least 512 bytes in the small pool; an unsplit block is allocated whole, and
  ``memory_allocated`` counts the block (``allocated_bytes += block->size``).

So a tensor-parallel slice whose size is an odd number of MiB (Qwen2.5-72B's ``down_proj`` at
tp 2: ``[8192, 14784]`` bf16, 231 MiB) occupies 232 MiB: 80 MiB over its 80 layers, the
difference between shardctl's 67.71 GiB of weights and vLLM's logged 67.8.

The engines load their own parameters, not the checkpoint's tensors: vLLM and SGLang fuse
``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``
(``packed_modules_mapping``), and every expert of a layer into ``w13``/``w2`` (``FusedMoE``),
each with its own scales. Which tensor joins which parameter is the family's vLLM declaration
(:class:`ParamNames`); the sizes priced here are those fused parameters, each the sum of its
members' bytes on the rank.
"""

from __future__ import annotations

import re
import weakref
from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from shardctl.dtypes import nbytes
from shardctl.errors import ShardctlError
from shardctl.layout.types import LayoutOptions, Mesh, Stage
from shardctl.model.types import ModelInfo

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of this
SMALL_SIZE = 2**20  # kSmallSize: largest request of the small pool; larger remainders split
SMALL_BUFFER = 2 * 2**20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 * 2**20  # kLargeBuffer: the segment of a request under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc: from here a request gets its own segment
ROUND_LARGE = 2 * 2**20  # kRoundLarge: such a segment's size is a multiple of this


@dataclass
class CachingAllocator:
    """PyTorch's CUDA caching allocator with its default settings, for a run of allocations
    that are never freed (a model's parameters as it loads): ``allocated`` is what
    ``torch.cuda.memory_allocated`` reports after them, ``reserved`` what
    ``torch.cuda.memory_reserved`` does (the segments taken from CUDA).

    >>> a = CachingAllocator()
    >>> a.malloc(231 * 2**20)  # remainder of its 232 MiB segment is 1 MiB: not split
    243269632
    >>> a.malloc(12 * 2**20 + 2**19)  # 12.5 MiB in a 14 MiB segment: 1.5 MiB split off
    13107200
    >>> a.allocated // 2**20, a.reserved // 2**20
    (244, 246)
    """

    allocated: int = 0
    reserved: int = 0

    def __post_init__(self) -> None:
        # free block sizes per pool (small, large), kept sorted: best fit is bisect_left
        self._free: tuple[list[int], list[int]] = ([], [])

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; the bytes of the block it occupies (0 for an empty tensor)."""
        if nbytes <= 0:
            return 0  # a zero-size tensor holds no block
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL_SIZE
        pool = self._free[0 if small else 1]
        i = bisect_left(pool, size)
        if i < len(pool):
            block = pool.pop(i)
        else:
            block = _segment(size)
            self.reserved += block
        rest = block - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            insort(pool, rest)
            block = size
        self.allocated += block
        return block


def _segment(size: int) -> int:
    """``get_allocation_size``: the segment CUDA is asked for when no free block holds ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def load_extra(sizes: Iterable[int], *, reserved: bool) -> int:
    """What the allocator holds beyond ``sizes`` once all are allocated in order: allocated
    (vLLM's measure) or reserved (SGLang's) minus their bytes."""
    a = CachingAllocator()
    total = 0
    for n in sizes:
        a.malloc(n)
        total += n
    return (a.reserved if reserved else a.allocated) - total


# ---- the engines' parameters ----------------------------------------------------------------

_WHOLE_NUMBER = re.compile(r"\.\d+(?=\.|$)")
# a tensor named after its weight: ``….weight_scale_inv``, ``….weight_scale``
_WEIGHT_SUFFIX = re.compile(r"(.*\.weight)(_\w+)")


class ParamNames:
    """Which engine parameter each checkpoint tensor loads into, from the family's own vLLM
    declaration (``Family.vllm``, :mod:`shardctl.formats.vllm.spec`: the rules ``--format vllm``
    writes by): ``q/k/v_proj`` into ``qkv_proj``, every expert of a layer into
    ``routed_experts.w13_weight``, and so on. SGLang's model files fuse alike. A tensor named
    after a weight (``….weight_scale_inv``) joins that weight's parameter, as vLLM keeps
    ``w13_weight_scale_inv`` beside ``w13_weight``. A tensor no rule names (a family without a
    declaration or with a refused one — GPT-2, Llama-4, gpt-oss —, GPTQ's ``qweight``) is a
    parameter of its own.

    Keys have their whole numbers as ``#``: members of one fused parameter share a key
    whichever layer their class's first tensor names (the layer is the key's other half)."""

    def __init__(self, architecture: str) -> None:
        from shardctl.archs import find

        family = find(architecture)
        spec = family.vllm if family is not None else None
        rules = spec.rules if spec is not None else ()  # a refused declaration has none
        self.rules = [(re.compile(rx), name) for rx, name, _ in rules]
        self.keys: dict[str, str] = {}

    def key(self, fqn: str) -> str:
        got = self.keys.get(fqn)
        if got is None:
            name = self._name(fqn)
            if name is None:
                m = _WEIGHT_SUFFIX.fullmatch(fqn)
                base = self._name(m.group(1)) if m is not None else None
                name = fqn if base is None else base + (m.group(2) if m is not None else "")
            got = self.keys[fqn] = _WHOLE_NUMBER.sub(".#", name)
        return got

    def _name(self, fqn: str) -> str | None:
        for rx, name in self.rules:
            m = rx.fullmatch(fqn)
            if m is not None:
                return m.expand(name)
        return None


@dataclass
class EngineParam:
    """One engine parameter: its bytes on each tp rank, where it sits, how many it is."""

    sizes: list[int]  # bytes on tp rank r (members summed)
    layer: int | None
    stages: tuple[int, ...]  # for a parameter outside the layers: the stages holding it
    ep_rank: int | None  # None: on every ep rank


def engine_params(
    model: ModelInfo,
    mesh: Mesh,
    options: LayoutOptions = LayoutOptions(),  # noqa: B008
) -> list[EngineParam]:
    """The engine's parameters of ``model`` on ``mesh`` (preset rules, the engine's own split;
    ``options``: the plan's stages as ``layers_per_stage``), in the model's order; a layer's
    fused parameter sums its members on each rank. Empty for a model the preset does not place
    (an architecture without one, placed by manifest rules: the engine's split is unknown, so
    its allocations are not priced)."""
    key = (id(model), mesh.tp, mesh.ep, mesh.pp, options)
    hit = _PARAMS.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]  # a search prices every dp of one (tp, ep, pp) alike
    try:
        params = _engine_params(model, mesh, options)
    except ShardctlError:
        params = []
    if len(_PARAMS) >= 8:
        _PARAMS.clear()
    _PARAMS[key] = (weakref.ref(model), params)
    return params


# (id(model), tp, ep, pp, options) -> (the model, weakly; its engine parameters on that mesh)
_PARAMS: dict[tuple[Any, ...], tuple[weakref.ref[ModelInfo], list[EngineParam]]] = {}


def _engine_params(model: ModelInfo, mesh: Mesh, options: LayoutOptions) -> list[EngineParam]:
    from shardctl.layout.engine import class_layout, resolve
    from shardctl.layout.pipeline import layer_index
    from shardctl.layout.split import local_numels

    tp, ep = mesh.tp, mesh.ep
    names = ParamNames(model.architecture)
    out: dict[tuple[str, int | None, int | None], EngineParam] = {}
    lone: list[EngineParam] = []  # parameters outside the layers: one allocation per tensor

    def add(fqn: str, dtype: str, numels: Sequence[int], share: int, layer: int | None,
            stages: tuple[int, ...], ep_rank: int | None, count: int) -> None:  # fmt: skip
        sizes = [nbytes(dtype, n // share) for n in numels]
        if layer is None:
            lone.extend(EngineParam(sizes, None, stages, ep_rank) for _ in range(count))
            return
        key = (names.key(fqn), layer, ep_rank)
        p = out.get(key)
        if p is None:
            out[key] = EngineParam([s * count for s in sizes], layer, (), ep_rank)
        else:
            p.sizes = [a + s * count for a, s in zip(p.sizes, sizes, strict=True)]

    got = class_layout(model, mesh, (), options)
    if got is not None:
        rc, _, specs = got
        numels: dict[int, tuple[int, ...]] = {}
        for (c, layer, e), count in _class_layer_counts(model, rc, ep):
            t = rc.rules[c]
            spec, _, fixed = specs[c]
            n = numels.get(id(spec))
            if n is None:
                n = numels[id(spec)] = local_numels(spec, tp)
            on_rank = None if t.packed or t.expert is None else e
            add(t.info.fqn, t.info.dtype, n, ep if t.packed else 1,
                layer if t.layer is not None else None, fixed, on_rank, count)  # fmt: skip
    else:
        res = resolve(model, Mesh(tp=tp, ep=ep, pp=mesh.pp), options=options)
        for tp_ in res.tensors:
            layer = layer_index(tp_.info.fqn)
            add(tp_.info.fqn, tp_.info.dtype, local_numels(tp_.split, tp),
                ep if tp_.packed else 1, layer, tp_.stages, tp_.ep_rank, 1)  # fmt: skip
    return [*out.values(), *lone]


def with_tensors(model: ModelInfo) -> ModelInfo | None:
    """``model`` when it has tensors; for a model known by its dimensions only (a library
    caller's ``ModelInfo(..., tensors=())``) of a family the closed form describes, the tensors
    its family file gives for those dimensions (``Family.tensors``, in the model's dtype); else
    None (a bare parameter count, or a family whose shapes need more than the dimensions)."""
    if model.tensors:
        return model
    from shardctl.archs import find
    from shardctl.model.types import TensorInfo

    family = find(model.architecture)
    if model.dims is None or family is None or not family.closed_form:
        return None
    config = model.config or MappingProxyType({"model_type": model.architecture})
    try:
        shapes = family.tensors(config, model.dims, "model")
    except (ShardctlError, KeyError, TypeError, ValueError):
        return None
    tensors = tuple(TensorInfo(fqn, shape, model.dtype) for fqn, shape in sorted(shapes))
    return replace(model, tensors=tensors)


# (id(model), ep) -> (the model, weakly; its (class, layer, ep rank) counts): a search prices
# many meshes of one model, and counting 90,000 tensors is ~20 ms.
_COUNTS: dict[tuple[int, int], tuple[weakref.ref[ModelInfo], list[Any]]] = {}


def _class_layer_counts(model: ModelInfo, rc: Any, ep: int) -> list[Any]:
    """``((class, layer, ep rank), count)`` of ``model``'s tensors (``rc``: its classes), in
    order of first appearance; the ep rank of an expert tensor (None for the others)."""
    key = (id(model), ep)
    hit = _COUNTS.get(key)
    if hit is not None and hit[0]() is model:
        return hit[1]
    from shardctl.layout.engine import expert_ranks

    expert_rank = list(map(expert_ranks(rc, ep).get, rc.experts))
    counts = list(Counter(zip(rc.of, rc.layers, expert_rank, strict=True)).items())
    if len(_COUNTS) >= 8:
        _COUNTS.clear()
    _COUNTS[key] = (weakref.ref(model), counts)
    return counts


def stage_load_extra(
    params: Sequence[EngineParam], st: Stage, mesh: Mesh, *, reserved: bool
) -> int:
    """The most :func:`load_extra` of any rank of stage ``st``: its parameters (the layers in
    its range, and those outside the layers it holds) allocated in order on a fresh device."""
    first, last = st.layers if st.layers is not None else (0, -1)
    mine = [
        p
        for p in params
        if (p.layer is not None and first <= p.layer <= last)
        or (p.layer is None and st.index in p.stages)
    ]
    most = 0
    seen: dict[tuple[int, ...], int] = {}  # ranks holding the same sizes (most of them)
    for e in range(mesh.ep):
        here = [p for p in mine if p.ep_rank is None or p.ep_rank == e]
        for r in range(mesh.tp):
            sizes = tuple(p.sizes[r] for p in here)
            got = seen.get(sizes)
            if got is None:
                got = seen[sizes] = load_extra(sizes, reserved=reserved)
            most = max(most, got)
    return most
