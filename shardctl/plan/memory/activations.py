"""Activation memory: what training stores for the backward pass, and inference's prefill peak.

Training, per decoder layer and micro-batch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4 and Table 2; ``s`` sequence, ``b`` micro-batch,
``h`` hidden, ``a`` heads, ``t`` tp; 16-bit activations, 1-byte dropout masks)::

    no parallelism          sbh · (34 + 5as/h)
    tensor parallel         sbh · (10 + 24/t + 5as/(ht))
    + sequence parallel     sbh · (34/t + 5as/(ht))
    + selective recompute   sbh · 34/t
    full recompute          2sbh            (only the layer input; /t with sequence parallel)

Generalized here term by term (derivation in docs/memory-model.md), with ``q = a·d`` query
width, ``kv = k_r·d`` K/V width per rank, ``f`` intermediate size, ``B`` bytes per element:

- replicated over tp unless sequence parallel: the two norm inputs ``2·sbh·B``, the QKV and
  MLP inputs ``2·sbh·B``, two dropout masks ``2·sbh`` (only with dropout) → ``10sbh``
  for B = 2 with dropout;
- split over tp: Q, K, V and the output-projection input ``sb(2q + 2kv)·B/t``; the MLP
  ``sb·2f·B/t`` (GeLU input and output) or, gated, ``sb·3f·B/t`` (gate and up outputs and
  their product, Megatron-LM's fused SwiGLU saves exactly these) → ``24sbh/t`` for MHA,
  ``f = 4h``, B = 2;
- attention scores ``as²b·(B + 1 + B)`` (softmax output, dropout mask, dropout output) or
  ``as²b·B`` without dropout, split over tp; flash attention (Dao et al. 2022) stores none of
  them, only the fp32 log-sum-exp ``4·asb``;
- MoE (Fedus et al. 2022): each token's expert MLP runs ``top_k`` times (× capacity factor),
  its dispatched input and expert output kept ``2·h·B`` per routed token, plus fp32 router
  probabilities ``4·sbE``.

Beyond the layers (Korthikanti §4.3): the last stage keeps the final-norm and head inputs
``4sbh/t`` and fp32 logits for the loss ``4sbV/t`` → ``4sbh/t · (1 + V/h)``; the first stage
an embedding dropout mask ``sbh/t`` (with dropout).
"""

from __future__ import annotations

from shardctl.model.types import ModelDims
from shardctl.plan.memory.shapes import kv_heads_per_rank


