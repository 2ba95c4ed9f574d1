"""``shardctl inspect`` of a DCP training checkpoint: tensors, optimizer state, step, ranks.

Reads ``.metadata``; the only data read are the 0-d ``step`` tensors and the ``param_groups``
objects (a few bytes each).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from shardctl.checkpoint.summary import FileSummary, InspectResult, RankSummary
from shardctl.formats.dcp.metadata import read_metadata
from shardctl.formats.dcp.read import DcpReader
from shardctl.formats.dcp.state import MODEL_PREFIX, carried_files
from shardctl.formats.dcp.write_hf import st_name
from shardctl.model.inventory import from_tensors
from shardctl.model.types import TensorInfo

MAX_STEPS_READ = 4096  # step tensors read for the summary (each is a 0-d tensor)
HYPER = ("lr", "betas", "eps", "weight_decay")


def inspect_dcp(root: Path) -> InspectResult:
    md = read_metadata(root)
    tensors = tuple(
        TensorInfo(k[len(MODEL_PREFIX) :], t.shape, st_name(t.dtype))
        for k, t in md.tensors.items()
        if k.startswith(MODEL_PREFIX)
    )
    model = from_tensors(root, tensors)
    states: Counter[str] = Counter()
    optim_bytes = 0
    steps: list[float] = []
    with DcpReader(md) as reader:
        for key, t in md.tensors.items():
            if not key.startswith("optimizer.state."):
                continue
            name = key.rpartition(".")[2]
            states[name] += 1
            optim_bytes += t.nbytes
            if name == "step" and t.shape == () and len(steps) < MAX_STEPS_READ:
                steps.append(float(reader.tensor(key)))
        groups: dict[str, dict[str, Any]] = {}
        for key in md.objects:
            parts = key.split(".")
            if len(parts) == 4 and parts[:2] == ["optimizer", "param_groups"]:
                if parts[3] in HYPER:
                    value = reader.obj(key)
                    groups.setdefault(parts[2], {})[parts[3]] = (
                        list(value) if isinstance(value, tuple) else value
                    )
    per_file: dict[str, list[int]] = {n: [0, 0] for n in md.files}
    for t in md.tensors.values():
        for c in t.chunks:
            per_file[c.file][0] += 1
            per_file[c.file][1] += math.prod(c.sizes) * t.dtype.itemsize
    ranks = tuple(
        RankSummary(i, {"dp": i}, n, b, (name,))
        for i, (name, (n, b)) in enumerate(per_file.items())
    )
    others = sorted({k.split(".")[0] for k in [*md.tensors, *md.objects]} - {"model", "optimizer"})
    dcp = {
        "files": len(md.files),
        "model_tensors": len(tensors),
        "optimizer_tensors": sum(states.values()),
        "optimizer_bytes": optim_bytes,
        "optimizer_state": dict(sorted(states.items())),
        "step": None if not steps else {"min": min(steps), "max": max(steps)},
        "param_groups": [groups[k] for k in sorted(groups, key=_num)],
        "objects": len(md.objects),
        "other_keys": others,
    }
    return InspectResult(
        path=root,
        kind="dcp",
        model=model,
        files=tuple(FileSummary(n, (root / n).stat().st_size, c) for n, (c, _) in per_file.items()),
        carried=carried_files(root, set(md.files), (".distcp",)),
        mesh={"pp": 1, "dp": len(md.files), "ep": 1, "tp": 1},
        layout_format="dcp",
        ranks=ranks,
        extra={"dcp": dcp},
    )


def _num(s: str) -> tuple[int, str]:
    return (int(s), "") if s.isdigit() else (1 << 30, s)
