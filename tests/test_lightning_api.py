"""Lightning's API in taskfit (issue 28): hooks, ``self.log``, the TaskModule's attributes, data
modules, the loop limits and schedulers, each against what PyTorch Lightning 2.6.6 does.

The expected sequences and values were observed by running Lightning 2.6.6 on the same set-up (a
LightningModule and a Callback defining every hook, recording calls; a module logging with each
option) and are stored here, as tests/test_lightning_semantics.py does: CI needs no Lightning. Where
taskfit differs on purpose (docs/migrating-lightning.md, "Where taskfit differs"), the test asserts
taskfit's behaviour and names Lightning's.
"""
from __future__ import annotations

import io
import os
import re
import warnings

import pytest
import tasks
import torch
import torchmetrics
from taskfit import DataModule, MisconfigurationError, TaskModule, Trainer
from taskfit.callbacks import HOOKS, Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

QUIET = dict(
    enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False
)


def _loader(start: int, n: int, batch_size: int = 2) -> DataLoader:
    x = torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)
    return DataLoader(TensorDataset(x, x), batch_size=batch_size)


# ---- hooks: every one Lightning calls, in Lightning's order --------------------------------------
# every hook of Lightning 2.6's Callback class (state_dict/load_state_dict recorded below)
CALLBACK_HOOKS = (
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_train_start",
    "on_train_end",
    "on_validation_start",
    "on_validation_end",
    "on_test_start",
    "on_test_end",
    "on_predict_start",
    "on_predict_end",
    "on_exception",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)
MODULE_HOOKS = (  # the LightningModule hooks taskfit calls on a TaskModule
    "prepare_data",
    "setup",
    "teardown",
    "configure_model",
    "on_fit_start",
    "on_fit_end",
    "on_train_start",
    "on_train_end",
    "on_validation_start",
    "on_validation_end",
    "on_test_start",
    "on_test_end",
    "on_predict_start",
    "on_predict_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_save_checkpoint",
    "on_load_checkpoint",
)


def _recorder(prefix: str, hook: str, log: list):
    def record(self, *args):
        log.append(f"{prefix}:{hook}")
    return record


def _recording_classes(log: list):
    class Recorder(Callback):  # written for Lightning: the same hook names and arguments
        locals().update({h: _recorder("C", h, log) for h in CALLBACK_HOOKS})

        def state_dict(self):
            log.append("C:state_dict")
            return {"calls": 1}

        def load_state_dict(self, state):
            log.append("C:load_state_dict")

    class Module(TaskModule):
        locals().update({h: _recorder("M", h, log) for h in MODULE_HOOKS})

        def configure_callbacks(self):
            log.append("M:configure_callbacks")
            return []

        def __init__(self):
            super().__init__()
            self.net = nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return ((self.net(batch[0]) - batch[1]) ** 2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("vl", ((self.net(batch[0]) - batch[1]) ** 2).mean())

        def test_step(self, batch, batch_idx):
            self.log("tl", ((self.net(batch[0]) - batch[1]) ** 2).mean())

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return _loader(0, 4)

        val_dataloader = test_dataloader = predict_dataloader = train_dataloader

    return Recorder, Module


def both(*hooks: str) -> list[str]:
    """Lightning calls a hook on the callbacks, then on the module: ``C:hook``, ``M:hook``."""
    return [f"{who}:{hook}" for hook in hooks for who in "CM"]


# Observed on Lightning 2.6.6: the recorder above as a Callback and a LightningModule,
# Trainer(max_epochs=2, num_sanity_val_steps=1), 2 training and 2 validation batches per epoch; then
# save_checkpoint, test, predict, and a fit with max_epochs=3 resumed from the saved checkpoint.
# (Batch-transfer and model-eval hooks omitted: taskfit does not call them, and names them in its
# warning.)
SETUP = ["M:configure_callbacks", "M:prepare_data", "C:setup", "M:setup", "M:configure_model"]
TRAIN_BATCH = both(
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
)
VALIDATION = [*both("on_validation_start", "on_validation_epoch_start"),
              *both("on_validation_batch_start", "on_validation_batch_end") * 2,
              *both("on_validation_epoch_end", "on_validation_end")]
EPOCH = [*both("on_train_epoch_start"), *TRAIN_BATCH * 2, *VALIDATION, *both("on_train_epoch_end")]
SANITY = ["C:on_sanity_check_start", *both("on_validation_start", "on_validation_epoch_start"),
          *both("on_validation_batch_start", "on_validation_batch_end"),
          *both("on_validation_epoch_end", "on_validation_end"), "C:on_sanity_check_end"]
LIGHTNING = [
    "== fit",
    *SETUP,
    *both("on_fit_start"),
    *SANITY,
    *both("on_train_start"),
    *EPOCH,
    *EPOCH,
    *both("on_train_end", "on_fit_end", "teardown"),
    "== save",
    "C:state_dict",
    *both("on_save_checkpoint"),
    "== test",
    *SETUP,
    *both("on_test_start", "on_test_epoch_start"),
    *both("on_test_batch_start", "on_test_batch_end") * 2,
    *both("on_test_epoch_end", "on_test_end", "teardown"),
    "== predict",
    *SETUP,
    *both("on_predict_start", "on_predict_epoch_start"),
    *both("on_predict_batch_start", "on_predict_batch_end") * 2,
    *both("on_predict_epoch_end", "on_predict_end", "teardown"),
    "== resume",
    *SETUP,
    "M:on_load_checkpoint",
    "C:on_load_checkpoint",
    "C:load_state_dict",
    *both("on_fit_start"),
    *both("on_train_start"),
    *EPOCH,
    *both("on_train_end", "on_fit_end", "teardown"),
]


def test_a_callback_and_a_module_written_for_lightning_get_lightnings_call_sequence(tmp_path):
    log: list[str] = []
    Recorder, Module = _recording_classes(log)
    settings = dict(QUIET, default_root_dir=str(tmp_path))
    trainer = Trainer(max_epochs=2, num_sanity_val_steps=1, callbacks=[Recorder()], **settings)
    task = Module()
    log.append("== fit")
    trainer.fit(task)
    log.append("== save")
    trainer.save_checkpoint(str(tmp_path / "x.ckpt"))
    log.append("== test")
    trainer.test(task)
    log.append("== predict")
    trainer.predict(task)
    log.append("== resume")
    Trainer(max_epochs=3, num_sanity_val_steps=0, callbacks=[Recorder()], **settings).fit(
        Module(), ckpt_path=str(tmp_path / "x.ckpt"))
    # The one difference (docs/migrating-lightning.md): the sanity check does not fire the
    # callbacks' on_validation_start/on_validation_end, which mean a real validation in taskfit.
    sanity = LIGHTNING.index("C:on_sanity_check_start")
    expected = (
        LIGHTNING[:sanity]
        + [h for h in SANITY if h not in ("C:on_validation_start", "C:on_validation_end")]
        + LIGHTNING[sanity + len(SANITY) :]
    )
    assert log == expected


def test_every_callback_hook_lightning_has_is_one_taskfit_calls():
    assert set(CALLBACK_HOOKS) <= set(HOOKS)


def test_hooks_receive_lightnings_arguments(tmp_path):
    seen: dict[str, tuple] = {}

    class Args(Callback):
        def setup(self, trainer, task, stage):
            seen.setdefault(f"setup:{stage}", ())

        def teardown(self, trainer, task, stage):
            seen.setdefault(f"teardown:{stage}", ())

        def on_before_zero_grad(self, trainer, task, optimizer):
            seen.setdefault("zero_grad", (optimizer is trainer.optimizer,))

        def on_before_backward(self, trainer, task, loss):
            seen.setdefault("backward", (loss.shape, loss.requires_grad))

        def on_after_backward(self, trainer, task):
            seen.setdefault("after_backward", (task.net.weight.grad is not None,))

        def on_validation_batch_end(
            self, trainer, task, outputs, batch, batch_idx, dataloader_idx=0
        ):
            seen.setdefault(
                "val_batch_end", (float(outputs), batch[0].shape, batch_idx, dataloader_idx)
            )

        def on_save_checkpoint(self, trainer, task, checkpoint):
            seen.setdefault("save", ("module" in checkpoint and "callbacks" in checkpoint,))

    # w stays 0: the validation loss of the batch (100, 101) is (100² + 101²) / 2
    task = Line(lr=0.0)
    trainer = Trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[Args()], **QUIET)
    trainer.fit(task)
    trainer.save_checkpoint(str(tmp_path / "x.ckpt"))
    trainer.validate(task)
    assert seen == {
        "setup:fit": (),
        "teardown:fit": (),
        "zero_grad": (True,),
        "backward": (torch.Size([]), True),
        "after_backward": (True,),
        "val_batch_end": (10100.5, (2, 1), 0, 0),
        "save": (True,),
        "setup:validate": (),
        "teardown:validate": (),
    }


