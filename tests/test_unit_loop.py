"""The loop's pure rules, without a Trainer: when validation is due (val_check_interval,
check_val_every_n_epoch), how batches group into optimizer steps (accumulate_grad_batches), the
argument checks and their messages."""
from __future__ import annotations

import datetime

import pytest
from taskfit.arguments import arguments_checked
from taskfit.errors import MisconfigurationError
from taskfit.loop.cadence import ValidationSchedule, accumulation_group
from taskfit.loop.checks import check_choice, check_count, check_limit, val_check_duration

INF = float("inf")


def due_batches(schedule: ValidationSchedule, epoch: int, n: int) -> list[int]:
    """The 1-based batches of ``epoch`` after which validation is due."""
    if not schedule.in_epoch(epoch):
        return []
    return [b + 1 for b in range(n) if schedule.due(epoch, b)]


# ---- ValidationSchedule --------------------------------------------------------------------------
@pytest.mark.parametrize("interval, expected", [
    (0.25, [2, 4, 6, 8]),  # every = int(9 * 0.25) = 2; no extra validation at the epoch's end
    (0.5, [4, 8]),
    (1.0, [9]),
    (0.01, [1, 2, 3, 4, 5, 6, 7, 8, 9]),  # never less than every batch
    (3, [3, 6, 9]),
    (9, [9]),
])
def test_validation_is_due_after_the_same_batches_in_every_epoch(interval, expected):
    schedule = ValidationSchedule(interval, 1, 9, has_val=True)
    assert due_batches(schedule, 0, 9) == expected
    assert due_batches(schedule, 3, 9) == expected  # counted from each epoch's start
    assert not schedule.at_exhaustion


def test_check_val_every_n_epoch_skips_the_epochs_between():
    schedule = ValidationSchedule(1.0, 3, 4, has_val=True)
    assert [e for e in range(7) if schedule.in_epoch(e)] == [2, 5]
    assert due_batches(schedule, 0, 4) == [] and due_batches(schedule, 2, 4) == [4]


def test_check_val_every_n_epoch_none_counts_batches_across_epochs():
    # epochs of 4 batches, every 3 batches of the run
    schedule = ValidationSchedule(3, None, 4, has_val=True)
    assert [due_batches(schedule, e, 4) for e in range(3)] == [[3], [2], [1, 4]]


def test_without_validation_data_nothing_is_due_and_nothing_is_refused():
    # longer than the epoch: fine, there is nothing to run
    schedule = ValidationSchedule(100, 1, 4, has_val=False)
    assert not schedule.in_epoch(0)
    ValidationSchedule(5, None, INF, has_val=False)


def test_a_loader_without_a_length_validates_when_it_is_exhausted():
    schedule = ValidationSchedule(1.0, 1, INF, has_val=True)
    assert schedule.at_exhaustion and schedule.in_epoch(0)
    assert not any(schedule.due(0, b) for b in range(100))


def test_an_interval_longer_than_the_epoch_is_refused_with_what_to_use():
    with pytest.raises(MisconfigurationError) as info:
        ValidationSchedule(10, 1, 4, has_val=True)
    message = str(info.value)
    assert "Trainer(val_check_interval=10) is longer than an epoch (4 training batches)" in message
    assert (
        "HINT: use val_check_interval <= 4" in message and "check_val_every_n_epoch=None" in message
    )


def test_counting_across_epochs_without_a_loader_length_counts_the_batches_trained():
    # Lightning's total_batch_idx (its test_validation_check_interval_exceed_data_length_correct)
    schedule = ValidationSchedule(3, None, INF, has_val=True)
    assert not schedule.at_exhaustion
    assert [b + 1 for b in range(12) if schedule.due(0, b)] == [3, 6, 9, 12]
    schedule.start_epoch(5)  # an epoch of 5 batches ended: counted on from there
    assert [b + 1 for b in range(7) if schedule.due(1, b)] == [1, 4, 7]


