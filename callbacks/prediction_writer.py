"""PredictionWriter: predictions to disk as they are made, with the dataset indices of their samples, so that a
predict set larger than memory never sits in one list (Lightning's ``BasePredictionWriter``, ready to use)."""
from __future__ import annotations

import os
from typing import Any

from ..data import batch_size_of, sample_order
from ..errors import MisconfigurationError
from ..evaluation import to_cpu
from ..serialization import atomic_save
from .base import Callback

_INTERVALS = ("batch", "epoch")


class PredictionWriter(Callback):
    """Writes each rank's predictions under ``output_dir``, as ``torch.save`` files of
    ``{"predictions": ..., "indices": [...]}`` (tensors on the CPU; loadable with ``weights_only=True``).

    ``write_interval="batch"``: one file per batch, ``predictions_rank{r}_batch{i:06d}.pt``, written as the batch
    is predicted (nothing is kept); ``"epoch"``: the rank's predictions kept and written once,
    ``predictions_rank{r}.pt``. ``indices`` are the dataset indices of the samples, in order (None when the
    loader's sampler is the user's own). Pair it with ``trainer.predict(task, return_predictions=False)`` so the
    Trainer keeps nothing either. Override :meth:`write_on_batch_end`/:meth:`write_on_epoch_end` for another format.
    """

    def __init__(self, output_dir: str, write_interval: str = "batch") -> None:
        if write_interval not in _INTERVALS:
            raise MisconfigurationError(f"PredictionWriter(write_interval={write_interval!r}) is not valid.",
                                        'use "batch" (a file per batch, nothing kept) or "epoch" (one file per rank).')
        self.output_dir, self.write_interval = os.fspath(output_dir), write_interval
        self._order: Any = None
        self._offset = 0
        self._kept: list[tuple[Any, Any]] = []

    def on_predict_start(self, trainer: Any, task: Any) -> None:
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            if not os.access(self.output_dir, os.W_OK):
                raise PermissionError(f"no write permission for {self.output_dir}")
        except OSError as exc:
            raise MisconfigurationError(f"PredictionWriter cannot write to {self.output_dir}: {exc}.",
                                        "pass an output_dir this process can create and write to.") from None
        self._order, self._offset, self._kept = sample_order(trainer.predict_dataloader), 0, []

    def on_predict_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        n = batch_size_of(batch)
        indices = None if self._order is None else list(self._order[self._offset:self._offset + n])
        self._offset += n
        if self.write_interval == "batch":
            self.write_on_batch_end(trainer, to_cpu(outputs), indices, batch_idx)
        else:
            self._kept.append((indices, to_cpu(outputs)))

    def on_predict_end(self, trainer: Any, task: Any) -> None:
        if self.write_interval == "epoch":
            indices = None if any(i is None for i, _ in self._kept) else [i for part, _ in self._kept for i in part]
            self.write_on_epoch_end(trainer, [p for _, p in self._kept], indices)
            self._kept = []

    # ---- the files: override for another format --------------------------------------------------------------
    def write_on_batch_end(self, trainer: Any, prediction: Any, indices: list[int] | None, batch_idx: int) -> None:
        """Save one batch's prediction (atomically: a killed run leaves no half-written file)."""
        name = f"predictions_rank{trainer.strategy.rank}_batch{batch_idx:06d}.pt"
        atomic_save({"predictions": prediction, "indices": indices}, os.path.join(self.output_dir, name))

    def write_on_epoch_end(self, trainer: Any, predictions: list[Any], indices: list[int] | None) -> None:
        """Save the rank's predictions (a list, one entry per batch) with the indices of all its samples."""
        name = f"predictions_rank{trainer.strategy.rank}.pt"
        atomic_save({"predictions": predictions, "indices": indices}, os.path.join(self.output_dir, name))
