"""Finding and reading checkpoints without a run: the newest complete one under a folder
(``ckpt_path="last"``, ``taskfit ckpt_path=last``) and a TaskModule built from one
(``TaskModule.load_from_checkpoint``)."""
from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from ..console import user_stacklevel
from ..errors import CheckpointError
from .files import LAST, check_weights, load_file, module_state
from .sharded import MARKER, checkpoint_exists, is_sharded, read_shards


def last_checkpoint(root: str | os.PathLike, warn: bool = True) -> str | None:
    """The newest checkpoint to continue from under ``root``: ``root/last.ckpt``, else the
    ``last.ckpt`` of the highest ``version_N/checkpoints`` that has one; None when there is none.

    A folder whose ``last.ckpt`` is missing, is not a checkpoint (an empty folder of that name) or
    is a sharded one without its COMPLETE marker (a copy or a write that stopped half-way) gives its
    newest other checkpoint (an ``epoch=...-step=...`` one) instead, else the next older version's;
    ``warn`` says which was skipped for which. Nothing is read here: :func:`last_candidates` lists
    the others to fall back to when a file turns out damaged."""
    found, skipped = last_candidates(root)
    if warn:
        warn_skipped(skipped, found[0] if found else None, stacklevel=user_stacklevel())
    return found[0] if found else None


def last_candidates(root: str | os.PathLike) -> tuple[list[str], list[tuple[str, str]]]:
    """Every checkpoint ``ckpt_path="last"`` may resume under ``root``, best first: per folder
    (``root``, then ``version_N/checkpoints`` from the highest N), its ``last.ckpt``, then its other
    checkpoints newest first (by modification time). Also ``(path, why)`` for each ``last.ckpt``
    that is not a checkpoint, in the order met."""
    root = os.fspath(root)
    versions = sorted(
        (
            (int(m.group(1)), d)
            for d in (os.listdir(root) if os.path.isdir(root) else [])
            if (m := re.fullmatch(r"version_(\d+)", d))
        ),
        reverse=True,
    )
    found: list[str] = []
    skipped: list[tuple[str, str]] = []
    for folder in [root] + [os.path.join(root, d, "checkpoints") for _, d in versions]:
        found += folder_candidates(folder, skipped if not found else None)
    return found, skipped


def folder_candidates(folder: str, skipped: list[tuple[str, str]] | None = None) -> list[str]:
    """``folder``'s checkpoints, its last ones first (``last.ckpt``, and ``last-v1.ckpt``... that a
    fresh fit writes beside an older run's: the newest first, as Lightning picks), then the others
    newest first (absolute paths); a ``last.ckpt`` that is not one is added to ``skipped`` with the
    reason, when the folder holds any other."""
    last = os.path.abspath(os.path.join(folder, LAST))
    newest = _newest_first(folder)
    lasts = [p for p in newest if _LAST_NAMES.fullmatch(os.path.basename(p))]
    others = [p for p in newest if p not in lasts]
    if checkpoint_exists(last):
        return lasts + others
    others = lasts + others
    if skipped is not None:
        if is_sharded(last):  # a directory of that name, without its marker
            skipped.append((last, INCOMPLETE))
        elif os.path.isdir(last):
            skipped.append((last, "a folder, not a checkpoint"))
        elif os.path.lexists(last):
            skipped.append((last, "not a regular file"))
        elif others:  # (a folder without any checkpoint has nothing to say)
            skipped.append((last, "missing"))
    return others


_LAST_NAMES = re.compile(r"last(-v\d+)?\.ckpt")
INCOMPLETE = "incomplete (no COMPLETE marker; its write or copy stopped half-way)"


def warn_skipped(skipped: list[tuple[str, str]], used: str | None, stacklevel: int = 2) -> None:
    """One warning naming the checkpoints ``"last"`` skipped, why, and the one it resumes
    instead."""
    if not skipped:
        return
    names = "; ".join(f"{path}: {why}" for path, why in skipped)
    if used is None:
        instead = "there is no intact checkpoint to resume from"
    elif any(why == INCOMPLETE for _, why in skipped):
        instead = f"resuming from {used}, the newest complete checkpoint"
    else:
        instead = f"resuming from {used}, the newest intact checkpoint"
    hint = (
        "delete the incomplete directory, or copy it again whole"
        if all(why == INCOMPLETE for _, why in skipped)
        else ("nothing to do if that is the state to continue; delete or replace the damaged file "
              "to silence this")
    )
    warnings.warn(
        f"Skipped {names}; {instead}. HINT: {hint}.", UserWarning, stacklevel=stacklevel + 1
    )


def _newest_first(folder: str) -> list[str]:
    """The complete checkpoints in ``folder`` (absolute paths), the most recently written first (a
    sharded one dates from its marker)."""
    dated = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = os.path.abspath(os.path.join(folder, name))
        if name.endswith(".ckpt") and not name.startswith(".") and checkpoint_exists(path):
            try:
                stamp = os.stat(
                    os.path.join(path, MARKER) if os.path.isdir(path) else path
                ).st_mtime_ns
            except OSError:  # removed meanwhile
                continue
            # equal times (a coarse clock): epoch=1-step=10 > step=8
            dated.append((stamp, _natural(name), path))
    return [path for _, _, path in sorted(dated, reverse=True)]


def _natural(name: str) -> list[Any]:
    return [
        (0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)
    ]


def load_module(
    cls: type, path: str | os.PathLike, map_location: Any = "cpu", **kwargs: Any
) -> Any:
    """Build ``cls`` with the init arguments the checkpoint records (``kwargs`` win) and load its
    weights."""
    path = os.path.abspath(os.fspath(path))
    ckpt = load_file(path)
    weights = module_state(ckpt, path)
    if is_sharded(path):  # read whole, in this process
        weights = read_shards(path, {"module": weights}, parts=("module",))["module"]
    recorded = (
        {}
        if not isinstance(ckpt, Mapping)
        else ckpt["task"].get("hparams", {})
        if "task" in ckpt
        else ckpt.get("hyper_parameters") or {}
    )  # a Lightning checkpoint records its module's hparams there
    params = inspect.signature(cls.__init__).parameters
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    args = {k: v for k, v in recorded.items()
            if (k in params or open_kwargs) and not (isinstance(v, Mapping) and "_target_" in v)}
    # factories (optimizer=...) were recorded as descriptions: defaults are used for them
    args.update(kwargs)
    try:
        module = cls(**args)
    except Exception as exc:
        raise CheckpointError(
            f"Could not build {cls.__name__} from the arguments recorded in {path} "
            f"({sorted(args)}): {type(exc).__name__}: {exc}",
            f"pass the missing or changed arguments: {cls.__name__}.load_from_checkpoint(path, "
            "name=value).") from None
    weights = check_weights(module, weights, path)
    module.load_state_dict(weights)
    return module.to(map_location).eval()