def layer_activation_bytes(
    dims: ModelDims,
    *,
    seq: int,
    batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash_attention: bool = False,
    dropout: bool = True,
    act_bytes: int = 2,
    capacity_factor: float = 1.0,
    saved: str = "korthikanti",
    kv_seq: int | None = None,
) -> int:
    """Bytes one decoder layer stores for backward, for one micro-batch on one tp rank.

    ``kv_seq``: keys each query attends over when it differs from ``seq`` — context parallelism
    holds ``seq = s/cp`` queries per rank against all ``s`` keys (ring attention).

    ``saved="transformers"``: what autograd saves in transformers' own Llama-style modules
    (measured with ``torch.autograd.graph.saved_tensors_hooks``, tests/test_memory_engines.py):
    each RMSNorm keeps an fp32 copy of its input, the fp32 ``rsqrt`` and its 16-bit normalized
    output besides the weighted output the next Linear saves — ``(8 + 4B)·h + 8`` per token for
    the two norms instead of ``4B·h`` — and the unfused SwiGLU keeps gate, up, ``act(gate)``
    and their product, ``4·f·B/t`` instead of ``3·f·B/t``.

    >>> from shardctl.model.types import ModelDims
    >>> gpt = ModelDims(4096, 1, 32, 32, 128, 16384, 50257, False, gated_mlp=False)
    >>> s, b, h, a = 2048, 1, 4096, 32
    >>> layer_activation_bytes(gpt, seq=s, batch=b) == s * b * h * (34 + 5 * a * s // h)
    True
    """
    s, b, h, t, nb = seq, batch, dims.hidden_size, tp, act_bytes
    tokens = s * b
    sp = t if sequence_parallel else 1
    if recompute == "full":
        # Only the layer's input is kept (Korthikanti Table 2: 2sbh).
        return tokens * h * nb // sp
    q = dims.num_heads * dims.head_dim // t
    kv = kv_heads_per_rank(dims.num_kv_heads, t) * dims.head_dim
    heads = dims.num_heads // t
    mask = 1 if dropout else 0
    replicated = tokens * h * (4 * nb + 2 * mask)
    hf = saved == "transformers"
    if hf:
        replicated = tokens * ((8 + 4 * nb) * h + 8 + 2 * mask * h)
    split = tokens * (2 * q + 2 * kv) * nb
    if dims.num_experts:
        k = max(dims.experts_per_token, 1)
        routed = int(tokens * k * capacity_factor)
        n_mlp = (4 if hf else 3) if dims.gated_mlp else 2
        split += routed * n_mlp * dims.intermediate_size * nb // t
        replicated += routed * 2 * h * nb + tokens * dims.num_experts * 4
    else:
        n_mlp = (4 if hf else 3) if dims.gated_mlp else 2
        split += tokens * n_mlp * dims.intermediate_size * nb // t
    if flash_attention:
        scores = 4 * heads * s * b  # fp32 log-sum-exp per query and head
    elif recompute == "selective":
        scores = 0  # recomputed in backward (Korthikanti §5)
    else:
        keys = s if kv_seq is None else kv_seq
        scores = heads * s * keys * b * (2 * nb + mask if dropout else nb)
    return replicated // sp + split + scores


def last_stage_activation_bytes(
    dims: ModelDims,
    *,
    seq: int,
    batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    act_bytes: int = 2,
    vocab_rows: int | None = None,
    saved: str = "korthikanti",
) -> int:
    """Final-norm and head inputs plus fp32 logits for the loss, one micro-batch, one tp rank
    (Korthikanti §4.3: ``4sbh/t · (1 + V/h)`` with sequence parallel, B = 2).

    ``vocab_rows`` is the rank's vocab-parallel share (padding included); default ``V/t``.
    ``saved="transformers"``: the final RMSNorm keeps ``(4 + 2B)·h + 4`` per token (fp32 input
    copy, rsqrt, normalized and weighted outputs) and the loss the fp32 log-softmax.
    """
    tokens = seq * batch
    sp = tp if sequence_parallel else 1
    rows = dims.vocab_size // tp if vocab_rows is None else vocab_rows
    if saved == "transformers":
        norm = tokens * ((4 + 2 * act_bytes) * dims.hidden_size + 4) // sp
        return norm + 4 * tokens * rows
    return 2 * tokens * dims.hidden_size * act_bytes // sp + 4 * tokens * rows


def first_stage_activation_bytes(
    dims: ModelDims,
    *,
    seq: int,
    batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dropout: bool = True,
) -> int:
    """The embedding dropout mask (Korthikanti §4.3: ``sbh/t`` per micro-batch)."""
    if not dropout:
        return 0
    sp = tp if sequence_parallel else 1
    return seq * batch * dims.hidden_size // sp


