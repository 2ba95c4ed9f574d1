"""Model states for training: weights, gradients, optimizer states; ZeRO; offload.

Mixed-precision Adam(W) keeps per parameter (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", §3.1): 16-bit weights (2 bytes),
16-bit gradients (2), and ``K = 12`` bytes of fp32 master weights, momentum and variance —
``2Ψ + 2Ψ + 12Ψ = 16Ψ``. Megatron-LM accumulates gradients in an fp32 ``main_grad``
(``grad_dtype: F32``): 2 + 4 + 12 = 18 bytes.

ZeRO over the ``Nd`` data-parallel ranks (ZeRO §5, Figure 1; Ψ = 7.5e9, Nd = 64):

    stage 0 (DDP)         2Ψ + 2Ψ + KΨ                 120   GB
    stage 1 (P_os)        2Ψ + 2Ψ + KΨ/Nd               31.4 GB
    stage 2 (P_os+g)      2Ψ + (2 + K)Ψ/Nd              16.6 GB
    stage 3 (P_os+g+p)    (2 + 2 + K)Ψ/Nd                1.9 GB

PyTorch FSDP's ``NO_SHARD``/``SHARD_GRAD_OP``/``FULL_SHARD`` are stages 0/2/3. Offload
(Ren et al. 2021, "ZeRO-Offload"; Rajbhandari et al. 2021, "ZeRO-Infinity") moves the
optimizer states (and with stage 3 the parameters) to host memory or NVMe.
"""

from __future__ import annotations

from dataclasses import dataclass

# Optimizer-state bytes per parameter *beyond* the 16-bit weights and gradients, for
# mixed precision (fp32 master weights included). ``(per_param, source)``.
OPTIMIZERS: dict[str, tuple[float, str]] = {
    # fp32 master + m + v (ZeRO §3.1, K = 12).
    "adamw": (12.0, "Rajbhandari et al. 2020 §3.1 (K = 12)"),
    "adam": (12.0, "Rajbhandari et al. 2020 §3.1 (K = 12)"),
    # fp32 master + momentum buffer (torch.optim.SGD momentum_buffer).
    "sgd": (8.0, "torch.optim.SGD: fp32 master + momentum_buffer"),
    # fp32 master + one momentum (Chen et al. 2023, "Symbolic Discovery of Optimization
    # Algorithms", Lion keeps only the momentum).
    "lion": (8.0, "Chen et al. 2023 (Lion): fp32 master + momentum"),
    # fp32 master + int8 m and v + one fp32 absmax per 2048-element block for each
    # (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization").
    "adamw-8bit": (4.0 + 2.0 + 2 * 4 / 2048, "Dettmers et al. 2022 (block-wise 8-bit Adam)"),
    # fp32 master + factored second moment (a row and a column vector per matrix, about
    # 2/h per parameter; Shazeer & Stern 2018, "Adafactor"), no first moment.
    "adafactor": (4.0, "Shazeer & Stern 2018 (Adafactor, factored, beta1 = 0)"),
}


def optimizer_bytes_per_param(
    optimizer: str, *, hidden: int = 0, mixed_precision: bool = True
) -> float:
    """Optimizer-state bytes per parameter; pure fp32 training drops the 4-byte master copy.

    >>> optimizer_bytes_per_param("adamw")
    12.0
    """
    per, _ = OPTIMIZERS[optimizer]
    if optimizer == "adafactor" and hidden:
        per += 4 * 2 / hidden
    return per if mixed_precision else per - 4.0


@dataclass(frozen=True)
class ModelStates:
    """One rank's training states in bytes, and what offload moved off the device."""

    weights: int
    gradients: int
    optimizer: int
    host: int = 0  # bytes this rank keeps in CPU memory (offload)
    nvme: int = 0  # bytes this rank keeps on NVMe (offload)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def model_states(
    params: int,
    *,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
    zero: int = 0,
    dp: int = 1,
    offload_optimizer: str = "none",
    offload_params: str = "none",
    weights_stored: int | None = None,
) -> ModelStates:
    """States of a rank holding ``params`` parameters (its model-parallel share), sharded
    over ``dp`` ranks by ZeRO stage ``zero``.

    ``weights_stored`` overrides ``params × weight_bytes`` with the exact (or quantized) bytes
    the layout engine reports. Shards round up: the last rank holds the remainder.

    >>> s = model_states(7_500_000_000, zero=1, dp=64)
    >>> round(s.total / 1e9, 1)  # ZeRO paper, Figure 1: P_os
    31.4
    """
    w = weights_stored if weights_stored is not None else int(params * weight_bytes)
    g = int(params * grad_bytes)
    o = int(params * optimizer_bytes)

    def shard(n: int) -> int:
        return -(-n // dp)

    if zero >= 1:
        o = shard(o)
    if zero >= 2:
        g = shard(g)
    if zero >= 3:
        w = shard(w)
    host = nvme = 0
    if offload_optimizer != "none":
        # ZeRO-Offload keeps the fp32 master, states and the optimizer step on the host.
        if offload_optimizer == "cpu":
            host += o
        else:
            nvme += o
        o = 0
    if offload_params != "none":
        if offload_params == "cpu":
            host += w
        else:
            nvme += w
        w = 0
    return ModelStates(w, g, o, host, nvme)
