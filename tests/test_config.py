"""The conf/ tree through Hydra's compose API: every option of every group composes, passes the checks and builds
(task, callbacks, Trainer); schemas match the real signatures; mistakes fail early with the close valid names."""
from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any, List, Optional

import pytest
import torch
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.utils import instantiate
from taskfit import Trainer
from taskfit import callbacks as cbs
from taskfit.cli.app import _config_path, build_callbacks, build_trainer, compose_config, find_last_checkpoint
from taskfit.cli.config import SCHEMAS, check_targets, explain, locate
from taskfit.errors import CheckpointError, MisconfigurationError
from taskfit.loop.checks import check_task

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
CUDA = torch.cuda.is_available()


def _initialize():
    path = _config_path()
    if path.startswith("pkg://"):
        return initialize_config_module(path[len("pkg://"):], version_base="1.3")
    return initialize_config_dir(path, version_base="1.3")


def composed(tmp_path, *overrides: str) -> dict:
    """The resolved job config of `taskfit <overrides>`, with the run directory and logs in ``tmp_path``."""
    return compose_config([f"paths.log_dir={tmp_path}", *overrides], run_dir=str(tmp_path))


def _options() -> list[tuple[str, str]]:
    return [(group.name, f.stem) for group in sorted(CONF.iterdir()) if group.is_dir() and group.name != "__pycache__"
            for f in sorted(group.glob("*.yaml")) if group.name not in ("hydra", "paths")]


# ---- every option composes and builds ----------------------------------------------------------------
@pytest.mark.parametrize("group,option", _options(), ids=lambda v: str(v))
def test_every_config_group_option_composes_and_instantiates(tmp_path, group, option):
    config = composed(tmp_path, f"{group}={option}")
    check_targets(config)
    trainer_cfg = config["trainer"]
    if trainer_cfg["accelerator"] == "cuda" and not CUDA:
        return  # gpu/dp presets compose and check on a CPU machine; building them needs CUDA
    built = build_callbacks(config)
    trainer = build_trainer(config, built)
    assert isinstance(trainer, Trainer)
    assert trainer.config == config and trainer.default_root_dir == str(tmp_path)
    assert all(cb in trainer.callbacks for cb in built)
    if group in ("task", "experiment"):  # the data sets of the examples: build the task too
        task = instantiate(config["task"], _convert_="all")
        assert type(task).__name__ == config["task"]["_target_"].rsplit(".", 1)[1]
        check_task(task, "fit")  # what fit checks before it starts


def test_defaults_reach_the_trainer_and_callbacks(tmp_path):
    config = composed(tmp_path, "trainer.max_epochs=7", "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=0.5",
                      "callbacks.early_stopping.patience=9", "callbacks.model_checkpoint.save_top_k=2")
    trainer = build_trainer(config, build_callbacks(config))
    assert (trainer.max_epochs, trainer.precision_name, trainer.gradient_clip_val) == (7, "bf16-mixed", 0.5)
    stopper = next(cb for cb in trainer.callbacks if isinstance(cb, cbs.EarlyStopping))
    checkpoint = trainer.checkpoint_callback
    assert stopper.patience == 9 and checkpoint.save_top_k == 2 and checkpoint.monitor == "val/loss"
    assert config["name"] == "digits" and config["task"]["scheduler"]["T_max"] == 7  # interpolations resolved
    assert trainer.hparams["task.optimizer.lr"] == 0.003  # the flattened config is what HParams shows


def test_ddp_preset_builds_a_ddp_strategy_with_its_options(tmp_path):
    from taskfit.strategies.ddp import DDPStrategy

    config = composed(tmp_path, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                      "trainer.strategy.timeout=30")
    trainer = build_trainer(config, [])
    assert isinstance(trainer.strategy, DDPStrategy)
    assert (trainer.strategy.world_size, trainer.strategy.timeout, trainer.strategy.backend) == (2, 30.0, "gloo")


def test_schemas_match_the_real_signatures():
    """Each schema has one field per argument of its target, with the same default (TrainerConf is built from the
    signature, so this holds by construction; a new callback argument must be added to trainer/cli/schemas.py, or
    the command line could not reach it)."""
    for name, schema in SCHEMAS.items():
        fields = {f.name: f for f in dataclasses.fields(schema)}
        target = locate(fields["_target_"].default, name)
        params = {k: p for k, p in inspect.signature(target.__init__).parameters.items()
                  if k != "self" and p.kind is not p.VAR_KEYWORD}
        if name == "trainer":
            params = {k: p for k, p in params.items() if k not in ("callbacks", "config")}  # built by the command
        assert set(fields) - {"_target_"} == set(params), name
        for key, param in params.items():
            f = fields[key]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            expected = list(param.default) if isinstance(param.default, tuple) else param.default
            assert default == expected, f"{name}.{key}: schema default {default!r} != {expected!r}"


