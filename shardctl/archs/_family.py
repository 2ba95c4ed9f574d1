"""What a family file declares, as plain frozen data, plus the config readers they share.

A :class:`Family` is everything shardctl knows about one architecture: config → dims and
inventory (closed-form, no torch), the ordered ``fqn`` rules (the preset), storage quirks, the
memory model's bias/norm flags for a tensor-less inventory, and what verify's forward level
needs to run it sharded (:class:`ForwardSpec`). Hooks that touch torch import it inside the
function, so ``plan`` never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardctl.errors import InvalidInputError
from shardctl.layout.types import RuleSpec
from shardctl.model.types import ModelDims

if TYPE_CHECKING:  # vllm-families
    from shardctl.formats.vllm.spec import VllmNames

Shapes = list[tuple[str, tuple[int, ...]]]
# What GPTQ / AWQ / fp8 / compressed-tensors quantize by default (Family.quantizable).
# Packed experts (gpt-oss ``mlp.experts.gate_up_proj [E, H, 2I]``) are MXFP4's only.
LINEAR_PROJECTIONS: tuple[str, ...] = (
    "model.layers.*_proj.weight",
    "model.layers.*_proj_with_mqa.weight",
    "model.layers.*.experts.*_proj",
)
Config = Mapping[str, Any]


@dataclass(frozen=True)
class MemoryFlags:
    """What the memory model counts beyond the dims, for an inventory without tensor names."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False  # LayerNorm with bias vs RMSNorm
    positions: int = 0  # learned position-embedding rows, replicated


@dataclass(frozen=True)
class ExpertSpec:
    """On-disk expert names (relative to a layer) → the in-memory module verify builds.

    Per-expert on disk (Mixtral on the hub: ``block_sparse_moe.experts.{e}.w1/w2/w3.weight``),
    which transformers 5 packs in memory as ``mlp.experts.gate_up_proj [E, 2I, H]`` (w1 then
    w3) and ``mlp.experts.down_proj [E, H, I]`` (w2): give ``pattern``/``gate``/``up``/``down``.
    Packed on disk as in memory (Llama-4, gpt-oss: ``experts.gate_up_proj [E, H, 2I]``): leave
    ``pattern`` empty; the names load as they are, each ep rank holding rows ``E/ep`` of dim 0.

    ``call`` is how the layer calls its experts module: ``"routed"`` —
    ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` (Mixtral, Qwen-MoE,
    gpt-oss); ``"stacked"`` — ``experts(x [E·T, H])``, every expert's input stacked, already
    scaled by its router score (Llama-4). ``once``: parameters of the experts module added
    after the tensor-parallel sum (gpt-oss ``down_proj_bias``): only tp rank 0 adds them.
    """

    router: str  # on-disk router weight, e.g. "block_sparse_moe.gate.weight"
    router_param: str  # the model's parameter for it, e.g. "mlp.gate.weight"
    module: str  # the experts module inside a layer ("mlp.experts")
    pattern: str = ""  # regex on the on-disk name: group 1 = expert index, group 2 = which matrix
    gate: str = ""  # the matrix that is the first half of the packed gate_up ("w1")
    up: str = ""  # the second half ("w3")
    down: str = ""  # the down projection ("w2")
    call: str = "routed"  # "routed" | "stacked"
    once: tuple[str, ...] = ()  # e.g. ("down_proj_bias",)
    # other on-disk names in a layer -> their in-memory ones, where transformers renames them on
    # load (MiniMax-M2: ``block_sparse_moe.e_score_correction_bias`` -> ``mlp.…``)
    aliases: tuple[tuple[str, str], ...] = ()
    # packed on-disk names in a layer stored ``[E, in, out]`` where transformers holds
    # ``[E, out, in]`` (Qwen3-VL-MoE's published ``mlp.experts.gate_up_proj``): transposed as
    # they load, as transformers' own conversion mapping does
    transposed: tuple[str, ...] = ()

    @property
    def regex(self) -> re.Pattern[str] | None:
        return re.compile(self.pattern) if self.pattern else None


