"""Closed-form parameter counts per rank, by tensor kind, from the model's dimensions.

The layout engine knows every shard exactly; this module reproduces its totals in O(1) per
``(stage, tp, ep)`` so the search can price hundreds of meshes in milliseconds. Default TP
style (Megatron-LM / vLLM): q/k/v, gate/up and experts' w1/w3 column-parallel
``S(0)`` with their biases; o/down and w2 row-parallel ``S(1)`` with replicated biases;
embedding and head vocab-parallel; norms and routers replicated; experts contiguous over ``ep``.

Per decoder layer, for hidden ``h``, heads ``a``, KV heads ``k``, head dim ``d``,
intermediate ``f``, tp degree ``t`` (Shoeybi et al. 2019, Megatron-LM §3)::

    attention   (a·d·h + 2·k_r·d·h) / t-ish   + o: a·d·h / t     k_r = KV heads per rank
    MLP (gated) 3·f·h / t        (GPT-2: 2·f·h / t)
    norms       2·h (RMSNorm) or 4·h (LayerNorm with bias), replicated

``k_r = k / t`` when ``t`` divides ``k``, else one whole head (replicated K/V; vLLM
``num_kv_head_replicas``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardctl.archs import MemoryFlags, find
from shardctl.errors import LayoutError
from shardctl.layout.pipeline import assign_layers
from shardctl.layout.types import Stage
from shardctl.model.types import ModelDims, ModelInfo


@dataclass(frozen=True)
class Counts:
    """Elements one rank holds, by how quantization and optimizers treat them.

    ``matrices``/``rows``/``cols`` describe the quantizable matrices (``linear`` + ``expert``):
    their number, and the sums of their local out- and in-features (per-channel scales,
    GPTQ ``g_idx``).
    """

    linear: int = 0
    expert: int = 0
    embedding: int = 0
    head: int = 0
    norm: int = 0  # norms, biases, routers, position embeddings
    matrices: int = 0
    rows: int = 0
    cols: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.expert + self.embedding + self.head + self.norm

    @property
    def expert_free(self) -> int:
        """Parameters replicated over ``ep`` (everything but experts)."""
        return self.total - self.expert

    def __add__(self, o: Counts) -> Counts:
        return Counts(
            self.linear + o.linear,
            self.expert + o.expert,
            self.embedding + o.embedding,
            self.head + o.head,
            self.norm + o.norm,
            self.matrices + o.matrices,
            self.rows + o.rows,
            self.cols + o.cols,
        )

    def times(self, n: int) -> Counts:
        return Counts(
            self.linear * n,
            self.expert * n,
            self.embedding * n,
            self.head * n,
            self.norm * n,
            self.matrices * n,
            self.rows * n,
            self.cols * n,
        )


@dataclass(frozen=True)
class ModelShape:
    """ModelDims plus what counting needs that the dims leave out (biases, norm kind)."""

    dims: ModelDims
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False  # LayerNorm with bias (GPT-2) vs RMSNorm
    positions: int = 0  # learned position-embedding rows (GPT-2 wpe), replicated
    vocab_padding: str = "tp"  # none | tp | megatron
    layer_norm_numel: int | None = None  # per layer, from the inventory (Qwen3 q/k norms)
    final_norm_numel: int | None = None
    # per-head norms ``[heads, head_dim]`` split with their heads (Cohere q/k norm): elements per
    # q head and per kv head, per layer
    q_head_norm: int = 0
    kv_head_norm: int = 0
    head_bias: bool = False  # a vocab-parallel LM-head bias (Phi-1/2 ``lm_head.bias [V]``)


def shape_from_model(model: ModelInfo, *, vocab_padding: str = "tp") -> ModelShape:
    """Bias and norm flags from the inventory's tensor names, else from the config."""
    assert model.dims is not None
    dims = model.dims
    cfg = model.config
    if model.tensors:
        # One pass picks the few tensors the questions below look at (each needs one of these
        # words in its name; 90,000 expert tensors have none), the finer tests run on those.
        picked = [
            t
            for t in model.tensors
            if "bias" in t.fqn or "norm" in t.fqn or "ln_" in t.fqn or "wpe.weight" in t.fqn
        ]
        biases = [t.fqn for t in picked if t.fqn.endswith(".bias")]

        def has(*parts: str) -> bool:
            return any(any(p in n for p in parts) for n in biases)

        qkv_bias = has("q_proj", "qkv_proj", "c_attn", "query_key_value")
        o_bias = has("o_proj", "attn.c_proj", "dense.")
        mlp_bias = has(
            "up_proj", "gate_up_proj", "c_fc", "down_proj", "mlp.c_proj", "dense_h_to_4h", "fc1"
        )
        norm_bias = has("norm", "ln_")
        positions = next((t.shape[0] for t in picked if t.fqn.endswith("wpe.weight")), 0)
        named = [t for t in picked if "norm" in t.fqn or "ln_" in t.fqn]  # as _is_norm needs
        norms = [t for t in named if len(t.shape) == 1 and _is_norm(t.fqn)]
        layer_norm = sum(t.numel for t in norms if _first_layer(t.fqn))
        final_norm = sum(t.numel for t in norms if not _in_layer(t.fqn))
        heads = [t for t in named if len(t.shape) == 2 and _is_norm(t.fqn) and _first_layer(t.fqn)]
        q_head = sum(t.shape[1] for t in heads if t.shape[0] == dims.num_heads)
        kv_head = sum(t.shape[1] for t in heads if t.shape[0] != dims.num_heads)
        return ModelShape(
            dims,
            qkv_bias,
            o_bias,
            mlp_bias,
            norm_bias,
            positions,
            vocab_padding,
            layer_norm,
            final_norm,
            q_head,
            kv_head,
            head_bias="lm_head.bias" in biases,
        )
    # No tensor names: the family file says what its config implies.
    family = find(model.architecture)
    f = family.memory(cfg) if family is not None else MemoryFlags()
    return ModelShape(
        dims, f.qkv_bias, f.o_bias, f.mlp_bias, f.norm_bias, f.positions, vocab_padding
    )


