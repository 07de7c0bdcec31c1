"""Checkpoint files: atomic writes, and reads that never run code (``torch.load(weights_only=True)``
only).

Writes go to a hidden temporary file in the same folder, are fsynced, then renamed over the target
with ``os.replace``: a process killed at any instant leaves the previous file intact, and no partial
file carries a checkpoint's name. An asynchronous save copies the state into reused host buffers
(staging.py) and leaves serialising, writing, fsync and rename to a :class:`CheckpointWriter`
thread, off the training loop. Reads map the file (``mmap``) instead of reading it whole, and
refuse, with one clear error, a missing, unsafe, truncated or foreign file, and a checkpoint of
another model (listing missing/unexpected keys and shape mismatches). trainer/checkpoint.py decides
what goes into a checkpoint and how a run continues from one.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import shutil
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError
from ..strategies.base import normalize_state_dict
from .dirs import STATE_FILE, copy_checkpoint, fsync_dir, is_sharded, publish, require_complete
from .integrity import KEY as CHECKSUMS
from .integrity import checksums, verify
from .staging import StagingBuffers

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

FORMAT = "taskfit.checkpoint"
FORMAT_VERSION = 1
LAST = "last.ckpt"
# Exactly the types torch.load(weights_only=True) reads back (subclasses, e.g. torch's version
# string, are not).
_PLAIN = (
    int,
    float,
    bool,
    str,
    bytes,
    complex,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
    torch.Tensor,
    torch.nn.Parameter,
)


# ---- writing -------------------------------------------------------------------------------------
def atomic_save(obj: Any, path: str, writer: CheckpointWriter | None = None) -> None:
    """``torch.save`` to a hidden temporary file beside ``path``; then fsync it and rename it over
    ``path``.

    With a ``writer``, only a copy of the tensors is made now (they change at the next step:
    staging.py); the writer's thread serialises the copy to the file, fsyncs and renames it while
    training goes on.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if writer is None:
        write_file(obj, path)
    else:
        writer.save(obj, path)


def write_file(obj: Any, path: str) -> None:
    """Serialise ``obj`` into a temporary file beside ``path``, make it durable and rename it over
    ``path``. A taskfit checkpoint gets its checksums (integrity.py) first. Every failure to write
    (a full disk, a quota, an I/O error, the folder gone) is one :class:`CheckpointError` naming the
    file, the cause and the intact checkpoint."""
    try:
        tmp = _temp_beside(path)
    except OSError as exc:  # the folder is gone, read-only or full
        raise _write_error(path, exc) from exc
    sink = None
    try:
        if isinstance(obj, Mapping) and obj.get("format") == FORMAT:
            # (a checkpoint read back has its old ones)
            obj = {k: v for k, v in obj.items() if k != CHECKSUMS}
            obj[CHECKSUMS] = checksums(obj)
        with open(tmp, "wb") as fh:  # a Python file: a full disk is an OSError naming its cause
            sink = _Sink(fh)
            torch.save(obj, sink)
    except BaseException as exc:
        _remove(tmp)
        cause = sink.error if sink is not None and sink.error is not None else exc
        if isinstance(cause, OSError):
            raise _write_error(path, cause) from cause
        # torch's zip writer: a failed write seen as a file position it missed
        if _zip_write_failure(cause):
            raise _write_error(path, cause) from None
        raise
    _finish(tmp, path)


class _Sink:
    """The file ``torch.save`` writes to, keeping the first OSError of a write: torch's zip writer
    swallows it and fails on a later write with ``unexpected pos 2113408 vs 2113360`` instead, which
    says nothing of the cause."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.error = fh, None

    def write(self, data: Any) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            if self.error is None:
                self.error = exc
            raise

    def flush(self) -> None:
        try:
            self.fh.flush()
        except OSError as exc:
            if self.error is None:
                self.error = exc
            raise


def _zip_write_failure(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and not isinstance(exc, CheckpointError) and (
        "inline_container" in str(exc) or "unexpected pos" in str(exc))


def write_probe(folder: str) -> None:
    """Create ``folder`` and write, fsync and remove a probe file in it: the OSError of a folder
    that cannot hold a file (permissions, a read-only or full file system), found before any work
    (loggers, ModelCheckpoint)."""
    probe = os.path.join(folder, f".taskfit-write-probe-{os.getpid()}")
    os.makedirs(folder, exist_ok=True)
    with open(probe, "wb") as fh:
        fh.write(b"probe")
        fh.flush()
        os.fsync(fh.fileno())
    os.unlink(probe)  # (unlink: a test that watches os.remove counts checkpoint rotations)


def atomic_copy(src: str, dst: str) -> None:
    """Make ``dst`` a copy of the checkpoint file ``src`` atomically (temporary file, fsync,
    rename). A real copy of the bytes, not a hard link: damage to one file (a tool writing into it,
    a bad sector) leaves the other whole. The copy runs in the kernel (``sendfile``) from the page
    cache, on the writer's thread."""
    if os.path.isdir(src):  # a sharded checkpoint: a directory of links
        return copy_checkpoint(src, dst)
    tmp = None
    try:
        tmp = _temp_beside(dst)
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            _copy_bytes(fin, fout)
    except BaseException as exc:
        if tmp is not None:
            _remove(tmp)
        if isinstance(exc, OSError):
            raise _write_error(dst, exc) from exc
        raise
    _finish(tmp, dst)


