"""Checkpoint directories (sharded checkpoints, docs/checkpointing.md): their names and marker, and
putting one in place atomically, copying and removing it. Plain file operations, below both
``serialization.py`` (which reads and writes single files and hands directories here) and
``sharded_checkpoint.py`` (which fills them)."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import tempfile

from ..errors import CheckpointError

STATE_FILE, MARKER = "checkpoint.pt", "COMPLETE"


def is_sharded(path: str) -> bool:
    """``path`` is a sharded checkpoint directory (complete or not)."""
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, n)) for n in (STATE_FILE, MARKER, ".metadata")
    )


def checkpoint_exists(path: str) -> bool:
    """A checkpoint file, or a complete sharded checkpoint directory, is at ``path``."""
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, MARKER))


def require_complete(path: str) -> None:
    """Refuse a sharded checkpoint directory without its marker (it was being written, copied or
    deleted)."""
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise CheckpointError(
            f"{path} is an incomplete sharded checkpoint (no {MARKER} marker): it was being "
            "written, copied or deleted when that stopped.",
            "use another checkpoint of the same folder (last.ckpt, or a complete "
            "epoch=...-step=... directory); taskfit never gives an unfinished checkpoint a "
            "checkpoint's name, so copy the directory again.")


def publish(tmp: str, path: str) -> None:
    """Move the finished directory ``tmp`` to ``path``: a rename, or, over an existing checkpoint (a
    file or a directory), an atomic exchange (Linux ``renameat2``), after which the old one is
    removed."""
    try:
        if os.path.isdir(tmp):
            fsync_dir(tmp)
        # never replace (and delete) a folder of something else
        if os.path.isdir(path) and not is_sharded(path):
            raise IsADirectoryError(errno.EISDIR, "a directory that is not a checkpoint has its "
                                                  "name", path)
        if not os.path.lexists(path):
            os.rename(tmp, path)
        elif not _exchange(tmp, path):  # no atomic exchange here: move the old one aside first
            aside = tmp + ".old"
            os.rename(path, aside)
            os.rename(tmp, path)
            tmp = aside
        fsync_dir(os.path.dirname(path))
    except OSError as exc:
        remove_checkpoint(tmp)
        raise write_error(path, exc) from exc
    remove_checkpoint(tmp)  # the replaced checkpoint (nothing, after a plain rename)


def copy_checkpoint(src: str, dst: str) -> None:
    """Make ``dst`` a copy of the checkpoint directory ``src``: hard links of its files (free), or
    copies."""
    tmp = tempfile.mkdtemp(
        prefix=f".{os.path.basename(dst)}.", suffix=".tmp", dir=os.path.dirname(dst)
    )
    try:
        for name in os.listdir(src):
            try:
                os.link(os.path.join(src, name), os.path.join(tmp, name))
            except OSError:
                shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, dst)


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint file or directory (already gone: fine)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _exchange(a: str, b: str) -> bool:
    """Swap ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``); False where the system
    cannot."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    # this file system or kernel cannot exchange
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


def fsync_dir(directory: str) -> None:
    """Make the renames inside ``directory`` durable (where the system can open a directory)."""
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_error(path: str, exc: Exception) -> CheckpointError:
    return CheckpointError(f"Could not write the sharded checkpoint {path}: {exc}.",
                           "check that its folder is writable by every process, has free space, "
                           "and is on a file system every rank can reach; the previous checkpoint "
                           "there is intact.")
