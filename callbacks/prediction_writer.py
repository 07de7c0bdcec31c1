"""Predictions to disk as they are made, with the dataset indices of their samples, so that a
predict set larger than memory never sits in one list: Lightning's ``BasePredictionWriter``
(subclass it, same hooks and arguments) and ``PredictionWriter``, a ready-to-use one that writes
``.pt`` files."""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..arguments import arguments_checked
from ..callback import Callback
from ..checkpoint.files import atomic_save
from ..data.loaders import batch_size_of, sample_order
from ..errors import MisconfigurationError
from ..loop.evaluation import to_cpu

_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    """Lightning's base class: override :meth:`write_on_batch_end` and/or
    :meth:`write_on_epoch_end`.

    ``write_interval="batch"`` calls ``write_on_batch_end`` after each predict batch (nothing is
    kept); ``"epoch"`` keeps each batch's prediction (on the CPU) and calls ``write_on_epoch_end``
    once at the end; ``"batch_and_epoch"`` both. ``batch_indices`` are the dataset indices of the
    samples (None when the loader's sampler is the user's own); under ddp each rank writes its own
    share (``trainer.strategy.rank``). Pair it with ``trainer.predict(task,
    return_predictions=False)`` so the Trainer keeps nothing either.

    Args:
        write_interval: ``"batch"``, ``"epoch"`` or ``"batch_and_epoch"``.
    """

    @arguments_checked(docs="docs/callbacks.md")
    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in _INTERVALS:
            raise MisconfigurationError(f"{type(self).__name__}(write_interval={write_interval!r}) "
                                        "is not valid.",
                                        'use "batch" (a call per batch, nothing kept), "epoch" '
                                        '(one call with every batch\'s prediction) or '
                                        '"batch_and_epoch".')
        self.write_interval = write_interval
        self._order: Any = None
        self._offset = 0
        self._kept: list[tuple[Any, Any]] = []

    def write_on_batch_end(
        self,
        trainer: Any,
        task: Any,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's ``prediction`` (as ``predict_step`` returned it, on the device)."""

    def write_on_epoch_end(self, trainer: Any, task: Any, predictions: Sequence[Any],
                           batch_indices: Sequence[Any]) -> None:
        """Write every batch's prediction (a list, on the CPU); ``batch_indices`` as Lightning gives
        them: one list per dataloader (here one) of each batch's sample indices."""

    def on_predict_start(self, trainer: Any, task: Any) -> None:
        needed = {
            "batch": ["write_on_batch_end"],
            "epoch": ["write_on_epoch_end"],
            "batch_and_epoch": ["write_on_batch_end", "write_on_epoch_end"],
        }[self.write_interval]
        missing = [m for m in needed if getattr(type(self), m) is getattr(BasePredictionWriter, m)]
        if missing:
            raise MisconfigurationError(
                f"{type(self).__name__}(write_interval={self.write_interval!r}) does not define "
                f"{missing[0]}, so nothing would be written.",
                f"define {missing[0]} in {type(self).__name__} (Lightning's arguments: "
                "docs/callbacks.md), or use taskfit.callbacks.PredictionWriter(output_dir), which "
                "writes .pt files.")
        self._order, self._offset, self._kept = sample_order(trainer.predict_dataloader), 0, []

    def on_predict_batch_end(
        self,
        trainer: Any,
        task: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        n = batch_size_of(batch)
        if not self._offset:  # read once the iteration started: a shuffled order is drawn then
            self._order = sample_order(trainer.predict_dataloader)
        indices = (
            None
            if self._order is None
            else [int(i) for i in self._order[self._offset : self._offset + n]]
        )
        self._offset += n
        if self.write_interval != "epoch":
            self.write_on_batch_end(
                trainer, task, outputs, indices, batch, batch_idx, dataloader_idx
            )
        if self.write_interval != "batch":
            self._kept.append((indices, to_cpu(outputs)))

    def on_predict_end(self, trainer: Any, task: Any) -> None:
        if self.write_interval != "batch":
            indices = (
                None if any(i is None for i, _ in self._kept) else [[i for i, _ in self._kept]]
            )
            self.write_on_epoch_end(trainer, task, [p for _, p in self._kept], indices)
            self._kept = []


class PredictionWriter(BasePredictionWriter):
    """Writes each rank's predictions under ``output_dir``, as ``torch.save`` files of
    ``{"predictions": ..., "indices": [...]}`` (tensors on the CPU; loadable with
    ``weights_only=True``), atomically.

    Per batch (``write_interval="batch"``): ``predictions_rank{r}_batch{i:06d}.pt``, written as the
    batch is predicted; per epoch (``"epoch"``): ``predictions_rank{r}.pt`` once, ``predictions`` a
    list per batch and ``indices`` every sample's dataset index in order. Override
    :meth:`write_on_batch_end`/:meth:`write_on_epoch_end` (Lightning's arguments) for another
    format.

    Args:
        output_dir: the folder (created if missing).
        write_interval: ``"batch"``, ``"epoch"`` or ``"batch_and_epoch"``.
    """

    @arguments_checked(docs="docs/callbacks.md")
    def __init__(self, output_dir: str | os.PathLike, write_interval: str = "batch") -> None:
        super().__init__(write_interval)
        self.output_dir = os.fspath(output_dir)

    def on_predict_start(self, trainer: Any, task: Any) -> None:
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            if not os.access(self.output_dir, os.W_OK):
                raise PermissionError(f"no write permission for {self.output_dir}")
        except OSError as exc:
            raise MisconfigurationError(
                f"PredictionWriter cannot write to {self.output_dir}: {exc}.",
                "pass an output_dir this process can create and write to.",
            ) from None
        super().on_predict_start(trainer, task)

    def write_on_batch_end(
        self,
        trainer: Any,
        task: Any,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        name = f"predictions_rank{trainer.strategy.rank}_batch{batch_idx:06d}.pt"
        atomic_save({"predictions": to_cpu(prediction), "indices": batch_indices},
                    os.path.join(self.output_dir, name))

    def write_on_epoch_end(self, trainer: Any, task: Any, predictions: Sequence[Any],
                           batch_indices: Sequence[Any]) -> None:
        indices = (
            None if batch_indices is None else [i for batch in batch_indices[0] for i in batch]
        )
        name = f"predictions_rank{trainer.strategy.rank}.pt"
        atomic_save(
            {"predictions": list(predictions), "indices": indices},
            os.path.join(self.output_dir, name),
        )
