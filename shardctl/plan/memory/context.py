"""Per-plan constants and the per-rank arithmetic of the memory model.

:class:`Context` holds what every rank of one layout shares (dtype, batch per replica,
micro-batches, budget) and prices one rank of a stage; the pieces live beside it:
:mod:`.terms` (KV cache, activations), :mod:`.states` (training states), :mod:`.summaries`.
"""

from __future__ import annotations

from shardctl.archs import find
from shardctl.dtypes import DTYPE_BITS
from shardctl.layout.types import LayoutOptions, Mesh, Stage
from shardctl.model.types import ModelInfo
from shardctl.plan.memory.allocator import (
    EngineParam,
    engine_params,
    stage_load_extra,
    with_tensors,
)
from shardctl.plan.memory.budget import engine_utilization, memory_budget
from shardctl.plan.memory.engines import engine_profile
from shardctl.plan.memory.hardware import HardwareSpec
from shardctl.plan.memory.kv_layers import layer_windows, mla_latent_width
from shardctl.plan.memory.layout_counts import layout_counts, uses_layout_counts
from shardctl.plan.memory.overhead import OverheadSpec, overhead_bytes
from shardctl.plan.memory.precision import priced_per_tensor
from shardctl.plan.memory.quant import matrix_bytes, quantized_weight_bytes
from shardctl.plan.memory.result import RankMemory
from shardctl.plan.memory.rotary import language_config, rotary_cache_bytes
from shardctl.plan.memory.sglang import (
    default_mem_fraction_static,
    default_mem_fraction_static_v05,
    sglang_overhead,
)
from shardctl.plan.memory.shapes import Counts, ModelShape, stage_counts
from shardctl.plan.memory.spec import QuantSpec, TrainingSpec, Workload
from shardctl.plan.memory.states import training_states
from shardctl.plan.memory.terms import inference_terms, training_terms
from shardctl.plan.memory.trtllm import TrtllmOverhead, kv_reserve_bytes
from shardctl.plan.memory.vllm import (
    V1_VERSIONS,
    VllmOverhead,
    default_cuda_graph_bytes,
    non_torch_bytes,
    profile_batch,
)


def _dense_bytes(dtype: str) -> int:
    return DTYPE_BITS[dtype] // 8 if DTYPE_BITS[dtype] >= 8 else 2


