"""The index of a sharded checkpoint (DCP's ``.metadata``), read without running code and checked
against its directory before DCP reads a byte: every storage path inside the directory, every file
there and long enough, each shard file the one the ``COMPLETE`` marker recorded
(:func:`fingerprint`) and every byte of it as written (its CRC-32, :func:`file_crc`, as single
files' tensors are: integrity.py). :func:`SafeReader` is DCP's file reader given that checked index.
Split from sharded_checkpoint.py, which writes and reads the shards themselves."""
from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import zlib
from typing import Any

import torch

from ..errors import CheckpointError
from .dirs import MARKER


def fingerprint(path: str, span: int = 1 << 16) -> tuple[int, str]:
    """(size, sha256 of the first and last 64 KiB): reads 128 KiB at most, whatever the shard's
    size."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        digest.update(fh.read(span))
        if size > span:
            fh.seek(max(span, size - span))
            digest.update(fh.read(span))
    return size, digest.hexdigest()[:32]


def file_crc(path: str, chunk: int = 1 << 22) -> int:
    """CRC-32 of every byte of ``path``, read in 4 MiB pieces (``zlib.crc32`` releases the GIL)."""
    crc, buffer = 0, bytearray(chunk)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def crc_line(path: str) -> str:
    """The COMPLETE marker's line for the shard file ``path``: ``crc32 <name> <size> <crc32>``."""
    return f"crc32 {os.path.basename(path)} {os.path.getsize(path)} {file_crc(path):08x}"


