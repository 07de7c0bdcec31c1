"""ModelCheckpoint's rules that need no Trainer (callbacks/checkpoint/policy.py): file names from Lightning's
templates, the argument checks and their messages, durations, the version counter and the top-k ranking."""
from __future__ import annotations

import datetime
import math
import os

import pytest
from taskfit.callbacks.checkpoint.policy import (
    Ranking,
    check_arguments,
    format_filename,
    seconds,
    versioned,
)
from taskfit.errors import MisconfigurationError

TRIGGERS = dict(every_n_train_steps=None, every_n_epochs=1, train_time_interval=None)


def check(**changes):
    args = dict(mode="min", save_top_k=1, triggers=TRIGGERS, save_last=None, filename=None)
    return check_arguments(**{**args, **changes})


# ---- file names ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template, auto, expected", [
    ("{epoch}-{step}", True, "epoch=3-step=120"),
    ("{epoch:03d}", True, "epoch=003"),
    ("{epoch}-{val/acc:.2f}", True, "epoch=3-val_acc=0.91"),  # "/" in an inserted name: "_", not a sub-folder
    ("{epoch}-{val/acc:.2f}", False, "3-0.91"),
    ("best", True, "best"),
    ("{ epoch }", True, "epoch=3"),  # spaces around the name
])
def test_format_filename(template, auto, expected):
    assert format_filename(template, {"epoch": 3, "step": 120, "val/acc": 0.9123}, auto) == expected


def test_a_name_missing_from_the_values_raises_key_error():
    with pytest.raises(KeyError, match="val/loss"):
        format_filename("{epoch}-{val/loss:.3f}", {"epoch": 0})


# ---- argument checks --------------------------------------------------------------------------------------------
def test_valid_arguments_give_the_filename_template_without_ckpt():
    assert check() == "{epoch}-{step}"
    assert check(filename="best-{epoch}.ckpt") == "best-{epoch}"
    assert check(filename="{epoch}-{val/acc:.3f}") == "{epoch}-{val/acc:.3f}"  # a "/" inside a field is no folder
    assert check(save_top_k=-1, save_last="link", mode="max") == "{epoch}-{step}"


@pytest.mark.parametrize("changes, what, hint", [
    (dict(mode="best"), "ModelCheckpoint(mode='best') is not valid.", 'use mode="min" (lower is better'),
    (dict(save_top_k=-2), "ModelCheckpoint(save_top_k=-2) is not valid.", "use -1 (keep all), 0 (only last.ckpt)"),
    (dict(save_top_k=True), "ModelCheckpoint(save_top_k=True) is not valid.", "use -1 (keep all)"),
    (dict(save_top_k=1.0), "ModelCheckpoint(save_top_k=1.0) is not valid.", "use -1 (keep all)"),
    (dict(triggers={**TRIGGERS, "every_n_epochs": -1}), "ModelCheckpoint(every_n_epochs=-1) is not valid.",
     "use a positive integer, or None/0 to turn this trigger off."),
    (dict(triggers={**TRIGGERS, "every_n_train_steps": True}), ("ModelCheckpoint(every_n_train_steps=True) is not "
                                                                "valid."), "use a positive integer"),
    (dict(save_last="always"), "ModelCheckpoint(save_last='always') is not valid.", 'or "link".'),
    (dict(filename="last"), "ModelCheckpoint(filename='last') is not valid.", 'other than "last"'),
    (dict(filename="last.ckpt"), "ModelCheckpoint(filename='last.ckpt') is not valid.", "put folders in dirpath"),
    (dict(filename=""), "ModelCheckpoint(filename='') is not valid.", "without folders"),
    (dict(filename=f"runs{os.sep}{{epoch}}"), f"ModelCheckpoint(filename='runs{os.sep}{{epoch}}') is not valid.",
     "put folders in dirpath"),
])
def test_each_bad_argument_is_one_error_with_a_hint(changes, what, hint):
    with pytest.raises(MisconfigurationError) as info:
        check(**changes)
    what_part, _, hint_part = str(info.value).partition("\n  HINT: ")
    assert what_part.startswith(what) and hint in hint_part, str(info.value)