def test_trainer_schema_is_built_from_the_signature():
    """TrainerConf: `_target_` first, then the signature's arguments in its order (less callbacks/config), each
    with the OmegaConf form of its annotation, except the few TRAINER_NARROWED names on purpose."""
    from taskfit.cli.schemas import TRAINER_NARROWED, TrainerConf, config_type

    params = [k for k in inspect.signature(Trainer.__init__).parameters if k not in ("self", "callbacks", "config")]
    assert [f.name for f in dataclasses.fields(TrainerConf)] == ["_target_", *params]
    assert SCHEMAS["trainer"] is TrainerConf and set(TRAINER_NARROWED) <= set(params)
    hints, schema_types = typing.get_type_hints(Trainer.__init__), typing.get_type_hints(TrainerConf)
    for key in params:
        assert schema_types[key] == TRAINER_NARROWED.get(key, config_type(hints[key])), key
    # the types the command has always had (a changed annotation that changes them shows up here)
    assert schema_types["max_epochs"] == Optional[int] and schema_types["gradient_clip_val"] == Optional[float]
    assert schema_types["preempt_signals"] == List[str] and schema_types["requeue"] == Optional[bool]
    assert schema_types["devices"] is Any and schema_types["limit_train_batches"] is Any
    assert (schema_types["precision"], schema_types["logger"], schema_types["profiler"]) == (str, bool, Optional[str])


@pytest.mark.parametrize("annotation,expected", [
    (int, int), (bool, bool), (int | None, Optional[int]), (Optional[str], Optional[str]), (int | float, Any),
    (int | str | None, Any), (Any, Any), ("Sequence[str]", List[str]), (list[int], List[int]),
    (tuple[str, ...], List[str]), (tuple[int, int], Any), ("Sequence[Callback]", Any), (torch.nn.Module, Any)])
def test_config_type_is_what_omegaconf_can_hold(annotation, expected):
    from collections.abc import Sequence

    from taskfit.callbacks import Callback
    from taskfit.cli.schemas import config_type

    if isinstance(annotation, str):
        annotation = eval(annotation, {"Sequence": Sequence, "Callback": Callback})
    assert config_type(annotation) == expected


def test_the_cli_package_is_not_imported_by_the_trainer():
    """schemas.py imports taskfit.Trainer: the Trainer's own imports must not reach taskfit.cli (an import cycle)."""
    code = "import sys, taskfit; assert not [m for m in sys.modules if m.startswith('taskfit.cli')], sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr


# conf/trainer/default.yaml sets these differently from Trainer(...)'s defaults, for the command; every other value
# it writes (with a comment, for the reader of the yaml) must be the signature's default.
COMMAND_DEFAULTS = {"max_epochs": 10, "seed": 0, "default_root_dir": "${paths.output_dir}"}


def test_default_yaml_repeats_the_signature_defaults():
    from omegaconf import OmegaConf

    written = OmegaConf.to_container(OmegaConf.load(CONF / "trainer" / "default.yaml"), resolve=False)
    written.pop("defaults")
    assert written.pop("_target_") == "taskfit.Trainer"
    params = {k: p.default for k, p in inspect.signature(Trainer.__init__).parameters.items()
              if k not in ("self", "callbacks", "config")}
    assert set(written) == set(params)
    for key, default in params.items():
        expected = COMMAND_DEFAULTS.get(key, list(default) if isinstance(default, tuple) else default)
        assert written[key] == expected and type(written[key]) is type(expected), \
            f"conf/trainer/default.yaml: {key}: {written[key]!r}, the signature's default is {default!r}"


def test_every_callback_and_trainer_argument_is_in_the_yaml():
    """The yaml files list every argument (with a comment), so `--cfg job` and the files document them all."""
    files = {"trainer": "trainer/default.yaml", "model_checkpoint": "callbacks/model_checkpoint.yaml",
             "early_stopping": "callbacks/early_stopping.yaml", "lr_monitor": "callbacks/lr_monitor.yaml",
             "throughput": "callbacks/throughput.yaml", "tensorboard": "logger/tensorboard.yaml",
             "csv": "logger/csv.yaml", "mlflow": "logger/mlflow.yaml", "wandb": "logger/wandb.yaml",
             "progress_bar": "callbacks/progress_bar.yaml", "model_summary": "callbacks/model_summary.yaml"}
    assert set(files) == set(SCHEMAS)
    for name, path in files.items():
        text = (CONF / path).read_text()
        missing = [f.name for f in dataclasses.fields(SCHEMAS[name]) if f"{f.name}:" not in text]
        assert not missing, f"{path} lacks {missing}"


