"""The hooks: their order and arguments, which callbacks are called per batch, and the call chain of one step."""
from __future__ import annotations

import io
import os
import time
import warnings

import torch
from taskfit import Trainer, seed_everything
from taskfit.callbacks import Callback, ModelCheckpoint, ProgressBar
from tasks import RegressionTask

_RECORDED = ("on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end", "on_train_epoch_start",
             "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_before_optimizer_step",
             "on_log_interval", "on_validation_start", "on_validation_end")


def _recorder(hook):
    def record(self, trainer, task, *args):
        self.log.append((hook, trainer.state.stage, trainer.state.fn, args))
    return record


class _Order(Callback):
    """Records (hook, stage) for every hook it overrides."""

    def __init__(self, log):
        self.log = log

    locals().update({hook: _recorder(hook) for hook in _RECORDED})


def test_hook_order(quiet):
    log = []
    trainer = Trainer(max_epochs=1, limit_train_batches=2, num_sanity_val_steps=1, log_every_n_steps=2,
                      callbacks=[_Order(log)], **quiet)
    task = RegressionTask(val_n=8)
    trainer.fit(task)
    names = [entry[0] for entry in log]
    assert names == ["on_fit_start", "on_sanity_check_start", "on_sanity_check_end", "on_train_epoch_start",
                     "on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end",
                     "on_train_batch_start", "on_before_optimizer_step", "on_log_interval", "on_train_batch_end",
                     "on_validation_start", "on_validation_end", "on_train_epoch_end", "on_fit_end"]
    # Lightning's order: a batch's on_train_batch_end, then the validation that batch triggers
    assert log[1][:3] == ("on_sanity_check_start", "sanity", "fit") and log[11][:2] == ("on_validation_start", "val")
    # Lightning's arguments: the batch and its index; after the step, its detached loss; the optimizer.
    batch, batch_idx = log[4][3]
    assert batch_idx == 0 and isinstance(batch, list) and batch[0].shape == (8, 4)
    outputs, batch, batch_idx = log[6][3]  # Lightning's outputs: a mapping with the step's detached loss
    assert batch_idx == 0 and list(outputs) == ["loss"] and outputs["loss"].shape == () and \
        not outputs["loss"].requires_grad and batch[0].shape == (8, 4)
    assert log[5][3] == (trainer.optimizer,)
    log.clear()
    trainer.validate(task)  # a validation on its own: the same hooks, state.fn says which
    assert [(entry[0], entry[2]) for entry in log] == [("on_validation_start", "validate"),
                                                       ("on_validation_end", "validate")]


def test_needs_batch_hooks_false_skips_only_the_per_batch_hooks(quiet, tmp_path):
    class Idle(_Order):
        def needs_batch_hooks(self, trainer):
            return False

    log = []
    Trainer(max_epochs=1, limit_train_batches=2, num_sanity_val_steps=0, callbacks=[Idle(log)],
            **quiet).fit(RegressionTask())
    assert [entry[0] for entry in log] == ["on_fit_start", "on_train_epoch_start", "on_before_optimizer_step",
                                           "on_before_optimizer_step", "on_log_interval",  # the epoch's end logs
                                           "on_train_epoch_end", "on_fit_end"]
    # The defaults ask for no per-step call where they would do nothing: a bar to a log file, a checkpoint
    # saved only at epoch ends. They do where they work (a terminal; step triggers).
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path)
    assert not ProgressBar(stream=io.StringIO()).needs_batch_hooks(trainer)
    tty = ProgressBar(stream=io.StringIO())
    tty._interactive = True  # what on_fit_start decides for a stream that isatty()
    assert tty.needs_batch_hooks(trainer)
    assert not ModelCheckpoint().needs_batch_hooks(trainer)
    assert ModelCheckpoint(every_n_train_steps=5).needs_batch_hooks(trainer)
    assert ModelCheckpoint(train_time_interval=60).needs_batch_hooks(trainer)