# (model, config, dims, tp, ep, dtype) -> None: rebuild modules at their local sizes.
Localize = Callable[[Any, Any, ModelDims, int, int, Any], None]
# (config, dims, tp, ep, first_layer, num_layers) -> the local config's changed keys.
LocalConfig = Callable[[Config, ModelDims, int, int, int, int], dict[str, Any]]
# (layer, comm, tp_rank, tp_size, dims) -> None: after loading, swap a layer's modules for
# tensor-parallel ones (OLMo-2's q/k norm over the whole projection needs a tp all-reduce).
ShardLayer = Callable[[Any, Any, int, int, ModelDims], None]
# (router logits [tokens, E], chosen experts [tokens, k], config) -> their routing weights,
# for a router that is not "softmax, then top-k, renormalized when norm_topk_prob".
RouteWeights = Callable[[Any, Any, Config], Any]


@dataclass(frozen=True)
class ForwardSpec:
    """What verify's forward level needs: names relative to the model root, conventions, hooks.

    ``row_parallel`` modules (inside a layer) produce partial sums: all-reduce, bias once.
    ``conv1d``: weights stored ``[in, out]`` (GPT-2), so row-parallel splits dim 0.
    ``renames``: on-disk name prefix -> the in-memory one, where transformers 5 renames on load
    (GPT-NeoX's head: ``embed_out.`` on disk, ``lm_head.`` in memory).
    ``recomputed``: fnmatch globs of on-disk tensors older hub files carry that transformers 5
    recomputes instead of loading (causal-mask buffers, rotary ``inv_freq``): the forward level
    skips them (structure and bitwise still check their bytes).
    """

    layer_prefix: str  # "model.layers" -> "model.layers.{i}."
    embeddings: tuple[str, ...]  # token (vocab) embedding first
    final_norm: str
    lm_head: str
    row_parallel: tuple[str, ...]
    local_config: LocalConfig
    conv1d: bool = False
    experts: ExpertSpec | None = None
    localize: Localize | None = None  # after from_config, before loading the rank's tensors
    shard_layer: ShardLayer | None = None  # per layer, after loading, with the tp comm
    route_weights: RouteWeights | None = None  # verify/routing.py: weights at pinned experts
    arch: str = ""  # filled in by the registry: the model_type asked for
    renames: tuple[tuple[str, str], ...] = ()
    recomputed: tuple[str, ...] = ()
    # a multimodal config's section the forward level runs (Llama-4: "text_config"): its keys
    # are lifted to the top of the config verify reads, model_type kept (verify/adapters.py)
    sub_config: str = ""
    # where the decoder layers sit in the unsharded reference, the model AutoModelForCausalLM
    # builds from the whole config, when not at ``layer_prefix`` (Gemma-3's
    # Gemma3ForConditionalGeneration: ``model.language_model.layers``)
    reference_layers: str = ""
    # the transformers auto class that builds the unsharded reference from the whole config:
    # AutoModelForCausalLM, or AutoModelForImageTextToText where a multimodal config has no
    # causal-LM mapping (Mistral3ForConditionalGeneration)
    reference_auto: str = "AutoModelForCausalLM"

    def param(self, fqn: str) -> str:
        """The in-memory name of an on-disk ``fqn``."""
        for disk, memory in self.renames:
            if fqn.startswith(disk):
                return memory + fqn[len(disk) :]
        return fqn

    @property
    def layer_re(self) -> re.Pattern[str]:
        return re.compile(rf"^{re.escape(self.layer_prefix)}\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class MegatronDecl:
    """How Megatron-Core's ``GPTModel`` holds this family (read by shardctl/formats/megatron):
    the HF module names only; every size, bias and norm is derived from the family's inventory.

    ``moe``: the MoE block's module under ``model.layers.N`` (``""``: a dense family);
    ``expert``: a routed expert's (gate, up, down) projection names; ``shared``: the shared
    expert(s) module under the MoE block; ``shared_gate``: its sigmoid gate ``[1, H]``;
    ``router``: ``"softmax"`` (top-k renormalized iff the config's ``norm_topk_prob``, default
    false), ``"softmax_topk"`` (always renormalized: Mixtral), ``"sigmoid_bias"`` (DeepSeek-V3:
    sigmoid scores, ``e_score_correction_bias``, group-limited top-k); ``mla``: DeepSeek MLA."""

    moe: str = ""
    expert: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str = ""
    shared_gate: str = ""
    router: str = "softmax"
    mla: bool = False


@dataclass(frozen=True)
class Family:
    """One architecture family; see any module in this package for an example."""

    name: str
    model_types: tuple[str, ...]
    tied_default: bool  # transformers' default for a missing tie_word_embeddings
    dims: Callable[[Config, bool, str], ModelDims]  # (config, tied, where)
    tensors: Callable[[Config, ModelDims, str], Shapes]  # (fqn, shape), any order
    rules: tuple[RuleSpec, ...]
    memory: Callable[[Config], MemoryFlags]
    forward: ForwardSpec | None
    conv1d: bool = False  # linear weights stored [in, out]: colwise/rowwise dims swap
    # A manifest's inline ``model:`` keys (shardctl/manifest/model_keys.py): the ones the
    # inventory reads, and the ones accepted and ignored (no tensor shape depends on them).
    shape_keys: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()
    # Which layers slide when the config has ``sliding_window`` but no ``layer_types`` (the KV
    # cache per layer, shardctl/plan/memory/kv_layers.py): "none", "all" or "even" (0, 2, ...),
    # or "pattern": every ``sliding_window_pattern``-th layer global, the rest slide (Gemma-3).
    sliding_layers: str = "none"
    # "pattern" without a ``sliding_window_pattern`` in the config: the config class's default
    # (transformers' Gemma3TextConfig: 6; the published Gemma-3 configs leave the key out).
    sliding_period: int = 0
    # A multimodal family's language model: its ``text_config`` as a config of the text family
    # (``model_type`` set, the config class's defaults filled in). The memory model reads KV
    # layers, rotary tables and lengths from it (``shardctl.archs.language_model``).
    text: Callable[[Config], Config] | None = None
    # Tokens of one image's embeddings at their largest (vLLM's ``max_tokens_per_mm_item``):
    # the engine profiles its encoder on a batch of them (plan/memory/vllm.py
    # ``encoder_cache_bytes``). None: no image input, or a size not modelled.
    image_tokens: Callable[[Config], int] | None = None
    # Width of one image embedding as the engine's encoder returns and caches it, when not the
    # text hidden size (Qwen3-VL: the merger's output and each DeepStack merger's, side by
    # side: out_hidden_size × (1 + levels), vLLM ``Qwen3VLForConditionalGeneration``).
    image_width: Callable[[Config], int] | None = None
    # Bytes of the persistent buffers vLLM's model class allocates when it is built, beyond the
    # weights, on every rank: ``(config, max_num_batched_tokens, activation bytes)`` (Qwen3-VL's
    # DeepStack input buffers). vLLM counts them in "Model loading took"; the plan prices them
    # as the overhead item ``model_buffers``.
    vllm_buffers: Callable[[Config, int, int], int] | None = None
    # fqn globs of a multimodal family's vision tower and projector: ``quantization.method``
    # leaves them as stored, as the published quantized releases do (their recipes' ignore
    # lists) and as quantizing to fit means (the language model holds the bytes); a
    # ``quantization.overrides`` entry still quantizes them (plan/memory/precision.py).
    towers: tuple[str, ...] = ()
    # the inputs the tower serves where vLLM's class skips the tower when each is limited to
    # 0 items (``workload.limit_mm_per_prompt``; Qwen-VL: ``get_limit_per_prompt("image") or
    # ...("video")``, ``_mark_tower_model``). () where that is not read: the tower counts
    modalities: tuple[str, ...] = ()
    # fqn globs of tensors vLLM builds as float32 parameters whatever dtype the checkpoint
    # stores them in (MiniMax-M2's router: ``ReplicatedLinear(params_dtype=torch.float32)``,
    # and its float32 correction bias): with ``engine: vllm`` the plan prices them at 4 bytes
    # an element (plan/weights.py ``served_model``)
    vllm_float32: tuple[str, ...] = ()
    # (a checkpoint's (fqn, shape) pairs, config, where) -> None: refuses, in one line, tensors
    # stored in a layout the rules do not describe (Qwen3-VL-MoE's experts as transformers 5
    # saves them); called wherever a checkpoint or record is inventoried (model/inventory.py)
    check_tensors: Callable[[Iterable[tuple[str, tuple[int, ...]]], Config, str], None] | None = (
        None
    )
    follows: str = ""  # the engine code whose placement the rules follow
    # False: plan/memory/shapes.py's Llama/Mixtral closed-form counts do not describe this
    # family (DeepSeek's MLA, dense-first layers, shared experts); plan counts by kind from
    # the layout engine instead (plan/memory/layout_counts.py).
    closed_form: bool = True
    # fqn globs of the weights a quantization_config quantizes (shardctl/quant/expand.py: a
    # config without a checkpoint); a checkpoint's own names say it for themselves. Default:
    # the decoder layers' linear projections (attention, MLP, per-expert ones, MLA's
    # kv_a_proj_with_mqa); routers, norms, embeddings and the head stay 16-bit.
    quantizable: tuple[str, ...] = LINEAR_PROJECTIONS
    # (fqn glob, dtype): tensors a quantized checkpoint (config with quantization_config) stores
    # in another dtype than the model's 16-bit one, as the published files do (DeepSeek-V3's FP8
    # release keeps mlp.gate.e_score_correction_bias in F32; save_pretrained writes it BF16).
    quantized_dtypes: tuple[tuple[str, str], ...] = ()
    # (first transformers version, fqn glob): tensors that ``save_pretrained`` of a 16-bit
    # model keeps in F32 from that version on (the model's ``_keep_in_fp32_modules_strict``).
    # A config's ``transformers_version`` (the writer's, which save_pretrained records) says
    # which applies; a config without one is read as written before any (shardctl/model/archs.py).
    fp32_kept: tuple[tuple[str, str], ...] = ()
    # ---- megatron-moe: Megatron-Core torch_dist (None: --format megatron refuses the family)
    megatron: MegatronDecl | None = None
    # vllm-families: how vLLM names and fuses the tensors in ``sharded_state``
    # (shardctl/formats/vllm/spec.py); None: ``--format vllm`` refuses the family.
    vllm: VllmNames | None = None


# ---- config readers ----------------------------------------------------------------------


def get_int(config: Config, key: str, where: str, *, default: int | None = None) -> int:
    """A positive integer field; ``default`` (if given) when the key is absent or null."""
    value = config.get(key)
    if value is None:
        if default is not None:
            return default
        raise InvalidInputError(
            f"missing {key!r} (needed to derive tensor shapes)",
            where=where,
            hint=f'add "{key}": <positive integer> to the config',
        )
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"{key!r}: expected a positive integer, got {value!r}", where=where)
    return value


def get_bool(config: Config, key: str, where: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidInputError(f"{key!r}: expected true or false, got {value!r}", where=where)
    return value


def divide(a: int, b: int, what: str, where: str) -> int:
    if a % b:
        raise InvalidInputError(
            f"{what}: {a} is not divisible by {b}", where=where, hint="set 'head_dim' explicitly"
        )
    return a // b


def local_div(what: str, n: int, tp: int) -> int:
    """``n / tp`` for a rank's local config; the forward level needs even splits."""
    if n % tp:
        raise InvalidInputError(
            f"forward level needs tp={tp} to divide {what}={n}",
            hint="uneven tensor-parallel splits are checked by --level bitwise only",
        )
    return n // tp