def _is_norm(fqn: str) -> bool:
    # the module holding the tensor, or its parent: StableLM's q_layernorm.norms.{h}.weight
    if "norm" not in fqn and "ln_" not in fqn:
        return False  # the test below needs one of them; 90,000 experts skip the split
    return any("norm" in p or p.startswith("ln_") for p in fqn.split(".")[-3:-1])


def _first_layer(fqn: str) -> bool:
    """In layer 0: its first numeric component is the layer index (not StableLM's norms.0)."""
    index = next((p for p in fqn.split(".") if p.isdigit()), None)
    return index == "0" and _in_layer(fqn)


def _in_layer(fqn: str) -> bool:
    return ".layers." in fqn or ".h." in fqn or fqn.startswith("h.")


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one tp rank holds: ``k / t``, or one whole (replicated) head when ``t > k``."""
    return num_kv_heads // tp if tp <= num_kv_heads else 1


def vocab_rows_per_rank(vocab: int, tp: int, padding: str = "tp") -> int:
    """Rows of the vocab-parallel embedding / head on one tp rank, padding included.

    ``tp``: pad to a multiple of ``tp`` (vLLM pads to 64, Megatron to 128·tp: ``megatron``).
    """
    if padding == "megatron":
        mult = 128 * tp
    elif padding == "tp":
        mult = tp
    else:
        if vocab % tp:
            raise LayoutError(
                f"vocab_size {vocab} is not divisible by tp={tp}",
                where="layout.vocab_padding",
                hint="use vocab_padding: tp",
            )
        mult = tp
    return -(-vocab // mult) * mult // tp


def lora_layer_params(dims: ModelDims, rank: int, targets: str, tp: int) -> int:
    """LoRA parameters of one decoder layer on one tp rank: ``r · (in + out)`` per target
    matrix at its local sizes (column-parallel: ``A [r, in]`` replicated, ``B [out/t, r]``;
    row-parallel: ``A [r, in/t]``, ``B [out, r]`` — Megatron-Bridge / vLLM punica layouts).
    Dense MLP or, for MoE, the experts' share is not adapted (PEFT ``all-linear`` matches
    ``nn.Linear`` modules; packed experts are parameters).

    >>> from shardctl.model.types import ModelDims
    >>> d = ModelDims(4096, 32, 32, 8, 128, 14336, 128256, False)  # Llama-3-8B
    >>> lora_layer_params(d, 16, "all-linear", 1) * 32  # PEFT reports 41,943,040
    41943040
    """
    h, t = dims.hidden_size, tp
    q = dims.num_heads * dims.head_dim
    kv = kv_heads_per_rank(dims.num_kv_heads, t) * dims.head_dim
    attn = (h + q // t) + 2 * (h + kv) + (q // t + h)  # q, k, v colwise; o rowwise
    f = dims.intermediate_size // t
    mlp = 0 if dims.num_experts else ((h + f) * (2 if dims.gated_mlp else 1) + (f + h))
    per = {"all-linear": attn + mlp, "attention": attn, "mlp": mlp}[targets]
    return rank * per


def layer_counts(shape: ModelShape, tp: int, ep: int = 1) -> Counts:
    """One decoder layer's elements on one ``(tp, ep)`` rank."""
    d = shape.dims
    h, hd, t = d.hidden_size, d.head_dim, tp
    q = d.num_heads * hd // t
    kv = kv_heads_per_rank(d.num_kv_heads, t) * hd
    lin = (q + 2 * kv) * h + h * q
    # q [q, h], k and v [kv, h], o [h, q]: four matrices
    rows, cols, mats = q + 2 * kv + h, 3 * h + q, 4
    norm = (4 if shape.norm_bias else 2) * h
    if shape.layer_norm_numel is not None:
        norm = shape.layer_norm_numel
    norm += d.num_heads // t * shape.q_head_norm
    norm += kv_heads_per_rank(d.num_kv_heads, t) * shape.kv_head_norm
    if shape.qkv_bias:
        norm += q + 2 * kv
    if shape.o_bias:
        norm += h
    n_mlp = 3 if d.gated_mlp else 2
    f = d.intermediate_size // t
    expert = 0
    if d.num_experts:
        per_rank = d.num_experts // ep
        expert = per_rank * n_mlp * f * h
        rows += per_rank * ((n_mlp - 1) * f + h)
        cols += per_rank * ((n_mlp - 1) * h + f)
        mats += per_rank * n_mlp
        norm += d.num_experts * h  # router [E, h], replicated
    else:
        lin += n_mlp * f * h
        rows += (n_mlp - 1) * f + h
        cols += (n_mlp - 1) * h + f
        mats += n_mlp
        if shape.mlp_bias:
            norm += (n_mlp - 1) * f + h
    return Counts(linear=lin, expert=expert, norm=norm, matrices=mats, rows=rows, cols=cols)