def test_defaults_call_no_callback_per_batch_on_a_non_terminal(tmp_path, capsys):
    """Progress bar to a log file, TensorBoard, LR and throughput monitors, epoch-end checkpoints: none of them
    has work per batch, so the loop calls no hook between two batches (the data wait is timed by the loop)."""
    trainer = Trainer(max_epochs=1, log_every_n_steps=2, default_root_dir=tmp_path)
    started = time.perf_counter()
    trainer.fit(RegressionTask(n=32, val_n=8))
    fit_s = time.perf_counter() - started
    assert trainer.hooks["on_train_batch_start"] == [] and trainer.hooks["on_train_batch_end"] == []
    assert 0 < trainer.state.data_wait_s < fit_s  # a part of the fit, measured: no speed claim
    assert "vitals/data_wait_pct" in trainer.state.metrics
    # The epoch's line shows the validation values too (taken from what was logged this epoch).
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch 0/0"))
    assert "4/4" in line and "loss=" in line and "val/loss=" in line


class _SeesTheOptimizer(Callback):
    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, trainer, task, optimizer):  # between backward and step
        self.seen.append(optimizer is trainer.optimizer and all(p.grad is not None for p in task.parameters()))


def test_a_hook_between_backward_and_step_changes_nothing(quiet):
    """One step for every setting: a callback that only looks at the gradients leaves the weights, bit for bit,
    and the logged losses as they are without it; it sees the optimizer with every gradient set."""
    runs, hook = {}, _SeesTheOptimizer()
    for name, callbacks in (("plain", []), ("hooked", [hook])):
        seed_everything(0)
        task = RegressionTask(shuffle=True, dropout=0.1)
        trainer = Trainer(max_epochs=2, log_every_n_steps=3, callbacks=callbacks, **quiet)
        trainer.fit(task)
        runs[name] = (task.state_dict(), trainer.state.metrics)
    assert hook.seen == [True] * trainer.state.global_step
    assert all(torch.equal(a, b) for a, b in zip(runs["plain"][0].values(), runs["hooked"][0].values()))
    assert runs["plain"][1] == runs["hooked"][1]


def test_callback_order_attribute_and_should_stop(quiet):
    calls = []

    class Late(Callback):
        order = 10

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            calls.append("late")

    class Early(Callback):
        order = -10

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            calls.append("early")
            if trainer.state.global_step == 3:
                trainer.should_stop = True  # the documented switch (trainer.state.should_stop)

    trainer = Trainer(max_epochs=5, callbacks=[Late(), Early()], **quiet)
    trainer.fit(RegressionTask())
    assert calls[:2] == ["early", "late"]
    assert trainer.state.global_step == 3  # stopped at the next batch boundary


def test_four_calls_from_fit_to_the_optimizer_step(quiet):
    """The loop reads top to bottom: Trainer.fit -> strategy.launch -> _fit -> _train_step -> optimizer.step, and
    nothing of taskfit's in between; with a GradScaler (16-mixed) precision.step is the one frame more."""
    import inspect

    import taskfit

    package = os.path.dirname(taskfit.__file__)
    chains = []

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            frames = inspect.stack(0)[1:]
            top = next(i for i, f in enumerate(frames) if f.function == "fit" and f.filename.startswith(package))
            chains.append([f.function for f in frames[:top + 1] if f.filename.startswith(package)])
            return super().step(closure)

    class Task(RegressionTask):
        def configure_optimizers(self):
            return Probe(self.parameters(), lr=0.01)

    plain = ["_train_step", "_fit", "launch", "fit"]
    for settings, chain in (({}, plain), ({"accumulate_grad_batches": 2, "gradient_clip_val": 1.0}, plain),
                            ({"precision": "16-mixed"}, ["step", *plain])):
        chains.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 16-mixed on the CPU warns that it is slow
            Trainer(max_epochs=1, **settings, **quiet).fit(Task())
        assert chains and all(c == chain for c in chains), (settings, chains[:1])


def test_limits_val_interval_and_sanity(quiet):
    log = []
    trainer = Trainer(max_epochs=2, limit_train_batches=0.5, val_check_interval=0.5, limit_val_batches=1,
                      check_val_every_n_epoch=2, num_sanity_val_steps=0, callbacks=[_Order(log)], **quiet)
    trainer.fit(RegressionTask(val_n=16))
    assert trainer.state.global_step == 2 * 4
    assert [entry[1] for entry in log if entry[0] == "on_validation_start"] == ["val", "val"]  # epoch 1 only, twice