@pytest.mark.parametrize("value, expected", [(0, 0.0), (90, 90.0), (1.5, 1.5),
                                             (datetime.timedelta(minutes=2), 120.0)])
def test_seconds_takes_numbers_and_timedeltas(value, expected):
    assert seconds("train_time_interval", value, "off") == expected


@pytest.mark.parametrize("value", [-1, "60", True, float("nan")])
def test_seconds_refuses_anything_else(value):
    with pytest.raises(MisconfigurationError) as info:
        seconds("train_time_interval", value, "never")
    assert f"ModelCheckpoint(train_time_interval={value!r}) is not valid." in str(info.value)
    assert "pass a number of seconds >= 0 (0: never) or a datetime.timedelta." in str(info.value)


def test_seconds_none_only_where_allowed():
    assert seconds("every", None, "off", allow_none=True) is None
    with pytest.raises(MisconfigurationError):
        seconds("every", None, "off")


# ---- the version counter ----------------------------------------------------------------------------------------
def test_versioned_takes_the_first_free_name_only_with_the_counter():
    taken = {os.path.join("d", "best.ckpt"), os.path.join("d", "best-v1.ckpt")}

    def free(path):
        return path not in taken

    assert versioned("d", "best", free, counter=True) == os.path.join("d", "best-v2.ckpt")
    assert versioned("d", "best", free, counter=False) == os.path.join("d", "best.ckpt")  # overwritten
    assert versioned("d", "other", free, counter=True) == os.path.join("d", "other.ckpt")


# ---- the top-k ranking ------------------------------------------------------------------------------------------
def test_min_mode_keeps_the_k_lowest_and_evicts_the_worst():
    ranking = Ranking("min", by_recency=False, k=2)
    assert ranking.admit("a", 0.5) == [] and ranking.admit("b", 0.3) == []
    assert ranking.would_evict() == "a" and ranking.best() == "b"
    assert not ranking.qualifies(0.5) and ranking.qualifies(0.4)  # strictly better than the k-th
    assert ranking.admit("c", 0.4) == ["a"]
    assert ranking.kept == {"b": 0.3, "c": 0.4}


def test_max_mode_keeps_the_highest():
    ranking = Ranking("max", by_recency=False, k=1)
    ranking.admit("a", 0.7)
    assert ranking.qualifies(0.8) and not ranking.qualifies(0.6)
    assert ranking.admit("b", 0.8) == ["a"] and ranking.best() == "b"


def test_without_a_monitor_the_newest_steps_are_kept_whatever_the_mode():
    ranking = Ranking("min", by_recency=True, k=2)  # the score is the global step: higher is newer
    for step in (10, 20, 30):
        evicted = ranking.admit(f"step={step}", float(step))
    assert evicted == ["step=10"] and sorted(ranking.kept) == ["step=20", "step=30"]


def test_a_nan_score_never_pushes_a_good_file_out():
    ranking = Ranking("min", by_recency=False, k=2)
    ranking.admit("good", 0.1)
    ranking.admit("diverged", math.nan)
    assert ranking.would_evict() == "diverged" and ranking.best() == "good"
    assert not ranking.better(math.nan, 1e9) and ranking.better(1e9, math.nan)
    assert ranking.admit("ok", 0.2) == ["diverged"]
    assert ranking.qualifies(0.15) and not ranking.qualifies(math.nan)


def test_k_zero_keeps_nothing_and_minus_one_keeps_everything():
    none = Ranking("min", by_recency=False, k=0)
    assert not none.qualifies(0.0) and none.admit("a", 0.0) == ["a"] and none.kept == {}
    everything = Ranking("min", by_recency=False, k=-1)
    assert all(everything.admit(str(i), float(-i)) == [] for i in range(5))
    assert len(everything.kept) == 5 and everything.qualifies(100.0) and everything.would_evict() == ""


def test_admitting_a_kept_path_again_replaces_its_score():
    ranking = Ranking("min", by_recency=False, k=2)
    ranking.admit("last", 0.9)
    ranking.admit("other", 0.5)
    assert ranking.admit("last", 0.1) == [] and ranking.kept == {"other": 0.5, "last": 0.1}
    assert ranking.best() == "last"
