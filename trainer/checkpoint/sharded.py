"""Sharded checkpoints: one directory per checkpoint, each rank writing its own shards with
``torch.distributed.checkpoint`` (DCP); read back on any number of processes (resharded), never
running code.

``<name>.ckpt/`` holds:

* ``checkpoint.pt``: everything a single-file checkpoint holds, each module and optimizer tensor
  replaced by a *meta* tensor of its full shape and dtype (``torch.load(weights_only=True)`` reads
  it; it is what is checked against the model before anything is loaded);
* ``.metadata`` and ``__<rank>_0.distcp``: DCP's index and each rank's shards (entries
  ``module/<name>`` and ``optimizer[/<i>]/state/<index>/<state>``); the index is read by an
  unpickler that builds DCP's metadata classes and nothing else, and checked before DCP reads a byte
  (every file it names is inside the directory, present and long enough: :func:`read_index`); the
  shards are read with ``torch.load(weights_only=True)``;
* ``COMPLETE``: written last, with each shard file's size and fingerprint (a swapped or replaced
  shard file is refused by name) and the CRC-32 of its every byte, computed by the rank that wrote
  it (on the checkpoint writer's thread for a background save) and checked before a byte is loaded;
  a directory without it is refused.

The directory is written under a hidden temporary name beside its target, then renamed into place
(an existing checkpoint of that name is swapped out atomically), so a process killed at any instant
leaves the previous checkpoint whole. ``consolidate`` turns one into today's single-file format.
Format: docs/checkpointing.md.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError
from .dirs import (  # noqa: F401
    MARKER,
    STATE_FILE,
    checkpoint_exists,
    copy_checkpoint,
    is_sharded,
    publish,
    remove_checkpoint,
    require_complete,
)
from .dirs import write_error as _write_error
from .files import CheckpointWriter, atomic_save, check_plain, load_file
from .sharded_index import SafeReader, crc_line, fingerprint, read_index

if TYPE_CHECKING:
    from ..strategies.base import Strategy

_SHARDED_PARTS = ("module", "optimizer")  # what is written as shards; the rest goes into STATE_FILE


# ---- writing -------------------------------------------------------------------------------------
def split(contents: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``contents`` with every tensor of its module and optimizer parts replaced by a meta tensor of
    the same (full) shape and dtype, and those tensors by entry name."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors[key] = obj
            return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
        if isinstance(obj, Mapping):
            return type(obj)((k, walk(v, f"{key}/{k}")) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v, f"{key}/{i}") for i, v in enumerate(obj))
        return obj

    skeleton = {k: walk(v, k) if k in _SHARDED_PARTS else v for k, v in contents.items()}
    return skeleton, tensors


def save_sharded(strategy: Strategy, contents: Mapping[str, Any], path: str,
                 writer: CheckpointWriter | None = None) -> None:
    """Write ``contents`` as a sharded checkpoint directory at ``path`` (every rank calls it; each
    writes its shards).

    Rank 0 writes the rest and, after every shard is on disk, the completion marker, then renames
    the directory into place. With ``writer``, through DCP's ``async_save``: each rank's shards are
    copied now into staging buffers that the writer keeps from one save to the next (DCP's
    ``DefaultStager``), and written, fsynced, completed and renamed on the writer's thread (DCP's
    collectives there use a gloo group of their own, so they never interleave with the training's).
    """
    import torch.distributed.checkpoint as dcp

    skeleton, tensors = split(contents)
    tmp = None
    if strategy.is_main:
        check_plain(skeleton, "checkpoint")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(
            prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path)
        )
    tmp = strategy.broadcast(tmp)
    storage = dcp.FileSystemWriter(tmp, sync_files=True)
    no_dist = strategy.world_size == 1 and not _distributed()
    try:
        if writer is None:
            # one process without a group: "assuming ... a single process", yes
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                _dcp_call(lambda: dcp.save(tensors, storage_writer=storage, no_dist=no_dist), path)
            # every rank's shards are on disk, each checksummed by the rank that wrote it
            crcs = strategy.all_gather_object(_own_crcs(tmp, strategy.rank))
            if strategy.is_main:
                _complete(tmp, path, skeleton, strategy.world_size, crcs)
            return
        stager = writer.kept("dcp stager", _stager, lambda stager: stager.close())
        group = None if no_dist else writer.kept("dcp group", _checkpoint_group, _destroy_group)
        future = _dcp_call(
            lambda: dcp.async_save(
                tensors,
                storage_writer=storage,
                process_group=group,
                async_stager=stager,
                no_dist=no_dist,
            ),
            path,
        )
        skeleton_if_main = skeleton if strategy.is_main else None
        writer.submit(_finish_async, future, tmp, path, skeleton_if_main, strategy.world_size,
                      group)
    except BaseException:
        if strategy.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _finish_async(future: Any, tmp: str, path: str, skeleton: dict[str, Any] | None,
                  world_size: int, group: Any) -> None:
    """On the writer's thread: wait for this rank's shards (on rank 0, DCP's future completes once
    every rank's are written and the index is too) and checksum them; every rank's checksums are
    gathered over the checkpoint's own ``group`` (None: one process), and rank 0 (``skeleton``
    given) completes the directory and renames it."""
    try:
        _dcp_call(future.result, path)
        own = _own_crcs(tmp, 0 if group is None else _group_rank(group))
        crcs = [own] if group is None else _gather(own, group)
        if skeleton is not None:
            _complete(tmp, path, skeleton, world_size, crcs)
    except BaseException:
        if skeleton is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _complete(tmp: str, path: str, skeleton: dict[str, Any], world_size: int,
              crcs: list[list[str]]) -> None:
    errors = [line for rank_lines in crcs for line in rank_lines if line.startswith("error ")]
    # a rank could not read back its own shard file
    if errors:
        raise _write_error(path, OSError(errors[0][len("error "):]))
    atomic_save(skeleton, os.path.join(tmp, STATE_FILE))
    _write_marker(tmp, world_size, crcs)
    publish(tmp, path)


def _own_crcs(directory: str, rank: int) -> list[str]:
    """The marker's ``crc32`` lines of the shard files rank ``rank`` wrote (DCP names them
    ``__<rank>_<i>``), read back from the page cache by that rank. A failure is returned as an
    ``error`` line, not raised, so that the gather that follows never waits for a rank that gave
    up."""
    try:
        names = sorted(n for n in os.listdir(directory)
                       if n.startswith(f"__{rank}_") and n.endswith(".distcp"))
        return [crc_line(os.path.join(directory, name)) for name in names]
    except OSError as exc:
        return [f"error rank {rank} could not checksum its shard files: {exc}"]


def _group_rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _gather(crcs: list[str], group: Any) -> list[list[str]]:
    """Every rank's ``crcs``, over the checkpoint's gloo group (on the writer's thread)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, crcs, group=group)
    return gathered


def _dcp_call(fn: Any, path: str) -> Any:
    """``fn()``; DCP wraps each rank's error in a CheckpointException: one clear error naming the
    first. A full disk is an OSError, or (DCP writes through torch's zip writer) a RuntimeError
    about a file position: the free space is then part of the message."""
    try:
        return fn()
    except BaseException as exc:
        cause = _cause(exc)
        if isinstance(cause, OSError):
            raise _write_error(path, cause) from None
        if isinstance(cause, Exception) and not isinstance(cause, CheckpointError):
            reason = " ".join(str(cause).split())[:200]
            free = shutil.disk_usage(os.path.dirname(path)).free
            raise _write_error(path, RuntimeError(f"{type(cause).__name__}: {reason}; {free} bytes "
                                                  "free on its file system")) from None
        raise


def _stager() -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # pinned buffers (page-locked exactly, not rounded up) where a GPU copies
    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


def _checkpoint_group() -> Any:
    import torch.distributed as dist

    # every rank creates it at its first asynchronous save, together
    return dist.new_group(backend="gloo")


def _destroy_group(group: Any) -> None:
    """At the end of fit (a process may run several, under torchrun): the group's sockets go with
    it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group(group)


def _cause(exc: BaseException) -> BaseException:
    """The first rank's error inside DCP's ``CheckpointException`` (a ``BaseException``), else
    ``exc``."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and failures:
        return next(iter(failures.values()))[0]
    return exc


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _write_marker(directory: str, world_size: int, crcs: list[list[str]]) -> None:
    """COMPLETE, written last; it also records each shard file's size and fingerprint, so that a
    file swapped, renamed or replaced afterwards is recognised before anything is read from it, and
    the CRC-32 of its every byte (``crcs``: each rank's lines), so that damage anywhere in it is
    (:func:`read_index`)."""
    lines = [f"taskfit sharded checkpoint, {world_size} shard file(s); complete"]
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".distcp")):
        size, digest = fingerprint(os.path.join(directory, name))
        lines.append(f"shard {name} {size} {digest}")
    lines += sorted(line for rank_lines in crcs for line in rank_lines)
    with open(os.path.join(directory, MARKER), "w") as fh:
        fh.write("\n".join(lines) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


# ---- reading -------------------------------------------------------------------------------------
def load_skeleton(path: str) -> dict[str, Any]:
    """``checkpoint.pt`` of a complete sharded checkpoint: the run's state, meta tensors in place of
    the shards."""
    require_complete(path)
    return load_file(os.path.join(path, STATE_FILE))


def meta_entries(
    skeleton: Mapping[str, Any], parts: tuple[str, ...] = _SHARDED_PARTS
) -> dict[str, torch.Tensor]:
    """Every entry still to be read in ``parts`` of ``skeleton``: its name and meta tensor."""
    found = {}

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            found[key] = obj
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, f"{key}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}/{i}")

    for part in parts:
        if part in skeleton:
            walk(skeleton[part], part)
    return found


