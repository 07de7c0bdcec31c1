"""One live run per checkpoint folder: a lock file beside it (``.<folder>.taskfit-lock``) that names
its holder.

The holder keeps an exclusive POSIX record lock (``lockf``) on the file for as long as it trains,
and the file says who it is (pid, host, start time, command). The kernel drops the lock when the
process ends, however it ends (SIGKILL too), so liveness needs no heartbeat and no guess: a file
whose lock can be taken is stale and is taken over. A record lock, not ``flock``: it belongs to the
process, so DataLoader workers forked from it do not keep it alive after it died, and network file
systems (NFS, Lustre) carry it between machines. The file is removed when its holder lets go. It
lies beside the folder, not in it, so that the folder holds checkpoints only (in a parent that
cannot be written: inside it). Within one process the folder is held once, whatever the number of
fits (a tuner's fits inside a fit); the process never opens the file a second time (closing any
descriptor of it would drop a record lock).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time

SUFFIX = ".taskfit-lock"

# folder -> (lock file, [file descriptor, holders in this process])
_HELD: dict[str, tuple[str, list[int]]] = {}


class FolderHeld(Exception):
    """Another live process holds the folder; ``holder`` says who (as its lock file records it)."""

    def __init__(self, lock: str, holder: dict[str, object]) -> None:
        super().__init__(lock)
        self.lock, self.holder = lock, holder

    def describe(self) -> str:
        """``pid 123 on host n1 (python train.py), since 12:03:04 UTC``: the holder, for a message.
        """
        h = self.holder
        since = h.get("started")
        when = (
            time.strftime(", since %H:%M:%S UTC", time.gmtime(since))
            if isinstance(since, float)
            else ""
        )
        command = f" ({h['command']})" if h.get("command") else ""
        return f"pid {h.get('pid', '?')} on host {h.get('host', '?')}{command}{when}"


def hold(folder: str) -> None:
    """Hold ``folder`` for this process (created if missing). Raises :class:`FolderHeld` when
    another live process holds it; an OSError when the lock file cannot be written."""
    folder = os.path.abspath(folder)
    if folder in _HELD:
        _HELD[folder][1][1] += 1
        return
    os.makedirs(folder, exist_ok=True)
    path = lock_path(folder)
    try:
        fd = _locked(path)
    except PermissionError:
        path = os.path.join(folder, SUFFIX)
        fd = _locked(path)
    try:
        _record(fd)
    except OSError:
        os.close(fd)
        raise
    _HELD[folder] = (path, [fd, 1])


def lock_path(folder: str) -> str:
    """The lock file of ``folder``: beside it, ``<parent>/.<name>.taskfit-lock``."""
    parent, name = os.path.split(os.path.abspath(folder).rstrip(os.sep) or os.sep)
    return os.path.join(parent, f".{name}{SUFFIX}")


def release(folder: str) -> None:
    """Let go of ``folder`` (the last holder in this process removes the lock file, then unlocks
    it)."""
    folder = os.path.abspath(folder)
    if folder not in _HELD:
        return
    path, held = _HELD[folder]
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[folder]
    # Removed while still locked: a process waiting on this file finds it unlinked and opens the new
    # one
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(held[0])


def _locked(path: str) -> int:
    """A descriptor of ``path`` that this process holds the lock of. The file may be removed by its
    last holder between our open and our lock: then it is opened again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            holder = _holder(fd)
            os.close(fd)
            raise FolderHeld(path, holder) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _record(fd: int) -> None:
    """Write who holds the folder into the lock file."""
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[
            :200
        ],
    }
    data = json.dumps(me).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _holder(fd: int) -> dict[str, object]:
    """The holder of a locked file: it writes its record right after it took the lock, so an empty
    file is read again for up to a second."""
    for _ in range(20):
        holder = _read(fd)
        if holder:
            return holder
        time.sleep(0.05)
    return {}


def _read(fd: int) -> dict[str, object]:
    """The holder recorded in a lock file ({} if it cannot be read yet: its holder is writing it).
    """
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