@pytest.mark.parametrize(
    "value, seconds",
    [
        ("00:00:00:02", 2),
        ("01:02:03:04", 93784),
        ({"seconds": 2}, 2),
        ({"hours": 2, "minutes": 30}, 9000),
        (datetime.timedelta(days=1, seconds=30), 86430),
    ],
)
def test_a_duration_is_read_as_lightning_reads_it(value, seconds):
    assert val_check_duration(value).total_seconds() == seconds


@pytest.mark.parametrize("value", [1, 0.5, 0])
def test_a_count_or_a_fraction_is_not_a_duration(value):
    assert val_check_duration(value) is None


@pytest.mark.parametrize("value, message", [
    ("00:02", "Invalid time format for `val_check_interval`: '00:02'. Expected 'DD:HH:MM:SS'."),
    ("00:00:aa:00", "Non-integer component in `val_check_interval` string: '00:00:aa:00'. Use "
                    "'DD:HH:MM:SS'."),
    ({"secs": 2}, "Trainer(val_check_interval={'secs': 2}) is not valid"),
    ("00:00:00:00", "Trainer(val_check_interval='00:00:00:00') is not valid: expected a positive "
                    "duration."),
])
def test_a_malformed_duration_is_refused_with_lightnings_words(value, message):
    with pytest.raises(MisconfigurationError) as info:
        val_check_duration(value)
    assert message in str(info.value) and "HINT" in str(info.value)


