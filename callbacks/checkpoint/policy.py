"""ModelCheckpoint's rules that need no Trainer: its arguments checked, the top-k ranking, the file
names.

Kept apart from callbacks/checkpoint.py (when to save, what happens on a fault): pure bookkeeping on
arguments, paths and numbers.
"""
from __future__ import annotations

import datetime
import math
import os
import re
from collections.abc import Mapping
from typing import Any, Callable

from ...errors import MisconfigurationError

_FIELD = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def format_filename(template: str, values: Mapping[str, Any], auto_insert_metric_name: bool = True,
                    equals: str = "=") -> str:
    """A file name (without ``.ckpt``) from a Lightning template, as Lightning's
    ``format_checkpoint_name`` writes it.

    Each ``{name}`` or ``{name:spec}`` is ``format(values[name], spec)``; with
    ``auto_insert_metric_name`` it is preceded by ``name=`` (``"{epoch:03d}"`` -> ``"epoch=009"``;
    ``equals``: Lightning's ``CHECKPOINT_EQUALS_CHAR`` in place of ``=``). One difference: a ``/``
    in an inserted name is written ``_`` (``"{val/acc:.2f}"`` -> ``"val_acc=0.91"``), where
    Lightning would start a sub-folder. A name missing from ``values`` raises ``KeyError``
    (Lightning would write 0).
    """
    def field(match: re.Match) -> str:
        name, spec = match.group(1).strip(), match.group(2) or ""
        value = format(values[name], spec)
        return f"{name.replace('/', '_')}{equals}{value}" if auto_insert_metric_name else value

    return _FIELD.sub(field, template)


def check_arguments(mode: str, save_top_k: Any, triggers: dict[str, Any], save_last: Any,
                    filename: str | None) -> str:
    """One error for an argument ModelCheckpoint cannot take; returns the filename template without
    ``.ckpt``."""
    if mode not in ("min", "max"):
        # Lightning's phrase in the message: people search for it
        raise MisconfigurationError(f"ModelCheckpoint(mode={mode!r}) is not valid. `mode` can be "
                                    f"min, max but got {mode}.",
                                    'use mode="min" (lower is better, e.g. a loss) or mode="max" '
                                    '(e.g. accuracy).')
    if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
        raise MisconfigurationError(f"ModelCheckpoint(save_top_k={save_top_k!r}) is not valid. "
                                    f"Invalid value for save_top_k={save_top_k}. Must be >= -1.",
                                    "use -1 (keep all), 0 (only last.ckpt) or a positive number of "
                                    "files.")
    for name, value in triggers.items():
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise MisconfigurationError(f"ModelCheckpoint({name}={value!r}) is not valid. Invalid "
                                        f"value for {name}={value}. Must be >= 0.",
                                        "use a positive integer, or None/0 to turn this trigger "
                                        "off.")
    if save_last not in (True, False, None, "link"):
        raise MisconfigurationError(f"ModelCheckpoint(save_last={save_last!r}) is not valid.",
                                    'use True (keep last.ckpt), False or None (none), or "link".')
    stem = (
        "{epoch}-{step}"
        if filename is None
        else filename[:-5]
        if filename.endswith(".ckpt")
        else filename
    )
    if not stem or stem == "last" or os.sep in _FIELD.sub("", stem):
        raise MisconfigurationError(f"ModelCheckpoint(filename={filename!r}) is not valid.",
                                    'give a file name template without folders and other than '
                                    '"last", e.g. "{epoch}-{step}" or "{epoch}-{val/acc:.3f}" (put '
                                    'folders in dirpath).')
    problem = _template_problem(stem)
    # refused here, before training: it would write a file named like `{epoch.ckpt`
    if problem is not None:
        raise MisconfigurationError(f"ModelCheckpoint(filename={filename!r}) is not a valid file "
                                    f"name template: {problem}.",
                                    'write each value as {name} or {name:format}, e.g. '
                                    '"{epoch}-{step}" or "{epoch}-{val/acc:.3f}"; a file name '
                                    'template has no other braces.')
    return stem


_URL = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")


