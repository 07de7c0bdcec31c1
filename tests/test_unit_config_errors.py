"""The `taskfit` command's config errors, without composing a config or running the command: each mistake is one
MisconfigurationError naming the key, what it accepts and the close valid names (cli/config.py: explain, locate,
check_targets; cli/config_errors.py: check_root, blame, null_group, yaml_error)."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, List, Optional

import pytest
import yaml
from omegaconf import OmegaConf
from taskfit.cli.config import check_targets, explain, locate, type_name
from taskfit.cli.config_errors import (
    ROOT_KEYS,
    blame,
    check_root,
    null_group,
    yaml_error,
)
from taskfit.errors import MisconfigurationError


def error_of(fn) -> BaseException:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error under test, whatever its class
        return exc
    raise AssertionError("no error")


def parts(error: MisconfigurationError) -> tuple[str, str]:
    """(what is wrong, the hint)."""
    what, _, hint = str(error).partition("\n  HINT: ")
    return what, hint


# ---- explain: Hydra's and OmegaConf's composition errors ------------------------------------------------------
@dataclasses.dataclass
class TrainerSchema:
    max_epochs: Optional[int] = None
    precision: str = "32"
    deterministic: bool = False


@dataclasses.dataclass
class RootSchema:
    trainer: TrainerSchema = dataclasses.field(default_factory=TrainerSchema)


def test_an_unknown_key_names_the_close_valid_one_with_its_type():
    config = OmegaConf.structured(RootSchema)
    what, hint = parts(explain(error_of(lambda: setattr(config.trainer, "max_epoch", 3))))
    assert what == "Unknown config key 'trainer.max_epoch'."
    assert hint == ("did you mean trainer.max_epochs (int or null)?\n"
                    "  Valid keys of trainer: max_epochs, precision, deterministic.")
    assert "+trainer.max_epoch" not in hint  # a near miss is a typo: no advice to add it as a new key


def test_an_unknown_key_with_nothing_close_lists_the_valid_keys():
    config = OmegaConf.structured(RootSchema)
    what, hint = parts(explain(error_of(lambda: config.trainer.zzz)))
    assert what == "Unknown config key 'trainer.zzz'."
    assert hint.startswith("+trainer.zzz=VALUE adds a key that is not in the config.")
    assert "Valid keys of trainer: max_epochs, precision" in hint and "did you mean" not in hint


@pytest.mark.parametrize("key, value, expected, example", [
    ("max_epochs", "abc", "int or null", "trainer.max_epochs=null"),
    ("deterministic", "maybe", "bool", "trainer.deterministic=false"),
])
def test_a_wrong_type_names_the_expected_type_and_the_default(key, value, expected, example):
    config = OmegaConf.structured(RootSchema)
    wrapped = error_of(lambda: OmegaConf.merge(config, OmegaConf.from_dotlist([f"trainer.{key}={value}"])))
    try:  # Hydra chains OmegaConf's error as the __cause__ of its own
        raise RuntimeError("composition failed") from wrapped
    except RuntimeError as exc:
        what, hint = parts(explain(exc))
    assert what == f"Config value trainer.{key}={value!r} is not valid: expected {expected}."
    assert hint == f"pass a value of that type, e.g. {example} (null is None)."


def test_a_missing_option_of_a_group_suggests_the_close_one():
    message = ("In 'config': Could not find 'trainer/gpuu'\n\nAvailable options in 'trainer':\n\tcpu\n\tddp\n"
               "\tdefault\n\tdp\n\tgpu\nConfig search path:\n\tprovider=hydra, path=pkg://hydra.conf")
    what, hint = parts(explain(Exception(message)))
    assert what == "There is no config 'trainer/gpuu' (the option 'gpuu' of the group 'trainer')."
    assert hint.startswith("did you mean trainer=gpu or trainer=cpu? Options of 'trainer': cpu, ddp, default, dp, "
                           "gpu. `taskfit --help` lists every group")
    what, hint = parts(explain(Exception("Could not find 'task/zzzzzz'\n\nAvailable options in 'task':\n\tdigits")))
    assert hint.startswith("Options of 'task': digits.")  # nothing close: no guess


def test_any_other_composition_error_keeps_its_text_and_its_cause():
    try:
        raise ValueError("mismatched input '='") from KeyError("inner")
    except ValueError as exc:
        what, hint = parts(explain(exc))
    assert what == "The configuration cannot be composed: mismatched input '=' ('inner')"
    assert hint.startswith("overrides are key=value, group=option, +new_key=value or ~key")


@pytest.mark.parametrize("annotation, name", [
    (int, "int"), (Optional[int], "int or null"), (typing.Union[int, str], "int or str"), (int | None, "int or null"),
    (List[str], "list of str"), (list, "list"), (tuple, "list"), (Any, "any value"), (type(None), "null"),
])
def test_type_name(annotation, name):
    assert type_name(annotation) == name


# ---- locate: _target_ import paths ------------------------------------------------------------------------------
def test_locate_imports_the_object():
    import collections

    assert locate("collections.OrderedDict", "task") is collections.OrderedDict
    assert locate("taskfit.callbacks.EarlyStopping", "callbacks.early_stopping").__name__ == "EarlyStopping"


@pytest.mark.parametrize("path, what, hint", [
    ("nopkg_xyz.MyTask", "task._target_='nopkg_xyz.MyTask': no module named 'nopkg_xyz' can be imported.",
     "check the spelling, and that the package is installed"),
    ("collections.OrderedDcit", ("task._target_='collections.OrderedDcit': 'collections' has no attribute "
                                "'OrderedDcit'."), "did you mean collections.OrderedDict?"),
    ("collections..OrderedDict", "task._target_='collections..OrderedDict' is not an import path.",
     "write the full path of a class or function: package.module.Name."),
])
def test_locate_names_what_is_wrong_with_a_path(path, what, hint):
    with pytest.raises(MisconfigurationError) as info:
        locate(path, "task")
    assert parts(info.value)[0] == what and hint in parts(info.value)[1]


def test_locate_tells_a_missing_dependency_from_a_broken_module(tmp_path, monkeypatch):
    (tmp_path / "needs_dep_xyz.py").write_text("import missing_dependency_xyz\n")
    (tmp_path / "raises_xyz.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MisconfigurationError) as info:
        locate("needs_dep_xyz.Task", "task")
    assert "importing module 'needs_dep_xyz' failed: No module named 'missing_dependency_xyz'" in str(info.value)
    assert "install the missing package (missing_dependency_xyz)" in str(info.value)
    with pytest.raises(MisconfigurationError) as info:
        locate("raises_xyz.Task", "task")
    assert "importing module 'raises_xyz' raised RuntimeError: boom at import." in str(info.value)
    assert "`python -c \"import raises_xyz\"` shows the traceback" in str(info.value)


# ---- check_targets: a node's keys against its target's signature ------------------------------------------------
TARGET = '''
def build(lr: float = 0.1, name: str = "x", steps: int | None = None, flag: bool = False, extra=None):
    return lr


class Model:
    def __init__(self, width: int = 8, **kwargs):
        self.width = width
'''


@pytest.fixture
def targets(tmp_path, monkeypatch):
    (tmp_path / "targets_xyz.py").write_text(TARGET)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_valid_nodes_pass(targets):
    check_targets({"task": {"_target_": "targets_xyz.build", "lr": 1, "steps": None, "extra": [1, 2]},
                   "model": {"_target_": "targets_xyz.Model", "width": 4, "anything": "goes to **kwargs"},
                   "plain": {"no_target": 1}})


@pytest.mark.parametrize("node, message", [
    ({"_target_": "targets_xyz.build", "lr_": 0.1},
     ("Unknown config key 'task.lr_': targets_xyz.build takes no argument 'lr_'.\n  HINT: did you mean task.lr? "
      "Its arguments: lr, name, steps, flag, extra.")),
    ({"_target_": "targets_xyz.build", "lr": "fast"},
     ("Config value task.lr='fast' is not valid: targets_xyz.build expects float.\n  HINT: pass a value of that type "
      "(null is None), e.g. the default: task.lr=0.1.")),
    ({"_target_": "targets_xyz.build", "flag": 1},
     "Config value task.flag=1 is not valid: targets_xyz.build expects bool."),
    ({"_target_": "targets_xyz.build", "steps": True},
     "Config value task.steps=True is not valid: targets_xyz.build expects int or null."),
])
def test_a_bad_key_or_value_names_the_key_the_target_and_the_type(targets, node, message):
    with pytest.raises(MisconfigurationError) as info:
        check_targets({"task": node})
    assert str(info.value).startswith(message), str(info.value)


def test_nested_and_listed_targets_are_checked_with_their_full_key(targets):
    with pytest.raises(MisconfigurationError, match=r"(?s)Unknown config key 'callbacks\[1\]\.nmae'.*did you mean "
                                                    r"callbacks\[1\]\.name\?"):
        check_targets({"callbacks": [{"_target_": "targets_xyz.Model"}, {"_target_": "targets_xyz.build",
                                                                         "nmae": "x"}]})
    with pytest.raises(MisconfigurationError, match=r"Config value task\.extra\.steps='2' is not valid"):
        check_targets({"task": {"_target_": "targets_xyz.build", "extra": {"_target_": "targets_xyz.build",
                                                                           "steps": "2"}}})


# ---- config_errors: root keys, values blamed on a key, task=null, YAML syntax -----------------------------------
def test_an_unknown_root_key_is_refused_with_the_close_name():
    with pytest.raises(MisconfigurationError) as info:
        check_root({"trainer": {}, "ckpt_pth": "last"}, {})
    what, hint = parts(info.value)
    assert what.startswith("Unknown config key 'ckpt_pth' at the root of the config: taskfit does not read it")
    assert hint.startswith("did you mean ckpt_path? Root keys: " + ", ".join(ROOT_KEYS))


def test_a_root_key_of_ones_own_is_fine_when_an_interpolation_reads_it():
    check_root({"trainer": {}, "base_lr": 0.1}, {"task": {"lr": "${base_lr}"}})
    with pytest.raises(MisconfigurationError, match=r"Unknown config key 'base_lr'.*\n  HINT: Root keys:"):
        check_root({"trainer": {}, "base_lr": 0.1}, {"task": {"lr": 0.1}})


def test_a_value_error_naming_one_config_value_is_blamed_on_its_key():
    config = {"task": {"batch_size": -4, "lr": 0.1}, "trainer": {"max_epochs": 3}}
    error = blame(ValueError("batch_size should be a positive integer value, but got batch_size=-4"), config)
    what, hint = parts(error)
    assert what.startswith("Config value task.batch_size=-4 is not valid: ValueError: batch_size should be a positive "
                           "integer value, but got batch_size=-4")
    assert hint.startswith("set task.batch_size to a value the message accepts, e.g. `taskfit task.batch_size=...`")


@pytest.mark.parametrize("exc", [
    ValueError("something else entirely"),  # no key named
    ValueError("lr=0.1 and lr=0.1 again, batch_size=-4 and max_epochs=3"),  # more than one key fits
    RuntimeError("batch_size=-4"),  # not a ValueError/TypeError: not the config's
])
def test_an_error_that_names_no_single_key_is_left_alone(exc):
    assert blame(exc, {"task": {"batch_size": -4, "lr": 0.1}, "trainer": {"max_epochs": 3}}) is None


def test_task_null_says_a_group_takes_one_of_its_options():
    exc = ValueError("Config group override must be a string or a list. Got NoneType")
    what, hint = parts(null_group(exc, ["trainer.max_epochs=2", "task=null"]))
    assert what == "task=null: 'task' is a config group, which takes the name of one of its options, not null."
    assert hint.startswith("use one of task=diabetes, task=digits, task=sequence;")
    assert null_group(ValueError("another error"), ["task=null"]) is None


def test_a_yaml_syntax_error_names_the_file_line_and_group(tmp_path):
    path = tmp_path / "task" / "broken.yaml"
    path.parent.mkdir()
    path.write_text("lr: 0.1\nlayers: [1, 2\nwidth: 3\n")
    with open(path) as fh:
        syntax = error_of(lambda: yaml.safe_load(fh))
    try:
        raise RuntimeError("Hydra could not load the config") from syntax
    except RuntimeError as exc:
        what, hint = parts(yaml_error(exc))
    assert what.startswith(f"The config file {path} is not valid YAML: while parsing a flow sequence")
    assert f"({path}, line 3, column" in what
    assert hint.startswith("fix that line of the file (the option 'broken' of the group 'task')")
    assert yaml_error(RuntimeError("not yaml")) is None
