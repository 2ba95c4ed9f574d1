"""Which format each tensor is stored in: ``quantization.method``, ``keep_16bit`` and
``overrides``, resolved per fqn (a mixed-precision checkpoint, priced tensor by tensor).

Per tensor, the first rule that applies::

    1. the first ``overrides`` entry whose ``match`` (fnmatch on the full name) matches:
       ``dtype: bf16`` -> dense in that dtype; ``method: none`` -> as stored;
       ``method: fp8`` (any method) -> that format, if the tensor is a matrix
    2. a ``keep_16bit`` glob matches, or the family's vision tower or projector
       (``Family.towers``) -> as stored (16-bit)
    3. ``method`` is set and the tensor is a matrix -> that format
    4. otherwise as stored

A *matrix* is a tensor of 2 or more dims other than an MoE router (``[E, hidden]``): norms,
biases and routers stay in 16-bit under every format, as GPTQ, AWQ, bitsandbytes, FBGEMM and
vLLM's fp8 leave them. Meta's Llama-3.1-405B-Instruct-FP8 (``fbgemm_fp8``: fp8 per-row MLPs,
attention and the first and last layers' MLPs in bf16) is::

    quantization:
      method: fp8
      fp8_scaling: channel
      overrides:
        - {match: "*.self_attn.*", method: none}
        - {match: "model.layers.0.mlp.*", method: none}
        - {match: "model.layers.125.mlp.*", method: none}
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from shardctl.globs import first_match
from shardctl.model.types import ModelInfo, TensorInfo
from shardctl.plan.memory.spec import DEFAULT_GROUP_SIZE, FP8_BLOCK, QuantSpec, formula_of


@dataclass(frozen=True)
class Format:
    """How one tensor is stored: ``formula`` (a :func:`~.quant.matrix_bytes` name) or dense
    (``formula`` None) in ``dtype`` (None: the tensor's own dtype)."""

    formula: str | None = None
    dtype: str | None = None
    group_size: int = 0
    double_quant: bool = False
    transposed: bool = False  # a Conv1D weight stored [in, out] (GPT-2)


AS_STORED = Format()


def is_matrix(t: TensorInfo, num_experts: int) -> bool:
    """A tensor a weight format quantizes: 2+ dims, not an MoE router ``[E, hidden]``."""
    shape = t.shape
    if len(shape) < 2:
        return False
    return not (num_experts and len(shape) == 2 and shape[0] == num_experts)


def _quantized(method: str, scaling: str, group: int | None, double: bool) -> Format:
    if group is None:
        group = FP8_BLOCK if method == "fp8" and scaling == "block" else DEFAULT_GROUP_SIZE[method]
    return Format(formula_of(method, scaling), None, group, double)


def tensor_format(
    t: TensorInfo, quant: QuantSpec, num_experts: int, first: int | None = -1
) -> Format:
    """The format of ``t`` under ``quant`` (see the module docstring for the order);
    ``first``: the index of the first override matching ``t`` (None: none) when the caller
    knows it, -1 to look it up here."""
    if first == -1:
        hits = (i for i, o in enumerate(quant.overrides) if fnmatchcase(t.fqn, o.match))
        first = next(hits, None)
    if first is not None:
        o = quant.overrides[first]
        if o.dtype is not None:
            return Format(None, o.dtype)
        if o.method is None or o.method == "none" or not is_matrix(t, num_experts):
            return AS_STORED
        return _quantized(o.method, o.fp8_scaling, o.group_size, quant.double_quant)
    if any(fnmatchcase(t.fqn, g) for g in quant.keep_16bit):
        return AS_STORED
    if quant.method != "none" and is_matrix(t, num_experts):
        return _quantized(quant.method, quant.fp8_scaling, quant.group_size, quant.double_quant)
    return AS_STORED


# (the model's tensor tuple, the spec) -> fqn -> format; the search prices thousands of meshes
# of one model, so the globs run once per tensor, not once per mesh.
_FORMATS: dict[tuple[int, QuantSpec], tuple[tuple[TensorInfo, ...], dict[str, Format]]] = {}


def tensor_formats(model: ModelInfo, quant: QuantSpec) -> dict[str, Format]:
    """fqn -> :class:`Format` for every tensor of ``model`` (cached per model and spec)."""
    key = (id(model.tensors), quant)
    hit = _FORMATS.get(key)
    if hit is not None and hit[0] is model.tensors:
        return hit[1]
    from dataclasses import replace

    from shardctl.archs import find

    experts = model.dims.num_experts if model.dims is not None else 0
    family = find(model.architecture)
    conv1d = family is not None and family.conv1d
    formats: dict[str, Format] = {}
    first = first_match(tuple(o.match for o in quant.overrides))
    tower = first_match(family.towers if family is not None else ())
    for t in model.tensors:
        override = first(t.fqn)
        if override is None and tower(t.fqn) is not None:
            formats[t.fqn] = AS_STORED
            continue
        fmt = tensor_format(t, quant, experts, override)
        if conv1d and fmt.formula is not None and _conv1d_weight(t):
            fmt = replace(fmt, transposed=True)
        formats[t.fqn] = fmt
    if len(_FORMATS) > 16:
        _FORMATS.clear()
    _FORMATS[key] = (model.tensors, formats)
    return formats


def _conv1d_weight(t: TensorInfo) -> bool:
    """A decoder ``Conv1D`` weight of a ``conv1d`` family (not the ``[V, H]`` / ``[P, H]``
    embedding tables or a head, which are ``nn.Embedding`` / ``nn.Linear``)."""
    name = t.fqn.rsplit(".", 2)[-2] if t.fqn.count(".") >= 1 else t.fqn
    return len(t.shape) == 2 and name not in ("wte", "wpe", "lm_head")


def priced_per_tensor(quant: QuantSpec | None) -> bool:
    """Whether weights are priced tensor by tensor in their formats (a method or overrides)."""
    return quant is not None and (quant.method != "none" or bool(quant.overrides))
