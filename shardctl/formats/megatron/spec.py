"""What a Megatron-Core ``GPTModel`` must be built with to load an HF checkpoint, and refusals.

``spec_from_config(config, tp=2)`` reads ``config.json`` (a dict) and returns a frozen
:class:`MegatronSpec`; everything Megatron cannot represent is one :class:`InvalidInputError`
line (what, where, expected vs actual, what to do). Megatron has no K/V replication: the query
groups must divide by TP. Megatron pads the vocabulary to a multiple of
``make_vocab_size_divisible_by · tp`` (default 128): the padded size is part of the checkpoint.

Which families are written, and how, is the family file's declaration (``Family.megatron``, a
:class:`~shardctl.archs._family.MegatronDecl`: HF module names, router kind, MLA); every size,
bias, norm, MoE layer and MTP layer is read from the family's own inventory of the config.
This module names no family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardctl.errors import InvalidInputError

VOCAB_DIVISOR = 128  # Megatron-LM's --make-vocab-size-divisible-by default


@dataclass(frozen=True)
class MegatronSpec:
    """The mcore model's shape: ``MegatronSpec("llama", layers=32, heads=32, groups=8, ...)``.

    Derived from the family's declaration (``Family.megatron``, shardctl/archs/_family.py) and
    its inventory; nothing here names a family."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    groups: int  # num_query_groups (= HF num_key_value_heads)
    head_dim: int  # kv_channels
    ffn: int  # the dense MLP's (or, for a model with no dense layer, the experts')
    vocab: int  # the HF vocabulary
    padded_vocab: int  # Megatron's (multiple of 128·tp)
    tied: bool
    qkv_bias: bool  # add_qkv_bias
    qk_norm: bool  # qk_layernorm
    experts: int  # 0 = dense
    topk: int
    rope_theta: float
    eps: float
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # MoE details. The defaults are what a sidecar written before these fields means (every
    # layer MoE, experts at ``ffn``, the ``block_sparse_moe`` / w1-w3-w2 names of that time)
    moe_layers: tuple[int, ...] | None = None  # None: all layers (when experts > 0)
    moe_ffn: int = 0  # 0: ffn
    shared_ffn: int = 0  # shared expert(s) intermediate size; 0: none
    shared_gate: bool = False  # moe_shared_expert_gate (sigmoid, [1, H])
    router_pre_softmax: bool = False  # softmax over all experts before top-k (no renorm)
    router_score: str = "softmax"  # | "sigmoid"
    router_bias: bool = False  # moe_router_enable_expert_bias (e_score_correction_bias)
    router_groups: int = 0  # moe_router_num_groups
    router_group_topk: int = 0
    router_scale: float = 1.0  # moe_router_topk_scaling_factor
    # MLA (multi_latent_attention) dims; kv_lora_rank 0 = ordinary attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head_dim: int = 0
    # HF module names (from the family's declaration; defaults: see "MoE details")
    hf_moe: str = "block_sparse_moe"
    hf_expert: tuple[str, str, str] = ("w1", "w3", "w2")
    hf_shared: str = ""
    hf_shared_gate: str = ""
    rope_scaling: dict[str, Any] | None = None  # yarn etc. (recorded; mcore's rope_type)
    mtp_layers: int = 0  # multi-token prediction: HF model.layers.{layers + k} -> mtp.layers.k

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.groups) * self.head_dim

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    def is_moe_layer(self, i: int) -> bool:
        return self.moe and (self.moe_layers is None or i in self.moe_layers)

    @property
    def stacked(self) -> bool:
        """mcore stacks the layers on a leading axis unless they differ (``moe_layer_freq``
        a list: MoE and dense layers mixed), then keys are ``decoder.layers.{i}.``."""
        return not self.moe or self.moe_layers is None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def padded_vocab(vocab: int, tp: int, divisor: int = VOCAB_DIVISOR) -> int:
    """Megatron's ``_vocab_size_with_padding``: up to a multiple of ``divisor · tp``."""
    multiple = divisor * tp
    return -(-vocab // multiple) * multiple


def _int(cfg: dict[str, Any], key: str, where: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise InvalidInputError(
            f"config.json {key}: expected a positive integer, got {v!r}",
            where=where,
            hint="fix config.json",
        )
    return v


def spec_from_config(
    cfg: dict[str, Any], *, tp: int = 1, pp: int = 1, ep: int = 1, where: str = "config.json"
) -> MegatronSpec:
    """The mcore spec for ``cfg`` at the given degrees; one-line refusals for what Megatron
    cannot load. Sizes, biases and norms come from the family's own inventory of ``cfg``."""
    from shardctl.archs import find

    mt = cfg.get("model_type")
    fam = find(mt) if isinstance(mt, str) else None
    decl = fam.megatron if fam is not None else None
    if fam is None or decl is None:
        raise InvalidInputError(
            f"format megatron: model_type {mt!r} is not supported "
            f"(supported: {', '.join(supported())})",
            where=where,
            hint="write --format ranks or hf for this model",
        )
    tied = bool(cfg.get("tie_word_embeddings", fam.tied_default))
    dims = fam.dims(cfg, tied, where)
    inv = dict(fam.tensors(cfg, dims, where))
    layers, hidden = dims.num_layers, dims.hidden_size
    heads, groups, head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
    vocab = dims.vocab_size
    p0 = "model.layers.0."

    def refuse(what: str, hint: str = "write --format ranks or hf for this model") -> None:
        raise InvalidInputError(f"format megatron: {mt} {what}", where=where, hint=hint)

    biases = sorted(n for n in inv if n.endswith(".bias") and "_proj.bias" in n)
    if any(not n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for n in biases):
        refuse(
            "with attention_bias/mlp_bias has biases on o_proj/MLP that the GPT spec "
            "(add_bias_linear=False) cannot hold"
        )
    mtp = sorted({i for n in inv if (i := _layer_of(n) or 0) >= layers})
    if mtp and not (decl.mla and f"model.layers.{layers}.eh_proj.weight" in inv):
        refuse(f"has layers past num_hidden_layers ({mtp[0]}, ...) that are no MTP layer")
    moe_layers = (
        tuple(i for i in range(layers) if f"model.layers.{i}.{decl.moe}.gate.weight" in inv)
        if decl.moe
        else ()
    )
    experts = dims.num_experts if moe_layers else 0
    topk = dims.experts_per_token if experts else 0
    dense = [i for i in range(layers) if i not in moe_layers]
    ffn = dims.intermediate_size
    if dense:
        ffn = inv[f"model.layers.{dense[0]}.mlp.gate_proj.weight"][0]
    moe_ffn = shared_ffn = 0
    kw: dict[str, Any] = {}
    if experts:
        m = f"model.layers.{moe_layers[0]}.{decl.moe}."
        moe_ffn = inv[f"{m}experts.0.{decl.expert[0]}.weight"][0]
        if decl.shared:
            shared_ffn = inv[f"{m}{decl.shared}.gate_proj.weight"][0]
        kw.update(_router(cfg, decl.router, experts, topk, where, refuse))
    if decl.mla:
        q_lora = inv.get(p0 + "self_attn.q_a_proj.weight", (0,))[0]
        if not q_lora:
            refuse("without q_lora_rank (plain q_proj) is not supported by --format megatron")
        kv_a = inv[p0 + "self_attn.kv_a_proj_with_mqa.weight"][0]
        kv_lora = inv[p0 + "self_attn.kv_a_layernorm.weight"][0]
        qk_rope = kv_a - kv_lora
        qk_nope = inv[p0 + "self_attn.q_b_proj.weight"][0] // heads - qk_rope
        v_dim = inv[p0 + "self_attn.o_proj.weight"][1] // heads
        kw.update(
            q_lora_rank=q_lora,
            kv_lora_rank=kv_lora,
            qk_nope=qk_nope,
            qk_rope=qk_rope,
            v_head_dim=v_dim,
        )
        groups = heads  # MLA has no query groups
    elif heads % groups:
        raise InvalidInputError(
            f"config.json: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {groups}",
            where=where,
        )
    if not decl.mla and groups % tp:
        raise InvalidInputError(
            f"format megatron: tp {tp} does not divide num_key_value_heads {groups} "
            "(Megatron has no K/V head replication)",
            where=where,
            hint=f"use a tp that divides {groups}: {_divisors(groups)}",
        )
    if decl.mla and heads % tp:
        raise InvalidInputError(
            f"format megatron: tp {tp} does not divide num_attention_heads {heads}",
            where=where,
            hint=f"use a tp that divides {heads}: {_divisors(heads)}",
        )
    for what, size in (
        ("intermediate_size", ffn),
        ("the experts' intermediate size", moe_ffn),
        ("the shared experts' intermediate size", shared_ffn),
    ):
        if size % tp:
            raise InvalidInputError(
                f"format megatron: tp {tp} does not divide {what} {size}",
                where=where,
                hint=f"use a tp that divides {size}",
            )
    last_stage = last_stage_layers(layers, pp)
    if last_stage is not None and last_stage < 1:
        raise InvalidInputError(
            f"format megatron: pp {pp} cannot split num_hidden_layers {layers} (Megatron gives "
            f"every stage but the last {-(-layers // pp)} layers, leaving the last none)",
            where=where,
            hint=f"use a pp that divides {layers}: {_divisors(layers)}",
        )
    if mtp and experts and layers - 1 not in moe_layers:
        refuse("has MTP layers after a dense last layer: mcore builds them like the last layer")
    if ep > 1 and (not experts or experts % ep):
        raise InvalidInputError(
            f"format megatron: ep {ep} needs a number of experts it divides, got {experts}",
            where=where,
            hint="use --ep 1" if not experts else f"use an ep that divides {experts}",
        )
    return MegatronSpec(
        model_type=mt,  # type: ignore[arg-type]
        layers=layers,
        hidden=hidden,
        heads=heads,
        groups=groups,
        head_dim=head_dim,
        ffn=ffn,
        vocab=vocab,
        padded_vocab=padded_vocab(vocab, tp),
        tied=tied,
        qkv_bias=p0 + "self_attn.q_proj.bias" in inv,
        qk_norm=p0 + "self_attn.q_norm.weight" in inv,
        experts=experts,
        topk=topk,
        rope_theta=_rope_theta(cfg),
        rope_scaling=_rope_params(cfg),
        mtp_layers=len(mtp),
        eps=float(cfg.get("rms_norm_eps") or 1e-6),
        tp=tp,
        pp=pp,
        ep=ep,
        moe_layers=None if len(moe_layers) in (0, layers) else moe_layers,
        moe_ffn=moe_ffn if moe_ffn != ffn else 0,
        shared_ffn=shared_ffn,
        shared_gate=bool(decl.shared_gate),
        hf_moe=decl.moe or "block_sparse_moe",
        hf_expert=decl.expert,
        hf_shared=decl.shared,
        hf_shared_gate=decl.shared_gate,
        **kw,
    )


def last_stage_layers(layers: int, pp: int) -> int | None:
    """The last pipeline stage's layers when ``pp`` does not divide ``layers`` (Megatron-LM's
    ``--decoder-last-pipeline-num-layers``; the other stages get ``ceil(layers / pp)``), else
    None. The checkpoint holds global tensors: only the load flags depend on it."""
    if layers % pp == 0:
        return None
    return layers - -(-layers // pp) * (pp - 1)


def supported() -> list[str]:
    """The model_types whose family declares how Megatron-Core holds it."""
    from shardctl.archs import FAMILIES

    return sorted(t for t, f in FAMILIES.items() if f.megatron is not None)


def _layer_of(fqn: str) -> int | None:
    parts = fqn.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling parameters other than plain rope (yarn for DeepSeek-V3), or {}."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not isinstance(params, dict):
        return {}
    kind = params.get("rope_type") or params.get("type")
    if kind in (None, "default"):
        return {}
    return {k: v for k, v in params.items() if isinstance(v, int | float | str)}


def _router(
    cfg: dict[str, Any], kind: str, experts: int, topk: int, where: str, refuse: Any
) -> dict[str, Any]:
    """The mcore router settings equal to the family's HF routing (refused where none is)."""
    if kind == "softmax_topk":  # top-k of the logits, softmax over them (= renormalized)
        return {}
    if kind == "softmax":  # softmax over all, top-k, renormalized iff norm_topk_prob
        return {"router_pre_softmax": not bool(cfg.get("norm_topk_prob", False))}
    if kind != "sigmoid_bias":
        refuse(f"declares an unknown router {kind!r}")
    if (cfg.get("scoring_func") or "sigmoid") != "sigmoid" or (
        cfg.get("topk_method") or "noaux_tc"
    ) != "noaux_tc":
        refuse("routing other than sigmoid/noaux_tc has no Megatron-Core router here")
    if not cfg.get("norm_topk_prob", True) and topk > 1:
        refuse("with norm_topk_prob false: Megatron's sigmoid router always renormalizes")
    groups = int(cfg.get("n_group") or 1)
    group_topk = int(cfg.get("topk_group") or 1)
    if groups > 1 and (experts % groups or topk % group_topk or topk // group_topk != 2):
        refuse(
            f"group-limited routing (n_group {groups}, topk_group {group_topk}, top-k {topk}) "
            "scores a group by its top 2 in transformers but by its top "
            f"top-k/topk_group in Megatron: they differ here"
        )
    return {
        "router_score": "sigmoid",
        "router_bias": True,
        "router_groups": groups if groups > 1 else 0,
        "router_group_topk": group_topk if groups > 1 else 0,
        "router_scale": float(cfg.get("routed_scaling_factor") or 1.0),
    }


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta) if isinstance(theta, int | float) else 10000.0


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def load_flags(spec: MegatronSpec) -> str:
    """The Megatron-LM arguments that build the model this checkpoint holds."""
    flags = [
        f"--tensor-model-parallel-size {spec.tp}",
        f"--pipeline-model-parallel-size {spec.pp}",
        *(
            [f"--decoder-last-pipeline-num-layers {last}"]
            if (last := last_stage_layers(spec.layers, spec.pp)) is not None
            else []
        ),
        f"--num-layers {spec.layers}",
        f"--hidden-size {spec.hidden}",
        f"--ffn-hidden-size {spec.ffn}",
        f"--num-attention-heads {spec.heads}",
        "--normalization RMSNorm --swiglu --disable-bias-linear",
        "--position-embedding-type rope",
        f"--rotary-base {_num(spec.rope_theta)}",  # an int in Megatron-LM's arguments
        f"--norm-epsilon {spec.eps:g}",
        "--make-vocab-size-divisible-by 128",
        "--ckpt-format torch_dist --finetune --no-load-optim --no-load-rng",
    ]
    if not spec.mla:
        flags.append(
            f"--group-query-attention --num-query-groups {spec.groups} "
            f"--kv-channels {spec.head_dim}"
        )
    if spec.moe or spec.mla:
        # the keys are the local spec's; the TE spec's MoE/MLA norm keys differ (docs/megatron.md)
        flags.append("--transformer-impl local")
    if not spec.tied:
        flags.append("--untie-embeddings-and-output-weights")
    if spec.qkv_bias:
        flags.append("--add-qkv-bias")
    if spec.qk_norm:
        flags.append("--qk-layernorm")
    if spec.mla:
        flags.append(
            f"--multi-latent-attention --q-lora-rank {spec.q_lora_rank} "
            f"--kv-lora-rank {spec.kv_lora_rank} --qk-head-dim {spec.qk_nope} "
            f"--qk-pos-emb-head-dim {spec.qk_rope} --v-head-dim {spec.v_head_dim} --qk-layernorm"
        )
        rope = spec.rope_scaling or {}
        if rope.get("rope_type", rope.get("type")) == "yarn":
            flags.append(f"--rope-type yarn --rotary-scaling-factor {_num(rope['factor'])}")
            for key in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
                if key in rope:
                    flags.append(f"--{key.replace('_', '-')} {_num(rope[key])}")
            if "original_max_position_embeddings" in rope:
                flags.append(
                    "--original-max-position-embeddings "
                    f"{int(rope['original_max_position_embeddings'])}"
                )
        else:
            flags.append("--rope-type rope")
    if spec.mtp_layers:
        flags.append(f"--mtp-num-layers {spec.mtp_layers}")
    if spec.moe:
        flags.append(
            f"--num-experts {spec.experts} --moe-router-topk {spec.topk} "
            f"--expert-model-parallel-size {spec.ep}"
        )
        if spec.moe_ffn:
            flags.append(f"--moe-ffn-hidden-size {spec.moe_ffn}")
        if spec.moe_layers is not None:
            pattern = ",".join("1" if spec.is_moe_layer(i) else "0" for i in range(spec.layers))
            flags.append(f"--moe-layer-freq '[{pattern}]'")
        if spec.shared_ffn:
            flags.append(f"--moe-shared-expert-intermediate-size {spec.shared_ffn}")
        if spec.shared_gate:
            flags.append("--moe-shared-expert-gate")
        if spec.router_pre_softmax:
            flags.append("--moe-router-pre-softmax")
        if spec.router_score != "softmax":
            flags.append(f"--moe-router-score-function {spec.router_score}")
        if spec.router_bias:
            flags.append("--moe-router-enable-expert-bias")
        if spec.router_groups:
            flags.append(
                f"--moe-router-num-groups {spec.router_groups} "
                f"--moe-router-group-topk {spec.router_group_topk}"
            )
        if spec.router_scale != 1.0:
            flags.append(f"--moe-router-topk-scaling-factor {_num(spec.router_scale)}")
    return " ".join(flags)
