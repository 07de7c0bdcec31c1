"""``python -m taskfit.consolidate SRC [DST]``: a sharded (fsdp) checkpoint directory as one
single-file checkpoint.

The file is today's format (``torch.load(DST, weights_only=True)``,
``TaskModule.load_from_checkpoint``, and ``fit(ckpt_path=DST)`` under any strategy). It holds every
tensor whole, so it needs the memory of the full model and optimizer state on this machine; nothing
needs a GPU or a process group. Default DST: SRC's name with ``-consolidated.ckpt`` beside it
(``last.ckpt`` -> ``last-consolidated.ckpt``).
"""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import CheckpointError
from .sharded import consolidate

__all__ = ["consolidate_checkpoint", "main"]


def consolidate_checkpoint(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> str:
    """Write the sharded checkpoint ``src`` as a single file (``dst``, by default beside it);
    returns its path."""
    src = os.path.abspath(os.fspath(src)).rstrip(os.sep)
    if dst is None:
        stem = src[:-5] if src.endswith(".ckpt") else src
        dst = f"{stem}-consolidated.ckpt"
    return consolidate(src, os.fspath(dst))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m taskfit.consolidate",
                                     description="Write a sharded (fsdp) checkpoint directory as "
                                                 "one checkpoint file.")
    parser.add_argument("src", help="the sharded checkpoint directory, e.g. "
                        "taskfit_logs/version_0/checkpoints/last.ckpt")
    parser.add_argument("dst", nargs="?", help="the file to write (default: "
                                               "<src>-consolidated.ckpt beside it)")
    args = parser.parse_args(argv)
    try:
        path = consolidate_checkpoint(args.src, args.dst)
    except CheckpointError as exc:
        print(f"taskfit.consolidate: {exc}", file=sys.stderr)
        return 1
    print(f"Wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
