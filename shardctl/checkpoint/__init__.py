"""Checkpoint formats below the commands: reading HF directories (:mod:`.hf`), the shardctl
layout record (:mod:`.record`), opening any input as one :class:`~.source.Source`, input
digests (:mod:`.input_check`) and output-file header planning (:mod:`.plan_files`).

``reshard``, ``verify`` and ``inspect`` import this package; it imports none of them.
"""
