"""self.log without a Trainer: the options' Lightning defaults and published names (logs/options.py), the epoch
reductions of a pass's book (logs/book.py) and the buffer's views, NaN check and resume state (logs/buffer.py)."""
from __future__ import annotations

import math
import types

import pytest
import torch
from taskfit.errors import MisconfigurationError, NonFiniteLossError
from taskfit.logs.book import LogBook, Series, stack_scalars
from taskfit.logs.buffer import LogBuffer
from taskfit.logs.options import LogOptions, check_same, log_options

CPU = torch.device("cpu")
DEFAULTS = dict(on_step=None, on_epoch=None, reduce_fx="mean", logger=True, prog_bar=False, rank_zero_only=False,
                enable_graph=False, sync_dist_group=None)


def options(key="train/x", stage="train", epoch_level=False, **changes) -> LogOptions:
    return log_options(key, stage, epoch_level, **{**DEFAULTS, **changes})


def log(book: LogBook, name: str, value, batch_size=None, **changes) -> None:
    book.log(name, value, batch_size=batch_size, **{**DEFAULTS, **changes})


def buffer(nonfinite_loss="raise", accumulate=1) -> LogBuffer:
    strategy = types.SimpleNamespace(device=CPU, world_size=1, all_reduce=lambda tensor, op: tensor)
    return LogBuffer(strategy, nonfinite_loss, False, accumulate)


# ---- options: Lightning's defaults, names and refusals ------------------------------------------------------
@pytest.mark.parametrize("stage, epoch_level, on_step, on_epoch", [
    ("train", False, True, False),  # a training step or batch hook: per step
    ("train", True, False, True),  # on_train_epoch_end and the other epoch-level hooks: per epoch
    ("val", False, False, True), ("test", False, False, True),  # evaluation: per epoch
])
def test_defaults_depend_on_where_self_log_is_called(stage, epoch_level, on_step, on_epoch):
    opts = options(stage=stage, epoch_level=epoch_level)
    assert (opts.on_step, opts.on_epoch, opts.reduce_fx, opts.logger, opts.prog_bar) == \
        (on_step, on_epoch, "mean", True, False)


def test_published_names():
    assert LogOptions(True, True).names("train/acc") == ("train/acc_step", "train/acc_epoch")
    assert LogOptions(True, False).names("train/acc") == ("train/acc", None)
    assert LogOptions(False, True).names("val/acc") == (None, "val/acc")


@pytest.mark.parametrize("given, fx", [("mean", "mean"), ("avg", "mean"), ("SUM", "sum"), ("max", "max"),
                                       (torch.mean, "mean"), (torch.sum, "sum"), (torch.min, "min")])
def test_reduce_fx_spellings(given, fx):
    assert options(reduce_fx=given).reduce_fx == fx


@pytest.mark.parametrize("changes, epoch_level, message", [
    (dict(on_step=False, on_epoch=False), False, "self.log('train/x', on_step=False, on_epoch=False) logs nothing."),
    (dict(on_step=True), True, "self.log('train/x', on_step=True) in an epoch-level hook"),
    (dict(reduce_fx="median"), False, "self.log('train/x', reduce_fx='median') is not a reduction taskfit knows."),
])
def test_combinations_lightning_refuses_are_refused(changes, epoch_level, message):
    with pytest.raises(MisconfigurationError) as info:
        options(epoch_level=epoch_level, **changes)
    assert str(info.value).startswith(message) and "\n  HINT: " in str(info.value)


def test_arguments_that_do_nothing_warn():
    with pytest.warns(UserWarning, match=r"self.log\('train/x', enable_graph=True\) does nothing in taskfit"):
        options(enable_graph=True)
    with pytest.warns(UserWarning, match=r"sync_dist_group=\.\.\.\) does nothing in taskfit"):
        options(sync_dist_group=object())


