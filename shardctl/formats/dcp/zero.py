"""DeepSpeed ZeRO-1/2 checkpoints as training state (what ``zero_to_fp32.py`` does, streaming,
without DeepSpeed installed).

On disk (``engine.save_checkpoint(dir)``; ``dir/latest`` names the tag)::

    <tag>/mp_rank_00_model_states.pt                   module (low-precision weights, buffers),
                                                       param_shapes (per group: name -> shape),
                                                       shared_params, bufferlisting
    <tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt  rank r's slice of each group's flat
                                                       fp32 master copy and of its Adam moments

Each group's parameters lie back to back in the concatenation of the ranks' flat slices (the
total padded to a multiple of ``2 * world``). A parameter's fp32 weight, ``exp_avg`` and
``exp_avg_sq`` are the same element range of the three flat vectors. Files are opened with
``torch.load(mmap=True, weights_only=True)``: only the pages of the tensor being copied are
read. DeepSpeed pickles three of its own classes (``ZeroStageEnum``, ``LossScaler``,
``fragment_address``) into the optimizer files; they are read as inert stand-ins, nothing else
beyond ``weights_only``'s allow-list is accepted. ZeRO-3, model parallel (``mp_rank_01``) and
bf16-optimizer files are refused with one line each.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from shardctl.errors import InvalidInputError
from shardctl.formats.dcp.state import MODEL_PREFIX, Item

MODEL_FILE = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class _Inert:
    """Stands in for a DeepSpeed class in a pickle: keeps its arguments and state, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


_DS_CLASSES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def is_zero(path: Path) -> bool:
    return path.is_dir() and (
        (path / MODEL_FILE).is_file()
        or ((path / "latest").is_file() and _tag_dir(path) is not None)
    )


def _tag_dir(root: Path) -> Path | None:
    if (root / MODEL_FILE).is_file():
        return root
    try:
        tag = (root / "latest").read_text().strip()
    except OSError:
        return None
    if not tag or "/" in tag or tag in (".", ".."):
        return None
    d = root / tag
    return d if (d / MODEL_FILE).is_file() else None


def _load(path: Path) -> Any:
    import torch
    from torch.serialization import safe_globals

    stand_ins = [(type(n.rsplit(".", 1)[1], (_Inert,), {}), n) for n in _DS_CLASSES]
    try:
        with safe_globals(stand_ins):  # type: ignore[arg-type]
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        raise InvalidInputError(
            f"not a readable DeepSpeed checkpoint file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]})",
            where=str(path),
            hint="only tensors, plain values and DeepSpeed's ZeRO bookkeeping classes are read",
        ) from None


