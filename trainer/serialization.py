"""Checkpoint files: atomic writes, and reads that never run code (``torch.load(weights_only=True)`` only).

Writes go to a hidden temporary file in the same folder, are flushed and fsynced, then renamed over the target
with ``os.replace``: a process killed at any instant leaves the previous file intact, and no partial file carries
a checkpoint's name. Reads refuse, with one clear error, a missing, unsafe, truncated or foreign file, and a
checkpoint of another model (listing missing/unexpected keys and shape mismatches). trainer/checkpoint.py
decides what goes into a checkpoint and how a run continues from one.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .errors import CheckpointError

FORMAT = "taskfit.checkpoint"
FORMAT_VERSION = 1
LAST = "last.ckpt"
# Exactly the types torch.load(weights_only=True) reads back (subclasses, e.g. torch's version string, are not).
_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size, torch.Tensor,
          torch.nn.Parameter)


# ---- writing --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _staged(path: str) -> Iterator[str]:
    """A hidden temporary name beside ``path``: renamed over ``path`` on success, removed on failure."""
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        yield tmp
        _publish(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a hidden temporary file beside ``path``, fsync, then rename it over ``path``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _staged(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # the data is on disk before the name points at it


def atomic_copy(src: str, dst: str) -> None:
    """Make ``dst`` a copy of the checkpoint ``src`` atomically: a hard link (free) or, where links fail, a copy."""
    with _staged(dst) as tmp:
        os.unlink(tmp)
        try:
            os.link(src, tmp)
        except OSError:  # no hard links on this file system: copy the bytes
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())


def _publish(tmp: str, path: str) -> None:
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600 files; give the checkpoint the usual permissions
    os.replace(tmp, path)
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def check_plain(obj: Any, where: str) -> None:
    """Refuse to write anything ``torch.load(weights_only=True)`` could not read back (names the culprit)."""
    kind = type(obj)
    if kind in _PLAIN:
        return
    if kind in (dict, OrderedDict):
        for key, value in obj.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(value, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, set):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"Cannot save a checkpoint: {where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a "
        "safe checkpoint cannot hold.",
        "checkpoints hold only tensors, dicts, lists, tuples and numbers/strings (so loading them never runs "
        "code): convert it in the state_dict() that returns it (numpy arrays: torch.from_numpy(a); "
        "numpy numbers: float(x); objects: a dict of their fields).")


# ---- reading --------------------------------------------------------------------------------------------
def load_file(path: str) -> Any:
    """``torch.load(path, weights_only=True)`` with one clear error for a missing, unsafe or damaged file."""
    if not os.path.exists(path):
        raise CheckpointError(f"Checkpoint {path} does not exist.",
                              "check the path (it is relative to the working directory), or pass "
                              "ckpt_path=\"last\" to resume from the newest checkpoint of the run directory.")
    if os.path.isdir(path):
        raise CheckpointError(f"Checkpoint {path} is a directory, not a file.",
                              f"pass a .ckpt file inside it (e.g. {os.path.join(path, LAST)}) or ckpt_path=\"last\".")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about unusual pickle protocols before refusing them
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        needed = re.search(r"GLOBAL (\S+) was not an allowed global", str(exc))
        if needed:
            raise CheckpointError(
                f"Refused to load {path}: it needs to import and call `{needed.group(1)}`, so loading it could "
                "run any code. Nothing in it was executed.",
                "load only checkpoints written by taskfit or plain state dicts (tensors only). If you trust the "
                "file, re-save its weights on a trusted machine with torch.save(model.state_dict(), path).") from None
        raise CheckpointError(
            f"Refused to load {path}: it is not a PyTorch checkpoint of tensors ({_reason(exc)}). Nothing in it "
            "was executed.",
            "pass a file written by taskfit (.ckpt) or by torch.save(model.state_dict(), path).") from None
    except Exception as exc:  # zip/stream errors of a truncated or overwritten file
        size = os.path.getsize(path)
        raise CheckpointError(
            f"Cannot read checkpoint {path} ({size} bytes): the file is truncated or corrupt ({_reason(exc)}).",
            "taskfit never leaves a partial file under a checkpoint's name, so it was damaged after writing "
            "(an interrupted copy, a full disk): copy it again, or use another checkpoint of the same folder."
        ) from None


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = re.sub(r"^Weights only load failed\..*?WeightsUnpickler error: ", "", text)
    text = text.split(" Check the documentation")[0].split(". ")[0][:160]
    return text if isinstance(exc, (RuntimeError, pickle.UnpicklingError)) and text else \
        f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_checkpoint(path: str) -> dict[str, Any]:
    """Load a taskfit checkpoint (a full training state), refusing a newer format or a bare state dict."""
    ckpt = load_file(path)
    if not isinstance(ckpt, Mapping) or ckpt.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} holds {'only weights (a state dict)' if _is_state_dict(ckpt) else type(ckpt).__name__}, "
            "not a taskfit training checkpoint, so training cannot resume from it.",
            "resume from a file written by taskfit (ModelCheckpoint, trainer.save_checkpoint); to start from "
            "these weights, load them first: task.load_state_dict(torch.load(path, weights_only=True)).")
    version = ckpt.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        written = ckpt.get("versions", {}).get("taskfit", "?")
        raise CheckpointError(
            f"{path} has checkpoint format version {version} (written by taskfit {written}); this taskfit reads "
            f"versions up to {FORMAT_VERSION}.",
            "upgrade taskfit (pip install -U taskfit) to load it.")
    return ckpt


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def module_state(ckpt: Any, path: str) -> Mapping[str, Any]:
    """The weights in a taskfit checkpoint, a Lightning-style ``{"state_dict": ...}`` or a plain state dict."""
    if isinstance(ckpt, Mapping) and ckpt.get("format") == FORMAT:
        return ckpt["module"]
    if isinstance(ckpt, Mapping) and _is_state_dict(ckpt.get("state_dict")):
        return ckpt["state_dict"]
    if _is_state_dict(ckpt):
        return ckpt
    raise CheckpointError(f"{path} holds no model weights (a {type(ckpt).__name__} without tensors).",
                          "pass a checkpoint written by taskfit or a file saved with "
                          "torch.save(model.state_dict(), path).")


def check_weights(module: torch.nn.Module, state: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """``state`` without foreign ``module.``/``_orig_mod.`` prefixes, checked against ``module`` before anything is
    loaded: one error listing the missing keys, unexpected keys and shape mismatches."""
    from .strategies import normalize_state_dict

    state = normalize_state_dict(state, module)
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(v.shape)}" for k, v in expected.items()
              if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        raise CheckpointError(
            f"{path} does not fit {type(module).__name__}: missing keys {_short(missing)}; unexpected keys "
            f"{_short(unexpected)}; shape mismatches {_short(shapes)}.",
            "load a checkpoint of this model, built with the same arguments (layer sizes); "
            "Module.load_from_checkpoint(path) rebuilds it with the arguments the checkpoint records.")
    return state


def _short(items: list[str], limit: int = 8) -> str:
    if not items:
        return "none"
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return "[" + ", ".join(items[:limit]) + more + "]"