def test_a_key_logged_again_with_other_options_names_what_changed():
    check_same("train/x", options(), options())
    with pytest.raises(MisconfigurationError) as info:
        check_same("train/x", options(), options(prog_bar=True, reduce_fx="max"))
    assert "self.log('train/x') was called with different options in one pass: reduce_fx='mean' then 'max', " \
           "prog_bar=False then True." in str(info.value)


# ---- Series: weighted means, sums, extremes ---------------------------------------------------------------------
def test_the_epoch_mean_is_weighted_by_batch_size():
    series = Series(LogOptions(False, True), "val/x")
    for value, samples in ((1.0, 4), (2.0, 4), (4.0, 2)):  # the last batch is short
        series.add(torch.tensor(value), samples)
    total, weight = series.peek()
    assert float(total) / weight == pytest.approx((4 * 1 + 4 * 2 + 2 * 4) / 10)
    series.fold()
    assert series.pending == [] and float(series.total) / series.weight == pytest.approx(2.0)
    assert float(series.last) == 4.0


def test_full_batches_alone_need_no_weights():
    series = Series(LogOptions(False, True), "val/x")
    for value in (1.0, 2.0, 6.0):
        series.add(value, 8)
    assert series.weights is None and series.peek() == (9.0, 3)


@pytest.mark.parametrize("fx, expected", [("sum", 7.0), ("max", 4.0), ("min", -1.0)])
def test_sum_max_and_min_over_folds(fx, expected):
    series = Series(LogOptions(False, True, fx), "val/x")
    series.add(torch.tensor(4.0))
    series.add(torch.tensor(-1.0))
    series.fold()  # the running extreme/total carries over a fold
    series.add(torch.tensor(4.0 if fx == "sum" else 0.5))
    assert float(series.peek()[0]) == expected


def test_stack_scalars_takes_numbers_and_scalar_tensors_of_any_dtype_and_shape():
    stacked = stack_scalars([1, 2.5, torch.tensor(3, dtype=torch.int64), torch.tensor([4.0], dtype=torch.float16)], CPU)
    assert stacked.dtype == torch.float32 and stacked.tolist() == [1.0, 2.5, 3.0, 4.0]


# ---- LogBook: one pass's keys ------------------------------------------------------------------------------------
def test_keys_are_published_as_logged_in_every_stage():
    for stage in ("train", "val", "test"):
        book = LogBook(stage)
        log(book, "acc", torch.tensor(1.0), on_step=False, on_epoch=True)
        log(book, "custom/acc", torch.tensor(1.0), on_step=False, on_epoch=True)
        assert [key for key, _ in book.reducible()] == ["acc", "custom/acc"]  # Lightning's names: no stage prefix


@pytest.mark.parametrize("value, message", [
    (torch.ones(3), "self.log('acc', ...) got a tensor of shape (3,); only scalars can be logged."),
    ("0.5", "self.log('acc', ...) got a str; expected a scalar tensor or a number."),
])
def test_what_cannot_be_logged_is_refused(value, message):
    with pytest.raises(MisconfigurationError) as info:
        log(LogBook("val"), "acc", value)
    assert str(info.value).startswith(message)


def test_step_values_use_the_published_names_and_only_per_step_keys():
    book = LogBook("train")
    log(book, "a", torch.tensor(1.0))  # per step: a
    log(book, "b", torch.tensor(2.0), on_step=True, on_epoch=True)  # both: b_step and b_epoch
    log(book, "c", torch.tensor(3.0), on_step=False, on_epoch=True)  # per epoch only
    log(book, "a", torch.tensor(5.0))
    assert {k: float(v) for k, v in book.step_values().items()} == {"a": 5.0, "b_step": 2.0}
    assert [key for key, _ in book.reducible()] == ["b", "c"]


def test_a_users_loss_key_hides_the_built_in_loss():
    book = LogBook("train")
    builtin = book.builtin_loss("train/loss", "train/loss_epoch")
    builtin.add(torch.tensor(9.0))
    assert set(book.step_values()) == {"train/loss"} and not builtin.hidden
    log(book, "loss", torch.tensor(3.0))  # another name: both published
    assert not builtin.hidden and set(book.step_values()) == {"train/loss", "loss"}
    log(book, "train/loss", torch.tensor(1.0))  # the user's train/loss: never mixed with the loop's
    assert builtin.hidden and float(book.step_values()["train/loss"]) == 1.0


