"""Checksums of single-file checkpoints: a bit flipped on disk (or in a copy) is refused by name,
not resumed.

When a taskfit checkpoint is written, :func:`checksums` computes a CRC-32 (``zlib.crc32``) of every
tensor's storage and one of everything else in it (the counters, settings, tensor shapes and dtypes:
the pickled part), and the file stores them under ``checkpoint["checksums"]``. A background save
computes them on the writer's thread, over the staged copy, so the training loop does not wait for
them. :func:`verify` recomputes them when a file is loaded and names the first tensor whose bytes
differ.

Why CRC-32 in the file: it is the fastest checksum of the standard library here (about 1.5 GB/s; it
releases the GIL), it detects every burst error of up to 32 bits and any other damage with
probability 1 - 2^-32, and the threat it guards against is accidental damage (a disk, a copy, a tool
writing into the file), not a forger. Stored in the checkpoint itself, it travels with every copy of
the file; a sidecar could be lost or paired with the wrong file. An older taskfit ignores the entry:
the format version stays the same.

A file without the entry (written by Lightning, ``torch.save``, an older taskfit) is
checked with the CRC-32 that torch's zip writer records for each member of the archive
(:func:`verify_zip`): every byte is read once more, which the entry spares taskfit's files.
"""
from __future__ import annotations

import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError

KEY, ALGORITHM = "checksums", "crc32"
# Lightning's name for "module" (checkpointing.py): the same tensors, checked once there
ALIAS = "state_dict"


def checksums(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The ``checkpoint["checksums"]`` entry of ``tree`` (a checkpoint without that entry)."""
    tensors: dict[str, int] = {}
    values = _walk({k: v for k, v in tree.items() if k != ALIAS}, "checkpoint", tensors, {})
    return {"algorithm": ALGORITHM, "tensors": tensors, "values": values}


def verify(ckpt: Any, path: str) -> None:
    """Refuse ``ckpt`` (loaded from ``path``) if a checksum it records does not match its
    contents; a file without taskfit's checksums is checked against its zip archive's own
    CRC-32s (:func:`verify_zip`)."""
    recorded = ckpt.get(KEY) if isinstance(ckpt, Mapping) else None
    if not isinstance(recorded, Mapping) or recorded.get("algorithm") != ALGORITHM:
        # not taskfit's, written before checksums, or by an algorithm this taskfit does not know
        verify_zip(path)
        return
    expected = recorded.get("tensors") if isinstance(recorded.get("tensors"), Mapping) else {}
    actual: dict[str, int] = {}
    values = _walk(
        {k: v for k, v in ckpt.items() if k not in (KEY, ALIAS)}, "checkpoint", actual, {}
    )
    bad = [name for name, crc in expected.items() if actual.get(name) != crc]
    if bad:
        name, more = bad[0], f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        found = f"{actual[name]:08x}" if name in actual else "no such tensor"
        what = (
            f"the bytes of tensor {name}{more} do not match the checksum recorded when it was "
            "written "
            f"(crc32 {found}, recorded {expected[name]:08x})"
        )
    elif values != recorded.get("values"):
        what = (
            "its counters, settings or tensor shapes (the pickled part) do not match the checksum "
            "recorded when "
            "it was written"
        )
    else:
        return
    raise CheckpointError(
        f"Checkpoint {path} is damaged: {what}.",
        "the file changed after taskfit wrote it (a disk or memory error, an interrupted copy, a "
        "tool that wrote into it): use another checkpoint of its folder (fit(ckpt_path=\"last\") "
        "falls back to the newest intact one by itself) or a good copy of this one.")


def verify_zip(path: str) -> None:
    """Refuse the file ``path`` if a member of its zip archive (torch's format since 1.6) does
    not match the CRC-32 the writer recorded for it. A file that is not a zip (torch's legacy
    format) is not checked."""
    if not zipfile.is_zipfile(path):
        return
    member = "the archive's directory"
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                member = info.filename
                _read_member(archive, info)
    except zipfile.BadZipFile as exc:
        raise _damaged_member(path, member) from exc


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    """Read a member in 4 MiB pieces: zipfile checks its CRC-32 at the end (``BadZipFile``
    if it differs)."""
    with archive.open(info) as fh:
        while fh.read(1 << 22):
            pass


def _damaged_member(path: str, member: str) -> Exception:
    what = "a record of the archive"
    if "/data/" in member:
        what = "the bytes of a tensor storage"
    elif member.endswith("data.pkl"):
        what = "its pickled part (counters, settings, tensor shapes)"
    return CheckpointError(
        f"Checkpoint {path} is damaged: {what} ({member}) did not match the CRC-32 its zip "
        "archive recorded when it was written.",
        "the file changed after it was written (a disk or memory error, an interrupted copy, "
        "a tool that wrote into it): use a good copy of it, or another checkpoint of its "
        "folder (fit(ckpt_path=\"last\") falls back to the newest intact one by itself).")


def _walk(obj: Any, where: str, tensors: dict[str, int], seen: dict[tuple[Any, ...], int]) -> int:
    """CRC-32 of ``obj``'s plain values and tensor layouts; each tensor's storage CRC goes into
    ``tensors``."""
    kind = type(obj)
    if isinstance(obj, torch.Tensor):
        layout = f"T{obj.dtype}{tuple(obj.shape)}"
        if obj.layout is torch.strided and not obj.is_meta:
            layout += f"{obj.stride()}{obj.storage_offset()}"
            tensors[where] = _storage_crc(obj.untyped_storage(), seen)
        return zlib.crc32(layout.encode())
    if isinstance(obj, Mapping):
        crc = zlib.crc32(f"{kind.__name__}{{".encode())
        for key, value in obj.items():
            crc = zlib.crc32(repr(key).encode(), crc)
            crc = zlib.crc32(
                _walk(value, f"{where}[{key!r}]", tensors, seen).to_bytes(4, "little"), crc
            )
        return crc
    if kind is list or kind is tuple:
        crc = zlib.crc32(f"{kind.__name__}[".encode())
        for i, value in enumerate(obj):
            crc = zlib.crc32(
                _walk(value, f"{where}[{i}]", tensors, seen).to_bytes(4, "little"), crc
            )
        return crc
    # a set's order is not kept by pickling: its sorted elements
    if kind is set or kind is frozenset:
        return zlib.crc32(f"{kind.__name__}{sorted(repr(v) for v in obj)}".encode())
    return zlib.crc32(f"{kind.__name__}:{obj!r}".encode())



def _storage_crc(storage: torch.UntypedStorage, seen: dict[tuple[Any, ...], int]) -> int:
    """CRC-32 of a storage's bytes, once per storage (tied weights and views share one)."""
    nbytes = storage.nbytes()
    if nbytes == 0:
        return 0
    key = (storage.data_ptr(), nbytes, str(storage.device))
    if key not in seen:
        # a synchronous save of device tensors: a host copy, one at a time
        if storage.device.type != "cpu":
            storage = storage.cpu()
        view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
        seen[key] = zlib.crc32(memoryview(view.numpy()))
    return seen[key]
