"""When things happen inside a training epoch: validations (``val_check_interval``) and optimizer
steps (``accumulate_grad_batches``). Pure arithmetic on batch counts, decided once per fit."""
from __future__ import annotations

from ..errors import MisconfigurationError


class ValidationSchedule:
    """When fit validates, by Lightning's rules (tests/test_lightning_semantics.py holds the exact
    sequences).

    With ``check_val_every_n_epoch=k``: in every k-th epoch, after every ``every`` batches counted
    from the epoch's start, where a float ``val_check_interval`` f gives ``every = max(1, int(n *
    f))`` for an epoch of n batches and an int gives itself. There is no extra validation at the
    epoch's end: f=0.25 with n=9 validates after batches 2, 4, 6 and 8 (f=1.0: after batch 9). With
    ``check_val_every_n_epoch=None``: after every ``val_check_interval`` (an int) batches counted
    across epochs. A loader without a length validates when it is exhausted (f=1.0).
    """

    def __init__(
        self,
        val_check_interval: int | float,
        every_n_epochs: int | None,
        num_train_batches: float,
        has_val: bool,
    ) -> None:
        self.has_val, self.every_n_epochs, self.n = has_val, every_n_epochs, num_train_batches
        if isinstance(val_check_interval, float):
            self.every = float("inf") if num_train_batches == float("inf") else \
                max(1, int(num_train_batches * val_check_interval))
        else:
            self.every = val_check_interval
        if not has_val:
            return
        if every_n_epochs is None and num_train_batches == float("inf"):
            raise MisconfigurationError(
                "check_val_every_n_epoch=None counts training batches across epochs, but the "
                "training loader has no "
                "length.",
                "give the training data a __len__, or validate per epoch "
                "(check_val_every_n_epoch=1).",
            )
        if every_n_epochs is not None and self.every > num_train_batches:
            raise MisconfigurationError(
                f"Trainer(val_check_interval={val_check_interval}) is longer than an epoch "
                f"({num_train_batches} training batches), so fit would never validate.",
                f"use val_check_interval <= {num_train_batches}, a fraction of the epoch (e.g. "
                f"0.5), or check_val_every_n_epoch=None to validate every {val_check_interval} "
                "batches counted across epochs (as Lightning).")

    def in_epoch(self, epoch: int) -> bool:
        """This epoch validates at all."""
        return self.has_val and (
            self.every_n_epochs is None or (epoch + 1) % self.every_n_epochs == 0
        )

    def due(self, epoch: int, batch_idx: int) -> bool:
        """Validation is due after batch ``batch_idx`` of ``epoch`` (asked only in epochs that
        validate)."""
        count = batch_idx + 1 if self.every_n_epochs is not None else epoch * self.n + batch_idx + 1
        return count % self.every == 0

    @property
    def at_exhaustion(self) -> bool:
        """A loader without a length: validate when it is exhausted (a float interval cannot count
        it)."""
        return self.every == float("inf")


def accumulation_group(batch_idx: int, k: int, n: float) -> tuple[int, bool]:
    """(size of the group batch ``batch_idx`` belongs to, whether the optimizer steps after it).

    Groups of ``k`` batches from the epoch's start; the epoch's last group is short when ``n`` is
    not a multiple of ``k``, and its loss is divided by its own size (the mean over the batches it
    really has).
    """
    start = batch_idx - batch_idx % k
    size = k if start + k <= n else int(n - start)
    return size, batch_idx + 1 - start == size


def steps_per_epoch(n: float, k: int) -> float:
    """Optimizer steps in an epoch of ``n`` batches grouped by ``k`` (:func:`accumulation_group`:
    the short last group steps too); inf for a loader without a length."""
    return n if n == float("inf") else -(-n // k)