def read_shards(
    path: str,
    skeleton: Mapping[str, Any],
    templates: Mapping[str, torch.Tensor] | None = None,
    parts: tuple[str, ...] = _SHARDED_PARTS,
) -> dict[str, Any]:
    """``skeleton`` with the meta tensors of ``parts`` replaced by the checkpoint's tensors.

    ``templates`` (by entry name) may give a DTensor to read only this rank's part into; every other
    entry is read whole, on the CPU. Each process reads on its own (no collective), so any number of
    processes can read a checkpoint written by any other number.
    """
    import torch.distributed.checkpoint as dcp

    entries = meta_entries(skeleton, parts)
    templates = dict(templates or {})
    request = {
        k: templates[k] if k in templates else torch.empty(m.shape, dtype=m.dtype)
        for k, m in entries.items()
    }
    if request:
        # checked before DCP runs: its failures print tracebacks
        reader = SafeReader(path, read_index(path))
        try:
            # "torch.distributed is ... uninitialized, assuming ... a single process"
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(request, storage_reader=reader, no_dist=True)
        # DCP wraps a missing or damaged shard file in a CheckpointException
        except BaseException as exc:
            cause = _cause(exc)
            if isinstance(cause, CheckpointError) or not isinstance(cause, Exception):
                raise cause from None
            reason = " ".join(str(cause).split())[:300]
            raise CheckpointError(
                f"Cannot read the shards of {path}: a shard file does not hold what .metadata says "
                f"it holds ({type(cause).__name__}: {reason}).",
                "the shard files (__<rank>_0.distcp) were swapped, renamed or damaged: copy the "
                "whole directory again, or use another checkpoint of the same folder.") from None

    def fill(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            return request[key]
        if isinstance(obj, Mapping):
            return type(obj)((k, fill(v, f"{key}/{k}")) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(fill(v, f"{key}/{i}") for i, v in enumerate(obj))
        return obj

    return {k: fill(v, k) if k in parts else v for k, v in skeleton.items()}


# ---- consolidation -------------------------------------------------------------------------------
def consolidate(src: str, dst: str) -> str:
    """Write the sharded checkpoint ``src`` as one single-file checkpoint ``dst`` (full tensors, on
    the CPU).

    The file is today's format: ``torch.load(dst, weights_only=True)`` reads it,
    ``TaskModule.load_from_checkpoint`` builds the task from it, and ``fit(ckpt_path=dst)`` resumes
    from it under any strategy. Returns ``dst``.
    """
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    if not is_sharded(src):
        raise CheckpointError(
            f"{src} is not a sharded checkpoint directory (no {STATE_FILE}, "
            f"{MARKER} or .metadata in "
            "it).",
            "pass the directory an fsdp run wrote (e.g. "
            ".../checkpoints/last.ckpt); a single-file checkpoint needs no consolidation.",
        )
    if os.path.abspath(dst) == src or os.path.isdir(dst):
        raise CheckpointError(f"Cannot consolidate {src} into {dst}: the output is a directory.",
                              "give the path of the file to write, e.g. model.ckpt beside the "
                              "directory.")
    full = read_shards(src, load_skeleton(src))
    check_plain(full, "checkpoint")
    atomic_save(full, dst)
    return dst


__all__ = [
    "STATE_FILE",
    "MARKER",
    "is_sharded",
    "checkpoint_exists",
    "split",
    "save_sharded",
    "publish",
    "copy_checkpoint",
    "remove_checkpoint",
    "load_skeleton",
    "meta_entries",
    "read_shards",
    "read_index",
    "SafeReader",
    "consolidate",
]