# ---- LogBuffer: the views, the epoch values, the NaN check, the resume state ------------------------------------
def test_epoch_values_of_an_evaluation_pass_are_weighted_means_as_floats():
    logs = buffer()
    book = logs.enter("val")
    for value, samples in ((0.5, 4), (1.0, 2)):
        book.weight = samples
        log(book, "acc", torch.tensor(value))
    log(book, "n", 1, reduce_fx="sum")
    log(book, "n", 2, reduce_fx="sum")
    values = logs.epoch_values(book)
    assert values == {"acc": pytest.approx((0.5 * 4 + 1.0 * 2) / 6), "n": 3.0}
    assert all(type(v) is float for v in values.values())


def test_callbacks_see_the_plain_name_loggers_do_not_and_logger_false_is_for_callbacks_only():
    logs = buffer()
    log(logs.train, "acc", torch.tensor(1.0), on_step=True, on_epoch=True)
    log(logs.train, "secret", torch.tensor(2.0), logger=False)
    values = {"acc_step": 0.25, "acc_epoch": 0.5, "secret": 2.0}
    assert logs.callback_view(values) == {**values, "acc": 0.5}  # the epoch value wins
    assert logs.logger_view(logs.callback_view(values)) == {"acc_step": 0.25, "acc_epoch": 0.5}


def test_the_log_interval_returns_the_latest_values_and_empties_the_pending_losses():
    logs = buffer()
    for loss in (0.5, 0.25):
        logs.add_loss(torch.tensor(loss), 1.0)
    state = types.SimpleNamespace(epoch=0, global_step=2, batch_idx=1)
    assert logs.interval(state) == {"train/loss": 0.25}
    assert logs.losses == [] and logs.fold_mark == (2, 2) and logs.logged_this_epoch


def test_a_nan_loss_is_reported_with_its_batch_and_step_at_the_interval():
    logs = buffer(accumulate=2)
    for loss in (0.5, 0.4, math.nan, 0.3):
        logs.add_loss(torch.tensor(loss), 1.0)
    with pytest.raises(NonFiniteLossError) as info:
        logs.interval(types.SimpleNamespace(epoch=3, global_step=2, batch_idx=3))
    assert str(info.value).startswith("The training loss is nan at epoch 3, batch 2 (global step 1).")
    assert "nonfinite_loss='skip'" in str(info.value)


def test_nonfinite_loss_skip_does_not_check():
    logs = buffer(nonfinite_loss="skip")
    logs.add_loss(torch.tensor(math.inf), 1.0)
    logs.check_pending(0)
    assert math.isinf(logs.interval(types.SimpleNamespace(epoch=0, global_step=1, batch_idx=0))["train/loss"])


def test_a_partial_epoch_resumes_with_bitwise_equal_epoch_values():
    logs = buffer()
    for i, loss in enumerate((0.3, 0.7, 0.11)):
        logs.train.weight = 4 if i < 2 else 3
        logs.add_loss(torch.tensor(loss), logs.train.weight)
        log(logs.train, "acc", torch.tensor(loss / 3), on_step=True, on_epoch=True, prog_bar=True)
    saved = logs.state_dict()
    resumed = buffer()
    resumed.load_state_dict(saved)
    assert resumed.epoch_values(resumed.train) == logs.epoch_values(logs.train)
    assert set(resumed.epoch_values(resumed.train)) == {"train/loss_epoch", "acc_epoch"}
    assert resumed.prog_bar == {"acc_step", "acc_epoch"}


def test_a_complete_epoch_resumes_into_an_empty_book_at_the_fold_mark():
    logs = buffer()
    logs.load_state_dict({"book": None, "fold_mark": [40, 0]})
    assert logs.fold_mark == (40, 0) and logs.losses == [] and not logs.step_logged