class ZeroState:
    """A ZeRO-1/2 checkpoint presented as flat DCP keys (``model.<fqn>``, ``optimizer.*``)."""

    kind = "zero"

    def __init__(self, root: Path):
        self.root = root
        tag = _tag_dir(root)
        if tag is None:
            raise InvalidInputError(
                "no DeepSpeed checkpoint here", where=str(root), hint=f"expected {MODEL_FILE}"
            )
        self.tag = tag
        if (tag / "mp_rank_01_model_states.pt").exists():
            raise InvalidInputError(
                "model-parallel DeepSpeed checkpoint (mp_rank_01): not supported",
                where=str(tag),
                hint="only data-parallel ZeRO-1/2 checkpoints are read",
            )
        ranks = sorted((int(m.group(1)), tag / n) for n in listing(tag) if (m := _OPTIM.match(n)))
        if not ranks or [r for r, _ in ranks] != list(range(len(ranks))):
            raise InvalidInputError(
                "expected zero_pp_rank_<r>_mp_rank_00_optim_states.pt for ranks 0..N-1, found "
                f"{[r for r, _ in ranks] or 'none'}",
                where=str(tag),
                hint="bf16 (bf16_zero_pp_rank_*) and ZeRO-3 layouts are not read",
            )
        self.model_states = _load(tag / MODEL_FILE)
        self.optim = [_load(p)["optimizer_state_dict"] for _, p in ranks]
        self._check_stage(tag)
        self.world = len(ranks)
        self.groups: list[list[tuple[str, tuple[int, ...], int]]] = []  # (fqn, shape, offset)
        for gi, shapes in enumerate(self.model_states["param_shapes"]):
            at, group = 0, []
            for name, shape in shapes.items():
                group.append((name, tuple(int(v) for v in shape), at))
                at += math.prod(shape)
            total = sum(o["single_partition_of_fp32_groups"][gi].numel() for o in self.optim)
            if at > total:
                raise InvalidInputError(
                    f"param group {gi}: parameters need {at} elements, the ranks' slices hold "
                    f"{total}",
                    where=str(tag),
                )
            self.groups.append(group)
        self._build_items()
        self.carried = tuple(
            n for n in ("config.json", "generation_config.json") if (root / n).is_file()
        )

    def _check_stage(self, tag: Path) -> None:
        first = self.optim[0]
        stage = first.get("zero_stage")
        stage_n = stage.args[0] if isinstance(stage, _Inert) and stage.args else stage
        if stage_n not in (1, 2) or "single_partition_of_fp32_groups" not in first:
            raise InvalidInputError(
                f"ZeRO stage {stage_n}: only ZeRO-1/2 checkpoints are read",
                where=str(tag),
                hint="for ZeRO-3 run DeepSpeed's zero_to_fp32.py first",
            )

    def _build_items(self) -> None:
        import torch

        items: list[Item] = []
        self._model: dict[str, tuple[int, int] | str] = {}
        for gi, group in enumerate(self.groups):
            for idx, (name, shape, _) in enumerate(group):
                items.append(Item(MODEL_PREFIX + name, shape, torch.float32))
                self._model[name] = (gi, idx)
        module = self.model_states["module"]
        for name in self.model_states.get("bufferlisting") or []:
            t = module[name]
            items.append(Item(MODEL_PREFIX + name, tuple(t.shape), t.dtype))
            self._model[name] = "module"
        for name in self.model_states.get("frozen_param_shapes") or {}:
            t = module[name]
            items.append(Item(MODEL_PREFIX + name, tuple(t.shape), t.dtype))
            self._model[name] = "module"
        for alias, target in (self.model_states.get("shared_params") or {}).items():
            if target in self._model:
                same = next(i for i in items if i.key == MODEL_PREFIX + target)
                items.append(Item(MODEL_PREFIX + alias, same.shape, same.dtype))
                self._model[alias] = self._model[target]
        self._optim: dict[str, tuple[int, int, str]] = {}
        self._objects: dict[str, Any] = {}
        base = self.optim[0]["base_optimizer_state"]
        for gi, group in enumerate(self.groups):
            state = base["state"].get(gi, {})
            for idx, (name, shape, _) in enumerate(group):
                for key, value in state.items():
                    k = f"optimizer.state.{name}.{key}"
                    if isinstance(value, torch.Tensor) and value.dim() == 0:
                        items.append(Item(k, (), value.dtype))
                    else:
                        items.append(Item(k, shape, torch.float32))
                    self._optim[k] = (gi, idx, key)
            for key, value in base["param_groups"][gi].items():
                k = f"optimizer.param_groups.{gi}.{key}"
                self._objects[k] = [n for n, _, _ in group] if key == "params" else value
                items.append(Item(k, None))
        self.items = tuple(items)

    def _flat_range(self, gi: int, idx: int, flats: list[Any]) -> Any:
        """Elements of parameter ``idx`` of group ``gi`` from the ranks' flat slices."""
        import torch

        _, shape, begin = self.groups[gi][idx]
        numel = math.prod(shape)
        out = torch.empty(numel, dtype=torch.float32)
        at = 0  # global element index where this rank's slice starts
        with torch.no_grad():
            for flat in flats:
                n = flat.numel()
                lo, hi = max(begin, at), min(begin + numel, at + n)
                if lo < hi:
                    out[lo - begin : hi - begin].copy_(flat.detach()[lo - at : hi - at])
                at += n
        return out.view(shape)

    def tensor(self, key: str) -> Any:
        if key.startswith(MODEL_PREFIX):
            where = self._model[key[len(MODEL_PREFIX) :]]
            if where == "module":
                return self.model_states["module"][key[len(MODEL_PREFIX) :]].detach().clone()
            assert isinstance(where, tuple)
            gi, idx = where
            flats = [o["single_partition_of_fp32_groups"][gi] for o in self.optim]
            return self._flat_range(gi, idx, flats)
        gi, idx, name = self._optim[key]
        values = [o["base_optimizer_state"]["state"][gi][name] for o in self.optim]
        if values[0].dim() == 0:
            return values[0].detach().clone()
        return self._flat_range(gi, idx, values)

    def obj(self, key: str) -> Any:
        return self._objects[key]

    def close(self) -> None:
        self.optim = []


def listing(d: Path) -> list[str]:
    import os

    return sorted(os.listdir(d))