class Context:
    """Per-plan constants and the per-rank arithmetic (kept apart from the public API)."""

    def __init__(
        self,
        model: ModelInfo,
        mesh: Mesh,
        stages: tuple[Stage, ...],
        shape: ModelShape | None,
        workload: Workload,
        training: TrainingSpec | None,
        quant: QuantSpec,
        hardware: HardwareSpec,
        overhead: OverheadSpec,
    ):
        self.model, self.mesh, self.stages, self.shape = model, mesh, stages, shape
        self.workload, self.training, self.quant = workload, training, quant
        self.hw, self.ovh = hardware, overhead
        self.dtype = model.dtype if DTYPE_BITS.get(model.dtype, 0) >= 16 else "BF16"
        self.nb = _dense_bytes(self.dtype)
        self.kv_dtype = workload.kv_cache_dtype or self.dtype
        self.engine = engine_profile(workload.engine, training=training is not None)
        self.cp = training.context_parallel if training is not None else 1
        self.vllm = training is None and workload.engine == "vllm"
        self.sglang = training is None and workload.engine == "sglang"
        self.trtllm = training is None and workload.engine == "trtllm"
        # the engine's cos/sin tables, on every rank (:mod:`.rotary`)
        self.rotary_cache = (
            rotary_cache_bytes(model, self.nb, engine=workload.engine)
            if self.vllm or self.sglang
            else 0
        )
        self.mem_fraction_static = (
            workload.mem_fraction_static
            if workload.mem_fraction_static is not None
            else default_mem_fraction_static_v05(
                hardware.device_memory, tp=mesh.tp * mesh.ep, pp=mesh.pp
            )
            if workload.sglang_version == "0.5" and hardware.device_memory is not None
            else default_mem_fraction_static(mesh.tp * mesh.pp * mesh.ep)
        )
        # vLLM's profile run: (tokens of the forward, sequences of the sampler)
        self.vllm_batch = profile_batch(
            workload.vllm_version,
            gpu=hardware.gpu,
            device_memory=hardware.device_memory,
            max_model_len=workload.sequence_length,
            max_num_batched_tokens=workload.profile_tokens,
            max_num_seqs=workload.max_num_seqs,
        )
        # tokens per KV block in the engine's own units (SGLang: page size 1)
        self.block_size = (
            workload.block_size if self.vllm else workload.tokens_per_block if self.trtllm else 1
        )
        self.utilization = (
            engine_utilization(workload.engine, workload.gpu_memory_utilization)
            if training is None
            else workload.gpu_memory_utilization
        )
        n_layers = shape.dims.num_layers if shape is not None else 0
        arch, text = language_config(model)  # a multimodal model's text section
        family = find(model.architecture)
        # vLLM serving it text only builds no tower: no encoder profile, no DeepStack buffers
        towerless = self.vllm and family is not None and workload.text_only(family.modalities)
        # tokens of one image's embeddings (a multimodal family's ``image_tokens``; 0: none)
        self.image_tokens = (
            family.image_tokens(model.config)
            if family is not None and family.image_tokens is not None and not towerless
            else 0
        )
        # the width of one image embedding as the encoder caches it (0: the text hidden size)
        self.image_width = (
            family.image_width(model.config)
            if family is not None and family.image_width is not None
            else 0
        )
        # vLLM's persistent model buffers beyond the weights (``Family.vllm_buffers``)
        self.model_buffers = (
            family.vllm_buffers(model.config, self.vllm_batch[0], self.nb)
            if self.vllm
            and workload.vllm_version in V1_VERSIONS
            and family is not None
            and family.vllm_buffers is not None
            and not towerless
            else 0
        )
        self.windows = layer_windows(arch, text, n_layers)
        self.mla_width = mla_latent_width(text)
        self.batch = -(-workload.batch_size // mesh.dp)  # per dp replica
        self.microbatches = training.grad_accumulation(mesh.dp) if training else 1
        self.budget = memory_budget(
            hardware.device_memory,
            training=training is not None,
            gpu_memory_utilization=self.utilization,
        )
        # Per stage index; the search shares them between meshes that agree on what they key.
        self._cache: dict[int, tuple[int, int, dict[str, int]]] = {}
        self._counts: dict[int, Counts] = {}
        self._load_extra: dict[int, int] = {}
        self._params: list[EngineParam] | None = None

    # -- weights -------------------------------------------------------------------------
    def counts(self, st: Stage) -> Counts:
        hit = self._counts.get(st.index)
        if hit is not None:
            return hit
        if self.shape is None:
            n = self.model.parameters // (self.mesh.pp * self.mesh.tp * self.mesh.ep)
            c = Counts(linear=n)
        elif uses_layout_counts(self.model):
            vocab_padding = self.shape.vocab_padding
            self._counts.update(layout_counts(self.model, self.mesh, self.stages, vocab_padding))
            return self._counts[st.index]
        else:
            c = stage_counts(self.shape, st, self.mesh.pp, self.mesh.tp, self.mesh.ep)
        self._counts[st.index] = c
        return c

    def weight_bytes(self, c: Counts, given: int | None) -> int:
        q = self.quant
        if given is not None and self.model.tensors and priced_per_tensor(q):
            # The layout engine's bytes, each tensor in its own format (plan/weights.py).
            return given
        if q.method != "none" and self.shape is None:
            # A bare count has no kinds to keep in 16-bit: every parameter is priced in the
            # format, payload plus per-group scales (docs/memory-model.md, "bare counts").
            return matrix_bytes(
                q.formula,
                c.total,
                0,
                0,
                1,
                group_size=q.group_size or 128,
                double_quant=q.double_quant,
            )
        if q.method != "none" and self.shape is not None:
            return quantized_weight_bytes(
                c,
                method=q.formula,
                dense_bytes=self.nb,
                group_size=q.group_size or 128,
                double_quant=q.double_quant,
                keep=q.keep,
            )
        if given is not None:
            return given
        return c.total * DTYPE_BITS[self.model.dtype] // 8

    def rank(self, st: Stage, given: int | None) -> RankMemory:
        """One rank of stage ``st`` whose stored weights are ``given`` bytes (the layout
        engine's), or the closed form's when ``None``."""
        c = self.counts(st)
        weights = self.weight_bytes(c, given)
        kv, acts, detail = self._stage_terms(st)
        detail = dict(detail)
        grads = opt = host = nvme = 0
        if self.training is not None:
            # ``given`` counts parameters only when it holds the dense stored bytes.
            dense = None if priced_per_tensor(self.quant) else given
            s = training_states(self, st, c, weights, dense)
            weights, grads, opt, host, nvme = s.weights, s.gradients, s.optimizer, s.host, s.nvme
            detail.update(s.detail)
        tensors = weights + kv + acts + grads + opt
        frag_base = tensors - kv if self.training is None else tensors
        if self.vllm:
            items = {
                **self.vllm_overhead().items(),
                "allocator": self.load_extra(st),
                "rotary_cache": self.rotary_cache,
            }
            if self.model_buffers:
                items["model_buffers"] = self.model_buffers
        elif self.sglang:
            items = sglang_overhead(
                self.hw.device_memory,
                gpu=self.hw.gpu,
                ranks=self.mesh.tp * self.mesh.pp * self.mesh.ep,
                fraction=self.mem_fraction_static,
                init=self.workload.non_torch_memory,
            ).items()
            items["allocator"] = self.load_extra(st)
            items["rotary_cache"] = self.rotary_cache
        elif self.trtllm:
            items = self.trtllm_overhead(weights + acts).items()
        else:
            items = overhead_bytes(
                self.ovh,
                frag_base,
                distributed=self.mesh.world > 1,
                expert_parallel=self.mesh.ep > 1,
            )
        detail.update({f"overhead.{k}": v for k, v in items.items()})
        return RankMemory(weights, kv, acts, grads, opt, sum(items.values()), detail, host, nvme)

    def load_extra(self, st: Stage) -> int:
        """What the caching allocator holds beyond the weights the engine loads on the
        fullest rank of ``st`` (:mod:`.allocator`), as the engine measures it: allocated bytes
        for vLLM (torch's counters), reserved for SGLang and for vLLM "0.2" (free device memory,
        ``mem_get_info``). A model known by its dimensions takes its family's tensors for them
        (:func:`.allocator.with_tensors`); 0 for a bare parameter count, a family whose shapes
        need more than the dimensions, or quantization applied at load."""
        hit = self._load_extra.get(st.index)
        if hit is not None:
            return hit
        value = 0
        if self.quant.method == "none" and not self.quant.overrides:
            if self._params is None:
                model = with_tensors(self.model)
                # the plan's stages (any convention), and any tp split the engine would take
                lps = tuple(s.num_layers for s in self.stages) if self.mesh.pp > 1 else None
                options = LayoutOptions(layers_per_stage=lps, uneven="chunk")
                self._params = [] if model is None else engine_params(model, self.mesh, options)
            reserved = self.sglang or self.workload.vllm_version == "0.2"
            value = stage_load_extra(self._params, st, self.mesh, reserved=reserved)
        self._load_extra[st.index] = value
        return value

    def vllm_overhead(self) -> VllmOverhead:
        """vLLM's non-torch memory and CUDA graphs (they replace the ``overhead:`` items)."""
        w = self.workload
        measured = non_torch_bytes(
            self.hw.gpu, self.mesh.tp, version=w.vllm_version, pp=self.mesh.pp
        )
        non_torch = measured if w.non_torch_memory is None else w.non_torch_memory
        graphs = w.cuda_graph_memory
        if graphs is None:
            graphs = default_cuda_graph_bytes(w.vllm_version) if self.vllm else 0
        return VllmOverhead(non_torch=non_torch, cuda_graphs=graphs)

    def trtllm_overhead(self, used: int) -> TrtllmOverhead:
        """TensorRT-LLM's non-torch memory, CUDA graphs, and the ``1 − fraction`` of what the
        profile left free (``used`` = weights + activation peak)."""
        vo = self.vllm_overhead()
        rest = used + vo.non_torch + vo.cuda_graphs
        reserve = kv_reserve_bytes(
            self.hw.device_memory, rest, self.workload.free_gpu_memory_fraction
        )
        return TrtllmOverhead(vo.non_torch, vo.cuda_graphs, reserve)

    def _stage_terms(self, st: Stage) -> tuple[int, int, dict[str, int]]:
        """KV cache and activations of one rank of ``st`` (same for every tp/ep rank)."""
        hit = self._cache.get(st.index)
        if hit is not None:
            return hit
        no_tokens = self.workload.only_weights or (
            self.workload.sequence_length == 0
            if self.training is None
            else self.training.sequence_length == 0
        )
        out = (
            (0, 0, {})
            if self.shape is None or no_tokens
            else (inference_terms(self, st) if self.training is None else training_terms(self, st))
        )
        self._cache[st.index] = out
        return out
