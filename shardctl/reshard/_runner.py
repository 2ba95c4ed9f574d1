"""Private test runner: ``python -m shardctl.reshard._runner SRC DST [--tp N] ...``.

Calls :func:`shardctl.reshard.api.reshard` and maps ShardctlError to its exit code with one
line on stderr — what the CLI does — so subprocess tests need not wait on the CLI.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shardctl.errors import EXIT_INTERNAL, ShardctlError
from shardctl.layout.types import LayoutOptions, Mesh


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shardctl-reshard-runner")
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    for axis in ("tp", "pp", "ep", "dp"):
        ap.add_argument(f"--{axis}", type=int, default=None)
    ap.add_argument("--format", dest="fmt", default=None)
    ap.add_argument("--max-shard-size", type=int, default=5 * 10**9)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--pipeline", default="even")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--allow-pickle", action="store_true")
    ap.add_argument("--hash", dest="hash_name", default=None)
    args = ap.parse_args(argv)
    from shardctl.reshard.api import reshard

    axes = {a: getattr(args, a) for a in ("tp", "pp", "ep", "dp") if getattr(args, a)}
    try:
        r = reshard(
            args.src,
            args.dst,
            mesh=Mesh(**axes) if axes else None,
            options=LayoutOptions(pipeline=args.pipeline),
            fmt=args.fmt,
            max_shard_size=args.max_shard_size,
            workers=args.workers,
            force=args.force,
            allow_pickle=args.allow_pickle,
            hash_name=args.hash_name,
        )
    except ShardctlError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        if os.environ.get("SHARDCTL_DEBUG"):
            raise
        print(
            f"internal error: {type(exc).__name__}: {exc}; SHARDCTL_DEBUG=1 shows the traceback",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    print(f"ok {r.format} {len(r.files)} files {r.tensor_bytes} bytes {r.seconds:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