def test_a_hook_nobody_defines_is_not_in_the_table_and_costs_no_call():
    trainer = Trainer(max_epochs=1, **QUIET)
    trainer.fit(Line())
    for hook in (
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_validation_batch_end",
        "on_train_batch_start",
        "setup",
    ):
        assert trainer.hooks[hook] == [], hook
    # the step calls the optimizer's and the tensor's own methods: no wrapper in between
    assert (
        trainer.run.zero_grad == trainer.optimizer.zero_grad
        and trainer.run.backward is torch.Tensor.backward
    )
    assert trainer.run.optimizer_step == trainer.optimizer.step


def test_lightning_hooks_taskfit_does_not_call_are_named_in_one_warning():
    class Eval(Callback):
        pass

    class Module(Line):
        def on_validation_model_eval(self):
            pass

        def validation_epoch_end(self, outputs):  # Lightning 1.x
            pass

    with pytest.warns(UserWarning) as record:
        Trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[Eval()], **QUIET).fit(Module())
    ours = [str(w.message) for w in record if "Lightning hook" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].startswith("`Module.on_validation_model_eval`, `Module.validation_epoch_end` "
                              "are Lightning hooks taskfit does not call. Use instead: "
                              "`Module.on_validation_model_eval`: the Trainer calls module.eval() "
                              "before validation")
    assert "on_validation_epoch_end, with self.log or torchmetrics" in ours[0]


class Line(tasks.Line):
    """tests/tasks.py's Line, 8 training samples by default: x = 0..7 in batches of 2, validation x
    = 100..103."""

    def __init__(self, lr: float = 1e-4, n: int = 8):
        super().__init__(n=n, lr=lr)


# ---- checkpoints: what callbacks and the task add, restored exactly ------------------------------
class Keeps(Callback):
    def __init__(self):
        self.loaded = None

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        task.seen = task.seen + outputs["loss"].detach()

    def on_save_checkpoint(self, trainer, task, checkpoint):
        checkpoint["keeps"] = {"step": trainer.state.global_step}

    def on_load_checkpoint(self, trainer, task, checkpoint):
        self.loaded = checkpoint["keeps"]


class Stateful(Line):
    def __init__(self):
        super().__init__()
        self.seen = torch.zeros(())  # a running sum kept outside the weights

    def on_save_checkpoint(self, checkpoint):
        checkpoint["seen"] = self.seen.clone()

    def on_load_checkpoint(self, checkpoint):
        self.seen = checkpoint["seen"].clone()


