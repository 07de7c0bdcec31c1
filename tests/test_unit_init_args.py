"""hparams without a TaskModule (init_args.py: what __init__ was called with, save_hyperparameters' choice, the plain
form checkpoints and loggers get) and the old module paths (compat/old_paths.py: taskfit.fsdp is
taskfit.strategies.fsdp, the same module object)."""
from __future__ import annotations

import enum
import functools
import importlib
import importlib.machinery
import io
import sys
import types

import pytest
import torch
from taskfit.compat.old_paths import MOVED
from taskfit.errors import MisconfigurationError
from taskfit.init_args import (
    AttributeDict,
    flatten,
    plain_hparams,
    recorded_init_args,
    select_hparams,
)


# ---- recorded_init_args -------------------------------------------------------------------------------------
class Model:
    def __init__(self, width, depth=2, *layers, act="relu", **extra):
        pass


def test_the_arguments_are_recorded_by_name_with_the_defaults():
    assert recorded_init_args(Model, (8,), {}) == {"width": 8, "depth": 2, "act": "relu"}
    assert recorded_init_args(Model, (8, 3, "a", "b"), {"act": "gelu", "dropout": 0.1, "lr": 1e-3}) == \
        {"width": 8, "depth": 3, "act": "gelu", "dropout": 0.1, "lr": 1e-3}  # **extra flattened, *layers not kept


def test_arguments_that_do_not_bind_record_nothing():
    assert recorded_init_args(Model, (), {}) == {}  # width missing: the constructor itself will say so
    assert recorded_init_args(Model, (1,), {"width": 2}) == {}


# ---- AttributeDict ------------------------------------------------------------------------------------------------
def test_attribute_dict_keys_are_attributes():
    hparams = AttributeDict(lr=0.1)
    hparams.width = 8
    assert hparams == {"lr": 0.1, "width": 8} and hparams.lr == 0.1
    del hparams.lr
    with pytest.raises(AttributeError, match=r"hparams has no 'lr'; it holds \['width'\]"):
        _ = hparams.lr


# ---- save_hyperparameters -----------------------------------------------------------------------------------------
def owner_with(**hparams):
    owner = types.SimpleNamespace()
    owner.__dict__["_hparams"] = AttributeDict(hparams)
    return owner


@pytest.mark.parametrize("args, ignore, kept", [
    ((), None, {"lr": 0.1, "width": 8, "net": "module"}),  # all of them
    (("lr", "width"), None, {"lr": 0.1, "width": 8}),
    ((["lr", "net"],), None, {"lr": 0.1, "net": "module"}),  # a list of names
    ((), "net", {"lr": 0.1, "width": 8}),
    ((), ["net", "width"], {"lr": 0.1}),
    (({"custom": 1},), None, {"custom": 1}),  # a mapping replaces them (Lightning's save_hyperparameters(config))
])
def test_save_hyperparameters_keeps_the_named_arguments_but_the_ignored_ones(args, ignore, kept):
    owner = owner_with(lr=0.1, width=8, net="module")
    select_hparams(owner, args, ignore)
    assert owner._hparams == kept


def test_save_hyperparameters_of_an_unknown_name_lists_the_arguments():
    with pytest.raises(MisconfigurationError) as info:
        select_hparams(owner_with(lr=0.1, width=8), ("lr", "depth"), None)
    assert str(info.value).startswith("save_hyperparameters('lr', 'depth'): 'depth' is not an argument of "
                                      "SimpleNamespace.__init__ (arguments: ['lr', 'width']).")


# ---- the plain form: checkpoints (weights_only=True) and loggers --------------------------------------------------
def test_plain_hparams_keep_the_types_given_and_load_with_weights_only():
    def make_optimizer(params, lr):
        return None

    owner = owner_with(lr=0.1, name="net", flag=True, nothing=None, sizes=(1, 2), nested={"a": {1: [3, (4,)]}},
                       tags={"x"}, shape=torch.Size([2, 3]), count=enum.IntEnum("E", "ONE")(1),
                       optimizer=functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9),
                       device=torch.device("cpu"))
    plain = plain_hparams(owner)
    expected = {"lr": 0.1, "name": "net", "flag": True, "nothing": None, "sizes": (1, 2),
                "nested": {"a": {1: [3, (4,)]}}, "tags": {"x"}, "shape": (2, 3), "count": 1,
                "optimizer": {"_target_": "torch.optim.sgd.SGD", "lr": 0.5, "momentum": 0.9},
                "device": "device(type='cpu')"}
    assert plain == expected
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # how checkpoints are read
    assert loaded == expected and repr(loaded) == repr(expected)  # tuple stays tuple, int keys stay ints
    assert type(loaded["shape"]) is tuple and type(loaded["count"]) is int
    assert plain_hparams(types.SimpleNamespace()) == {}


def test_flatten_gives_dotted_keys_and_loggable_values():
    config = {"task": {"lr": 0.1, "layers": [1, 2], "opt": {"name": "sgd"}}, "seed": None, "tag": "x"}
    assert flatten(config) == {"task.lr": 0.1, "task.layers": "[1, 2]", "task.opt.name": "sgd", "seed": None,
                               "tag": "x"}
    assert flatten({"a": 1}, "hp/") == {"hp/a": 1}


# ---- old module paths -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old, new", [
    ("taskfit.fsdp", "taskfit.strategies.fsdp"),
    ("taskfit.schedule", "taskfit.loop.cadence"),
    ("taskfit.logbook", "taskfit.logs.book"),
    ("taskfit.sharded_index", "taskfit.checkpoint.sharded_index"),
    ("taskfit.config_errors", "taskfit.cli.config_errors"),
    ("taskfit.callbacks.checkpoint_policy", "taskfit.callbacks.checkpoint.policy"),
])
def test_an_old_module_name_imports_as_the_new_module_object(old, new):
    assert MOVED[old] == new
    assert importlib.import_module(old) is importlib.import_module(new)
    assert sys.modules[old] is sys.modules[new]


def test_from_an_old_path_gives_the_same_objects_and_a_monkeypatch_reaches_the_new_module(monkeypatch):
    from taskfit.fsdp import FSDPStrategy
    from taskfit.schedule import accumulation_group
    from taskfit.strategies.fsdp import FSDPStrategy as New

    assert FSDPStrategy is New
    monkeypatch.setattr("taskfit.schedule.accumulation_group", lambda *args: "patched")
    from taskfit.loop import cadence

    assert cadence.accumulation_group(0, 1, 1) == "patched" and accumulation_group(0, 1, 1) == (1, True)


def test_every_new_name_exists_and_no_old_name_is_a_real_module():
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        parent, _, leaf = old.rpartition(".")
        assert importlib.machinery.PathFinder.find_spec(leaf, importlib.import_module(parent).__path__) is None, old
