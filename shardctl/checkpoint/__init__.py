"""Checkpoint formats below the commands: reading HF directories (:mod:`.hf`, with its index
:mod:`.hf_index`, path rules :mod:`.paths` and strict JSON :mod:`.strict_json`), the shardctl
layout record (:mod:`.record`), opening any input as one :class:`~.source.Source`, input
digests (:mod:`.input_check`), output-file header planning (:mod:`.plan_files`) and the
at-a-glance summary ``inspect`` prints (:mod:`.summary`).

``reshard``, ``verify`` and ``inspect`` import this package; it imports none of them.
"""