def in_flight_microbatches(stage: int, pp: int, microbatches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations a stage holds at its peak.

    1F1B: stage ``i`` runs ``pp - i`` forwards before its first backward (Narayanan et al.
    2021, "Efficient Large-Scale Language Model Training on GPU Clusters", §2.2,
    PipeDream-Flush), never more than the micro-batches in the step; stage 0 holds the most.
    GPipe (Huang et al. 2019) runs every forward first: all ``m`` micro-batches.

    >>> [in_flight_microbatches(i, 4, 8) for i in range(4)]
    [4, 3, 2, 1]
    """
    if schedule == "gpipe":
        return max(1, microbatches)
    return max(1, min(pp - stage, microbatches))


def interleaved_in_flight_chunks(stage: int, pp: int, microbatches: int, virtual: int) -> int:
    """Model chunks (each ``1/virtual`` of the stage's layers, one micro-batch) whose
    activations stage ``stage`` holds at its peak under interleaved 1F1B.

    Megatron-LM ``schedules.py`` (``forward_backward_pipelining_with_interleaving``) runs
    ``(pp − stage − 1)·2 + (virtual − 1)·pp`` warm-up forwards (micro-batch groups of ``pp``)
    and one more before its first backward, never more than the ``m·virtual`` chunk forwards
    of the step (Narayanan et al. 2021 §2.2.1). Stage 0 holds ``pp·v + pp − 1`` chunks, i.e.
    ``pp · (1 + (pp − 1)/(pp·v))`` micro-batches' worth of its layers — the penalty
    Megatron's ``theoretical_memory_usage.py`` applies.

    >>> [interleaved_in_flight_chunks(i, 4, 8, 2) for i in range(4)]
    [11, 9, 7, 5]
    """
    warmup = (pp - stage - 1) * 2 + (virtual - 1) * pp
    return max(1, min(warmup + 1, microbatches * virtual))


def prefill_peak_bytes(
    dims: ModelDims,
    *,
    tokens: int,
    context: int,
    tp: int = 1,
    ep: int = 1,
    flash_attention: bool = True,
    act_bytes: int = 2,
) -> int:
    """Transient peak of one inference forward pass of ``tokens`` new tokens (no tensors kept
    across layers), one rank; each token attends over at most ``context`` tokens.

    Live at the peak: the residual stream and the normed input ``2·T·h·B``, plus the larger
    of attention (Q, K, V and the attention output ``T(2q + 2kv)·B``; eager attention also
    the fp32 scores and 16-bit probabilities ``a·T·ctx·(4 + B)``, flash attention none; Dao et
    al. 2022) and the MLP (gate, up, product ``3·T·f·B/t``; ``2·T·f·B/t`` ungated; for MoE the
    all-to-all send and receive buffers ``2·T·k·h·B`` and one expert's share at a time).
    """
    t, nb, h = tp, act_bytes, dims.hidden_size
    q = dims.num_heads * dims.head_dim // t
    kv = kv_heads_per_rank(dims.num_kv_heads, t) * dims.head_dim
    attn = tokens * (2 * q + 2 * kv) * nb
    if not flash_attention:
        attn += (dims.num_heads // t) * tokens * context * (4 + nb)
    n_mlp = 3 if dims.gated_mlp else 2
    if dims.num_experts:
        k = max(dims.experts_per_token, 1)
        experts_here = max(dims.num_experts // ep, 1)
        mlp = dispatch_buffer_bytes(tokens, k, h, nb) + (
            tokens * k * n_mlp * dims.intermediate_size * nb // t // experts_here
        )
    else:
        mlp = tokens * n_mlp * dims.intermediate_size * nb // t
    return 2 * tokens * h * nb + max(attn, mlp)


def dispatch_buffer_bytes(
    tokens: int, top_k: int, hidden: int, act_bytes: int = 2, capacity_factor: float = 1.0
) -> int:
    """MoE all-to-all send and receive buffers: ``2 · T · k · cf · h · B`` (each routed token's
    hidden state leaves and another arrives; Lepikhin et al. 2021, GShard §2.2)."""
    return int(2 * tokens * top_k * capacity_factor) * hidden * act_bytes


def logits_buffer_bytes(batch: int, vocab: int, *, positions: int = 1) -> int:
    """Inference logits: fp32 ``batch × positions × V`` after the vocab gather (vLLM's
    ``LogitsProcessor`` computes them for the sampled position only, ``positions = 1``)."""
    return 4 * batch * positions * vocab
