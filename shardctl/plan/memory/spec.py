"""What the memory model is asked about: the workload, training setup and quantization.

Plain frozen data, validated on construction (errors name the manifest key). One type per
concept: the manifest's ``workload:``, ``training:`` and ``quantization:`` sections build
exactly these (:mod:`shardctl.manifest.validate_training`); tests and the search build them
directly. The choices below are the only definitions of these enumerations.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from shardctl.dtypes import normalize_dtype
from shardctl.errors import InvalidInputError

RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "cpu", "nvme")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved")
# Which linear layers of each decoder layer carry LoRA adapters (PEFT ``target_modules``):
# ``all-linear`` is PEFT's name for every Linear but the head; ``attention`` q/k/v/o; ``mlp``
# gate/up/down.
LORA_TARGETS = ("all-linear", "attention", "mlp")
FP8_SCALING = ("tensor", "channel", "block")
QUANT_KINDS = ("embedding", "head", "norm")

# FSDP sharding strategies -> ZeRO stage (PyTorch FSDP docs: FULL_SHARD is ZeRO-3,
# SHARD_GRAD_OP is ZeRO-2, NO_SHARD is DDP).
FSDP_NAMES: dict[str, int] = {
    "no_shard": 0,
    "ddp": 0,
    "shard_grad_op": 2,
    "full_shard": 3,
    "hybrid_shard": 3,
}


def _positive(value: int, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"expected a positive integer, got {value!r}", where=where)


MODALITIES = ("image", "video", "audio")  # vLLM --limit-mm-per-prompt keys


@dataclass(frozen=True)
class Workload:
    """Inference: ``batch_size`` concurrent sequences of ``sequence_length`` tokens (prompt +
    generated), shared by the ``dp`` replicas. Training uses :class:`TrainingSpec`'s batch.

    ``kv_cache_dtype`` ``None`` means the model dtype (vLLM's ``kv_cache_dtype="auto"``).
    ``sequence_length`` 0 (the default, as in a manifest) plans weights only (no KV cache, no
    activations).
    ``gpu_memory_utilization`` is the share of device memory the run may use (vLLM's flag).
    ``only_weights`` (manifest ``mode: weights-only``, ``--weights-only``) prices weights and
    overhead alone, on purpose: the plan then says "weights only".
    ``max_num_batched_tokens`` caps the tokens one forward pass processes (vLLM's chunked
    prefill; 8192 is vLLM V1's default for offline inference); ``None`` prefills every
    prompt of the batch in one pass, as ``transformers``' ``generate`` does.

    ``engine`` ``"vllm"`` prices a rank as vLLM's start-up profile does
    (:mod:`shardctl.plan.memory.vllm`): the device size CUDA reports, measured non-torch memory
    (``non_torch_memory`` overrides it), the profile run's forward over ``profile_tokens``
    tokens (vLLM's ``max_num_batched_tokens``; ``None`` = V0's ``max(sequence_length, 2048)``)
    and its sampler over ``max_num_seqs`` sequences (``None``: the version's default),
    ``vllm_version`` ("0.6" V0, "0.2" V0 of December 2023, "0.16" V1 as at 0.15-0.16, "0.19"
    V1 from 0.17, "0.21" V1 from 0.21),
    ``cuda_graph_memory`` (``None``: the version's —
    0, graphs captured after the KV cache, except "0.21"'s estimate; 0 also for
    ``enforce_eager``), KV in blocks of ``block_size`` tokens.
    ``sequence_length`` is then vLLM's ``max_model_len``.

    ``engine`` ``"sglang"`` (:mod:`shardctl.plan.memory.sglang`): ``mem_fraction_static``
    (``None``: SGLang's default, by tp for ``sglang_version`` "0.4", by GPU memory for "0.5");
    ``non_torch_memory`` overrides the memory used before the weights load. ``engine``
    ``"trtllm"`` (:mod:`shardctl.plan.memory.trtllm`): ``free_gpu_memory_fraction``,
    ``tokens_per_block``, and ``profile_tokens`` (default 8192) for the dummy run;
    ``non_torch_memory`` and ``cuda_graph_memory`` as for vLLM.
    """

    batch_size: int = 1
    sequence_length: int = 0
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float = 0.9
    flash_attention: bool = True
    max_num_batched_tokens: int | None = 8192
    # asked for: no KV cache, no activations (``mode: weights-only``). Not named weights_only:
    # that keyword is torch.load's safety flag, held to True everywhere by a static test.
    only_weights: bool = False
    engine: str = "generic"
    max_num_seqs: int | None = None
    block_size: int = 16
    profile_tokens: int | None = None
    non_torch_memory: int | None = None
    cuda_graph_memory: int | None = None
    mem_fraction_static: float | None = None
    sglang_version: str = "0.4"
    vllm_version: str = "0.6"
    free_gpu_memory_fraction: float = 0.9
    tokens_per_block: int = 32
    # vLLM ``--mm-encoder-tp-mode``: "weights" splits a multimodal tower over tp, "data"
    # replicates it on every rank (families whose vLLM class supports it, ``Family.
    # encoder_tp_data``; vLLM falls back to "weights" for the others)
    mm_encoder_tp_mode: str = "weights"
    # vLLM ``--limit-mm-per-prompt`` as ``(modality, items)`` pairs; () = vLLM's defaults. Every
    # modality of a family's tower at 0 (``Family.modalities``): vLLM builds no tower
    limit_mm_per_prompt: tuple[tuple[str, int], ...] = ()

    def text_only(self, modalities: tuple[str, ...]) -> bool:
        """Whether vLLM skips a tower that serves ``modalities`` (each limited to 0 items)."""
        limits = dict(self.limit_mm_per_prompt)
        return bool(modalities) and all(limits.get(m) == 0 for m in modalities)

    def __post_init__(self) -> None:
        from shardctl.plan.memory.engines import ENGINES

        if self.mm_encoder_tp_mode not in ("weights", "data"):
            raise InvalidInputError(
                f"expected 'weights' or 'data', got {self.mm_encoder_tp_mode!r}",
                where="workload.mm_encoder_tp_mode",
                hint="vLLM --mm-encoder-tp-mode: weights (split over tp) or data (replicated)",
            )
        for modality, items in self.limit_mm_per_prompt:
            if modality not in MODALITIES or isinstance(items, bool) or items < 0:
                raise InvalidInputError(
                    f"expected one of {', '.join(MODALITIES)} with a non-negative count, got "
                    f"{modality!r}: {items!r}",
                    where="workload.limit_mm_per_prompt",
                    hint="as vLLM --limit-mm-per-prompt, e.g. {image: 0, video: 0}",
                )

        _positive(self.batch_size, "workload.batch_size")
        if self.engine not in ENGINES:
            raise InvalidInputError(
                f"unknown engine {self.engine!r}",
                where="workload.engine",
                hint=f"use one of: {', '.join(ENGINES)}",
            )
        if self.max_num_seqs is not None:
            _positive(self.max_num_seqs, "workload.max_num_seqs")
        if self.vllm_version not in ("0.2", "0.6", "0.16", "0.19", "0.21"):
            raise InvalidInputError(
                f"expected '0.2', '0.6', '0.16', '0.19' or '0.21', got {self.vllm_version!r}",
                where="workload.vllm_version",
                hint="0.6: V0's start-up profile (the default); 0.2: V0 of December 2023; "
                "0.16: the V1 engine as at 0.15-0.16; 0.19: V1 from 0.17; 0.21: V1 from 0.21 "
                "(CUDA-graph estimate subtracted)",
            )
        _positive(self.block_size, "workload.block_size")
        _positive(self.tokens_per_block, "workload.tokens_per_block")
        if self.sglang_version not in ("0.4", "0.5"):
            raise InvalidInputError(
                f"expected '0.4' or '0.5', got {self.sglang_version!r}",
                where="workload.sglang_version",
                hint="0.4: the default mem_fraction_static by tp; 0.5: by GPU memory (>= 0.5.3)",
            )
        for key in ("mem_fraction_static", "free_gpu_memory_fraction"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not 0 < v <= 1):
                raise InvalidInputError(
                    f"expected 0 < value <= 1, got {v!r}", where=f"workload.{key}"
                )
        if self.profile_tokens is not None:
            _positive(self.profile_tokens, "workload.max_num_batched_tokens")
        for key in ("non_torch_memory", "cuda_graph_memory"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise InvalidInputError(
                    f"expected a non-negative byte count, got {v!r}", where=f"workload.{key}"
                )
        if isinstance(self.sequence_length, bool) or self.sequence_length < 0:
            raise InvalidInputError(
                f"expected a non-negative integer, got {self.sequence_length!r}",
                where="workload.sequence_length",
            )
        if self.max_num_batched_tokens is not None:
            _positive(self.max_num_batched_tokens, "workload.max_num_batched_tokens")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidInputError(
                f"expected 0 < value <= 1, got {self.gpu_memory_utilization}",
                where="workload.gpu_memory_utilization",
            )
        if self.kv_cache_dtype is not None and self.kv_cache_dtype != "auto":
            object.__setattr__(
                self,
                "kv_cache_dtype",
                normalize_dtype(self.kv_cache_dtype, where="workload.kv_cache_dtype"),
            )
        elif self.kv_cache_dtype == "auto":
            object.__setattr__(self, "kv_cache_dtype", None)


@dataclass(frozen=True)
class TrainingSpec:
    """One training step: ``global_batch_size`` sequences of ``sequence_length`` tokens, as
    ``micro_batch_size`` sequences per forward, accumulated over ``grad_accumulation`` steps.

    ``global_batch_size`` ``None`` means ``grad_accumulation_steps`` micro-batches per dp rank
    per step, whatever ``dp`` is (the manifest's ``workload.gradient_accumulation_steps``).
    ``zero`` is the ZeRO stage over the data-parallel group (0–3); ``fsdp`` names are accepted
    through :func:`zero_stage`. ``grad_dtype`` ``"F32"`` is Megatron's fp32 ``main_grad``.
    """

    optimizer: str = "adamw"
    zero: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    flash_attention: bool = True
    dropout: bool = False
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    grad_accumulation_steps: int = 1
    sequence_length: int = 4096
    grad_dtype: str | None = None  # None = model dtype
    offload_optimizer: str = "none"
    offload_params: str = "none"
    capacity_factor: float = 1.0  # MoE token capacity (Switch Transformer); 1.0 = balanced
    master_weights: bool = True  # fp32 master copy with 16-bit weights (mixed precision)
    pipeline_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved
    # Interleaved 1F1B: model chunks per pipeline rank (Megatron
    # --num-virtual-stages-per-pipeline-rank); 1 otherwise.
    virtual_stages: int = 1
    # LoRA (Hu et al. 2021) adapters of rank ``lora_rank`` on ``lora_targets``: the base
    # weights are frozen (no gradients, no optimizer states); QLoRA = LoRA over a 4-bit base
    # (``quantization.method: nf4``). 0 = full fine-tuning.
    lora_rank: int = 0
    # Context parallelism (``mesh.cp``; Megatron --context-parallel-size, Liu et al. 2023 ring
    # attention): each of ``cp`` ranks holds ``sequence_length / cp`` tokens of every sequence.
    context_parallel: int = 1
    lora_targets: str = "all-linear"
    # Partial recompute (Megatron --recompute-method block --recompute-num-layers N): with
    # ``recompute: full``, only the first N layers of each stage are recomputed, the rest keep
    # their activations. ``None`` = every layer.
    recompute_layers: int | None = None

    def __post_init__(self) -> None:
        from shardctl.plan.memory.training import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise InvalidInputError(
                f"unknown optimizer {self.optimizer!r}",
                where="training.optimizer",
                hint=f"use one of: {', '.join(OPTIMIZERS)}",
            )
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise InvalidInputError(
                f"expected a ZeRO stage 0-3, got {self.zero!r}", where="training.zero"
            )
        if self.recompute not in RECOMPUTE:
            raise InvalidInputError(
                f"expected one of {', '.join(RECOMPUTE)}, got {self.recompute!r}",
                where="training.recompute",
            )
        for key in ("offload_optimizer", "offload_params"):
            if getattr(self, key) not in OFFLOAD:
                raise InvalidInputError(
                    f"expected one of {', '.join(OFFLOAD)}, got {getattr(self, key)!r}",
                    where=f"training.{key}",
                )
        if self.offload_params != "none" and self.zero != 3:
            raise InvalidInputError(
                "parameter offload needs ZeRO stage 3",
                where="training.offload_params",
                hint="set training.zero: 3 (DeepSpeed offload_param works with stage 3 only)",
            )
        _positive(self.micro_batch_size, "training.micro_batch_size")
        if isinstance(self.sequence_length, bool) or self.sequence_length < 0:
            raise InvalidInputError(
                f"expected a non-negative integer, got {self.sequence_length!r}",
                where="training.sequence_length",
            )
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise InvalidInputError(
                f"expected one of {', '.join(PIPELINE_SCHEDULES)}, got {self.pipeline_schedule!r}",
                where="training.pipeline_schedule",
            )
        _positive(self.virtual_stages, "training.virtual_stages")
        if (self.pipeline_schedule == "interleaved") != (self.virtual_stages > 1):
            raise InvalidInputError(
                f"pipeline_schedule {self.pipeline_schedule} with virtual_stages "
                f"{self.virtual_stages}: the interleaved schedule needs virtual_stages >= 2, "
                "and virtual stages need the interleaved schedule",
                where="training.virtual_stages",
                hint="set pipeline_schedule: interleaved and virtual_stages: 2 (or more), or "
                "drop virtual_stages",
            )
        _positive(self.context_parallel, "mesh.cp")
        cp = self.context_parallel
        if cp > 1 and self.sequence_length % (2 * cp):
            raise InvalidInputError(
                f"sequence_length {self.sequence_length} is not divisible by 2 × cp = {2 * cp}",
                where="mesh.cp",
                hint="Megatron splits each sequence into 2·cp chunks (load-balanced causal "
                "attention): use a sequence_length that is a multiple of 2·cp",
            )
        if isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise InvalidInputError(
                f"expected a non-negative integer, got {self.lora_rank!r}",
                where="training.lora_rank",
            )
        if self.lora_targets not in LORA_TARGETS:
            raise InvalidInputError(
                f"expected one of {', '.join(LORA_TARGETS)}, got {self.lora_targets!r}",
                where="training.lora_targets",
            )
        if self.recompute_layers is not None:
            if isinstance(self.recompute_layers, bool) or self.recompute_layers < 0:
                raise InvalidInputError(
                    f"expected a non-negative integer, got {self.recompute_layers!r}",
                    where="training.recompute_layers",
                )
            if self.recompute != "full":
                raise InvalidInputError(
                    f"recompute_layers needs recompute: full, got recompute: {self.recompute}",
                    where="training.recompute_layers",
                    hint="set recompute: full (Megatron --recompute-granularity full "
                    "--recompute-method block), or drop recompute_layers",
                )
        _positive(self.grad_accumulation_steps, "training.grad_accumulation_steps")
        if self.global_batch_size is not None:
            _positive(self.global_batch_size, "training.global_batch_size")
        if self.grad_dtype is not None:
            object.__setattr__(
                self, "grad_dtype", normalize_dtype(self.grad_dtype, where="training.grad_dtype")
            )
        if not self.capacity_factor >= 1.0:
            raise InvalidInputError(
                f"expected capacity_factor >= 1, got {self.capacity_factor}",
                where="training.capacity_factor",
            )

    def grad_accumulation(self, dp: int) -> int:
        """Micro-batches per dp rank per step: ``global / (micro × dp)`` (must divide)."""
        if self.global_batch_size is None:
            return self.grad_accumulation_steps
        per = self.micro_batch_size * dp
        if self.global_batch_size % per:
            raise InvalidInputError(
                f"global_batch_size {self.global_batch_size} is not divisible by "
                f"micro_batch_size × dp = {self.micro_batch_size} × {dp} = {per}",
                where="training.global_batch_size",
                hint="pick a global batch that is a multiple of micro_batch_size × dp",
            )
        return self.global_batch_size // per


def zero_stage(value: int | str) -> int:
    """``2`` / ``"2"`` / ``"zero-2"`` / ``"SHARD_GRAD_OP"`` -> 2."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    key = str(value).strip().lower().replace("-", "_")
    if key.startswith("zero"):
        key = key[4:].lstrip("_")
    if key in ("0", "1", "2", "3"):
        return int(key)
    if key in FSDP_NAMES:
        return FSDP_NAMES[key]
    raise InvalidInputError(
        f"unknown ZeRO stage or FSDP strategy {value!r}",
        where="training.zero",
        hint="use 0-3 or one of " + ", ".join(n.upper() for n in FSDP_NAMES),
    )


# Group/block size per quantization method when none is given; 0 = no groups (one scale per
# output channel or per tensor). MXFP4 (OCP MX spec) and NVFP4 fix theirs by definition;
# int4/gptq/awq = GPTQ/AWQ's usual 128; nf4 = bitsandbytes' 64-element blocks; int8 =
# LLM.int8()'s per-channel scales; fp8 = one scale per tensor, or DeepSeek-V3's 128x128 tiles
# with ``fp8_scaling: block``.
DEFAULT_GROUP_SIZE: dict[str, int] = {
    "none": 0,
    "int8": 0,
    "int4": 128,
    "gptq": 128,
    "awq": 128,
    "nf4": 64,
    "fp8": 0,
    "mxfp4": 32,
    "nvfp4": 16,
}
QUANT_METHODS = tuple(DEFAULT_GROUP_SIZE)
FP8_BLOCK = 128

# Tensors kept in 16-bit when quantizing, unless ``keep_16bit`` says otherwise: embeddings
# (llama-style ``embed_tokens``, GPT-2 ``wte``/``wpe``), the LM head (also a multimodal model's
# ``language_model.lm_head``), and every norm (``*norm*`` covers ``input_layernorm``,
# ``model.norm``; ``*.ln_*`` covers GPT-2's ``ln_1``, ``ln_f``). This is what
# GPTQ/AWQ/bitsandbytes do: they quantize the decoder's Linear weights only.
DEFAULT_KEEP_16BIT: tuple[str, ...] = (
    "*embed_tokens.*",
    "*.wte.*",
    "*.wpe.*",
    "*lm_head.*",
    "*norm*",
    "*.ln_*",
)
# Representative fqns per tensor kind, matched against ``keep_16bit`` globs.
_KIND_NAMES = {
    "embedding": ("model.embed_tokens.weight", "transformer.wte.weight"),
    "head": ("lm_head.weight",),
    "norm": ("model.norm.weight", "model.layers.0.input_layernorm.weight"),
}


@dataclass(frozen=True)
class QuantOverride:
    """One ``quantization.overrides`` entry: tensors whose full name matches ``match`` (fnmatch)
    are stored as ``method`` (a :data:`QUANT_METHODS` name; ``none``: unquantized, as stored)
    or dense in ``dtype`` (``BF16``, ``F16``, ``F32``). The first matching entry wins.

    >>> QuantOverride("*.self_attn.*", dtype="BF16").describe()
    '*.self_attn.* -> BF16'
    """

    match: str
    method: str | None = None
    dtype: str | None = None
    group_size: int | None = None
    fp8_scaling: str = "tensor"

    @property
    def quantizes(self) -> bool:
        return self.method is not None and self.method != "none"

    def describe(self) -> str:
        if self.dtype is not None:
            return f"{self.match} -> {self.dtype}"
        return f"{self.match} -> {self.method}"


@dataclass(frozen=True)
class QuantSpec:
    """How weights are stored on the device (see :mod:`shardctl.plan.memory.quant`).

    ``method`` ``"none"`` counts the checkpoint as stored (an already-quantized checkpoint too).
    ``group_size`` ``None`` is the method's :data:`DEFAULT_GROUP_SIZE` (``fp8_scaling: block``:
    128). ``keep_16bit`` are fqn globs left in 16-bit (:data:`DEFAULT_KEEP_16BIT`), any tensor.
    ``overrides`` give tensors their own format, first match wins, before ``keep_16bit`` and
    ``method`` (:mod:`shardctl.plan.memory.precision`); with ``method`` ``"none"`` only they
    quantize.
    """

    method: str = "none"
    group_size: int | None = None
    double_quant: bool = False
    fp8_scaling: str = "tensor"
    keep_16bit: tuple[str, ...] = DEFAULT_KEEP_16BIT
    overrides: tuple[QuantOverride, ...] = ()

    @property
    def quantizes(self) -> bool:
        """Whether any tensor is stored in a quantized format (the method or an override)."""
        return self.method != "none" or any(o.quantizes for o in self.overrides)

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise InvalidInputError(
                f"unknown quantization method {self.method!r}",
                where="quantization.method",
                hint=f"use one of: {', '.join(QUANT_METHODS)}",
            )
        if self.fp8_scaling not in FP8_SCALING:
            raise InvalidInputError(
                f"expected one of {', '.join(FP8_SCALING)}, got {self.fp8_scaling!r}",
                where="quantization.fp8_scaling",
            )
        if self.group_size is None:
            block = self.method == "fp8" and self.fp8_scaling == "block"
            size = FP8_BLOCK if block else DEFAULT_GROUP_SIZE[self.method]
            object.__setattr__(self, "group_size", size)
        elif isinstance(self.group_size, bool) or self.group_size < 0:
            raise InvalidInputError(
                f"expected a non-negative integer, got {self.group_size!r}",
                where="quantization.group_size",
            )

    @property
    def formula(self) -> str:
        """The :func:`~shardctl.plan.memory.quant.matrix_bytes` formula: ``fp8`` with block
        scaling is ``fp8-block``."""
        return formula_of(self.method, self.fp8_scaling)

    @property
    def keep(self) -> tuple[str, ...]:
        """The tensor kinds (:data:`QUANT_KINDS`) whose names ``keep_16bit`` matches."""
        return tuple(
            kind
            for kind, names in _KIND_NAMES.items()
            if any(fnmatchcase(n, g) for n in names for g in self.keep_16bit)
        )


def formula_of(method: str, fp8_scaling: str) -> str:
    """The :func:`~shardctl.plan.memory.quant.matrix_bytes` name of ``method``: ``fp8`` is
    ``fp8-block`` or ``fp8-channel`` by its scaling."""
    if method == "fp8" and fp8_scaling != "tensor":
        return f"fp8-{fp8_scaling}"
    return method