def local_folder(dirpath: str | os.PathLike) -> str:
    """``dirpath`` as an absolute local path (``~`` expanded, ``file://`` dropped). A URL of another
    file system (``s3://``, ``memory://``...) is refused: it would otherwise name a local folder
    ``s3:`` (Lightning writes there through fsspec)."""
    text = os.fspath(dirpath)
    scheme = _URL.match(text)
    if scheme and scheme.group(1).lower() != "file":
        raise MisconfigurationError(
            f"ModelCheckpoint(dirpath={text!r}) is a URL: taskfit writes checkpoints to a local or "
            "mounted folder only (Lightning writes to any fsspec file system).",
            "mount the storage (s3fs, gcsfuse, NFS...) and pass its local path, or copy the files "
            "after fit (best_model_path, last_model_path).")
    if scheme:
        text = text[len(scheme.group(0)):]
    return os.path.abspath(os.path.expanduser(text))


def _template_problem(stem: str) -> str | None:
    """What is wrong with the ``{...}`` fields of a file name template (an unclosed or stray brace,
    an empty name, a format spec ``format`` refuses), or None."""
    rest = _FIELD.sub("", stem)
    if "{" in rest or "}" in rest:
        brace = "{" if "{" in rest else "}"
        return f"a '{brace}' that is not part of a {{name}} or {{name:format}} field"
    for match in _FIELD.finditer(stem):
        name, spec = match.group(1).strip(), match.group(2) or ""
        if not name:
            return f"the field {match.group(0)!r} has no name"
        try:
            format(0, spec)
        except (ValueError, TypeError) as exc:
            return f"the format of {match.group(0)!r} is not valid ({exc})"
    return None


def seconds(name: str, value: Any, zero: str, allow_none: bool = False) -> float | None:
    """A duration argument as seconds: a number >= 0 or a ``datetime.timedelta`` (``zero``: what 0
    means)."""
    if value is None and allow_none:
        return None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise MisconfigurationError(f"ModelCheckpoint({name}={value!r}) is not valid.",
                                    f"pass a number of seconds >= 0 (0: {zero}) or a "
                                    "datetime.timedelta.")
    return float(value)


def versioned(
    dirpath: str,
    name: str,
    free: Callable[[str], bool],
    counter: bool,
    extension: str = ".ckpt",
    join: str = "-",
    start: int = 1,
) -> str:
    """``dirpath/name.ckpt``, or with ``enable_version_counter`` the first of ``name-v1.ckpt``,
    ``name-v2.ckpt``... that is ``free`` (Lightning's version counter: a file from another save is
    never overwritten). ``extension``, ``join`` and ``start``: Lightning's ``FILE_EXTENSION``,
    ``CHECKPOINT_JOIN_CHAR`` and ``STARTING_VERSION``."""
    path, version = os.path.join(dirpath, name + extension), start
    while counter and not free(path):
        path = os.path.join(dirpath, f"{name}{join}v{version}{extension}")
        version += 1
    return path


class Ranking:
    """The kept files and their scores: the ``k`` best by a monitored value (``mode``), or without a
    monitor the ``k`` newest (the score is then the global step). ``k == -1`` keeps every file. A
    NaN score is never better than anything, so a diverged state never pushes a good file out."""

    def __init__(self, mode: str, by_recency: bool, k: int) -> None:
        self.lower, self.k = mode == "min" and not by_recency, k
        self.kept: dict[str, float] = {}

    def __eq__(self, other: object) -> bool:
        # By value: a pickled and unpickled ModelCheckpoint equals the original (vars() compared)
        return isinstance(other, Ranking) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    def better(self, a: float, b: float) -> bool:
        if math.isnan(a):
            return False
        return math.isnan(b) or (a < b if self.lower else a > b)

    def worst(self) -> str:
        worst = ""
        for path, score in self.kept.items():
            if not worst or self.better(self.kept[worst], score):
                worst = path
        return worst

    def best(self) -> str:
        best = ""
        for path, score in self.kept.items():
            if not best or self.better(score, self.kept[best]):
                best = path
        return best

    def qualifies(self, score: float) -> bool:
        """``score`` enters the top k (Lightning's ``check_monitor_top_k``: strictly better than the
        k-th)."""
        if self.k == -1 or len(self.kept) < self.k:
            return True
        return self.k > 0 and self.better(score, self.kept[self.worst()])

    def would_evict(self) -> str:
        """The file that admitting one more would push out ("" when the top k is not full)."""
        return self.worst() if self.k != -1 and len(self.kept) >= self.k else ""

    def admit(self, path: str, score: float) -> list[str]:
        """Rank ``path`` (an existing entry of that name is replaced); return the files that fell
        out."""
        self.kept.pop(path, None)
        self.kept[path] = score
        evicted = []
        while self.k != -1 and len(self.kept) > self.k:
            worst = self.worst()
            evicted.append(worst)
            del self.kept[worst]
        return evicted