# ---- presets ------------------------------------------------------------------------------------------------
def test_experiment_preset_sets_groups_and_values(tmp_path):
    config = composed(tmp_path, "experiment=digits_fast", "task.hidden=32")
    assert config["name"] == "digits_fast" and config["trainer"]["accelerator"] == "cpu"
    assert config["task"]["channels"] == 16 and config["task"]["hidden"] == 32  # the command line wins
    assert config["callbacks"]["model_checkpoint"]["monitor"] == "val/acc"
    with _initialize():
        cfg = compose("config", overrides=["experiment=digits_sweep"], return_hydra_config=True)
    assert dict(cfg.hydra.sweeper.params) == {"task.optimizer.lr": "0.01,0.003,0.001", "task.channels": "16,32"}


def test_debug_presets(tmp_path):
    config = composed(tmp_path, "debug=fast_dev_run")
    assert config["name"] == "debug_digits" and config["trainer"]["fast_dev_run"] is True
    kinds = {type(cb) for cb in build_callbacks(config)}
    assert cbs.ModelCheckpoint not in kinds and cbs.TensorBoardLogger not in kinds  # a fast_dev_run writes nothing
    trainer = build_trainer(config, build_callbacks(config))
    assert not any(isinstance(cb, (cbs.ModelCheckpoint, cbs.TensorBoardLogger)) for cb in trainer.callbacks)
    config = composed(tmp_path, "debug=overfit", "task=diabetes")
    assert not config["callbacks"] and config["trainer"]["overfit_batches"] == 4
    assert config["name"] == "debug_diabetes"
    config = composed(tmp_path, "debug=limit")
    assert config["trainer"]["limit_train_batches"] == 5 and config["trainer"]["max_epochs"] == 2


def test_switches_drop_configured_callbacks(tmp_path):
    config = composed(tmp_path, "trainer.enable_checkpointing=false", "logger=none",
                      "trainer.enable_progress_bar=false")
    assert config["logger"] is None and config["trainer"]["logger"] is False
    trainer = build_trainer(config, build_callbacks(config))
    dropped = (cbs.ModelCheckpoint, cbs.TensorBoardLogger, cbs.LearningRateMonitor, cbs.ThroughputMonitor,
               cbs.ProgressBar)
    assert not [cb for cb in trainer.callbacks if isinstance(cb, dropped)]
    assert any(isinstance(cb, cbs.EarlyStopping) for cb in trainer.callbacks)
    config = composed(tmp_path, "callbacks.early_stopping=null")
    assert not any(isinstance(cb, cbs.EarlyStopping) for cb in build_callbacks(config))


# ---- mistakes fail before any work, naming the key and the close valid names ----------------------------------
def _composition_error(tmp_path, *overrides: str) -> str:
    with pytest.raises(Exception) as info:
        composed(tmp_path, *overrides)
    return str(explain(info.value))


def test_typo_in_a_trainer_key_suggests_the_valid_name(tmp_path):
    message = _composition_error(tmp_path, "trainer.max_epoch=3")
    assert "Unknown config key 'trainer.max_epoch'" in message
    assert "did you mean trainer.max_epochs (int or null)" in message
    lines = f"MisconfigurationError: {message}".splitlines()  # as the command prints it: 3 lines of 120 columns
    assert len(lines) <= 3 and all(len(line) <= 120 for line in lines), message
    assert "+trainer.max_epoch" not in message  # a near miss is a typo, not a key to add
    message = _composition_error(tmp_path, "callbacks.model_checkpoint.zzz=3")  # nothing close: a few keys, listed
    assert "+callbacks.model_checkpoint.zzz=VALUE adds a key" in message and "did you mean" not in message
    lines = f"MisconfigurationError: {message}".splitlines()
    assert len(lines) <= 3 and all(len(line) <= 120 for line in lines), message


def test_an_unparsable_override_names_its_key(tmp_path):
    message = _composition_error(tmp_path, "trainer.max_epochs=[1,")
    assert message.startswith("Config value trainer.max_epochs='[1,' cannot be parsed: ")
    assert "'trainer.max_epochs=\"[1,\"'" in message  # how to quote it