def test_a_duration_is_due_once_its_seconds_have_passed_since_the_last_validation(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    schedule = ValidationSchedule(datetime.timedelta(seconds=2), 1, 50, has_val=True)
    assert not schedule.at_exhaustion
    schedule.start()
    due = []
    for batch in range(10):
        now[0] += 0.75  # a batch takes 0.75 s
        if schedule.due(0, batch):
            # asked again for the same batch: the same answer, no clock read
            assert schedule.due(0, batch)
            due.append(batch)
            now[0] += 5.0  # the validation takes 5 s: not counted
            schedule.validated()
    assert due == [2, 5, 8]


def test_a_duration_under_ddp_is_decided_by_rank_0_at_the_log_interval(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    asked = []
    schedule = ValidationSchedule(
        datetime.timedelta(seconds=1),
        1,
        50,
        has_val=True,
        broadcast=lambda value: asked.append(value) or value,
        sync_every=4,
    )
    schedule.start()
    now[0] = 10.0
    assert [b for b in range(8) if schedule.due(0, b)] == [3, 7]
    assert asked == [True, True]  # one broadcast per log interval, none between


# ---- accumulate_grad_batches ---------------------------------------------------------------------
def test_accumulation_groups_step_after_every_kth_batch_and_the_short_last_group():
    groups = [accumulation_group(b, 3, 7) for b in range(7)]
    assert groups == [
        (3, False),
        (3, False),
        (3, True),
        (3, False),
        (3, False),
        (3, True),
        (1, True),
    ]


def test_accumulation_of_one_steps_after_every_batch():
    assert [accumulation_group(b, 1, 5) for b in range(5)] == [(1, True)] * 5


def test_accumulation_on_a_loader_without_a_length_keeps_full_groups():
    assert [accumulation_group(b, 4, INF) for b in (0, 3, 4, 1001, 1003)] == \
        [(4, False), (4, True), (4, False), (4, False), (4, True)]


def test_an_epoch_shorter_than_one_group_steps_once_at_its_end():
    assert [accumulation_group(b, 8, 3) for b in range(3)] == [(3, False), (3, False), (3, True)]


# ---- argument checks -----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, 2.0, True, "3"])
def test_check_count_refuses_what_is_not_a_count(value):
    with pytest.raises(MisconfigurationError) as info:
        check_count("max_epochs", value, 0)
    assert f"Trainer(max_epochs={value!r}) is not valid: expected an integer >= 0 or None." in str(
        info.value
    )
    assert "HINT: pass max_epochs=<an integer >= 0 or None>" in str(info.value)


def test_check_count_minimum_and_none():
    check_count("max_epochs", None, 0)
    check_count("accumulate_grad_batches", 1, 1, allow_none=False)
    with pytest.raises(MisconfigurationError, match=r"Trainer\(accumulate_grad_batches=None\) is "
                                                    r"not valid: expected an integer >= 1\.\n"):
        check_count("accumulate_grad_batches", None, 1, allow_none=False)
    with pytest.raises(MisconfigurationError, match=r"expected an integer >= 1\."):
        check_count("accumulate_grad_batches", 0, 1, allow_none=False)


@pytest.mark.parametrize("value", [0, 7, 0.0, 0.5, 1.0])
def test_check_limit_takes_batches_or_a_fraction(value):
    check_limit("limit_val_batches", value)


@pytest.mark.parametrize("value", [-1, 1.5, -0.1, True, "all", None])
def test_check_limit_refuses_anything_else(value):
    with pytest.raises(MisconfigurationError) as info:
        check_limit("limit_val_batches", value)
    assert f"Trainer(limit_val_batches={value!r}) is not valid" in str(info.value)
    assert (
        "an int >= 0 (number of batches) or a float in [0.0, 1.0] (fraction of the epoch)"
        in str(info.value)
    )


def test_check_choice_lists_the_choices():
    check_choice("gradient_clip_algorithm", "norm", ("norm", "value"))
    with pytest.raises(MisconfigurationError, match=r"Trainer\(gradient_clip_algorithm='max'\) is "
                                                    r"not valid: expected one of 'norm', "
                                                    r"'value'\."):
        check_choice("gradient_clip_algorithm", "max", ("norm", "value"))


# ---- arguments_checked: one error for a call __init__ cannot take --------------------------------
class Widget:
    @arguments_checked(lightning={"gpus": 'use accelerator="cuda", devices=N'}, docs="docs/widget.md")
    def __init__(self, size: int, *, max_epochs: int = 1, patience: int = 3) -> None:
        self.size, self.max_epochs, self.patience = size, max_epochs, patience


class KeywordsOnly:
    @arguments_checked
    def __init__(self, *, rate: float = 1.0) -> None:
        self.rate = rate


def test_a_valid_call_builds_the_object():
    widget = Widget(2, max_epochs=5)
    assert (widget.size, widget.max_epochs, widget.patience) == (2, 5, 3)


@pytest.mark.parametrize("build, message", [
    (lambda: Widget(1, max_epoch=3), ("Widget() got an unknown argument 'max_epoch'.\n  HINT: did "
                                      "you mean max_epochs? docs/widget.md lists every argument.")),
    (lambda: Widget(1, zzz=3), "Widget() got an unknown argument 'zzz'.\n  HINT: docs/widget.md "
                               "lists every argument."),
    (lambda: Widget(1, gpus=2), ("Widget(gpus=...) is an argument of Lightning's Widget that "
                                 "taskfit's does not "
                                 'take.\n  HINT: use accelerator="cuda", devices=N')),
    (lambda: Widget(1, 2), "Widget() takes at most 1 positional arguments (size); got 2."),
    (lambda: Widget(max_epochs=2), "Widget() is missing the argument 'size'."),
    (lambda: KeywordsOnly(0.5), ("KeywordsOnly() takes keyword arguments only; got 1 positional.\n "
                                 " HINT: name each one, e.g. KeywordsOnly(rate=...).")),
])
def test_a_call_the_signature_does_not_take_is_one_error(build, message):
    with pytest.raises(MisconfigurationError) as info:
        build()
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("n, k", [(9, 1), (9, 2), (9, 3), (8, 4), (1, 4), (10, 3)])
def test_steps_per_epoch_counts_the_batches_that_step(n, k):
    """The one count of an epoch's optimizer steps (estimated_stepping_batches, a resume's schedule
    warning) agrees with the groups the loop steps after (the short last group steps too)."""
    from taskfit.loop.cadence import steps_per_epoch

    stepping = sum(accumulation_group(i, k, n)[1] for i in range(n))
    assert steps_per_epoch(n, k) == stepping
    assert steps_per_epoch(INF, k) == INF