def test_callbacks_and_the_task_add_their_state_to_checkpoints_and_get_it_back_exactly(tmp_path):
    settings = dict(QUIET, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    straight = Stateful()
    Trainer(max_epochs=3, callbacks=[Keeps()], **settings).fit(straight)
    first, keeps = Stateful(), Keeps()
    trainer = Trainer(max_epochs=1, callbacks=[keeps], **settings)
    trainer.fit(first)
    trainer.save_checkpoint(str(tmp_path / "one.ckpt"))
    assert torch.load(tmp_path / "one.ckpt", weights_only=True)["keeps"] == {"step": 4}
    resumed, keeps = Stateful(), Keeps()
    Trainer(max_epochs=3, callbacks=[keeps], **settings).fit(
        resumed, ckpt_path=str(tmp_path / "one.ckpt")
    )
    assert keeps.loaded == {"step": 4}
    assert torch.equal(resumed.seen, straight.seen) and torch.equal(
        resumed.net.weight, straight.net.weight
    )


# ---- the order of a batch's hooks and its validation; outputs ------------------------------------
def test_on_train_batch_end_comes_before_the_validation_its_batch_triggers_and_gets_a_mapping():
    calls = []

    class Order(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            calls.append(("batch_end", batch_idx, sorted(outputs), float(outputs["loss"])))

        def on_validation_start(self, trainer, task):
            calls.append(("validation", trainer.state.batch_idx))

    Trainer(
        max_epochs=1, num_sanity_val_steps=0, val_check_interval=2, callbacks=[Order()], **QUIET
    ).fit(Line(lr=0.0))
    # Lightning 2.6.6: batch 1's on_train_batch_end, then the validation it triggers; outputs ==
    # {"loss": loss}
    assert calls == [
        ("batch_end", 0, ["loss"], 0.5),
        ("batch_end", 1, ["loss"], 6.5),
        ("validation", 1),
        ("batch_end", 2, ["loss"], 20.5),
        ("batch_end", 3, ["loss"], 42.5),
        ("validation", 3),
    ]


@pytest.mark.parametrize("returns, expected", [
    ("nothing", set()),  # Lightning: {} for a manual step that returned None
    ("tensor", {"loss"}),  # {"loss": the tensor, detached}
    ("dict", {"loss", "extra"}),  # the step's dict
])
def test_manual_steps_outputs_are_a_mapping_as_in_lightning(returns, expected):
    seen = []

    class Manual(Line):
        automatic_optimization = False

        def training_step(self, batch):  # Lightning's signature without batch_idx
            opt = self.optimizers()
            loss = self.loss(self(batch[0]), batch[1])
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return {"nothing": None, "tensor": loss, "dict": {"loss": loss, "extra": 1}}[returns]

    class Probe(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            seen.append(outputs)

    Trainer(max_epochs=1, num_sanity_val_steps=0, callbacks=[Probe()], **QUIET).fit(Manual())
    assert [set(o) for o in seen] == [expected] * 4
    assert all(not o["loss"].requires_grad for o in seen if "loss" in o)


# ---- self.log: Lightning's options, names and values ---------------------------------------------
class Logs(TaskModule):
    """Logs x.mean() of each batch with each of self.log's options; x = 0..5 in batches of 2 (0.5,
    2.5, 4.5)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(self.net.weight)

    def training_step(self, batch, batch_idx):
        x, y = batch
        v = x.mean()
        self.log("t/a", v)
        self.log("t/b", v, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("t/c", v, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("t/d", v, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("t/e", v, logger=False, prog_bar=True)
        self.log("t/f", v, on_step=False, on_epoch=True, batch_size=batch_idx + 1)
        self.log("t/g", v, on_step=False, on_epoch=True, reduce_fx=torch.min)
        return ((self.net(x) - y) ** 2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("v/l", batch[0].mean())
        self.log("v/s", batch[0].mean(), on_step=True, prog_bar=True)

    def on_train_epoch_end(self):
        self.log("t/ep", float(self.current_epoch))

    def on_validation_epoch_end(self):
        self.log("v/ep", 7.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return _loader(0, 6)

    def val_dataloader(self):
        return _loader(100, 4)


class Snapshots(Callback):
    def __init__(self):
        self.seen = []

    def _snap(self, where, trainer):
        keep = lambda d: {k: round(float(v), 4) for k, v in d.items() if k[:2] in ("t/", "v/")}  # noqa: E731
        self.seen.append((where, trainer.state.global_step, keep(trainer.callback_metrics),
                          sorted(keep(trainer.logged_metrics)), keep(trainer.progress_bar_metrics)))

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self._snap("batch_end", trainer)

    def on_validation_epoch_end(self, trainer, task):
        self._snap("val_epoch_end", trainer)

    def on_train_epoch_end(self, trainer, task):
        self._snap("train_epoch_end", trainer)


def test_self_log_options_give_lightnings_names_and_values():
    snaps, logged = Snapshots(), []

    class Writes(Callback):  # what a logger receives
        def on_log(self, trainer, task, metrics):
            logged.append(
                (
                    trainer.state.global_step,
                    {k: round(v, 4) for k, v in metrics.items() if k[:2] in ("t/", "v/")},
                )
            )

    trainer = Trainer(
        max_epochs=2,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=[snaps, Writes()],
        **QUIET,
    )
    trainer.fit(Logs())
    # Observed on Lightning 2.6.6 (the same module; keys there without the "t/" and "v/" prefixes):
    step1 = {"t/a": 0.5, "t/b": 0.5, "t/b_step": 0.5, "t/e": 0.5}
    assert snaps.seen[0] == (
        "batch_end",
        1,
        step1,
        ["t/a", "t/b_step"],
        {"t/b_step": 0.5, "t/e": 0.5},
    )
    epoch_end = {
        "t/a": 4.5,
        "t/b": 2.5,
        "t/b_epoch": 2.5,
        "t/b_step": 4.5,
        "t/c": 4.5,
        "t/d": 7.5,
        "t/e": 4.5,
        "t/f": 3.1667,
        "t/g": 0.5,
        "v/ep": 7.0,
        "v/l": 101.5,
        "v/s": 101.5,
        "v/s_epoch": 101.5,
    }
    where, step, callback, logged_keys, bar = snaps.seen[4]
    assert (where, step) == ("train_epoch_end", 3)
    # as Lightning: v/s_step (the last validation batch's value) is logged, not a callback metric
    # (issue 46)
    assert callback == epoch_end and trainer.state.metrics["v/s_step"] == 102.5
    assert logged_keys == [
        "t/a",
        "t/b_epoch",
        "t/b_step",
        "t/c",
        "t/d",
        "t/f",
        "t/g",
        "v/ep",
        "v/l",
        "v/s_epoch",
        "v/s_step",
    ]
    assert bar == {
        "t/b_epoch": 2.5,
        "t/b_step": 4.5,
        "t/e": 4.5,
        "v/s_epoch": 101.5,
        "v/s_step": 102.5,
    }
    # a value logged in the task's on_train_epoch_end is published at once (before
    # ModelCheckpoint/EarlyStopping)
    assert trainer.callback_metrics["t/ep"] == 1.0 and trainer.state.metrics["t/ep"] == 1.0
    # loggers: the epoch values at the epoch's last step; logger=False keys never (Lightning: x-axis
    # one less)
    epoch0 = [m for s, m in logged if s == 3]
    assert {"t/b_epoch": 2.5, "t/c": 4.5, "t/d": 7.5, "t/f": 3.1667, "t/g": 0.5} in epoch0
    assert {"t/ep": 0.0} in epoch0 and not any("t/e" in m for _, m in logged)


def test_lightning_refuses_these_self_log_calls_and_so_does_taskfit():
    def fit_logging(**options):
        class One(Line):
            def training_step(self, batch, batch_idx):
                self.log("x", batch[0].mean(), **options)
                return self.loss(self(batch[0]), batch[1])
        Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(One())

    # Lightning 2.6.6: "`self.log(on_step=False, on_epoch=False)` is not useful."
    with pytest.raises(MisconfigurationError, match=r"self.log\('x', on_step=False, "
                                                    r"on_epoch=False\) logs nothing"):
        fit_logging(on_step=False, on_epoch=False)
    with pytest.raises(MisconfigurationError, match=r"reduce_fx='median'\) is not a reduction "
                                                    r"taskfit knows"):
        fit_logging(on_epoch=True, reduce_fx="median")

    # Lightning: "You can't `self.log(on_step=True)` inside `on_train_epoch_end`"
    class InEpochEnd(Line):
        def on_train_epoch_end(self):
            self.log("q", 1.0, on_step=True)

    with pytest.raises(MisconfigurationError, match=r"self.log\('q', on_step=True\) in an "
                                                    r"epoch-level hook"):
        Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(InEpochEnd())

    class Changes(Line):
        def training_step(self, batch, batch_idx):
            self.log("x", batch[0].mean(), reduce_fx="max" if batch_idx else "min", on_epoch=True)
            return self.loss(self(batch[0]), batch[1])

    with pytest.raises(MisconfigurationError, match=r"self.log\('x'\) was called with different "
                                                    r"options in one pass: reduce_fx='min' then "
                                                    r"'max'"):
        Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(Changes())


def test_a_users_train_loss_replaces_the_built_in_one_never_mixed():
    """The lightning-hydra-template logs self.log("train/loss", MeanMetric, on_step=False,
    on_epoch=True): its train/loss is the metric's epoch mean (Lightning); taskfit's own train/loss
    and train/loss_epoch step aside."""
    published, kept = [], []

    class Template(Line):
        def __init__(self):
            super().__init__()
            self.train_loss = torchmetrics.MeanMetric()

        def training_step(self, batch, batch_idx):
            loss = self.loss(self(batch[0]), batch[1])
            # 0, 1, 2, 3: the epoch mean is 1.5, unlike any real loss
            self.train_loss(loss * 0 + batch_idx)
            self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
            return loss

    class Published(Callback):
        def on_log(self, trainer, task, metrics):
            published.append({k: v for k, v in metrics.items() if k.startswith("train/loss")})

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            kept.append(trainer.logs.last_loss is None)  # the bar shows the user's loss only

    trainer = Trainer(
        max_epochs=2, num_sanity_val_steps=0, log_every_n_steps=1, callbacks=[Published()], **QUIET
    )
    metrics = trainer.fit(Template())
    # one source: the user's
    assert [p for p in published if p] == [{"train/loss": 1.5}, {"train/loss": 1.5}]
    assert metrics["train/loss"] == 1.5 and "train/loss_epoch" not in metrics
    assert trainer.progress_bar_metrics == {"train/loss": 1.5}
    assert kept == [True] * 8


# Lightning 2.6.6 on _ViewsProgram (fit, then validate and test): callback_metrics, logged_metrics,
# progress_bar_metrics after each, and validate/test's results
LIGHTNING_VIEWS = {
    "fit": (
        None,
        ["train_loss", "val_loss"],
        ["train_loss", "val_loss"],
        ["train_loss", "val_loss"],
    ),
    "validate": ([["val_loss"]], ["val_loss"], ["val_loss"], ["val_loss"]),
    "test": ([["test_loss"]], ["test_loss"], ["test_loss"], []),
}


class _ViewsProgram(Line):
    """A Lightning program: its own steps, each logging its loss (and returning it)."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss(self(batch[0]), batch[1])
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch, batch_idx):
        loss = self.loss(self(batch[0]), batch[1])
        self.log("test_loss", loss)
        return loss

    test_dataloader = Line.val_dataloader


def test_a_program_that_logs_its_own_values_sees_exactly_those_as_lightning(tmp_path):
    from taskfit.callbacks import CSVLogger, ProgressBar

    class Screen(io.StringIO):
        def isatty(self):
            return True

    trainer = Trainer(
        max_epochs=1,
        log_every_n_steps=1,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=CSVLogger(str(tmp_path)),
        callbacks=[ProgressBar(stream=(screen := Screen()))],
    )
    task, seen = _ViewsProgram(), {}

    def views(result):
        return (result and [sorted(r) for r in result], sorted(trainer.callback_metrics),
                sorted(trainer.logged_metrics), sorted(trainer.progress_bar_metrics))

    trainer.fit(task)
    seen["fit"] = views(None)
    seen["validate"] = views(trainer.validate(task, verbose=False))
    seen["test"] = views(trainer.test(task, verbose=False))
    assert seen == LIGHTNING_VIEWS
    bar = screen.getvalue()
    # no taskfit loss beside the user's
    assert "train_loss=" in bar and not re.search(r"[ ,]loss=", bar)
    with open(os.path.join(trainer.log_dir, "metrics.csv"), encoding="utf-8") as f:
        header = f.readline().strip().split(",")
    # the loggers: the user's keys, and taskfit's vitals/* for the first screen; never a second
    # train loss
    assert {"train_loss", "val_loss"} <= set(header) and not any(
        k.startswith(("train/", "val/")) for k in header
    )
    assert any(k.startswith("vitals/") for k in header)


def test_a_program_that_logs_nothing_still_gets_taskfits_loss_curve():
    class Silent(_ViewsProgram):
        def log(self, *args, **kwargs):  # the same program, its self.log calls removed
            pass

    trainer = Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET)
    metrics = trainer.fit(Silent())
    assert {"train/loss", "train/loss_epoch", "val/loss"} <= set(metrics)
    assert trainer.test(Silent(), verbose=False)[0].keys() == {"test/loss"}


class _LogsAccuracyOnly(TaskModule):
    """A training_step that logs a value that is not its loss (``acc``) and returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        outputs = self.net(batch[0])
        self.log("acc", (outputs.argmax(-1) == batch[1]).float().mean())
        return nn.functional.cross_entropy(outputs, batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(32, 4, generator=generator), torch.randint(0, 2, (32,), generator=generator)
        )
        return DataLoader(data, batch_size=4)


def test_a_program_that_logs_only_a_value_that_is_not_its_loss_gets_no_loss_curve_as_lightning(
    tmp_path,
):
    """Lightning 2.6.6 on the same program (a LightningModule of the same code, CSVLogger, max_epochs=2,
    log_every_n_steps=2; `pip install lightning==2.6.6`) logs nothing of its own: callback_metrics, logged_metrics
    ['acc'], progress_bar_metrics [], metrics.csv's header acc,epoch,step. taskfit's views are the same; its loggers
    add vitals/* only: no train/loss, which could be a second version of a loss logged under any name."""
    from taskfit.callbacks import CSVLogger

    trainer = Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        logger=CSVLogger(str(tmp_path)),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(_LogsAccuracyOnly())
    assert (
        sorted(trainer.callback_metrics),
        sorted(trainer.logged_metrics),
        sorted(trainer.progress_bar_metrics),
    ) == (["acc"], ["acc"], [])
    with open(os.path.join(trainer.log_dir, "metrics.csv"), encoding="utf-8") as f:
        header = f.readline().strip().split(",")
    assert {k for k in header if not k.startswith("vitals/")} == {"acc", "epoch", "step"}


def test_lightning_shows_the_recorded_views(tmp_path):
    lightning = pytest.importorskip("lightning.pytorch")

    class Program(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(1, 1, bias=False)

        training_step, validation_step, test_step = (
            _ViewsProgram.training_step,
            _ViewsProgram.validation_step,
            _ViewsProgram.test_step,
        )
        loss, forward = Line.loss, Line.forward

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    data = _loader(0, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = lightning.Trainer(max_epochs=1, log_every_n_steps=1, enable_progress_bar=False,
                                    enable_model_summary=False, enable_checkpointing=False,
                                    default_root_dir=str(tmp_path))
        task, seen = Program(), {}

        def views(result):
            return (result and [sorted(r) for r in result], sorted(trainer.callback_metrics),
                    sorted(trainer.logged_metrics), sorted(trainer.progress_bar_metrics))

        trainer.fit(task, data, data)
        seen["fit"] = views(None)
        seen["validate"] = views(trainer.validate(task, data, verbose=False))
        seen["test"] = views(trainer.test(task, data, verbose=False))
    assert seen == LIGHTNING_VIEWS


def test_torchmetrics_are_computed_before_the_epoch_end_hooks_and_reset_after():
    seen = []

    class Metric(Line):
        def __init__(self):
            super().__init__()
            self.acc = torchmetrics.MeanMetric()

        def validation_step(self, batch, batch_idx):
            self.acc.update(batch[0].mean())
            self.log("val/m", self.acc, prog_bar=True)

        def on_validation_epoch_end(self):
            seen.append((float(self.acc.compute()), float(self.trainer.callback_metrics["val/m"])))

    task = Metric()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torchmetrics warns when compute() runs on a reset metric
        trainer = Trainer(max_epochs=2, num_sanity_val_steps=0, **QUIET)
        trainer.fit(task)
    assert seen == [(101.5, 101.5), (101.5, 101.5)]  # Lightning 2.6.6: the same
    assert task.acc.update_count == 0 and trainer.progress_bar_metrics == {"val/m": 101.5}


# ---- the TaskModule's attributes and helpers -----------------------------------------------------
class Hyper(TaskModule):
    def __init__(
        self,
        lr: float = 0.1,
        hidden: int = 4,
        net: nn.Module | None = None,
        optimizer=torch.optim.SGD,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["net"])  # Lightning's call, as the template writes it
        self.net = net or nn.Linear(1, 1)

    def training_step(self, batch):  # no batch_idx: Lightning allows it
        self.log_dict({"lr_seen": self.hparams.lr, "epoch_seen": float(self.current_epoch)})
        return ((self.net(batch[0]) - batch[1]) ** 2).mean()

    def configure_optimizers(self):
        # the object itself, as Lightning
        return self.hparams.optimizer(self.parameters(), lr=self.hparams.lr)

    def on_train_epoch_start(self):
        self.seen = (
            self.current_epoch,
            self.global_step,
            self.device,
            self.logger,
            self.global_rank,
        )

    def train_dataloader(self):
        return _loader(0, 4)


def test_hparams_attributes_and_helpers_lightning_code_uses(tmp_path, capsys):
    task = Hyper(lr=0.05, net=nn.Linear(1, 1))
    assert task.hparams.lr == 0.05 and task.hparams["hidden"] == 4 and "net" not in task.hparams
    with pytest.raises(AttributeError, match=r"hparams has no 'lrr'; it holds \['hidden', 'lr', "
                                             r"'optimizer'\]"):
        task.hparams.lrr
    # outside a run
    assert (task.current_epoch, task.global_step, task.logger, task.loggers) == (0, 0, None, [])
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=True, log_every_n_steps=1)
    metrics = trainer.fit(task)
    assert metrics["lr_seen"] == pytest.approx(0.05) and metrics["epoch_seen"] == 1.0
    epoch, step, device, logger, rank = task.seen
    assert (epoch, step, device, rank) == (
        1,
        2,
        torch.device("cpu"),
        0,
    ) and logger is trainer.logger
    ckpt = torch.load(trainer.checkpoint_callback.last_model_path, weights_only=True)
    # plain values
    assert ckpt["task"]["hparams"] == {"lr": 0.05, "hidden": 4, "optimizer": repr(torch.optim.SGD)}
    with pytest.raises(MisconfigurationError, match=r"save_hyperparameters\('lr', 'hiden'\): "
                                                    r"'hiden' is not an argument of "
                                                    r"Hyper.__init__"):
        task.save_hyperparameters("lr", "hiden")
    task.save_hyperparameters("lr", logger=False)
    # logger=False: the loggers get none
    assert task.hparams == {"lr": 0.05} and trainer.hparams == {}

    class Prints(Line):
        def on_train_start(self):
            self.print("rank zero says hi")

    Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(Prints())
    assert "rank zero says hi" in capsys.readouterr().out


# Lightning 2.6.6: Shaped.load_from_checkpoint(path).hparams, with each value's type (its checkpoint
# pickles them)
LIGHTNING_LOADED_HPARAMS = {
    "shape": (1, 4),
    "layers": [(2, 3), (3, 4)],
    "table": {1: "a", "b": (2,)},
    "tags": {"x"},
    "n": 3,
    "lr": 0.1,
    "nothing": None,
}


def test_hyperparameters_keep_their_types_through_a_checkpoint_as_lightning(tmp_path):
    class Shaped(Line):
        def __init__(
            self,
            shape=(1, 4),
            layers=[(2, 3), (3, 4)],
            table={1: "a", "b": (2,)},
            tags={"x"},
            n=3,
            lr=0.1,
            nothing=None,
        ):
            super().__init__()
            self.save_hyperparameters()

    trainer = Trainer(max_steps=1, **QUIET)
    trainer.fit(Shaped())
    trainer.save_checkpoint(path := str(tmp_path / "shaped.ckpt"))
    loaded = Shaped.load_from_checkpoint(path)
    assert dict(loaded.hparams) == LIGHTNING_LOADED_HPARAMS
    # (1, 4), not [1, 4]; 1, not "1"
    assert repr(dict(loaded.hparams)) == repr(LIGHTNING_LOADED_HPARAMS)
    assert (1,) + loaded.hparams.shape == (1, 1, 4)  # the tutorial's line: a TypeError with a list


def test_toggle_optimizer_sets_requires_grad_as_lightning():
    states = []

    class Two(Line):
        automatic_optimization = False

        def __init__(self):
            super().__init__()
            self.other = nn.Linear(1, 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.0), torch.optim.SGD(
                self.other.parameters(), lr=0.0
            )

        def training_step(self, batch, batch_idx):
            first, second = self.optimizers()
            self.toggle_optimizer(first)
            states.append([p.requires_grad for p in self.parameters()])
            loss = self.loss(self(batch[0]), batch[1]) + self.other(batch[0]).sum()
            self.manual_backward(loss)
            # toggled off: no gradient for the other optimizer
            states.append(self.other.weight.grad is None)
            first.step()
            self.untoggle_optimizer(first)
            states.append([p.requires_grad for p in self.parameters()])
            with self.toggled_optimizer(second):
                states.append([p.requires_grad for p in self.parameters()])

    Trainer(max_steps=1, num_sanity_val_steps=0, limit_train_batches=1, **QUIET).fit(Two())
    # net.weight, other.weight, other.bias; Lightning 2.6.6 gives the same states
    assert states == [[True, False, False], True, [True, True, True], [False, True, True]]


# ---- data: loaders passed to fit, data modules ---------------------------------------------------
DATA_LOG: list[str] = []


class Data(DataModule):
    def __init__(self, batch_size: int = 2):
        super().__init__()
        self.log, self.offset = DATA_LOG, 0

    def prepare_data(self):
        self.log.append("D:prepare_data")

    def setup(self, stage):
        self.log.append(f"D:setup:{stage}")

    def teardown(self, stage):
        self.log.append(f"D:teardown:{stage}")

    def train_dataloader(self):
        self.log.append("D:train_dataloader")
        return _loader(self.offset, 8, self.hparams.batch_size)

    def val_dataloader(self):
        self.log.append("D:val_dataloader")
        return _loader(100, 4)

    def test_dataloader(self):
        self.log.append("D:test_dataloader")
        return _loader(100, 4)

    def state_dict(self):
        self.log.append("D:state_dict")
        return {"offset": self.offset}

    def load_state_dict(self, state):
        self.log.append(f"D:load_state_dict:{state}")


class Bare(TaskModule):
    """No data of its own: a Lightning module whose data lives in a LightningDataModule."""

    def __init__(self):
        super().__init__()
        self.net, self.calls = nn.Linear(1, 1, bias=False), []

    def forward(self, x):
        return self.net(x)

    def loss(self, outputs, targets):
        return ((outputs - targets) ** 2).mean()

    def prepare_data(self):
        self.calls.append("M:prepare_data")

    def setup(self, stage):
        self.calls.append(f"M:setup:{stage}")

    def teardown(self, stage):
        self.calls.append(f"M:teardown:{stage}")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def test_a_data_module_is_driven_as_lightning_drives_it_and_its_state_is_in_checkpoints(tmp_path):
    log = DATA_LOG
    log.clear()
    settings = dict(
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    trainer = Trainer(max_epochs=1, **settings)
    data = Data()
    log.append("== fit")
    task = Bare()
    task.calls = log
    trainer.fit(task, datamodule=data)
    # kept after fit, as Lightning 2.6.6
    assert data.trainer is trainer and trainer.datamodule is data
    log.append("== test")
    with pytest.warns(UserWarning, match=r"Trainer.test\(\) without a task uses the fitted one, "
                                         r"with the weights of its best checkpoint"):
        # no task: the fitted one, from its best checkpoint (Lightning)
        trainer.test(datamodule=data)
    log.append("== resume")
    task = Bare()
    task.calls = log
    Trainer(max_epochs=2, **settings).fit(
        task, datamodule=Data(), ckpt_path=trainer.checkpoint_callback.best_model_path
    )
    # Observed on Lightning 2.6.6 (stages there are TrainerFn members equal to these strings)
    assert log == [
        "== fit",
        "D:prepare_data",
        "M:prepare_data",
        "D:setup:fit",
        "M:setup:fit",
        "D:train_dataloader",
        "D:val_dataloader",
        "D:state_dict",
        "D:teardown:fit",
        "M:teardown:fit",
        "== test",
        "D:prepare_data",
        "M:prepare_data",
        "D:setup:test",
        "M:setup:test",
        "D:load_state_dict:{'offset': 0}",
        "D:test_dataloader",
        "D:teardown:test",
        "M:teardown:test",
        "== resume",
        "D:prepare_data",
        "M:prepare_data",
        "D:setup:fit",
        "M:setup:fit",
        "D:load_state_dict:{'offset': 0}",
        "D:train_dataloader",
        "D:val_dataloader",
        "D:state_dict",
        "D:teardown:fit",
        "M:teardown:fit",
    ]


def test_loaders_passed_to_the_entry_points_and_the_errors_lightning_gives_too():
    class NoData(Bare):
        pass

    trainer = Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET)
    trainer.fit(NoData(), _loader(0, 8), _loader(100, 4))  # Lightning's positions: train, val
    assert trainer.num_training_batches == 4 and "val/loss" in trainer.state.metrics
    (validated,) = trainer.validate(NoData(), _loader(100, 4))
    assert set(validated) == {"val/loss"}
    predictions = trainer.predict(NoData(), _loader(0, 6, batch_size=3))
    assert [p.shape for p in predictions] == [(3, 1), (3, 1)]
    with pytest.raises(MisconfigurationError, match=r"Trainer.fit\(\) got both train_dataloaders= "
                                                    r"and datamodule="):
        trainer.fit(NoData(), _loader(0, 8), datamodule=Data())
    with pytest.raises(MisconfigurationError, match=r"Trainer.fit\(task, 'last'\): the second "
                                                    r"argument is train_dataloaders \(Lightning's "
                                                    r"order\), not a checkpoint"):
        trainer.fit(NoData(), "last")
    with pytest.raises(TypeError, match=r"NoData does not define `train_dataloader`, which fit "
                                        r"needs"):
        trainer.fit(NoData())
    with pytest.raises(MisconfigurationError, match=r"Trainer.test\(\) was called without a task, "
                                                    r"and this Trainer has not fitted one"):
        Trainer(**QUIET).test(dataloaders=_loader(0, 4))


# ---- the loop's limits and schedulers ------------------------------------------------------------
class Stop(Callback):
    def __init__(self, at_step: int | None = None):
        self.at_step = at_step

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if self.at_step is not None and trainer.state.global_step == self.at_step:
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer, task):
        if self.at_step is None:
            trainer.should_stop = True


@pytest.mark.parametrize("limits, stop_at, expected", [
    (dict(min_epochs=3), None, (3, 27)),  # Lightning 2.6.6: current_epoch 3, global_step 27
    # Lightning: global_step 12 and current_epoch 2 (mid-epoch: see below)
    (dict(min_steps=12), None, (1, 12)),
    # min_steps alone also waits for the first epoch (Lightning: 1, 9)
    (dict(min_steps=5), 2, (1, 9)),
])
def test_min_epochs_and_min_steps_defer_a_stop_as_lightning_does(limits, stop_at, expected):
    with pytest.warns(UserWarning, match=r"should_stop was set, but min_epochs=.* are not reached"):
        trainer = Trainer(
            max_epochs=10, num_sanity_val_steps=0, callbacks=[Stop(stop_at)], **QUIET, **limits
        )
        trainer.fit(Line(n=18))
    # taskfit keeps an epoch ended mid-way open (state.epoch is not advanced: an exact resume), as
    # for max_steps
    assert (trainer.state.epoch, trainer.state.global_step) == expected


def test_reduce_lr_on_plateau_per_step_monitors_a_value_logged_in_that_step():
    lrs = []

    class Plateau(Line):
        def training_step(self, batch, batch_idx):
            self.log("train/mse", torch.tensor(5.0))  # never improves
            return self.loss(self(batch[0]), batch[1])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
                opt, mode="min", factor=0.5, patience=1
            )
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step",
                                                       "monitor": "train/mse"}}

    class LR(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            lrs.append((trainer.state.global_step, trainer.optimizer.param_groups[0]["lr"]))

    Trainer(
        max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=50, callbacks=[LR()], **QUIET
    ).fit(Plateau(lr=0.0, n=18))
    # Lightning 2.6.6: the lr halves after step 3 (patience 1), as seen at step 4's
    # on_train_batch_end
    assert lrs == [
        (1, 1.0),
        (2, 1.0),
        (3, 1.0),
        (4, 0.5),
        (5, 0.5),
        (6, 0.25),
        (7, 0.25),
        (8, 0.125),
        (9, 0.125),
    ]


def test_a_plateau_scheduler_with_strict_false_skips_a_missing_monitor_with_one_warning():
    class Lenient(Line):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "nope", "strict": False},
            }

    with pytest.warns(UserWarning) as record:
        trainer = Trainer(max_epochs=3, num_sanity_val_steps=0, **QUIET)
        trainer.fit(Lenient(lr=0.0))
    ours = [str(w.message) for w in record if "'nope'" in str(w.message)]
    # Lightning 2.6.6 warns at every epoch end: "ReduceLROnPlateau conditioned on metric nope which
    # is not available but strict is set to `False`. Skipping learning rate update."
    assert ours == ["ReduceLROnPlateau monitors 'nope', which is not logged, and its scheduler "
                    "dict says 'strict': False: its steps are skipped until it is. HINT: log the "
                    "key, or fix 'monitor' in configure_optimizers."]
    assert trainer.optimizer.param_groups[0]["lr"] == 1.0


# ---- deliberate differences (docs/migrating-lightning.md, "Where taskfit differs") ---------------
def test_the_logged_x_axis_is_lightnings_count_of_batches_that_stepped_before():
    steps = []

    class At(Callback):
        def on_log(self, trainer, task, metrics):
            if "train/loss" in metrics:
                steps.append((trainer.state.log_step, trainer.state.global_step))

    Trainer(
        max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=1, callbacks=[At()], **QUIET
    ).fit(Line())
    # Lightning 2.6.6 writes them at 0, 1, 2, 3: its batches-that-stepped count before the batch's
    # own +1
    assert steps == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_manual_optimization_counts_log_every_n_steps_in_batches_as_lightning():
    logged = []

    class Manual(Line):
        automatic_optimization = False

        def __init__(self):
            super().__init__(n=18)
            self.head = nn.Linear(1, 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.0), torch.optim.SGD(
                self.head.parameters(), lr=0.0
            )

        def training_step(self, batch):
            for opt, module in zip(self.optimizers(), (self.net, self.head)):
                opt.zero_grad()
                self.manual_backward(self.loss(module(batch[0]), batch[1]))
                opt.step()
            self.log("m", batch[0].mean())

    class At(Callback):
        def on_log(self, trainer, task, metrics):
            if "m" in metrics:
                logged.append((trainer.state.log_step, trainer.state.global_step))

    Trainer(
        max_epochs=1, num_sanity_val_steps=0, log_every_n_steps=2, callbacks=[At()], **QUIET
    ).fit(Manual())
    # two optimizer steps per batch; Lightning 2.6.6 counts batches: every 2nd batch, at x = 1, 3,
    # 5, 7
    assert logged == [(1, 4), (3, 8), (5, 12), (7, 16)]


# Lightning 2.6.6, metrics.csv of _csv_steps' program (13 batches, 2 epochs, log_every_n_steps=5,
# val_check_interval=0.5): the steps each key was written at, and global_step after fit
LIGHTNING_CSV_STEPS = {
    ("automatic", 1): (
        26,
        {
            "hook_value": [12, 25],
            "train_loss_epoch": [12, 25],
            "train_loss_step": [4, 9, 14, 19, 24],
            "val_loss": [5, 11, 18, 24],
        },
    ),
    ("manual", 1): (
        52,
        {
            "hook_value": [12, 25],
            "train_loss_epoch": [12, 25],
            "train_loss_step": [4, 9, 14, 19, 24],
            "val_loss": [5, 11, 18, 24],
        },
    ),
    ("automatic", 2): (
        14,
        {
            "hook_value": [6, 13],
            "train_loss_epoch": [6, 13],
            "train_loss_step": [4, 9],
            "val_loss": [2, 5, 9, 12],
        },
    ),
}


def _csv_steps(
    framework, root, optimization: str, accumulate: int
) -> tuple[int, dict[str, list[int]]]:
    """A program run by ``framework`` (taskfit, or lightning.pytorch) with a CSVLogger: global_step,
    and the steps metrics.csv holds each key of the program at."""
    import csv

    if framework.__name__ == "taskfit":
        from taskfit.callbacks import CSVLogger
        base = framework.TaskModule
    else:
        from lightning.pytorch.loggers import CSVLogger
        base = framework.LightningModule
    manual = optimization == "manual"

    class Program(base):
        def __init__(self):
            super().__init__()
            self.net, self.head = nn.Linear(2, 1), nn.Linear(2, 1)
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            if not manual:
                return loss
            for opt in self.optimizers():
                opt.zero_grad()
                self.manual_backward(
                    self.net(batch[0]).pow(2).mean() + self.head(batch[0]).pow(2).mean()
                )
                opt.step()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.net(batch[0]).pow(2).mean())

        def on_train_epoch_end(self):
            self.log("hook_value", 1.0)

        def configure_optimizers(self):
            if manual:
                return [torch.optim.SGD(m.parameters(), lr=0.01) for m in (self.net, self.head)]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.randn(30, 2, generator=torch.Generator().manual_seed(0))
    trainer = framework.Trainer(
        max_epochs=2,
        logger=CSVLogger(str(root)),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=5,
        num_sanity_val_steps=0,
        val_check_interval=0.5,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(Program(), DataLoader(TensorDataset(data[:26]), batch_size=2),
                DataLoader(TensorDataset(data[26:]), batch_size=2))
    steps: dict[str, list[int]] = {}
    for row in csv.DictReader(
        open(os.path.join(trainer.logger.log_dir, "metrics.csv"), encoding="utf-8")
    ):
        for key in ("hook_value", "train_loss_epoch", "train_loss_step", "val_loss"):
            if row.get(key):
                steps.setdefault(key, []).append(int(row["step"]))
    return trainer.global_step, steps


@pytest.mark.parametrize("optimization, accumulate", sorted(LIGHTNING_CSV_STEPS))
def test_every_logged_value_is_written_at_lightnings_step(tmp_path, optimization, accumulate):
    import taskfit

    assert (
        _csv_steps(taskfit, tmp_path, optimization, accumulate)
        == LIGHTNING_CSV_STEPS[optimization, accumulate]
    )


@pytest.mark.parametrize("optimization, accumulate", sorted(LIGHTNING_CSV_STEPS))
def test_lightning_writes_the_recorded_steps(tmp_path, optimization, accumulate):
    lightning = pytest.importorskip("lightning.pytorch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = _csv_steps(lightning, tmp_path, optimization, accumulate)
    assert observed == LIGHTNING_CSV_STEPS[optimization, accumulate]


# ---- ddp: epoch values reduced over ranks with each reduce_fx (real processes, gloo) -------------
def test_epoch_values_are_reduced_over_ranks_with_their_reduce_fx(tmp_path):
    from tasks import MetricsProbe, RankLogs

    trainer = Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        num_sanity_val_steps=0,
        callbacks=[MetricsProbe(str(tmp_path))],
        **QUIET,
    )
    trainer.fit(RankLogs())
    ranks = [torch.load(tmp_path / f"metrics{r}.pt", weights_only=True) for r in (0, 1)]
    # rank 0 logs 0, 1; rank 1 logs 10, 11 (sync_dist's meaning: every epoch value over all ranks)
    for metrics in ranks:
        assert {
            k: metrics[k]
            for k in ("train/mean", "train/sum", "train/max", "train/min", "train/metric")
        } == {
            "train/mean": 5.5,
            "train/sum": 22.0,
            "train/max": 11.0,
            "train/min": 0.0,
            "train/metric": 5.5,
        }
    # rank_zero_only: not reduced
    assert (ranks[0]["train/mine"], ranks[1]["train/mine"]) == (0.5, 10.5)


# ---- the guide: what it calls "same" is accepted or called ---------------------------------------
GUIDE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "migrating-lightning.md"
)


def _same(label: str) -> list[str]:
    """The backticked names of the guide's "**<label>.**" paragraph in "Same names, same
    meaning"."""
    text = open(GUIDE, encoding="utf-8").read()
    paragraph = re.search(rf"\*\*{re.escape(label)}\.?\*\*(.*?)\n\n", text, re.S)
    assert paragraph, label
    spans = re.findall(r"`([^`]*)`", paragraph.group(1))
    return [m.group(1) for span in spans if (m := re.fullmatch(r"(\w+)(\(.*\))?", span))]


def test_every_name_the_guide_calls_same_is_accepted_or_called():
    import inspect

    from taskfit.loop.hooks import AUTOMATIC_OVERRIDES
    from taskfit.loop.hooks import MODULE_HOOKS as CALLED_ON_TASK

    trainer_args = set(inspect.signature(Trainer.__init__).parameters)
    assert set(_same("Trainer arguments")) <= trainer_args
    entries = re.findall(r"`(\w+)\(([^`]*)\)`", open(GUIDE, encoding="utf-8").read().split(
        "**Entry points and their arguments.**")[1].split("\n\n")[0])
    for name, args in entries:
        params = list(inspect.signature(getattr(Trainer, name)).parameters)[1:]
        lightning = [a.strip() for a in args.split(",")]
        assert ["task" if a == "model" else a for a in lightning] == params[:len(lightning)], name
    trainer = Trainer(max_epochs=1, **QUIET)
    trainer.fit(Line(), datamodule=None)
    for name in _same("Trainer attributes"):
        getattr(trainer, name)
    assert set(_same("Callback hooks")) - {"state_dict", "load_state_dict"} <= set(HOOKS)
    # and the guide lists every one of them
    assert set(CALLBACK_HOOKS) <= set(_same("Callback hooks"))
    steps_and_data = {
        "training_step",
        "validation_step",
        "test_step",
        "predict_step",
        "configure_optimizers",
        "train_dataloader",
        "val_dataloader",
        "test_dataloader",
        "predict_dataloader",
        "configure_callbacks",
    }
    assert set(_same("LightningModule hooks and methods")) - steps_and_data == set(CALLED_ON_TASK)
    assert set(_same("Overrides of the automatic step")) == set(AUTOMATIC_OVERRIDES)
    task = Line()
    for name in _same("LightningModule attributes"):
        assert hasattr(task, name), name
    assert set(_same("`self.log` arguments")) == set(
        inspect.signature(TaskModule.log).parameters
    ) - {"self"}
    for name in _same("LightningDataModule"):
        assert hasattr(Data(), name), name


# Lightning 2.6.6: lightning.pytorch.__all__, and the other names its examples/ import from
# lightning.pytorch
LIGHTNING_ALL = ("Trainer", "LightningDataModule", "LightningModule", "Callback", "seed_everything")
LIGHTNING_EXAMPLES_IMPORT = ("callbacks", "cli_lightning_logo")
GUIDE_RENAMES = {"LightningModule": "TaskModule", "LightningDataModule": "DataModule"}


def test_every_top_level_name_lightning_programs_import_resolves_after_the_guides_rename(capsys):
    import taskfit
    from taskfit import Callback as TopLevelCallback
    from taskfit import callbacks, cli_lightning_logo

    for name in LIGHTNING_ALL + LIGHTNING_EXAMPLES_IMPORT:
        assert hasattr(taskfit, GUIDE_RENAMES.get(name, name)), name
    assert set(GUIDE_RENAMES.get(n, n) for n in LIGHTNING_ALL) <= set(taskfit.__all__)
    # one class: a subclass is a taskfit callback
    assert TopLevelCallback is Callback is callbacks.Callback
    cli_lightning_logo()  # cosmetic: a plain banner, no terminal codes
    out = capsys.readouterr().out
    assert "taskfit" in out and "\033" not in out


def test_lightnings_top_level_names_are_the_recorded_ones():
    lightning = pytest.importorskip("lightning.pytorch")
    assert tuple(lightning.__all__) == LIGHTNING_ALL
    assert all(hasattr(lightning, name) for name in LIGHTNING_EXAMPLES_IMPORT)


def test_test_returns_the_epoch_values_as_lightning():
    class Tested(Line):
        def test_step(self, batch, batch_idx):
            self.log("tl", batch[0].mean(), on_step=True)
            self.log("te", batch[0].mean())

        def test_dataloader(self):
            return _loader(0, 4)

    trainer = Trainer(**QUIET)
    # Lightning 2.6.6: [{'tl_epoch': 1.5, 'te': 1.5}] (the step value is logged, not returned)
    assert trainer.test(Tested()) == [{"tl_epoch": 1.5, "te": 1.5}]
    assert trainer.logged_metrics["tl_step"] == 2.5 and "tl" in trainer.callback_metrics


def test_configure_callbacks_replaces_the_trainers_callback_of_the_same_class(tmp_path):
    from taskfit.callbacks import ModelCheckpoint

    class Own(Line):
        def configure_callbacks(self):
            return [ModelCheckpoint(monitor="val/loss", filename="own-{epoch}")]

    trainer = Trainer(
        max_epochs=1,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Own())
    (checkpoint,) = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert (
        checkpoint.monitor == "val/loss"
        and os.path.basename(checkpoint.best_model_path) == "own-epoch=0.ckpt"
    )


def test_prepare_data_runs_once_per_machine_and_setup_on_every_rank(tmp_path):
    from tasks import MetricsProbe, RankLogs, RecordingData

    trainer = Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        num_sanity_val_steps=0,
        callbacks=[MetricsProbe(str(tmp_path))],
        **QUIET,
    )
    trainer.fit(RankLogs(), datamodule=RecordingData(str(tmp_path)))
    calls = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("call-"))
    assert calls == [
        "call-prepare_data-0",
        "call-setup-fit-0",
        "call-setup-fit-1",
        "call-teardown-fit-0",
        "call-teardown-fit-1",
    ]


def test_estimated_stepping_batches_and_manual_backward_arguments_as_lightning():
    seen = []

    class OneCycle(Line):
        automatic_optimization = False

        # a common Lightning pattern: the schedule sized from the Trainer
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            seen.append(self.trainer.estimated_stepping_batches)
            return [opt], [torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=seen[0])]

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = self.loss(self(batch[0]), batch[1])
            opt.zero_grad()
            # passed through to backward, as in Lightning
            self.manual_backward(loss, retain_graph=True)
            self.manual_backward(loss)  # the graph is still there
            opt.step()
            self.lr_schedulers().step()

    Trainer(max_epochs=3, num_sanity_val_steps=0, limit_train_batches=3, **QUIET).fit(
        OneCycle(n=18)
    )
    assert seen == [9]  # 3 epochs of limit_train_batches=3 (Lightning 2.6.6: 9)
