"""Where a run's files go and how a logger writes them, without a Trainer: the run directory of a
new run (:func:`run_directory`, ``<root>/version_<N>``), text files replaced atomically,
Lightning's ``hparams.yaml``, a check that a folder is writable. The Logger interface that uses
them is a callback (callbacks/loggers/logger.py); the loop calls :func:`run_directory` when it
builds a run."""
from __future__ import annotations

import os
import re
from typing import Any

from ..checkpoint.files import write_probe
from ..errors import MisconfigurationError


def run_directory(callbacks: Any, default_root_dir: str | None) -> str:
    """``trainer.log_dir`` of a new run (rank 0): where the first logger among ``callbacks`` with a
    directory puts its run (``Logger.directory``), else ``<default_root_dir>/version_<N>`` (default
    root ``./taskfit_logs``)."""
    first = next((cb for cb in callbacks if getattr(cb, "has_directory", False)), None)
    if first is not None:
        return first.directory(default_root_dir)
    return next_version_dir(default_root_dir)


def next_version_dir(root: str | None) -> str:
    """``<root>/version_<N+1>`` for the highest existing ``version_N`` (root: ``./taskfit_logs`` by
    default)."""
    root = os.path.abspath(root or os.path.join(os.getcwd(), "taskfit_logs"))
    taken = [int(m.group(1)) for d in (os.listdir(root) if os.path.isdir(root) else [])
             if (m := re.fullmatch(r"version_(\d+)", d))]
    return os.path.join(root, f"version_{max(taken, default=-1) + 1}")


def hparams_dict(params: Any) -> dict[str, Any]:
    """``log_hyperparams``' argument as a dict: a mapping, or an ``argparse.Namespace`` (Lightning
    takes both); None (Lightning's default) is none."""
    if params is None:
        return {}
    return (
        dict(vars(params))
        if hasattr(params, "__dict__") and not isinstance(params, dict)
        else dict(params)
    )


def write_hparams_yaml(folder: str, params: dict[str, Any]) -> None:
    """``<folder>/hparams.yaml`` (Lightning's file, which its loggers write beside their runs):
    numbers, strings, bools and null as they are, anything else as text."""
    import yaml

    plain = {
        str(k): v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
        for k, v in params.items()
    }
    replace_file(
        os.path.join(folder, "hparams.yaml"),
        yaml.safe_dump(plain, sort_keys=False, default_flow_style=False, allow_unicode=True),
    )


def replace_file(path: str, text: str) -> None:
    """Write ``path`` through a temporary file and an atomic rename: a crash leaves the old file or
    the new."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def check_writable(folder: str, who: str) -> None:
    """Create ``folder`` and write, fsync and remove a probe file in it; a MisconfigurationError
    says why not."""
    try:
        write_probe(folder)
    except OSError as exc:
        raise MisconfigurationError(
            f"{who} cannot write to {folder}: {exc.strerror or exc} ({type(exc).__name__}).",
            "make the folder writable (permissions, a read-only or full file system), or pass "
            f"{who}(save_dir=...) / Trainer(default_root_dir=...) elsewhere.") from exc
