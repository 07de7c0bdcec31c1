"""Interleaved runs: the Trainer and the hand-written loop in lock-step in one fit, wall time split at every
switch (the measurement that survives a busy machine), and the harness check (a hand-written loop in the
Trainer's place). Used by overhead.py."""
from __future__ import annotations

import time
from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from workloads import make_hand, make_task

HARNESS_CHECK = "hand in the Trainer's place (harness check)"


def make_interleave(spec: dict[str, Any], data: TensorDataset) -> Any:
    """The callback that runs one hand-written step after each Trainer batch, splitting wall time at each switch.

    The harness is not perfectly even: the switch is a hook call that counts on the Trainer's side, the hand
    side's bookkeeping (its own iterator, a method call) on the hand's. ``run_harness_check`` measures the net
    effect: the same interleaving with a hand-written loop in the Trainer's place.
    """
    from taskfit.callbacks import Callback

    class Interleave(Callback):
        order = 10**6  # last at batch end: every other callback's work counts as the Trainer's

        def __init__(self) -> None:
            self.model, self.optimizer, self.loader = make_hand(spec, data)
            self.batches = iter(())
            self.mark = self.trainer_s = self.hand_s = 0.0
            self.epochs: list[tuple[float, float]] = []

        def on_fit_start(self, trainer: Any, task: Any) -> None:
            self.model.train()
            self.mark = time.perf_counter()

        def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
            # Last at epoch end: the epoch's checkpoint and logging count; what fit does once at its end does not.
            now = time.perf_counter()
            self.epochs.append((self.trainer_s + now - self.mark, self.hand_s))
            self.trainer_s = self.hand_s = 0.0
            self.mark = now

        def on_train_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            start = time.perf_counter()
            self.trainer_s += start - self.mark
            self.hand_step()  # its batch, output and loss are freed on return: inside the hand's time, as in a loop
            self.mark = time.perf_counter()
            self.hand_s += self.mark - start

        def hand_step(self) -> None:
            batch = next(self.batches, None)
            if batch is None:  # the hand loop's epoch boundary: a new iterator, as `for x, y in loader` does
                self.batches = iter(self.loader)
                batch = next(self.batches)
            x, y = batch
            self.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()

    return Interleave()


def run_interleaved(spec: dict[str, Any], data: TensorDataset, epochs: int, root: str,
                    **settings: Any) -> tuple[list[tuple[float, float]], nn.Module, nn.Module]:
    """The Trainer and the hand-written loop in lock-step: after each Trainer batch, one hand-written step.

    Wall time is split at every switch, so both see the same machine load at millisecond granularity: the
    ratio survives noise that swamps separate runs. Returns per epoch (Trainer seconds, hand seconds).
    """
    from taskfit import Trainer

    interleave = make_interleave(spec, data)
    trainer = Trainer(max_epochs=epochs, accelerator="cpu", default_root_dir=root, callbacks=[interleave],
                      **settings)
    task = make_task(spec, data)
    trainer.fit(task)
    return interleave.epochs, task.net, interleave.model.net


def run_harness_check(spec: dict[str, Any], data: TensorDataset, epochs: int, root: str,
                      **settings: Any) -> tuple[list[tuple[float, float]], nn.Module, nn.Module]:
    """The interleaving of ``run_interleaved`` with a hand-written loop in the Trainer's place, dispatching the
    switch as the Trainer does: what the harness itself reads for two identical loops (ideally 1.000)."""
    interleave = make_interleave(spec, data)
    model, optimizer, loader = make_hand(spec, data)
    on_end = [interleave.on_train_batch_end]
    interleave.on_fit_start(None, None)
    for _ in range(epochs):
        for batch_idx, (x, y) in enumerate(loader):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            for fn in on_end:
                fn(None, None, loss, (x, y), batch_idx)
        interleave.on_train_epoch_end(None, None)
    return interleave.epochs, model.net, interleave.model.net