def stage_counts(shape: ModelShape, stage: Stage, pp: int, tp: int, ep: int = 1) -> Counts:
    """Everything one ``(stage, tp, ep)`` rank holds: its layers, plus the embedding on the
    first stage and the final norm and head on the last (a tied head also on the last stage
    when ``pp > 1``; DESIGN.md)."""
    d = shape.dims
    c = layer_counts(shape, tp, ep).times(stage.num_layers)
    rows = vocab_rows_per_rank(d.vocab_size, tp, shape.vocab_padding)
    emb = rows * d.hidden_size
    extra = Counts()
    if stage.index == 0:
        extra = extra + Counts(embedding=emb, norm=shape.positions * d.hidden_size)
    if stage.index == pp - 1:
        head = emb if (not d.tie_word_embeddings or pp > 1) else 0
        final_norm = (2 if shape.norm_bias else 1) * d.hidden_size
        if shape.final_norm_numel is not None:
            final_norm = shape.final_norm_numel
        bias = rows if shape.head_bias else 0  # split with the head's rows
        extra = extra + Counts(head=head, norm=final_norm + bias)
    return c + extra


def split_layers(
    num_layers: int,
    pp: int,
    convention: str = "even",
    layers_per_stage: tuple[int, ...] | None = None,
) -> tuple[Stage, ...]:
    """Stages for ``pp`` by the layout engine's own rule (one split for plan and reshard)."""
    return assign_layers(num_layers, pp, convention, layers_per_stage)
