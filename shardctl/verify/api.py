"""``verify(src, dst)``: is DST the same model as SRC? Levels, cumulative, stop at first failure.

    structure  headers and the record: tensors, shapes, dtypes, coverage, stages, replicas
    bitwise    every shard equals its region of SRC bit for bit; padding zero; file hashes
    forward    the sharded checkpoint runs as a sharded model (torch.distributed) and its logits
               match SRC's unsharded model within the dtype's own noise

Outcomes (README "Exit codes"): ``VerifyResult.ok`` true → 0; false → 1 (not equivalent,
naming the level, tensor, rank, file); :class:`InvalidInputError` → 3 (SRC/DST unreadable, a
malformed record); :class:`EnvironmentFailure` → 5 (could not verify: backend unavailable,
no CUDA for ``--device cuda``, a rank died).

Example::

    result = verify(Path("llama"), Path("llama-tp4"), level="forward")
    result.ok, result.level_result("forward").figures["sharded"]["kl"]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardctl.checkpoint.source import Source, open_source
from shardctl.errors import EnvironmentFailure, InvalidInputError, UsageError
from shardctl.gcpause import gc_paused
from shardctl.io.heap import give_back_heap
from shardctl.layout.types import Layout, LayoutOptions, Mesh, RankLayout, Stage
from shardctl.verify.bitwise.level import check_bitwise
from shardctl.verify.dst import Destination, open_destination
from shardctl.verify.result import LEVELS, LevelResult, VerifyResult
from shardctl.verify.sharded import ShardedCheckpoint
from shardctl.verify.structure import check_structure

DEVICES = ("auto", "cpu", "cuda")
LAUNCHERS = ("local", "torchrun")
TORCHRUN_HINT = (
    "start one process per rank with torchrun instead, the same command on every node: "
    "torchrun --nnodes N --nproc-per-node M --node-rank I --master-addr HEAD --master-port 29500 "
    "-m shardctl.verify.worker SRC DST --report verify.json (README: multi-node)"
)


@gc_paused
def verify(
    src: Path,
    dst: Path,
    *,
    level: str = "forward",
    device: str = "auto",
    launcher: str = "local",
    seed: int = 0,
    simulate: bool | None = None,
    world: Any = None,
    hashes: bool = True,
) -> VerifyResult:
    """Verify DST against SRC up to ``level``.

    ``simulate`` / ``world``: see ``check_forward``. ``hashes=False`` skips re-hashing DST's
    files against the record in the bitwise level (the data comparison still runs).
    """
    _check_options(level, device, launcher)
    src, dst = Path(src), Path(dst)
    # --- dcp-optim: a DCP training checkpoint on either side runs as HF-named tensors ---
    from shardctl.formats.dcp.verify import involves_dcp, verify_dcp

    if involves_dcp(src, dst):
        return verify_dcp(
            src,
            dst,
            lambda s, d: verify(
                s,
                d,
                level=level,
                device=device,
                launcher=launcher,
                seed=seed,
                simulate=simulate,
                world=world,
                hashes=hashes,
            ),
        )
    # --- end dcp-optim ---
    source = open_source(src)
    dest = open_destination(dst)
    give_back_heap()  # the headers' and the record's parse, dropped (see boxes.give_back_heap)
    result = VerifyResult(str(src), str(dst), level, [LevelResult(n) for n in LEVELS])
    result.environment = {"launcher": launcher}
    wanted = LEVELS[: LEVELS.index(level) + 1]

    structure = check_structure(
        {t.fqn: t for t in source.model.tensors}, src, [f.path for f in source.files], dest
    )
    result.levels[0] = structure
    if not structure.ok or "bitwise" not in wanted:
        return result
    give_back_heap()
    bitwise = check_bitwise(source, dest, hashes=hashes)
    note = str(structure.figures.get("source_identity", ""))
    if not bitwise.ok and note.startswith("original changed"):
        bitwise.fail(f"{note}: the output may match the original as it was at reshard time")
    result.levels[1] = bitwise
    if not bitwise.ok or "forward" not in wanted:
        return result
    # a vLLM side runs as shardctl ranks of the same TP degree (formats/vllm/destination.py)
    from shardctl.formats.vllm.destination import as_ranks
    from shardctl.verify.forward import check_forward

    with as_ranks(src) as fsrc, as_ranks(dst) as fdst:
        if fsrc != src:
            source = open_source(fsrc)
        if fdst != dst:
            dest = open_destination(fdst)
        reference, sharded = _forward_sides(fsrc, source, fdst, dest)
        _forward_runs(sharded.config, bitwise, sharded)
        forward, tolerances, env = check_forward(
            reference, sharded, device=device, seed=seed, simulate=simulate, world=world
        )
    result.levels[2] = forward
    result.tolerances["forward"] = tolerances
    result.environment.update(env)
    return result


def _forward_runs(
    config: dict[str, Any], bitwise: LevelResult, sharded: ShardedCheckpoint | None = None
) -> None:
    """Exit 5 "could not verify" when the forward level cannot run this family or this layout
    of it (the family's local config refuses it: an uneven split, ALiBi at tp > 1): a verifier
    that cannot check must say so, never report a difference (exit 1) it did not find."""
    from shardctl.quant.dequant import forward_refusal
    from shardctl.verify.adapters import SUPPORTED, local_config

    arch = config.get("model_type")
    why = forward_refusal(config)
    if why:
        raise EnvironmentFailure(
            f"could not verify the forward level: {why}; structure and bitwise passed",
            hint="rerun with --level bitwise to gate on the levels that ran",
        )
    if arch not in SUPPORTED:
        raise EnvironmentFailure(
            f"could not verify the forward level: it cannot run architecture {arch!r} yet "
            f"(it runs {', '.join(SUPPORTED)}); structure and bitwise passed "
            f"({bitwise.figures.get('tensors', 'every')} tensors bit-identical)",
            hint="rerun with --level bitwise to gate on the levels that ran",
        )
    if sharded is None:
        return
    mesh = sharded.layout.mesh
    for stage in sharded.layout.stages:
        first = stage.layers[0] if stage.layers is not None else 0
        try:
            local_config(
                config,
                tp=mesh.tp,
                ep=mesh.ep,
                first_layer=first,
                num_layers=stage.num_layers,
                vocab=int(config.get("vocab_size") or 1),
            )
        except InvalidInputError as err:
            raise EnvironmentFailure(
                f"could not verify the forward level: {err.message} (mesh {mesh}); structure "
                f"and bitwise passed ({bitwise.figures.get('tensors', 'every')} tensors "
                "bit-identical)",
                hint=err.hint or "rerun with --level bitwise to gate on the levels that ran",
            ) from None


def _check_options(level: str, device: str, launcher: str) -> None:
    if level not in LEVELS:
        raise UsageError(f"level: expected one of {', '.join(LEVELS)}, got {level!r}")
    if device not in DEVICES:
        raise UsageError(f"device: expected one of {', '.join(DEVICES)}, got {device!r}")
    if launcher not in LAUNCHERS:
        raise UsageError(f"launcher: expected one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if launcher == "torchrun" and level == "forward":
        # before any level runs: the bitwise level of a large checkpoint takes minutes
        raise UsageError(
            "--launcher torchrun: the forward level's ranks cannot be started from here",
            hint=TORCHRUN_HINT,
        )


def _forward_sides(
    src: Path, source: Source, dst: Path, dest: Destination
) -> tuple[Path, ShardedCheckpoint]:
    """(checkpoint to load as the reference, sharded checkpoint to run).

    Both sharded (``verify TP2 TP4``): DST runs sharded, and the reference is SRC reassembled
    into a temporary HF directory (``reference.hf_reference``) — bitwise has just shown that
    DST holds SRC's bytes, so this is the model both must compute.
    """
    if source.kind != "hf" and dest.kind == "hf":
        # equivalence is symmetric: run SRC sharded, load DST as the reference
        return dst, sharded_view(open_destination(src))
    return src, sharded_view(dest)


def sharded_view(dest: Destination) -> ShardedCheckpoint:
    """What the forward level runs: DST's layout and rank files (an HF DST is one rank)."""
    from shardctl.verify.adapters import forward_config

    config = forward_config(dest.config)
    layout = dest.layout
    if layout is None:
        layers = config.get("num_hidden_layers") or config.get("n_layer") or 1
        layout = Layout(
            architecture=str(dest.config.get("model_type", "unknown")),
            mesh=Mesh(),
            options=LayoutOptions(),
            stages=(Stage(0, (0, int(layers) - 1)),),
            ranks=(RankLayout(0, 0, 0, ()),),
        )
    return ShardedCheckpoint(dest.root, config, layout, dest.rank_files())
