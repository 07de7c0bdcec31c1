"""When things happen inside a training epoch: validations (``val_check_interval``) and optimizer steps
(``accumulate_grad_batches``). Pure arithmetic on batch counts, decided once per fit."""
from __future__ import annotations


class ValidationSchedule:
    """Validate in every ``check_val_every_n_epoch``-th epoch, after every ``val_check_interval`` batches.

    An int interval counts batches; a float is a fraction of the epoch's ``n`` batches (``int(n * f)``, at least
    1). A float interval also validates after the epoch's last batch.
    """

    def __init__(self, val_check_interval: int | float, every_n_epochs: int, num_train_batches: float,
                 has_val: bool) -> None:
        self.has_val, self.every_n_epochs, self.n = has_val, every_n_epochs, num_train_batches
        self.fractional = isinstance(val_check_interval, float)
        if not self.fractional:
            self.every: float = val_check_interval
        elif num_train_batches == float("inf"):
            self.every = float("inf")  # a loader without len(): validate when it is exhausted
        else:
            self.every = max(1, int(num_train_batches * val_check_interval))

    def in_epoch(self, epoch: int) -> bool:
        """This epoch validates at all."""
        return self.has_val and (epoch + 1) % self.every_n_epochs == 0

    def due(self, batch_idx: int) -> bool:
        """Validation is due after batch ``batch_idx`` (asked only in epochs that validate)."""
        done = batch_idx + 1
        return done % self.every == 0 or (self.fractional and done == self.n)


def accumulation_group(batch_idx: int, k: int, n: float) -> tuple[int, bool]:
    """(size of the group batch ``batch_idx`` belongs to, whether the optimizer steps after it).

    Groups of ``k`` batches from the epoch's start; the epoch's last group is short when ``n`` is not a multiple
    of ``k``, and its loss is divided by its own size (the mean over the batches it really has).
    """
    start = batch_idx - batch_idx % k
    size = k if start + k <= n else int(n - start)
    return size, batch_idx + 1 - start == size
