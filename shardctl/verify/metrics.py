"""Logit error figures and the dtype-calibrated tolerance of the forward level.

The tolerance is not a fixed number: it is measured. Both the sharded model and the unsharded
model (transformers' own class, loaded from SRC, in the checkpoint's dtype) are compared with a
float64 forward of the same weights. Tensor parallelism changes the order of summation, so the
sharded error differs from the unsharded one, but by a small factor; a wrong layout (a naive
split of a fused tensor, swapped halves, a wrong kv head) misses by orders of magnitude::

    pass  iff  sharded[m] <= MULTIPLES[m] * unsharded[m] + FLOORS[m] * scale[m]   for every m

``MULTIPLES``: 4× for the absolute errors; 16× (= 4²) for KL, which is quadratic in a small
logit perturbation (a 2× larger error is a 4× larger KL).
``scale`` makes the floor relative: the reference logits' RMS for the two absolute errors,
1 for KL. The floor only matters where the unsharded error is ~0 (float32 or float64 weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MULTIPLES: dict[str, float] = {"max_abs": 4.0, "mean_abs": 4.0, "kl": 16.0}
FLOORS: dict[str, float] = {"max_abs": 1e-5, "mean_abs": 1e-6, "kl": 1e-9}


@dataclass(frozen=True)
class Errors:
    max_abs: float
    mean_abs: float
    kl: float  # mean over positions of KL(softmax(reference) || softmax(x)), in nats

    def as_dict(self) -> dict[str, float]:
        return {"max_abs": self.max_abs, "mean_abs": self.mean_abs, "kl": self.kl}


def errors(x: torch.Tensor, reference: torch.Tensor) -> Errors:
    x64 = x.to(torch.float64)
    r64 = reference.to(torch.float64)
    diff = (x64 - r64).abs()
    log_p = torch.log_softmax(r64, dim=-1)
    log_q = torch.log_softmax(x64, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return Errors(float(diff.max()), float(diff.mean()), max(0.0, float(kl)))


def bounds(unsharded: Errors, reference: torch.Tensor) -> dict[str, float]:
    """The largest sharded error that passes, per figure."""
    rms = float(reference.to(torch.float64).pow(2).mean().sqrt())
    scale = {"max_abs": rms, "mean_abs": rms, "kl": 1.0}
    base = unsharded.as_dict()
    return {m: MULTIPLES[m] * base[m] + FLOORS[m] * scale[m] for m in base}


def within(sharded: Errors, limit: dict[str, float]) -> list[str]:
    """Names of the figures over their bound (empty: pass)."""
    got = sharded.as_dict()
    return [m for m in got if not got[m] <= limit[m]]
