"""Quantized weight bytes: payload bits plus the scales, zeros and indices each format stores.

Per quantizable matrix of ``n`` elements, ``r`` local rows (out-features) and ``c`` columns
(in-features), group size ``g``:

- ``int8``: ``n + 4r`` (fp32 scale per output row) — Dettmers et al. 2022, LLM.int8()
  (bitsandbytes ``SCB``).
- ``gptq`` (and ``int4``): ``n/2 + 2n/g + n/(2g) + 4c`` — int4 ``qweight``, fp16 ``scales``,
  int4 ``qzeros`` packed in int32, int32 ``g_idx`` per in-feature; Frantar et al. 2023,
  AutoGPTQ / transformers ``QuantLinear`` buffers.
- ``awq``: ``n/2 + 2n/g + n/(2g)`` (no ``g_idx``) — Lin et al. 2024, AutoAWQ ``WQLinear_GEMM``.
- ``nf4``: ``n/2 + 4n/64``; with double quantization ``n/2 + n/64 + 4n/(64·256)`` (0.127 bit
  per parameter of constants instead of 0.5) — Dettmers et al. 2023, QLoRA §3.
- ``fp8``: ``n + 4`` (one fp32 scale per tensor) — Micikevicius et al. 2022, FP8 formats;
  vLLM ``Fp8LinearMethod``.
- ``fp8-channel``: ``n + 4r`` (one fp32 scale per output row) — FBGEMM ``fbgemm_fp8``
  (Meta's Llama-3.1-405B-FP8: ``weight_scale`` F32 ``[out, 1]``), vLLM ``FBGEMMFp8Config``.
- ``fp8-block``: ``n + 4·n/(128·128)`` (fp32 scale per 128×128 block) — DeepSeek-V3 §3.3.
- ``mxfp4``: ``n/2 + n/32`` (E2M1, one E8M0 scale per 32) — OCP Microscaling Formats v1.0.
- ``nvfp4``: ``n/2 + n/16 + 4`` (E2M1, an E4M3 scale per 16, an fp32 scale per tensor) —
  NVIDIA TensorRT Model Optimizer NVFP4 docs.

Embeddings, the head and norms (with biases and routers) stay in the model's 16-bit dtype by
default (``QuantSpec.keep_16bit``), as GPTQ, AWQ, bitsandbytes and vLLM's fp8 leave them.
The methods are :data:`~shardctl.plan.memory.spec.QUANT_METHODS`; ``fp8-block`` here is
``fp8`` with ``fp8_scaling: block`` (``fp8-channel``: ``fp8_scaling: channel``).

:func:`tensor_bytes` prices one rank's local piece of one tensor (its shape from the layout
engine), so a mixed-precision model (``quantization.overrides``) is priced tensor by tensor.
"""

from __future__ import annotations

from shardctl.plan.memory.shapes import Counts
from shardctl.plan.memory.spec import QUANT_KINDS


def matrix_bytes(
    method: str,
    n: int,
    rows: int,
    cols: int,
    matrices: int,
    *,
    group_size: int = 128,
    double_quant: bool = True,
) -> int:
    """Bytes of ``matrices`` quantized matrices holding ``n`` elements in total.

    >>> matrix_bytes("gptq", 4096 * 4096, 4096, 4096, 1)  # one 4096² layer, g = 128
    8732672
    """
    g = group_size
    if method == "int8":
        return n + 4 * rows
    if method in ("gptq", "int4"):  # int4 = GPTQ's layout, the larger of the two
        return n // 2 + 2 * n // g + n // (2 * g) + 4 * cols
    if method == "awq":
        return n // 2 + 2 * n // g + n // (2 * g)
    if method == "nf4":
        blocks = -(-n // 64)
        if double_quant:
            return n // 2 + blocks + 4 * -(-blocks // 256)
        return n // 2 + 4 * blocks
    if method == "fp8":
        return n + 4 * matrices
    if method == "fp8-channel":
        return n + 4 * rows
    if method == "fp8-block":
        return n + 4 * -(-n // (128 * 128))
    if method == "mxfp4":
        return n // 2 + -(-n // 32)
    if method == "nvfp4":
        return n // 2 + -(-n // 16) + 4 * matrices
    raise AssertionError(method)


def quantized_weight_bytes(
    counts: Counts,
    *,
    method: str,
    dense_bytes: int,
    group_size: int = 128,
    double_quant: bool = True,
    keep: tuple[str, ...] = QUANT_KINDS,
) -> int:
    """One rank's weight bytes under ``method``; kept kinds at ``dense_bytes`` per element."""
    n = counts.linear + counts.expert
    q = matrix_bytes(
        method,
        n,
        counts.rows,
        counts.cols,
        counts.matrices,
        group_size=group_size,
        double_quant=double_quant,
    )
    other = 0
    for kind in QUANT_KINDS:
        numel = getattr(counts, kind)
        if kind in keep or kind == "norm":
            other += numel * dense_bytes
        else:
            # A quantized embedding or head: same format, one matrix of V_r rows × h cols.
            other += matrix_bytes(
                method,
                numel,
                0,
                0,
                1 if numel else 0,
                group_size=group_size,
                double_quant=double_quant,
            )
    return q + other


def tensor_bytes(
    method: str,
    shape: tuple[int, ...],
    *,
    group_size: int = 128,
    double_quant: bool = True,
    transposed: bool = False,
) -> int:
    """Bytes of one local tensor piece of ``shape`` stored as ``method`` (a
    :func:`matrix_bytes` name): a matrix ``[r, c]``, or ``[*lead, r, c]`` packed experts
    (``lead`` matrices of ``[r, c]``); ``transposed``: stored ``[in, out]`` (GPT-2's
    ``Conv1D``), so per-output-row scales count ``c``.

    >>> tensor_bytes("fp8-channel", (1024, 4096))  # fp8 payload + an fp32 scale per row
    4198400
    >>> tensor_bytes("fp8-block", (200, 300), group_size=128)  # 2 x 3 blocks of 128 x 128
    60024
    """
    n = 1
    for d in shape:
        n *= d
    *lead, r, c = shape if len(shape) >= 2 else (1, n)
    if transposed:
        r, c = c, r
    m = 1
    for d in lead:
        m *= d
    if method == "fp8-block":
        g = group_size or 128
        return n + 4 * m * -(-r // g) * -(-c // g)
    return matrix_bytes(
        method, n, m * r, m * c, m, group_size=group_size or 128, double_quant=double_quant
    )