def test_wrong_type_names_the_key_and_the_expected_type(tmp_path):
    message = _composition_error(tmp_path, "trainer.max_epochs=abc")
    assert "trainer.max_epochs='abc' is not valid: expected int or null" in message
    message = _composition_error(tmp_path, "callbacks.model_checkpoint.save_last=maybe")
    assert "callbacks.model_checkpoint.save_last='maybe'" in message and "expected bool" in message


def test_unknown_option_of_a_group_suggests_one(tmp_path):
    message = _composition_error(tmp_path, "trainer=gpuu")
    assert "There is no config 'trainer/gpuu'" in message and "did you mean trainer=gpu" in message


def test_added_keys_and_unschemed_nodes_are_checked_against_the_target(tmp_path):
    config = composed(tmp_path, "+trainer.max_epoch=3")  # `+` slips past the schema, not past check_targets
    with pytest.raises(MisconfigurationError, match=r"(?s)'trainer.max_epoch'.*did you mean trainer.max_epochs"):
        check_targets(config)
    config = composed(tmp_path, "+task.chanels=8")
    with pytest.raises(MisconfigurationError, match=r"(?s)DigitsTask takes no argument 'chanels'.*did you mean task.channels"):
        check_targets(config)
    config = composed(tmp_path, "task.channels=abc")
    with pytest.raises(MisconfigurationError, match=r"task.channels='abc' is not valid: .*DigitsTask expects int"):
        check_targets(config)
    check_targets(composed(tmp_path, "task.dropout=0", "trainer.limit_train_batches=3"))  # int for float: fine
    with pytest.raises(MisconfigurationError, match=r"trainer.limit_train_batches=True .*expects int or float"):
        check_targets(composed(tmp_path, "trainer.limit_train_batches=true"))


def test_a_target_that_cannot_be_imported_names_the_module(tmp_path, monkeypatch):
    with pytest.raises(MisconfigurationError, match=r"(?s)task._target_='nopkg_xyz.MyTask': no module named 'nopkg_xyz'"
                                                     r".*HINT: check the spelling, and that the package is installed"):
        check_targets(composed(tmp_path, "task._target_=nopkg_xyz.MyTask"))
    with pytest.raises(MisconfigurationError, match=r"(?s)'taskfit.examples.digits' has no attribute 'DigitTask'.*"
                                                     r"did you mean taskfit.examples.digits.DigitsTask"):
        check_targets(composed(tmp_path, "task._target_=taskfit.examples.digits.DigitTask"))
    (tmp_path / "broken_mod_xyz.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MisconfigurationError, match=r"(?s)importing module 'broken_mod_xyz' failed: No module named "
                                                     r"'not_installed_dependency_xyz'.*install the missing package"):
        locate("broken_mod_xyz.Task", "task")


def test_a_user_task_from_a_package_outside_taskfit(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "user_package"))
    config = composed(tmp_path, "task._target_=mypkg.digits.BatchNormDigits", "task.channels=8")
    check_targets(config)
    task = instantiate(config["task"], _convert_="all")
    assert type(task).__module__ == "mypkg.digits"
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in task.modules()) and task.hparams["channels"] == 8
    sys.modules.pop("mypkg.digits", None), sys.modules.pop("mypkg", None)


def test_a_users_config_dir_adds_options(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "user_package"))
    search = f"hydra.searchpath=[file://{ROOT / 'examples' / 'user_package' / 'configs'}]"
    config = composed(tmp_path, search, "experiment=sine_wide")
    assert config["name"] == "sine_wide" and config["task"]["_target_"] == "mypkg.sine.SineTask"
    assert config["task"]["layers"] == 3 and config["callbacks"]["model_checkpoint"]["monitor"] == "val/mae"
    check_targets(config)
    trainer = build_trainer(config, build_callbacks(config))
    assert trainer.max_epochs == 20
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        sys.modules.pop(name)


