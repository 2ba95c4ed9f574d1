"""Checks on a target mesh and on the model's config, made before any layout is built.

Both are cheap (one pass over the tensor list) and run before :func:`build_layout`, which
materializes ``tp`` shards per replicated tensor: ``--tp 1048576`` on a 4-layer model used to
spend seconds and gigabytes before the first divisibility error (RELIABILITY K).

- :func:`check_mesh`: a degree larger than anything it could split is refused at once:
  ``tp`` above every tensor dim or above the attention heads, ``pp`` above the layers, ``ep``
  above the experts.
- :func:`check_config`: ``config.json`` must agree with the tensors it describes — the
  embedding table is ``[vocab_size, hidden_size]``, ``q_proj`` has ``heads × head_dim`` rows and
  ``k_proj``/``v_proj`` ``kv_heads × head_dim``. A config claiming 8 KV heads on a 2-head
  checkpoint would otherwise be split mid-head (exit 3, naming the field and both numbers).
"""

from __future__ import annotations

from operator import attrgetter

from shardctl.dtypes import DTYPE_BITS
from shardctl.errors import LayoutError
from shardctl.layout.types import Mesh
from shardctl.model.types import ModelInfo

_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")
_EMBED = ("embed_tokens.weight", ".wte.weight", "word_embeddings.weight")


def check_mesh(model: ModelInfo, mesh: Mesh) -> None:
    """Refuse degrees that could never produce a layout of ``model`` (exit 3)."""
    # per distinct shape (90,000 experts share a handful)
    largest = max((max(s) for s in set(map(_SHAPE, model.tensors)) if s), default=1)
    if mesh.tp > 1 and mesh.tp > largest:
        raise LayoutError(
            f"tp={mesh.tp} is larger than every tensor dim of the model (largest {largest})",
            where="mesh.tp",
            hint="pick a tp that divides the attention heads",
        )
    dims = model.dims
    if dims is None:
        return
    if dims.num_heads > 0 and mesh.tp > dims.num_heads:
        raise LayoutError(
            f"tp={mesh.tp} is larger than the model's {dims.num_heads} attention heads",
            where="mesh.tp",
            hint="tp must divide num_attention_heads",
        )
    if dims.num_layers > 0 and mesh.pp > dims.num_layers:
        raise LayoutError(
            f"pp={mesh.pp} is larger than the model's {dims.num_layers} layers",
            where="mesh.pp",
            hint="every pipeline stage needs at least one layer",
        )
    if mesh.ep > max(1, dims.num_experts):
        raise LayoutError(
            f"ep={mesh.ep} is larger than the model's {dims.num_experts} experts",
            where="mesh.ep",
            hint="ep must divide num_local_experts (1 for a dense model)",
        )


# A multimodal model's own encoders (Llama-4's vision_model.*) have their own config section:
# the decoder's heads and hidden size say nothing about their tensors.
_ENCODERS = ("vision_model.", "vision_tower.", "visual.", "audio_tower.")
_CHECKED = (
    *_EMBED,
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
)


def check_config(model: ModelInfo) -> None:
    """The config's heads, vocabulary and hidden size agree with the tensors (exit 3)."""
    dims = model.dims
    if dims is None:
        return
    # only the names checked below: one endswith per name picks them
    for t in [t for t in model.tensors if t.fqn.endswith(_CHECKED)]:
        if len(t.shape) != 2 or t.fqn.startswith(_ENCODERS):
            continue
        rows, cols = t.shape
        if t.fqn.endswith(_EMBED) and "position" not in t.fqn:
            _agree(t.fqn, "vocab_size", dims.vocab_size, rows)
            _agree(t.fqn, "hidden_size", dims.hidden_size, cols)
        elif t.fqn.endswith("self_attn.q_proj.weight") and dims.head_dim > 0:
            _agree(t.fqn, "num_attention_heads × head_dim", dims.num_heads * dims.head_dim, rows)
        elif t.fqn.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            if dims.head_dim > 0:
                _agree(
                    t.fqn,
                    "num_key_value_heads × head_dim",
                    dims.num_kv_heads * dims.head_dim,
                    rows,
                )


def check_dtypes(model: ModelInfo) -> None:
    """Sub-byte dtypes (F4, F6_*) pack several elements per byte: shardctl slices whole bytes,
    so it cannot cut or even copy them element-wise (exit 3 naming the tensor)."""
    if all(DTYPE_BITS.get(d, 8) % 8 == 0 for d in set(map(_DTYPE, model.tensors))):
        return  # no sub-byte dtype (the usual case: decided per distinct dtype)
    for t in model.tensors:
        if DTYPE_BITS.get(t.dtype, 8) % 8:
            raise LayoutError(
                f"dtype {t.dtype} is sub-byte ({DTYPE_BITS[t.dtype]} bits per element); "
                "shardctl cannot reshard it",
                where=t.fqn,
                hint="store it as U8 with its packing recorded, or convert it elsewhere",
            )


def _agree(fqn: str, field: str, config: int, tensor: int) -> None:
    if config > 0 and config != tensor:
        raise LayoutError(
            f"config.json contradicts the tensors: {field} = {config}, but the tensor has {tensor}",
            where=fqn,
            hint="fix config.json (or the checkpoint); nothing was split",
        )


__all__ = ["check_config", "check_dtypes", "check_mesh"]
