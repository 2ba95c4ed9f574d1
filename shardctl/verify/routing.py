"""Pin MoE expert selection to the float64 reference's, so routing ties cannot cry wolf.

Why: in bf16, a token whose router scores for its k-th and (k+1)-th expert are nearly tied
picks either one depending on the last bit of its hidden state. The sharded model sums
row-parallel partial products in another order than the unsharded one, so that last bit differs,
the token goes to another expert, and its logits move by far more than the dtype's noise —
Mixtral bf16 TP2 failed 3 seeds of 8 (max-abs 0.036 against a bound of 0.019) on shards that
were byte-identical to the original. A float32 model passes at 2e-7.

What: the float64 reference runs first and records, for every MoE layer, which experts each
token chose (``router_indices``, ``[tokens, top_k]``). The unsharded model in the checkpoint's
dtype and every sharded rank then run with those indices imposed; each still computes its own
router logits and weights its chosen experts by its *own* softmax probabilities at those
indices (renormalized as the family does). So everything except the discrete choice is each
model's own arithmetic, and the level stays sharp: a misplaced or swapped expert still computes
the wrong function for the tokens pinned to it, and a wrong router weight still gives wrong
routing weights — the tests' negative cases (swapped experts, wrong gate) still fail.

The router is found by shape, not by family: in each decoder layer, the module with a ``top_k``
whose parent holds ``experts`` (``mlp.gate`` of Mixtral / Qwen-MoE, ``mlp.router`` of gpt-oss,
``feed_forward.router`` of Llama-4). Two output contracts are known: transformers 5's top-k
router, ``(router_logits, scores [T, k], indices [T, k])``; and Llama-4's, ``(scores [T, E],
router_logits [T, E])`` with the chosen experts' sigmoid scores and zeros elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

# layer index (global) -> [tokens, top_k] expert ids, as nested lists (JSON-able for RankJob)
Routing = dict[int, list[list[int]]]
Hook = Callable[[nn.Module, Any, Any], Any]
Weigh = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, chosen) -> weights


def routers(layers: nn.ModuleList, first_layer: int = 0) -> dict[int, nn.Module]:
    """``global layer index -> router module`` for the MoE layers among ``layers``."""
    found: dict[int, nn.Module] = {}
    for i, layer in enumerate(layers):
        for parent in layer.modules():
            if not isinstance(getattr(parent, "experts", None), nn.Module):
                continue
            for name, child in parent.named_children():
                if name != "experts" and hasattr(child, "top_k"):
                    found[first_layer + i] = child
    return found


def _chosen(module: nn.Module, output: Any) -> torch.Tensor:
    """The ``[T, k]`` expert ids a router's output chose."""
    if len(output) == 3:  # (logits, scores, indices)
        return output[2]
    logits = output[1]  # Llama-4: (scores [T, E], logits [T, E])
    return torch.topk(logits, int(getattr(module, "top_k", 1)), dim=-1).indices


@contextmanager
def _hooked(
    layers: nn.ModuleList, first_layer: int, hook_for: Callable[[int], Hook | None]
) -> Iterator[None]:
    """Register ``hook_for(layer index)`` (if not None) on each MoE router while inside."""
    handles = []
    for index, gate in routers(layers, first_layer).items():
        hook = hook_for(index)
        if hook is not None:
            handles.append(gate.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def record(
    layers: nn.ModuleList, into: Routing, first_layer: int = 0
) -> AbstractContextManager[None]:
    """Record each MoE layer's chosen experts during the forwards run inside the block."""

    def hook_for(index: int) -> Hook:
        def hook(m: nn.Module, _a: Any, output: Any) -> None:
            into[index] = _chosen(m, output).detach().to("cpu").tolist()

        return hook

    return _hooked(layers, first_layer, hook_for)


def pin(
    layers: nn.ModuleList,
    routing: Routing,
    *,
    normalize: bool,
    first_layer: int = 0,
    own: Routing | None = None,
    weigh: Weigh | None = None,
) -> AbstractContextManager[None]:
    """Impose ``routing``'s expert choices on the MoE layers among ``layers``.

    ``normalize``: the family renormalizes the top-k probabilities to sum to 1 (Mixtral
    always; Qwen-MoE when ``norm_topk_prob``). ``own`` (if given) receives the choices the
    model would have made itself. ``weigh`` (:func:`weigher`) replaces the softmax rule for a
    family whose router weighs its experts otherwise (DeepSeek: sigmoid, scaling factor).
    """

    def hook_for(index: int) -> Hook | None:
        if index not in routing:
            return None

        def hook(m: nn.Module, _a: Any, output: Any) -> Any:
            indices = _chosen(m, output)
            if own is not None:
                own[index] = indices.detach().to("cpu").tolist()
            pinned = torch.tensor(routing[index], dtype=indices.dtype, device=indices.device)
            if pinned.shape != indices.shape:
                return output  # a different input shape: nothing to impose
            if len(output) == 2:  # Llama-4: sigmoid of the chosen logits, zeros elsewhere
                dense, logits = output
                chosen = torch.sigmoid(logits.float().gather(-1, pinned)).to(dense.dtype)
                return torch.zeros_like(dense).scatter_(-1, pinned, chosen), logits
            logits, scores, _ = output
            if weigh is not None:
                weights = weigh(logits, pinned)
            else:
                probs = torch.softmax(logits.float(), dim=-1)
                weights = probs.gather(-1, pinned)
                if normalize:
                    weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), pinned

        return hook

    return _hooked(layers, first_layer, hook_for)


def weigher(config: dict[str, Any]) -> Weigh | None:
    """The family's own routing-weight rule (``ForwardSpec.route_weights``), bound to
    ``config``; None for the softmax rule :func:`pin` applies by default."""
    from shardctl.archs import find

    family = find(str(config.get("model_type")))
    rule = family.forward.route_weights if family and family.forward else None
    if rule is None:
        return None
    return lambda logits, indices: rule(logits, indices, config)


def normalizes(config: dict[str, Any]) -> bool:
    """Whether the family renormalizes its top-k routing weights (transformers' behaviour)."""
    if "norm_topk_prob" in config:
        return bool(config["norm_topk_prob"])
    return True  # Mixtral: always


def disagreements(a: Routing, b: Routing) -> int:
    """Token-layer choices where two recorded routings differ (as sets of experts)."""
    count = 0
    for index in a.keys() & b.keys():
        for x, y in zip(a[index], b[index], strict=False):
            count += set(x) != set(y)
    return count
