"""Finding and reading checkpoints without a run: the newest complete one under a folder (``ckpt_path="last"``,
``taskfit ckpt_path=last``) and a TaskModule built from one (``TaskModule.load_from_checkpoint``)."""
from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError
from .files import LAST, check_weights, load_file, module_state
from .sharded import MARKER, checkpoint_exists, is_sharded, read_shards


def last_checkpoint(root: str | os.PathLike, warn: bool = True) -> str | None:
    """The newest complete checkpoint to continue from under ``root``: ``root/last.ckpt``, else the ``last.ckpt``
    of the highest ``version_N/checkpoints`` that has one; None when there is none.

    A sharded ``last.ckpt`` without its COMPLETE marker (a copy or a write that stopped half-way) is skipped for
    the newest complete checkpoint of its folder (an ``epoch=...-step=...`` one), else of the next older version,
    and ``warn`` says which one was skipped for which."""
    root = os.fspath(root)
    versions = sorted(((int(m.group(1)), d) for d in (os.listdir(root) if os.path.isdir(root) else [])
                       if (m := re.fullmatch(r"version_(\d+)", d))), reverse=True)
    skipped, found = [], None
    for folder in [root] + [os.path.join(root, d, "checkpoints") for _, d in versions]:
        last = os.path.join(folder, LAST)
        if checkpoint_exists(last):
            found = last
        elif is_sharded(last):  # a directory of that name, without its marker
            skipped.append(os.path.abspath(last))
            found = _newest_complete(folder)
        if found:
            break
    if skipped and warn:
        instead = f"resuming from {os.path.abspath(found)}, the newest complete checkpoint" if found else \
            "there is no complete checkpoint to resume from"
        warnings.warn(f"Skipped {', '.join(skipped)}: incomplete (no COMPLETE marker; its write or copy stopped "
                      f"half-way); {instead}. HINT: delete the incomplete directory, or copy it again whole.",
                      UserWarning, stacklevel=3)
    return os.path.abspath(found) if found else None


def _newest_complete(folder: str) -> str | None:
    """The most recently written complete checkpoint in ``folder`` (a sharded one dates from its marker)."""
    dated = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if name.endswith(".ckpt") and not name.startswith(".") and checkpoint_exists(path):
            dated.append((os.path.getmtime(os.path.join(path, MARKER) if os.path.isdir(path) else path), path))
    return max(dated)[1] if dated else None


def load_module(cls: type, path: str | os.PathLike, map_location: Any = "cpu", **kwargs: Any) -> Any:
    """Build ``cls`` with the init arguments the checkpoint records (``kwargs`` win) and load its weights."""
    path = os.path.abspath(os.fspath(path))
    ckpt = load_file(path)
    weights = module_state(ckpt, path)
    if is_sharded(path):  # read whole, in this process
        weights = read_shards(path, {"module": weights}, parts=("module",))["module"]
    recorded = ckpt.get("task", {}).get("hparams", {}) if isinstance(ckpt, Mapping) else {}
    params = inspect.signature(cls.__init__).parameters
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    args = {k: v for k, v in recorded.items()
            if (k in params or open_kwargs) and not (isinstance(v, Mapping) and "_target_" in v)}
    args.update(kwargs)  # factories (optimizer=...) were recorded as descriptions: defaults are used for them
    try:
        module = cls(**args)
    except Exception as exc:
        raise CheckpointError(
            f"Could not build {cls.__name__} from the arguments recorded in {path} ({sorted(args)}): "
            f"{type(exc).__name__}: {exc}",
            f"pass the missing or changed arguments: {cls.__name__}.load_from_checkpoint(path, name=value).") from None
    weights = check_weights(module, weights, path)
    module.load_state_dict(weights)
    return module.to(map_location).eval()