# ---- the command in this process: --help and --cfg job run nothing ------------------------------------------
@pytest.fixture
def command(tmp_path, monkeypatch):
    """Call trainer.cli.main in this process (its environment, argv and sys.path changes are undone after)."""
    from hydra.core.global_hydra import GlobalHydra
    from taskfit.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setattr(sys, "argv", ["taskfit"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield main
    GlobalHydra.instance().clear()


def test_help_lists_the_groups(command, capsys):
    with pytest.raises(SystemExit) as info:
        command(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for line in ("task: diabetes, digits, sequence", "trainer: cpu, ddp, default, dp, gpu",
                 "debug: fast_dev_run, limit, overfit", "logger: csv, mlflow, none, tensorboard",
                 "experiment: digits_fast, digits_sweep, sequence"):
        assert line in out


def test_cfg_job_prints_the_composed_config(command, capsys, tmp_path):
    import yaml

    command(["--cfg", "job", "trainer.max_epochs=7", "experiment=digits_fast"])
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["trainer"]["max_epochs"] == 7 and shown["task"]["channels"] == 16
    assert shown["name"] == "digits_fast" and shown["callbacks"]["model_checkpoint"]["monitor"] == "val/acc"
    assert not list(tmp_path.iterdir())  # printing the config runs nothing


def test_command_errors_are_one_clear_message(command, capsys):
    with pytest.raises(SystemExit) as info:
        command(["trainer=gpuu"])
    assert info.value.code == 1
    assert "MisconfigurationError: There is no config 'trainer/gpuu'" in capsys.readouterr().err


# ---- ckpt_path=last: the newest run of the same name ----------------------------------------------------------
def test_find_last_checkpoint_picks_the_newest_run_of_the_name(tmp_path):
    def make(rel: str, age: float) -> Path:
        path = tmp_path / "digits" / rel / "version_0" / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        stamp = time.time() - age
        os.utime(path, (stamp, stamp))
        return path

    old = make("runs/2024-01-01_00-00-00_000000", age=300)
    swept = make("multiruns/2024-01-02_00-00-00_000000/1", age=100)
    assert find_last_checkpoint(str(tmp_path), "digits") == str(swept)
    newest = make("runs/2024-01-03_00-00-00_000000", age=10)
    assert find_last_checkpoint(str(tmp_path), "digits") == str(newest)
    assert find_last_checkpoint(str(tmp_path), "digits", exclude=str(newest.parents[2])) == str(swept)
    assert old.exists()
    with pytest.raises(CheckpointError, match=r"ckpt_path=last found no last.ckpt in the runs named 'other'"):
        find_last_checkpoint(str(tmp_path), "other")


# ---- sweeps: the keys a sweep varies, job names, HParams' hyperparameters ------------------------------------
def test_swept_keys_job_names_and_hparams_of_a_run(tmp_path):
    from taskfit.cli.sweep import hparams_of, run_name, swept_keys

    raw = ["task.optimizer.lr=0.1,0.01", "trainer.max_epochs=2", "task=digits", "task.channels=range(16,33,16)"]
    assert swept_keys(raw, {"task.hidden": "64,128", "seed": "3"}) == ["task.optimizer.lr", "task.channels",
                                                                      "task.hidden"]
    job = ["task.optimizer.lr=0.1", "trainer.max_epochs=2", "task.channels=16",
           "callbacks.model_checkpoint.monitor=val/acc", "+model.lr=3"]
    assert run_name(job, ["task.optimizer.lr", "task.channels"]) == "lr=0.1,channels=16"
    assert run_name(job, ["task.optimizer.lr", "model.lr"]) == "task.optimizer.lr=0.1,model.lr=3"  # same last part
    assert run_name(job, ["callbacks.model_checkpoint.monitor"]) == "monitor=val-acc"  # a folder name, no "/"

    config = composed(tmp_path, "task.optimizer.lr=0.1", "trainer.max_epochs=2", "callbacks.early_stopping.patience=9",
                      "experiment=digits_fast")
    hparams = hparams_of(config, ["task.optimizer.lr=0.1", "trainer.max_epochs=2",
                                  "callbacks.early_stopping.patience=9", "experiment=digits_fast", "~task.scheduler"],
                         {"experiment": "digits_fast", "task": "digits"})
    assert hparams["task.optimizer.lr"] == 0.1 and hparams["task.optimizer"] == "AdamW"
    assert hparams["task.channels"] == 16 and hparams["task.scheduler"] == "CosineAnnealingLR"
    assert hparams["trainer.max_epochs"] == 2 and hparams["trainer.precision"] == "32" and hparams["trainer.seed"] == 0
    assert hparams["callbacks.early_stopping.patience"] == 9 and hparams["experiment"] == "digits_fast"
    assert not [k for k in hparams if "_target_" in k or "_partial_" in k or k.startswith(("paths.", "hydra"))]
    assert "callbacks.model_checkpoint.monitor" not in hparams  # set by the preset, not the command line
