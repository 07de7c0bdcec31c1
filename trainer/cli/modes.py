"""The ``taskfit`` command's modes besides training: ``mode=validate``, ``mode=test`` and
``mode=predict`` evaluate a checkpoint (as lightning-hydra-template's ``eval.py``), with the same
configs, overrides and sweeps as ``fit``.

Everything that can be wrong is found before the task is built: an unknown mode, no checkpoint, a
checkpoint that does not exist, cannot be read or holds no weights. ``mode=predict`` writes the
predictions with a :class:`~taskfit.callbacks.PredictionWriter` under ``predict.output_dir`` and
keeps none in memory (``trainer.predict(task, ckpt_path, return_predictions=False)``).
"""
from __future__ import annotations

import glob
import os
import warnings
from collections.abc import Mapping
from typing import Any

from ..callbacks.loggers.tensorboard import guess_mode
from ..errors import MisconfigurationError

MODES = ("fit", "validate", "test", "predict", "lr_find", "scale_batch_size")
EVALUATING = ("validate", "test", "predict")  # the modes that evaluate a checkpoint
LOADERS = ("predict", "test", "val")  # what predict.dataloader may name


def check_mode(config: Mapping[str, Any]) -> str:
    """The run's ``mode`` (``fit`` when the config has none), or a MisconfigurationError."""
    mode = config.get("mode", "fit")
    if mode not in MODES:
        raise MisconfigurationError(
            f"mode={mode!r} is not a mode of the taskfit command.",
            "use mode=fit (train; the default), mode=validate, mode=test or mode=predict with "
            "ckpt_path=/path/to/file.ckpt, mode=lr_find (a learning-rate range test) or "
            "mode=scale_batch_size (the batch size finder).")
    if mode == "predict":
        which = (config.get("predict") or {}).get("dataloader")
        if which is not None and which not in LOADERS:
            raise MisconfigurationError(
                f"predict.dataloader={which!r} is not valid.",
                "use null (the task's predict_dataloader(), else its test_dataloader()), predict, "
                "test or val.")
    return mode


def check_checkpoint_arg(mode: str, value: Any, name: str) -> None:
    """An evaluating mode needs a checkpoint to evaluate: ``ckpt_path`` is a path or ``last``."""
    if value is None:
        raise MisconfigurationError(
            f"mode={mode} needs a checkpoint, but ckpt_path is null.",
            "pass ckpt_path=/path/to/file.ckpt, or ckpt_path=last (the newest last.ckpt of the "
            f"runs named '{name}').")
    if value == "best":
        raise MisconfigurationError(
            f"mode={mode} with ckpt_path=best: 'best' is the best checkpoint of a fit in the same "
            "run, and this run does not fit.",
            "pass the file (the report of the training run and sweep_summary.yaml name it): "
            "ckpt_path=/path/to/epoch=3-step=92.ckpt, or ckpt_path=last.")


def check_checkpoint(path: str) -> None:
    """``path`` exists, can be read safely and holds model weights: one clear CheckpointError
    otherwise. A file is memory-mapped (its tensors are not read); a file that cannot be is loaded
    as ``fit`` would load it."""
    import torch

    from ..checkpoint.files import check_format, load_file, module_state

    ckpt: Any = None
    if os.path.isfile(path):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        # load_file below gives the clear error, or reads an older format
        except Exception:  # noqa: BLE001
            ckpt = None
    if ckpt is None:
        ckpt = load_file(path)  # missing, a directory, unsafe, corrupt: its CheckpointError
    check_format(ckpt, path)
    module_state(ckpt, path)  # a file without weights: its CheckpointError


def check_resume_path(path: str) -> None:
    """``mode=fit`` with ``ckpt_path=<path>``: a checkpoint must be there, before the task is built
    and before anything is written: a missing path, a folder that is not a sharded checkpoint, a
    file that is not one (text, garbage, empty) is one CheckpointError naming ``ckpt_path`` (whether
    it fits the task is checked by fit)."""
    from ..errors import CheckpointError

    if not os.path.exists(path):
        raise CheckpointError(
            f"ckpt_path={path}: there is no checkpoint there (no such file or directory).",
            "ckpt_path takes null (a fresh run), last (the newest last.ckpt of the runs of this "
            "name; a fresh run when there is none yet), or the path of a .ckpt file or sharded "
            "checkpoint directory.")
    try:
        check_checkpoint(path)
    except CheckpointError as exc:
        raise CheckpointError(f"ckpt_path={path} cannot be resumed from: {exc.what}",
                              "pass a .ckpt file (or sharded checkpoint directory) a taskfit fit "
                              "wrote, or ckpt_path=last (the newest last.ckpt of the runs of this "
                              "name).") from exc


def use_loader(task: Any, which: str | None) -> str:
    """Point ``task.predict_dataloader`` at the loader ``which`` names (None: ``predict`` if the
    task defines it, else ``test``); returns the method used, for the report."""
    from ..module import TaskModule

    def defines(method: str) -> bool:
        return getattr(type(task), method, None) is not getattr(TaskModule, method)

    if which is None:
        which = (
            "predict" if defines("predict_dataloader") or not defines("test_dataloader") else "test"
        )
    method = f"{which}_dataloader"
    if which != "predict":  # an instance attribute: the Trainer calls task.predict_dataloader()
        object.__setattr__(task, "predict_dataloader", getattr(task, method))
    return method


def evaluate(trainer: Any, task: Any, mode: str, ckpt_path: str) -> dict[str, Any]:
    """Run ``mode`` on ``task`` with the weights of ``ckpt_path``; what the report and the sweep
    summary show."""
    if mode == "predict":
        trainer.predict(task, ckpt_path=ckpt_path, return_predictions=False)
        return {"metrics": {}}
    metrics = (trainer.validate if mode == "validate" else trainer.test)(task, ckpt_path=ckpt_path)[
        0
    ]
    stage = "val" if mode == "validate" else "test"
    monitor = f"{stage}/loss" if f"{stage}/loss" in metrics else next(iter(metrics), None)
    return {
        "metrics": metrics,
        "monitor": monitor,
        "mode": guess_mode(monitor) if monitor else "min",
        "score": None if monitor is None else float(metrics[monitor]),
        "kind": "final",
    }


def prediction_files(output_dir: str) -> list[str]:
    """The files a PredictionWriter wrote into ``output_dir``."""
    return sorted(glob.glob(os.path.join(glob.escape(output_dir), "predictions_rank*.pt")))


def report_lines(mode: str, result: Mapping[str, Any]) -> list[str]:
    """The report's lines of an evaluating run (after ``run directory``)."""
    lines = [f"  checkpoint:      {result['ckpt_path']}"]
    if mode == "predict":
        files = result.get("predictions") or []
        lines.append(f"  predictions:     {result['output_dir']}  ({len(files)} file(s), from "
                     f"{result['loader']}())")
    elif result["metrics"]:
        stage = "validation:      " if mode == "validate" else "test:            "
        lines.append("  " + stage + ", ".join(f"{k}={v:.4g}" for k, v in result["metrics"].items()))
    return lines


__all__ = [
    "MODES",
    "EVALUATING",
    "check_mode",
    "check_checkpoint_arg",
    "check_checkpoint",
    "check_resume_path",
    "use_loader",
    "evaluate",
    "prediction_files",
    "report_lines",
]
