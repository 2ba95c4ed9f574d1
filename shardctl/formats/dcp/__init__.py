"""torch DCP training checkpoints (FSDP2 / torchtitan style) with optimizer state.

A DCP checkpoint is a directory with ``.metadata`` (every key's global shape, dtype and the
chunks that tile it, and where each chunk's bytes lie) and ``__<rank>_<n>.distcp`` files (each
chunk a ``torch.save``'d tensor at a byte range). Keys are flat, as
``torch.distributed.checkpoint.state_dict.get_state_dict`` + ``dcp.save({"model": ...,
"optimizer": ...})`` writes them::

    model.<fqn>                               a parameter or buffer, global shape
    optimizer.state.<fqn>.exp_avg             Adam moments: the parameter's global shape
    optimizer.state.<fqn>.step                a 0-d tensor (replicated)
    optimizer.param_groups.<i>.<name>         hyper-parameters, pickled bytes (lr, betas, ...)

*Resharding* a DCP checkpoint means re-chunking its storage: DCP stores global tensors and
reshards at load, so another mesh is another set of per-rank files whose chunks are the new
ranks' FSDP2 shards (``Shard(0)``, ``torch.chunk`` sizes) — parameters and their moments alike;
``step`` and the bytes items are written once, by rank 0. Conversions (``convert.reshard_dcp``):
DCP -> DCP (new world size), DCP -> HF (``model.safetensors`` + optional ``optimizer.safetensors``
sidecar), HF (+ sidecar) -> DCP. One tensor is in memory at a time.
"""
