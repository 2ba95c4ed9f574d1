"""Live memory of running ranks against a plan (``shardctl watch``).

``procs`` finds the processes (``--pid``, ``--torchrun``) and reads their RSS from ``/proc``;
``nvml`` reads per-process GPU memory through NVML when a GPU exists; ``sampler`` joins
both with the plan's per-rank figures into records the CLI renders (table or JSON lines).
Linux only (``/proc``); nothing here prints.
"""