def _copy_bytes(fin: Any, fout: Any) -> None:
    """Copy an open file into another: ``os.sendfile`` (never a reflink that would share the
    blocks), else reads."""
    size, offset = os.fstat(fin.fileno()).st_size, 0
    try:
        if not hasattr(os, "sendfile"):  # (Windows)
            raise OSError(errno.ENOSYS, "no sendfile")
        while offset < size:
            sent = os.sendfile(fout.fileno(), fin.fileno(), offset, min(size - offset, 1 << 30))
            if sent == 0:
                break
            offset += sent
        if offset == size:
            return
    except OSError as exc:
        if exc.errno not in (
            errno.EINVAL,
            errno.ENOSYS,
            errno.EOPNOTSUPP,
            errno.ENOTSUP,
            errno.ENOTSOCK,
        ):
            raise
    fin.seek(0)
    fout.seek(0)
    fout.truncate()
    shutil.copyfileobj(fin, fout, 1 << 20)


def remove_files(paths: list[str]) -> None:
    """Delete checkpoint files (or sharded checkpoint directories) that fell out of the top k
    (already gone: fine)."""
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


class CheckpointWriter:
    """Writes checkpoint files on one background thread, in the order they were submitted:
    :meth:`save` (the asynchronous save: the caller's thread copies the tensors into reused staging
    buffers, this thread serialises, writes, fsyncs and renames the copy), then what else waits for
    the disk (a link, removing old files). :meth:`wait` joins that work and re-raises its first
    error; the Trainer calls it before every save and before fit returns, so a file is never renamed
    over a newer one, the buffers are free when the next save fills them, and ``fit`` returns with
    every file in place. :meth:`close` also lets the buffers go."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        # a submitted step failed: the steps after it (until wait() reports it) are skipped
        self._failed = False
        self._staging = StagingBuffers()
        self._kept: dict[str, tuple[Any, Callable[[Any], None] | None]] = {}

    def save(self, obj: Any, path: str) -> None:
        """Copy ``obj``'s tensors into the staging buffers now; write the file on the writer's
        thread."""
        self.wait()  # the previous save's file is written: its buffers may be filled again
        self.submit(self._write_staged, self._staging.stage(obj), path)

    def _write_staged(self, staged: Any, path: str) -> None:
        self._staging.wait()  # CUDA: the copies queued by stage() are done
        write_file(staged, path)

    @property
    def staged_bytes(self) -> int:
        """The bytes the staging buffers hold (one copy of the last asynchronous save's tensors)."""
        return self._staging.nbytes

    def kept(
        self, name: str, create: Callable[[], Any], release: Callable[[Any], None] | None = None
    ) -> Any:
        """An object kept for this writer's saves until :meth:`close` (sharded saves keep DCP's
        stager and a process group of their own here), created by ``create`` on first use and passed
        to ``release`` at close."""
        if name not in self._kept:
            self._kept[name] = (create(), release)
        return self._kept[name][0]

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        # created on first use, in the process that trains (never pickled or forked)
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="taskfit-checkpoint")
        self._pending.append(self._pool.submit(self._run, fn, args))

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        # The steps of one save depend on each other: a link to a file that was not written, or the
        # removal of the file it was to replace, must not run (a full disk must not cost the
        # previous best checkpoint).
        if self._failed:
            return
        try:
            fn(*args)
        except BaseException:
            self._failed = True
            raise

    def check(self) -> None:
        """Raise now if a submitted write has failed (the steps after it are skipped, so this does
        not wait for the disk); nothing otherwise. ModelCheckpoint calls it at every step
        (step-triggered saves), log interval, validation and epoch end: a failed background write
        reaches the training thread soon after it happens."""
        if self._failed:
            self.wait()

    def wait(self) -> None:
        """Block until every submitted file is in place; raise the first error of that work."""
        pending, self._pending = self._pending, []
        errors = [error for future in pending if (error := future.exception()) is not None]
        self._failed = False
        if errors:
            raise errors[0]

    def close(self) -> None:
        """:meth:`wait`, then stop the thread and let the staging buffers go (the next save starts
        afresh)."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
            self._staging = StagingBuffers()
            kept, self._kept = self._kept, {}
            for value, release in kept.values():
                if release is not None:
                    release(value)

    def close_quietly(self) -> None:
        """:meth:`close` while an error is already on its way: its own errors become a warning."""
        try:
            self.close()
        # the exception already propagating is the one to report
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"A background checkpoint write failed too: {exc!r}.", stacklevel=3)

    # a Trainer sent to ddp workers carries no thread and no buffers
    def __getstate__(self) -> dict[str, Any]:
        return CheckpointWriter().__dict__


def _temp_beside(path: str) -> str:
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    return tmp


def _finish(tmp: str, path: str, sync: bool = True) -> None:
    """Make ``tmp`` durable and rename it over ``path`` (``tmp`` is removed if that fails)."""
    try:
        if sync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())  # the data is on disk before the name points at it
        # mkstemp makes 0600 files; give the checkpoint the usual permissions
        os.chmod(tmp, _FILE_MODE)
        if os.path.isdir(path):
            # a sharded checkpoint of an earlier fsdp run had this name: swap it out
            if is_sharded(path):
                return publish(tmp, path)
            # an empty folder of that name (rmdir removes nothing else)
            with contextlib.suppress(OSError):
                os.rmdir(path)
        os.replace(tmp, path)
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, OSError):
            raise _write_error(path, exc) from exc
        raise
    try:
        fsync_dir(os.path.dirname(path))  # make the rename itself durable
    except OSError as exc:
        raise _write_error(path, exc) from exc


_FIXES = {
    errno.ENOSPC: "free space on that file system ({free} free now), keep fewer files (save_top_k) "
                  "or save elsewhere (ModelCheckpoint(dirpath=...), Trainer(default_root_dir=...))",
    errno.EDQUOT: "your disk quota is used up ({free} free on the file system): delete files "
                  "within it, ask for a larger quota or save elsewhere "
                  "(ModelCheckpoint(dirpath=...))",
    errno.EIO: "the storage reported an I/O error: check the disk or network file system (dmesg) "
               "and save elsewhere (ModelCheckpoint(dirpath=...)) if it persists",
    errno.ENOENT: "its folder was removed while training ran: recreate it, or save elsewhere "
                  "(ModelCheckpoint(dirpath=...))",
    errno.EISDIR: "move away the folder that has the checkpoint's name",
    errno.EROFS: "the file system became read-only (often after a disk error): remount it or save "
                 "elsewhere",
    errno.EACCES: "make the folder writable, or save elsewhere (ModelCheckpoint(dirpath=...))",
}


def _write_error(path: str, exc: BaseException) -> CheckpointError:
    """The one error of a failed write: the file, the cause (errno and its name), the fix, what is
    intact."""
    code = getattr(exc, "errno", None)
    if isinstance(exc, OSError):
        name = errno.errorcode.get(code, "") if code is not None else ""
        cause = f"{exc.strerror or exc} ({name or type(exc).__name__})"
    else:  # torch's zip writer lost the OSError: the free space says whether the disk filled
        cause = f"{' '.join(str(exc).split())[:160]}; {_free(path)} free on its file system"
        code = errno.ENOSPC if _free_bytes(path) == 0 else None
    fix = _FIXES.get(code, "check that its folder exists, is writable and has free space").format(
        free=_free(path)
    )
    intact = _intact(path)
    return CheckpointError(f"Could not write the checkpoint {path}: {cause}. {intact}",
                           f"{fix}; then resume with fit(ckpt_path=\"last\").")


def _intact(path: str) -> str:
    """What a failed write of ``path`` left intact: the file it was to replace, else the newest of
    its folder."""
    if os.path.isfile(path):
        return f"The previous {os.path.basename(path)} is intact."
    folder = os.path.dirname(path)
    try:
        files = [
            os.path.join(folder, n)
            for n in os.listdir(folder)
            if n.endswith(".ckpt") and not n.startswith(".")
        ]
        newest = max(files, key=os.path.getmtime) if files else None
    except OSError:
        newest = None
    if newest is None:
        return "No earlier checkpoint is in its folder."
    return f"The checkpoints written before are intact; the newest is {newest}."


def _free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(os.path.dirname(path)).free
    except OSError:
        return None


def _free(path: str) -> str:
    free = _free_bytes(path)
    return "unknown" if free is None else f"{free} bytes"


def _file_mode() -> int:
    mask = os.umask(0)  # process-wide: read once here, at import, not from the writer thread
    os.umask(mask)
    return 0o666 & ~mask


_FILE_MODE = _file_mode()


def _remove(path: str) -> None:
    # gone already, or its folder is: the write's own error is the one to say
    with contextlib.suppress(OSError):
        os.unlink(path)


def check_plain(obj: Any, where: str) -> None:
    """Refuse to write anything ``torch.load(weights_only=True)`` could not read back (names the
    culprit). A numpy number held in a dict or list (``SGD(lr=np.float64(0.01))``: the param
    group's ``lr``) is stored as the Python number it equals, as Lightning's file reads it back:
    the file still holds only plain types."""
    kind = type(obj)
    if kind in _PLAIN:
        return
    if kind in (dict, OrderedDict):
        for key, value in obj.items():
            check_plain(key, f"{where} key {key!r}")
            if _numpy_number(value):
                obj[key] = value.item()
                continue
            check_plain(value, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, set):
        for i, value in enumerate(obj):
            if kind is list and _numpy_number(value):
                obj[i] = value.item()
                continue
            check_plain(value, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"Cannot save a checkpoint: {where} is a {type(obj).__module__}.{type(obj).__qualname__}, "
        "which a safe checkpoint cannot hold.",
        "checkpoints hold only tensors, dicts, lists, tuples and numbers/strings (so loading them "
        "never runs code): convert it in the state_dict() that returns it (numpy arrays: "
        "torch.from_numpy(a); numpy numbers: float(x); objects: a dict of their fields).")


def _numpy_number(value: Any) -> bool:
    """A numpy scalar (``np.float64(0.01)``, ``np.int64``, ``np.bool_``), not an array."""
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ != "ndarray" and hasattr(value, "item") \
        and getattr(value, "shape", None) == ()


# ---- reading -------------------------------------------------------------------------------------
def load_file(path: str) -> Any:
    """``torch.load(path, weights_only=True, mmap=True)`` with one clear error for a missing, unsafe
    or damaged file. Mapped, not read: weights are copied once, from the page cache, into a model
    (an old non-zip file: read whole)."""
    if not os.path.exists(path):
        raise CheckpointError(f"Checkpoint {path} does not exist.",
                              "check the path (it is relative to the working directory), or pass "
                              "ckpt_path=\"last\" to resume from the newest checkpoint of the run "
                              "directory.")
    if os.path.isdir(path):
        # an fsdp checkpoint: its state, with meta tensors where the shards are
        if is_sharded(path):
            require_complete(path)
            return load_file(os.path.join(path, STATE_FILE))
        raise CheckpointError(f"Checkpoint {path} is a directory, not a file.",
                              f"pass a .ckpt file inside it (e.g. {os.path.join(path, LAST)}) or "
                              "ckpt_path=\"last\".")
    try:
        with warnings.catch_warnings():
            # torch warns about unusual pickle protocols before refusing them
            warnings.simplefilter("ignore")
            try:
                ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap can only be used" not in str(exc):
                    raise
                ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch words it "GLOBAL x.y was not an allowed global" or "unsupported GLOBAL x.y whose
        # module x is blocked"
        needed = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if needed:
            raise CheckpointError(
                f"Refused to load {path}: it needs to import and call `{needed.group(1)}`, so "
                "loading it could run any code. Nothing in it was executed.",
                "load only checkpoints written by taskfit or plain state dicts (tensors only). If "
                "you trust the file, re-save its weights on a trusted machine with "
                "torch.save(model.state_dict(), path).") from None
        raise CheckpointError(
            f"Refused to load {path}: it is not a PyTorch checkpoint of tensors ({_reason(exc)}). "
            "Nothing in it was executed.",
            "pass a file written by taskfit (.ckpt) or by torch.save(model.state_dict(), path).",
        ) from None
    except Exception as exc:  # zip/stream errors of a truncated or overwritten file
        size = os.path.getsize(path)
        raise CheckpointError(
            f"Cannot read checkpoint {path} ({size} bytes): the file is truncated or corrupt "
            f"({_reason(exc)}).",
            "taskfit never leaves a partial file under a checkpoint's name, so it was damaged "
            "after writing (an interrupted copy, a full disk): copy it again, or use another "
            "checkpoint of the same folder."
        ) from None
    check_format(ckpt, path)
    # the checksums it records (integrity.py); a file without them loads as before
    verify(ckpt, path)
    return ckpt


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = re.sub(r"^Weights only load failed\..*?WeightsUnpickler error: ", "", text)
    text = text.split(" Check the documentation")[0].split(". ")[0][:160]
    return text if isinstance(exc, (RuntimeError, pickle.UnpicklingError)) and text else \
        f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_checkpoint(path: str) -> dict[str, Any]:
    """Load a taskfit checkpoint (a full training state), refusing a newer format or a bare state
    dict. The weights stay mapped (a resume copies them into the parameters); what a resume keeps
    (optimizer states, logged values) is copied into memory, so that nothing the run uses depends on
    the file (the next save may replace it)."""
    ckpt = load_file(path)
    if not isinstance(ckpt, Mapping) or ckpt.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} holds {_describe(ckpt)}, not a taskfit training checkpoint, so training "
            "cannot resume from it.",
            "resume from a file written by taskfit (ModelCheckpoint, trainer.save_checkpoint); to "
            "start from these weights, load them first: task = MyTask.load_from_checkpoint(path) "
            "(a taskfit or Lightning file) or task.load_state_dict(torch.load(path, "
            "weights_only=True)) (a state dict), then fit(task).")
    return {key: value if key == "module" else _in_memory(value) for key, value in ckpt.items()
            # Lightning's name for "module" (the same tensors): not read by a resume
            if key != "state_dict"}


def _describe(ckpt: Any) -> str:
    """What a file that is not a taskfit checkpoint holds, for an error."""
    if _is_state_dict(ckpt):
        return "only weights (a state dict)"
    # its optimizer and loops are Lightning's
    if isinstance(ckpt, Mapping) and "pytorch-lightning_version" in ckpt:
        return f"a Lightning {ckpt['pytorch-lightning_version']} checkpoint"
    return type(ckpt).__name__


def _in_memory(tree: Any) -> Any:
    """``tree`` with every tensor copied out of the mapped file (one at a time: no second copy of
    the file)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, Mapping):
        return type(tree)((k, _in_memory(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_in_memory(v) for v in tree)
    return tree


def check_format(ckpt: Any, path: str) -> None:
    """A taskfit checkpoint of a newer format is refused by every loading path (resume, weights,
    inference)."""
    if not isinstance(ckpt, Mapping) or ckpt.get("format") != FORMAT:
        return  # a plain state dict: no format to check
    version = ckpt.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        written = ckpt.get("versions", {}).get("taskfit", "?")
        raise CheckpointError(
            f"{path} has checkpoint format version {version} (written by taskfit {written}); this "
            f"taskfit reads versions up to {FORMAT_VERSION}.",
            "upgrade taskfit (pip install -U taskfit) to load it.")


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and bool(obj)
        and all(isinstance(v, torch.Tensor) for v in obj.values())
    )


def module_state(ckpt: Any, path: str) -> Mapping[str, Any]:
    """The weights in a taskfit checkpoint, a Lightning-style ``{"state_dict": ...}`` or a plain
    state dict."""
    if isinstance(ckpt, Mapping) and ckpt.get("format") == FORMAT:
        return ckpt["module"]
    if isinstance(ckpt, Mapping) and _is_state_dict(ckpt.get("state_dict")):
        return ckpt["state_dict"]
    if _is_state_dict(ckpt):
        return ckpt
    raise CheckpointError(f"{path} holds no model weights (a {type(ckpt).__name__} without "
                          "tensors).",
                          "pass a checkpoint written by taskfit or a file saved with "
                          "torch.save(model.state_dict(), path).")


def check_weights(
    module: torch.nn.Module, state: Mapping[str, Any], path: str
) -> Mapping[str, Any]:
    """``state`` without foreign ``module.``/``_orig_mod.`` prefixes, checked against ``module``
    before anything is loaded: one error listing the missing keys, unexpected keys and shape
    mismatches."""
    state = normalize_state_dict(state, module)
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{path} does not fit {type(module).__name__}: missing keys {_short(missing)}; "
            f"unexpected keys {_short(unexpected)}; shape mismatches {_short(shapes)}.",
            "load a checkpoint of this model, built with the same arguments (layer sizes); "
            "Module.load_from_checkpoint(path) rebuilds it with the arguments the checkpoint "
            "records.")
    return state


def _short(items: list[str], limit: int = 8) -> str:
    if not items:
        return "none"
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return "[" + ", ".join(items[:limit]) + more + "]"
