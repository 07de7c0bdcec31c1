"""The hook table without a Trainer (loop/hooks.py): only what overrides a hook is in its list, in Lightning's order
(the callbacks as the Trainer sorted them, then the task's and the data module's own, with the documented
exceptions); Lightning hooks taskfit does not call are named in one warning; configure_callbacks replaces callbacks
of the same class."""
from __future__ import annotations

import pytest
from taskfit.callback import HOOKS as CORE_HOOKS
from taskfit.callback import Callback, default_hook
from taskfit.loop.hooks import (
    HOOKS,
    LIGHTNING_HOOKS,
    defines,
    drop_idle_batch_hooks,
    hook_table,
    is_task_hook,
    merge_task_callbacks,
    uncalled_hooks,
    warn_uncalled,
)


class First(Callback):
    order = -5

    def on_fit_start(self, trainer, task):
        pass

    def on_train_epoch_end(self, trainer, task):
        pass


class Second(Callback):
    def on_fit_start(self, trainer, task):
        pass

    def setup(self, trainer, task, stage):
        pass

    def on_load_checkpoint(self, trainer, task, checkpoint):
        pass

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        pass


class Monitor(Callback):  # as ModelCheckpoint and EarlyStopping: reads what the epoch logged
    monitors_epoch_values = True

    def on_train_epoch_end(self, trainer, task):
        pass


class Plain(Callback):  # same order as Monitor, defined after it
    def on_train_epoch_end(self, trainer, task):
        pass


class Idle(Callback):
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        pass

    def needs_batch_hooks(self, trainer):
        return False


class Task:
    def __init__(self):
        self.calls = []

    def on_fit_start(self):
        self.calls.append("on_fit_start")

    def on_train_epoch_end(self):
        self.calls.append("on_train_epoch_end")

    def setup(self, stage):
        self.calls.append(("setup", stage))

    def on_load_checkpoint(self, checkpoint):
        self.calls.append("on_load_checkpoint")


class Data:
    def __init__(self):
        self.calls = []

    @default_hook
    def prepare_data(self):  # a base class's no-op: not defined
        pass

    def setup(self, stage):
        self.calls.append(("setup", stage))


def owners(hooks) -> list[str]:
    """Who each entry of a hook list belongs to: the callback's class, or "task"."""
    return ["task" if is_task_hook(fn) else type(fn.__self__).__name__ for fn in hooks]


def test_a_hook_only_a_base_class_defines_is_not_in_the_table():
    table = hook_table([Second()], object())
    assert table["on_validation_end"] == [] and table["on_train_epoch_start"] == []
    assert owners(table["on_fit_start"]) == ["Second"] and owners(table["on_train_batch_end"]) == ["Second"]
    assert set(table) >= set(CORE_HOOKS) | set(LIGHTNING_HOOKS) and set(HOOKS) == set(CORE_HOOKS) | set(LIGHTNING_HOOKS)


def test_callbacks_come_first_in_the_order_given_then_the_task():
    assert owners(hook_table([First(), Second()], Task())["on_fit_start"]) == ["First", "Second", "task"]
    assert owners(hook_table([Second(), First()], Task())["on_fit_start"]) == ["Second", "First", "task"]


def test_setup_has_the_data_module_first_and_on_load_checkpoint_the_task_first():
    task, data = Task(), Data()
    table = hook_table([Second()], task, data)
    assert [is_task_hook(fn) for fn in table["setup"]] == [True, False, True] and owners(table["setup"])[1] == "Second"
    table["setup"][0]("trainer", task, "fit")
    assert data.calls == [("setup", "fit")] and task.calls == []
    table["setup"][2]("trainer", task, "fit")
    assert task.calls == [("setup", "fit")]
    assert owners(table["on_load_checkpoint"]) == ["task", "Second"]
    assert table["prepare_data"] == []  # Data's prepare_data is a default_hook


def test_task_hooks_are_called_with_lightnings_arguments():
    task = Task()
    table = hook_table([], task, Data())
    for fn in table["on_fit_start"] + table["setup"][-1:]:
        fn("trainer", task, *(["fit"] if fn.__name__ == "setup" else []))
    assert task.calls == ["on_fit_start", ("setup", "fit")]


def test_on_train_epoch_end_runs_the_task_and_publish_before_the_monitors():
    def publish(trainer, task):
        pass

    monitor, plain, first = Monitor(), Plain(), First()
    table = hook_table([monitor, plain, first], Task(), publish=publish)
    hooks = table["on_train_epoch_end"]
    assert [getattr(fn, "__self__", None) for fn in hooks] == [first, plain, None, None, monitor, None]
    assert is_task_hook(hooks[2]) and hooks[3] is publish and hooks[5] is publish  # after the task's, and last


def test_without_a_monitor_the_task_and_publish_come_after_every_callback():
    hooks = hook_table([First()], Task())["on_train_epoch_end"]
    assert owners(hooks) == ["First", "task"]


def test_batch_hooks_of_idle_callbacks_are_dropped_for_the_fit():
    table = hook_table([Idle(), Second()], object())
    start, end = drop_idle_batch_hooks(table, trainer=None)
    assert start == [] and owners(end) == ["Second"] and owners(table["on_train_batch_end"]) == ["Second"]


def test_defines_ignores_the_base_class_no_ops():
    assert defines(Second(), "on_fit_start") and not defines(Second(), "on_fit_end")
    assert not defines(Data(), "prepare_data") and defines(Data(), "setup")
    assert not defines(Task(), "on_fit_end") and not defines(Task(), "calls")


class LightningStyle(Callback):
    def on_epoch_end(self, trainer, task):  # Lightning 1.x
        pass

    def on_validation_model_eval(self, trainer, task):
        pass


class OldTask:
    def training_epoch_end(self, outputs):
        pass

    def on_log(self, trainer, task, metrics):  # a callback hook on a task: not called on it
        pass


def test_lightning_hooks_taskfit_does_not_call_are_listed():
    names = uncalled_hooks([LightningStyle(), Second()], OldTask())
    assert sorted(names) == ["LightningStyle.on_epoch_end", "LightningStyle.on_validation_model_eval",
                             "OldTask.training_epoch_end"]
    assert uncalled_hooks([Second()], Task(), Data()) == []


def test_one_warning_names_each_uncalled_hook_with_what_to_use_instead():
    with pytest.warns(UserWarning) as caught:
        warn_uncalled([LightningStyle()], OldTask())
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("`LightningStyle.on_validation_model_eval`, `LightningStyle.on_epoch_end`, "
                              "`OldTask.training_epoch_end` are Lightning hooks taskfit does not call.")
    assert "`LightningStyle.on_epoch_end`: on_train_epoch_end" in message
    assert "`OldTask.training_epoch_end`: on_train_epoch_end, collecting what it needs in training_step" in message


def test_configure_callbacks_replaces_the_trainers_callback_of_the_same_class():
    class WithCallbacks:
        def configure_callbacks(self):
            return mine

    mine, theirs, other = Second(), Second(), First()
    assert merge_task_callbacks([theirs, other], WithCallbacks()) == [other, mine]
    assert merge_task_callbacks([theirs], Task()) == [theirs]  # no configure_callbacks: unchanged
