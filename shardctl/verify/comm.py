"""The few collectives a sharded forward needs, on torch.distributed or simulated in threads.

A rank of the forward level talks to its peers through a :class:`Comm`:

- ``all_reduce(t, "tp")``: sum over the ranks of one tensor-parallel group (row-parallel
  outputs, vocab-parallel embeddings);
- ``all_reduce(t, "moe")``: sum over the ``ep × tp`` ranks of one stage (expert outputs);
- ``all_gather(t, "tp")``: concatenate along the last dim in tp order (vocab-parallel logits);
- ``send`` / ``recv``: activations between neighbouring pipeline stages;
- ``agree(ok)``: every rank learns whether all ranks are ok (a rank that failed to load must not
  leave the others waiting in a collective).

:class:`DistComm` runs on a real process group (gloo on CPU, NCCL on GPUs). :class:`ThreadComm`
runs every rank as a thread of one process — the *simulation* used when there are fewer devices
than ranks; it sums in rank order, so results are deterministic.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shardctl.layout.types import Mesh


@dataclass(frozen=True)
class Topology:
    """Model-parallel ranks (one dp replica) ordered ``(pp, ep, tp)``, and their groups."""

    pp: int
    ep: int
    tp: int

    @property
    def world(self) -> int:
        return self.pp * self.ep * self.tp

    @classmethod
    def of(cls, mesh: Mesh) -> Topology:
        return cls(pp=mesh.pp, ep=mesh.ep, tp=mesh.tp)

    def coord(self, rank: int) -> tuple[int, int, int]:
        """``rank -> (pp, ep, tp)``."""
        return rank // (self.ep * self.tp), (rank // self.tp) % self.ep, rank % self.tp

    def rank(self, pp: int, ep: int, tp: int) -> int:
        return (pp * self.ep + ep) * self.tp + tp

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of one kind, in a fixed order (all ranks create them identically)."""
        if kind == "tp":
            return [
                tuple(self.rank(p, e, t) for t in range(self.tp))
                for p in range(self.pp)
                for e in range(self.ep)
            ]
        if kind == "moe":
            return [
                tuple(self.rank(p, e, t) for e in range(self.ep) for t in range(self.tp))
                for p in range(self.pp)
            ]
        raise ValueError(kind)

    def group_of(self, rank: int, kind: str) -> tuple[int, ...]:
        return next(g for g in self.groups(kind) if rank in g)


class Comm(Protocol):
    rank: int
    topo: Topology

    def all_reduce(self, t: torch.Tensor, kind: str) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor, kind: str) -> torch.Tensor: ...

    def send(self, t: torch.Tensor, dst: int) -> None: ...

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor: ...

    def agree(self, ok: bool) -> bool: ...


class DistComm:
    """Collectives on the default torch.distributed process group (already initialized)."""

    def __init__(self, rank: int, topo: Topology) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.topo = topo
        self._dist = dist
        self._groups: dict[str, Any] = {}
        for kind in ("tp", "moe"):
            for members in topo.groups(kind):
                # new_group is collective: every rank creates every group, in the same order.
                group = dist.new_group(list(members)) if len(members) < topo.world else None
                if rank in members:
                    self._groups[kind] = group

    def all_reduce(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        if len(self.topo.group_of(self.rank, kind)) > 1:
            self._dist.all_reduce(t, group=self._groups[kind])
        return t

    def all_gather(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        n = len(self.topo.group_of(self.rank, kind))
        if n == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(n)]
        self._dist.all_gather(parts, t.contiguous(), group=self._groups[kind])
        return torch.cat(parts, dim=-1)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._dist.send(t.contiguous(), dst)

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        out = torch.empty_like(like)
        self._dist.recv(out, src)
        return out

    def agree(self, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        if self._dist.get_backend() == "nccl":
            flag = flag.cuda()
        self._dist.all_reduce(flag)
        return int(flag.item()) == 0


class ThreadHub:
    """Shared state of a simulated world: one barrier and mailbox per group, queues for p2p."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}
        self._barriers: dict[tuple[int, ...], threading.Barrier] = {}
        self._queues: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {}

    def barrier(self, members: tuple[int, ...]) -> threading.Barrier:
        with self._lock:
            if members not in self._barriers:
                self._barriers[members] = threading.Barrier(len(members), timeout=600)
                self._slots[members] = {}
            return self._barriers[members]

    def exchange(self, members: tuple[int, ...], rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Every member deposits ``t``; all get every member's tensor in rank order."""
        barrier = self.barrier(members)
        slots = self._slots[members]
        slots[rank] = t
        barrier.wait()
        got = [slots[m] for m in members]
        barrier.wait()  # nobody overwrites a slot before everyone has read it
        return got

    def channel(self, src: int, dst: int) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self._queues.setdefault((src, dst), queue.Queue())

    def abort(self) -> None:
        """Break every barrier so ranks blocked in a collective fail instead of hanging."""
        with self._lock:
            for b in self._barriers.values():
                b.abort()


class ThreadComm:
    """One simulated rank: collectives through a :class:`ThreadHub` shared by all threads."""

    def __init__(self, rank: int, hub: ThreadHub) -> None:
        self.rank = rank
        self.topo = hub.topo
        self._hub = hub

    def _members(self, kind: str) -> tuple[int, ...]:
        return self.topo.group_of(self.rank, kind)

    def all_reduce(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        members = self._members(kind)
        if len(members) == 1:
            return t
        parts = self._hub.exchange(members, self.rank, t.clone())
        total = _sum(parts)
        t.copy_(total)
        return t

    def all_gather(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        members = self._members(kind)
        if len(members) == 1:
            return t
        return torch.cat(self._hub.exchange(members, self.rank, t.clone()), dim=-1)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._hub.channel(self.rank, dst).put(t.clone())

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        return self._hub.channel(src, self.rank).get(timeout=600)

    def agree(self, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1])
        members = tuple(range(self.topo.world))
        return all(int(f.item()) == 0 for f in self._hub.exchange(members, self.rank, flag))


def _sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total
