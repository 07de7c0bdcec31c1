"""When things happen inside a training epoch: validations (``val_check_interval``) and optimizer
steps (``accumulate_grad_batches``). Arithmetic on batch counts, decided once per fit; a duration
``val_check_interval`` reads the clock (``time.monotonic``) after each batch of a validating
epoch, and only then."""
from __future__ import annotations

import datetime
import time
from typing import Any, Callable

from ..errors import MisconfigurationError


class ValidationSchedule:
    """When fit validates, by Lightning's rules (tests/test_lightning_semantics.py holds the exact
    sequences).

    With ``check_val_every_n_epoch=k``: in every k-th epoch, after every ``every`` batches counted
    from the epoch's start, where a float ``val_check_interval`` f gives ``every = max(1, int(n *
    f))`` for an epoch of n batches and an int gives itself. There is no extra validation at the
    epoch's end: f=0.25 with n=9 validates after batches 2, 4, 6 and 8 (f=1.0: after batch 9). With
    ``check_val_every_n_epoch=None``: after every ``val_check_interval`` (an int) batches counted
    across epochs (Lightning's ``total_batch_idx``: also without a loader length). A loader without
    a length validates when it is exhausted (f=1.0).

    A duration (``datetime.timedelta``: trainer_config.py turns ``"DD:HH:MM:SS"`` and a dict into
    one): in epochs that validate, after the first batch that ends ``seconds`` or more after the
    training start or the last validation's end (Lightning 2.6's rule; no validation at an epoch's
    end of its own). Under ddp the ranks' clocks differ, so rank 0 decides, every ``sync_every``
    batches (the log interval, where the ranks meet anyway), and ``broadcast`` tells the others.
    """

    def __init__(
        self,
        val_check_interval: int | float | datetime.timedelta,
        every_n_epochs: int | None,
        num_train_batches: float,
        has_val: bool,
        broadcast: Callable[[Any], Any] | None = None,
        sync_every: int = 1,
    ) -> None:
        self.has_val, self.every_n_epochs, self.n = has_val, every_n_epochs, num_train_batches
        self.seconds: float | None = None
        # the clock's reading at the training start or the last validation's end (duration only)
        self.last = 0.0
        self.broadcast, self.sync_every = broadcast, sync_every
        # (epoch, batch_idx, due): a duration's decision, asked again by the checkpoint manager
        self._decided: tuple[int, int, bool] = (-1, -1, False)
        # the batches of the fit's earlier epochs (start_epoch): counted across epochs
        self.before = 0
        if isinstance(val_check_interval, datetime.timedelta):
            self.seconds, self.every = val_check_interval.total_seconds(), float("inf")
            # asked after every batch of a validating epoch: the clock's rule, chosen once
            self.due = self._time_due  # type: ignore[method-assign]
            return
        if isinstance(val_check_interval, float):
            self.every = float("inf") if num_train_batches == float("inf") else \
                max(1, int(num_train_batches * val_check_interval))
        else:
            self.every = val_check_interval
        if not has_val:
            return
        if every_n_epochs is not None and self.every > num_train_batches:
            # Lightning's ValueError says "must be less than or equal to the number of the
            # training batches"
            raise MisconfigurationError(
                f"Trainer(val_check_interval={val_check_interval}) is longer than an epoch "
                f"({num_train_batches} training batches), so fit would never validate: it must "
                "be less than or equal to the number of the training batches.",
                f"use val_check_interval <= {num_train_batches}, a fraction of the epoch (e.g. "
                f"0.5), or check_val_every_n_epoch=None to validate every {val_check_interval} "
                "batches counted across epochs (as Lightning).")

    def in_epoch(self, epoch: int) -> bool:
        """This epoch validates at all."""
        return self.has_val and (
            self.every_n_epochs is None or (epoch + 1) % self.every_n_epochs == 0
        )

    def start_epoch(self, batches_before: int) -> None:
        """An epoch starts after ``batches_before`` batches of the fit's earlier epochs (what
        ``check_val_every_n_epoch=None`` counts from when the loader has no length)."""
        self.before = batches_before

    def due(self, epoch: int, batch_idx: int) -> bool:
        """Validation is due after batch ``batch_idx`` of ``epoch`` (asked only in epochs that
        validate). A duration's rule is :meth:`_time_due`."""
        if self.every_n_epochs is not None:
            count = batch_idx + 1
        else:
            count = (self.before if self.n == float("inf") else epoch * self.n) + batch_idx + 1
        return count % self.every == 0

    def _time_due(self, epoch: int, batch_idx: int) -> bool:
        decided_epoch, decided_batch, due = self._decided
        if (decided_epoch, decided_batch) == (epoch, batch_idx):
            return due
        if self.broadcast is None:
            due = time.monotonic() - self.last >= self.seconds
        elif (batch_idx + 1) % self.sync_every:
            due = False
        else:
            due = bool(self.broadcast(time.monotonic() - self.last >= self.seconds))
        self._decided = (epoch, batch_idx, due)
        return due

    def start(self) -> None:
        """Training starts (after the sanity check): a duration counts from now."""
        if self.seconds is not None:
            self.last = time.monotonic()

    def validated(self) -> None:
        """A validation ended: a duration counts from now."""
        if self.seconds is not None:
            self.last = time.monotonic()

    @property
    def at_exhaustion(self) -> bool:
        """A loader without a length: validate when it is exhausted (a float interval cannot count
        it)."""
        return self.every == float("inf") and self.seconds is None


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