def read_index(path: str) -> Any:
    """The DCP index (``.metadata``) of the sharded checkpoint ``path``, unpickled by
    :class:`_MetadataUnpickler` and checked against the directory before DCP reads anything: every
    storage path resolves inside it, every file it names is there and long enough, and each shard
    file is the one the COMPLETE marker recorded. Any problem is one CheckpointError naming the file
    and what is wrong."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    where = os.path.join(path, ".metadata")
    try:
        with open(where, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except _Refused as exc:
        raise CheckpointError(f"Refused to load {where}: {exc}. Nothing in it was executed.",
                              "load only sharded checkpoints written by taskfit.") from None
    # truncated, garbled, missing: damaged, whatever the exception
    except Exception as exc:  # noqa: BLE001
        metadata, damage = None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    else:
        damage = f"it holds a {type(metadata).__name__}, not DCP's index"
    if not isinstance(metadata, Metadata) or not isinstance(
        getattr(metadata, "storage_data", None), dict
    ):
        raise CheckpointError(f"Cannot read {where}, the index of the sharded checkpoint: it is "
                              f"damaged ({damage}).",
                              "copy the whole checkpoint directory again, or use another "
                              "checkpoint of the same folder (last.ckpt, epoch=...).")
    pickled = [
        k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    ]
    if pickled:
        raise _pickled_entries(path, pickled)
    _check_files(path, metadata)
    return metadata


def _check_files(path: str, metadata: Any) -> None:
    root = os.path.realpath(path)
    extents: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        rel = getattr(info, "relative_path", None)
        target = os.path.realpath(os.path.join(root, str(rel)))
        if not isinstance(rel, str) or os.path.commonpath([root, target]) != root or target == root:
            raise CheckpointError(
                f"Refused to load {path}: its index (.metadata) stores "
                f"{getattr(index, 'fqn', index)} in {rel!r}, which is outside the checkpoint "
                "directory. Nothing was read.",
                "load only sharded checkpoints written by taskfit: every file of one is inside its "
                "directory.")
        extents[target] = max(extents.get(target, 0), int(info.offset) + int(info.length))
    marker = os.path.join(path, MARKER)
    with open(marker) if os.path.isfile(marker) else contextlib.nullcontext([]) as fh:
        lines = [line.split() for line in fh]
    # fingerprints (none in older checkpoints), then the CRC-32 of every byte (none in older ones)
    recorded = [r for r in lines if r[:1] == ["shard"]]
    recorded_crcs = [r for r in lines if r[:1] == ["crc32"]]
    written = {
        (int(size), digest): name for _, name, size, digest in (r for r in recorded if len(r) == 4)
    }
    for (size, digest), name in written.items():
        target = os.path.join(path, name)
        now = fingerprint(target) if os.path.isfile(target) else None  # missing: named below
        if now is not None and now != (size, digest):
            what = (
                f"it holds the data written as {written[now]} (shard files swapped or renamed)"
                if now in written
                else (f"it changed since it was written ({now[0]} bytes now, {size} then: "
                      "truncated or damaged)")
            )
            raise CheckpointError(f"{target} is not the shard file written under that name: "
                                  f"{what}; {MARKER} recorded each shard file's size and "
                                  "fingerprint.",
                                  "put each shard file back under its own name, or copy the whole "
                                  "checkpoint directory again, or use another checkpoint of the "
                                  "same folder.")
    for target, end in sorted(extents.items()):
        if not os.path.isfile(target):
            raise CheckpointError(f"{target} is missing: the index (.metadata) of {path} stores "
                                  "data in it.",
                                  "copy the whole checkpoint directory again, or use another "
                                  "checkpoint of the same folder.")
        if os.path.getsize(target) < end:
            raise CheckpointError(
                f"{target} is shorter than the index (.metadata) says: "
                f"{os.path.getsize(target)} bytes, with data up to byte {end} "
                "(truncated, or another shard file under its "
                "name).",
                "copy the whole checkpoint directory again, or use another checkpoint of "
                "the same folder.",
            )
    for name, size, crc in (r[1:] for r in recorded_crcs if len(r) == 4):
        _check_crc(os.path.join(path, name), int(size), int(crc, 16))


def _check_crc(target: str, size: int, crc: int) -> None:
    """Refuse the shard file ``target`` unless its CRC-32 is the one recorded when it was written.
    A file checked once (same inode, size and modification time) is not read again by this process:
    a resume reads the index twice (to choose the checkpoint, then to load it)."""
    try:
        st = os.stat(target)
    except OSError:
        st = None
    key = (os.path.realpath(target), st and (st.st_ino, st.st_size, st.st_mtime_ns), size, crc)
    if key in _VERIFIED:
        return
    now = file_crc(target) if st is not None and st.st_size == size else None
    if now != crc:
        found = f"crc32 {now:08x}" if now is not None else \
            f"{st.st_size if st else 0} bytes, not {size}"
        raise CheckpointError(
            f"Sharded checkpoint {os.path.dirname(target)} is damaged: the bytes of its shard file "
            f"{os.path.basename(target)} do not match the checksum {MARKER} recorded when it was "
            f"written ({found}, recorded crc32 {crc:08x}).",
            "the file changed after taskfit wrote it (a disk or memory error, an interrupted copy, "
            "a tool that wrote into it): use another checkpoint of its folder "
            "(fit(ckpt_path=\"last\") falls back to the newest intact one by itself) or a good "
            "copy of this directory.")
    _VERIFIED.add(key)


# shard files whose every byte this process has checked
_VERIFIED: set[tuple[Any, ...]] = set()


def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    class SafeFileSystemReader(FileSystemReader):
        """DCP's file reader, given the index :func:`read_index` has read and checked (``.metadata``
        is never unpickled by DCP), which never reads an entry stored as pickled bytes (which DCP
        would unpickle with ``weights_only=False``)."""

        def __init__(self, path: str, metadata: Any) -> None:
            super().__init__(path)
            self._index = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = self._index
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            pickled = [
                item.dest_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO
            ]
            # never planned (the index check comes first): a second lock on the same door
            if pickled:
                raise _pickled_entries(self.path, pickled)
            return super().read_data(plan, planner)

    return SafeFileSystemReader


def _pickled_entries(path: Any, names: list[str]) -> CheckpointError:
    return CheckpointError(f"Refused to load {os.fspath(path)}: its entries {names[:4]} are "
                           "pickled objects, which loading would execute. Nothing in it was "
                           "executed.",
                           "load only sharded checkpoints written by taskfit (tensors only).")


# a factory standing for the class (lazy torch)
def SafeReader(path: str, metadata: Any = None) -> Any:  # noqa: N802
    """A ``FileSystemReader`` of ``path`` that never runs code from the checkpoint; ``metadata``:
    its index, as :func:`read_index` returns it (read here when not given)."""
    return _safe_reader_class()(path, metadata if metadata is not None else read_index(path))


class _Refused(pickle.UnpicklingError):
    """A global the index unpickler does not build."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records (dataclasses of sizes, offsets, dtypes, file names) and refuses
    any other global, as ``torch.load(weights_only=True)`` does for tensors."""

    _ALLOWED = {
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or (
            module == "torch"
            and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))
        ):
            return super().find_class(module, name)
        raise _Refused(f"it needs to import and call `{module}.{name}`, which a checkpoint index "
                       "never needs")


__all__ = ["read_index", "SafeReader", "fingerprint", "file_crc", "crc_line"]
