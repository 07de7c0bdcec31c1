"""The real `taskfit` command in a subprocess: overrides reach the Trainer, typos fail with a
suggestion, sweeps, presets, resuming with ckpt_path=last, a user's package and configs, ddp (spawn
and torchrun), a wheel install."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
# Tiny runs: 2 training batches, 1 validation batch, no model summary.
TINY = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    for key in ("TASKFIT_SEED", "HYDRA_FULL_ERROR", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    return env


def _command() -> list[str]:
    """The installed console script when it runs this checkout (pip install -e .), else `python -m
    taskfit`."""
    script = shutil.which("taskfit")
    return [script] if script else [sys.executable, "-m", "taskfit"]


def taskfit(
    *args: str,
    cwd: Path,
    timeout: int = 300,
    expect: int = 0,
    command: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [*(command or _command()), *args],
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == expect, (
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    return result


def run_dirs(root: Path, name: str) -> list[Path]:
    return sorted((root / "logs" / name / "runs").iterdir())


def read_events(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    run.Reload()
    return run


def start_hparams(path: Path) -> dict:
    """The hyperparameters of the HParams session a TensorBoard run directory holds."""
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    for raw in read_events(path).PluginTagToContent("hparams").values():
        data = HParamsPluginData.FromString(raw)
        if data.HasField("session_start_info"):
            values = data.session_start_info.hparams
            return {
                k: v.number_value
                if v.HasField("number_value")
                else v.string_value
                if v.HasField("string_value")
                else v.bool_value
                for k, v in values.items()
            }
    raise AssertionError(f"no HParams session start in {path}")


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


# ---- the command line ----------------------------------------------------------------------------
def test_a_typo_fails_before_training_with_the_close_valid_name(tmp_path):
    result = taskfit("trainer.max_epoch=3", cwd=tmp_path, expect=1)
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "MisconfigurationError: Unknown config key 'trainer.max_epoch'."
    # the best match first
    assert lines[1].startswith("  HINT: did you mean trainer.max_epochs (int or null)")
    # Issue 38: 3 short lines (the Trainer's 36 keys on request), and no `+key` advice for a typo.
    assert len(lines) <= 3 and all(len(line) <= 120 for line in lines), result.stderr
    assert (
        "`taskfit --cfg job -p trainer`" in lines[2] and "+trainer.max_epoch" not in result.stderr
    )
    # it failed while composing: no run directory, nothing trained
    assert not (tmp_path / "logs").exists()


def test_a_target_that_fails_after_composition_leaves_no_run_directory(tmp_path):
    result = taskfit("task._target_=nope.Task", cwd=tmp_path, expect=1)
    assert "no module named 'nope' can be imported" in result.stderr
    # Hydra had created the run directory: it is removed
    assert not (tmp_path / "logs" / "digits").exists()


def test_overrides_reach_the_trainer_config_checkpoint_and_hparams_then_ckpt_path_last_resumes(
    tmp_path,
):
    common = [
        "debug=limit",
        "trainer.limit_train_batches=3",
        "task.scheduler=null",
        "task.channels=8",
        "task.hidden=16",
        "trainer.enable_model_summary=false",
    ]
    first = taskfit(*common, "trainer.max_epochs=1", "task.optimizer.lr=0.02", cwd=tmp_path).stdout
    (run,) = run_dirs(tmp_path, "debug_digits")
    assert f"run directory:   {run}" in first and "best checkpoint: " in first and "test:" in first
    # the resolved config, in the run directory
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["task"]["optimizer"]["lr"] == 0.02 and config["trainer"][
        "default_root_dir"
    ] == str(run)
    assert (run / ".hydra" / "overrides.yaml").is_file()
    # the Trainer ran 1 epoch of 3 batches
    last = load_ckpt(run / "version_0" / "checkpoints" / "last.ckpt")
    assert last["loop"]["state"]["global_step"] == 3 and last["config"] == config
    best = [p for p in (run / "version_0" / "checkpoints").glob("*.ckpt") if p.name != "last.ckpt"]
    assert best and str(best[0]) in first and load_ckpt(best[0])["config"] == config
    hparams = start_hparams(run / "version_0")
    assert (
        hparams["task.optimizer.lr"] == pytest.approx(0.02) and hparams["trainer.max_epochs"] == 1
    )

    out = taskfit(
        *common,
        "trainer.max_epochs=2",
        "task.optimizer.lr=0.02",
        "ckpt_path=last",
        "test=false",
        cwd=tmp_path,
    ).stdout
    # this command's config and log...
    resumed = next(d for d in run_dirs(tmp_path, "debug_digits") if d != run)
    # ...its run: run's
    assert not (resumed / "version_0").exists() and f"TensorBoard:     {run / 'version_0'}" in out
    state = load_ckpt(run / "version_0" / "checkpoints" / "last.ckpt")["loop"]["state"]
    assert state["global_step"] == 6
    steps = [e.step for e in read_events(run / "version_0").Scalars("train/loss")]
    # logged at Lightning's step (the batches that stepped before: 3, 4, 5 for steps 4 to 6)
    assert steps[-3:] == [3, 4, 5] and steps == sorted(set(steps)), (
        "the resumed run did not continue"
    )


def test_multirun_with_an_experiment_makes_one_run_per_value_and_a_summary(tmp_path):
    out = taskfit(
        "-m",
        "experiment=digits_fast",
        "task.optimizer.lr=0.05,0.001",
        *TINY,
        "test=false",
        cwd=tmp_path,
    ).stdout
    (sweep,) = (tmp_path / "logs" / "digits_fast" / "multiruns").iterdir()
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    # the values the sweep varies name the jobs
    assert [j.name for j in jobs] == ["0_lr=0.05", "1_lr=0.001"]
    rates = []
    for job in jobs:
        assert list((job / "version_0").glob("events.out.tfevents.*"))
        hparams = start_hparams(job / "version_0")
        # HParams: the task's arguments and what the command line set (a group by its option), no
        # callback internals
        assert hparams["task.channels"] == 16 and hparams["experiment"] == "digits_fast"
        assert hparams["trainer.max_epochs"] == 1 and hparams["task.optimizer"] == "AdamW"
        assert not [k for k in hparams if k.startswith("callbacks.") or "_target_" in k]
        rates.append(hparams["task.optimizer.lr"])
    assert rates == pytest.approx([0.05, 0.001])
    summary = yaml.safe_load((sweep / "sweep_summary.yaml").read_text())
    assert [j["overrides"][1] for j in summary["jobs"]] == [
        "task.optimizer.lr=0.05",
        "task.optimizer.lr=0.001",
    ]
    assert all(
        j["monitor"] == "val/acc" and j["mode"] == "max" and 0 <= j["score"] <= 1
        for j in summary["jobs"]
    )
    best = max(summary["jobs"], key=lambda j: j["score"])
    assert summary["best_job"] == best["job"]
    assert "Sweep summary: 2 job(s)" in out and "task.optimizer.lr=0.001" in out


def test_a_users_package_and_config_dir(tmp_path):
    project = tmp_path / "project"
    shutil.copytree(
        ROOT / "examples" / "user_package", project, ignore=shutil.ignore_patterns("__pycache__")
    )
    out = taskfit("--config-dir", "configs", "task=sine", "debug=fast_dev_run", cwd=project).stdout
    (run,) = run_dirs(project, "debug_sine")
    assert (
        yaml.safe_load((run / "config.yaml").read_text())["task"]["_target_"]
        == "mypkg.sine.SineTask"
    )
    assert "test/mae=" in out  # SineTask's own metric, on its own test data


# ---- ddp: every rank shares the launching run's directory ----------------------------------------
def _single_run(root: Path, name: str) -> Path:
    (run,) = run_dirs(root, name)
    assert sorted(p.name for p in run.iterdir()) == [
        ".hydra",
        "config.yaml",
        "taskfit.log",
        "version_0",
    ]
    assert sorted(
        p.name for p in (root / "logs").rglob("config.yaml") if p.parent.name != ".hydra"
    ) == ["config.yaml"]
    assert len(list(run.rglob("events.out.tfevents.*"))) == 1
    return run


def test_ddp_spawn_through_the_command_on_cpu(tmp_path):
    taskfit(
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        *TINY,
        "test=false",
        cwd=tmp_path,
    )
    run = _single_run(tmp_path, "digits")
    last = load_ckpt(run / "version_0" / "checkpoints" / "last.ckpt")
    assert last["data"]["world_size"] == 2 and last["config"]["trainer"]["devices"] == 2
    # the spawned rank 0 appended its lines to the command's log
    log = (run / "taskfit.log").read_text()
    assert (
        "][taskfit.progress][INFO] - Epoch 0/0: 100%" in log
        and "][taskfit.cli][INFO] - taskfit: done" in log
    )


def test_ddp_torchrun_ranks_share_rank0s_run_directory(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "taskfit"]
    taskfit(
        "trainer=ddp", "trainer.accelerator=cpu", *TINY, "test=false", cwd=tmp_path, command=command
    )
    run = _single_run(tmp_path, "digits")
    assert load_ckpt(run / "version_0" / "checkpoints" / "last.ckpt")["data"]["world_size"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]  # rank 1 wrote nothing of its own


# ---- the configs ship with the package -----------------------------------------------------------
def test_a_non_editable_install_runs_from_another_directory(tmp_path):
    source, site, work = tmp_path / "src", tmp_path / "site", tmp_path / "work"
    for name in ("trainer", "callbacks", "examples", "conf"):
        shutil.copytree(
            ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "user_package")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [
            *pip,
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    (wheel,) = (tmp_path / "dist").glob("taskfit-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True, timeout=180)
    shutil.rmtree(source)  # nothing may come from the source tree any more
    work.mkdir()
    env = _env()
    env["PYTHONPATH"] = str(site)
    with zipfile.ZipFile(wheel) as archive:  # one import name: nothing else lands in site-packages
        top = {
            name.split("/")[0]
            for name in archive.namelist()
            if not name.split("/")[0].endswith(".dist-info")
        }
    assert top == {"taskfit"}
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == [
        "bin",
        "taskfit",
    ]
    where = subprocess.run(
        [sys.executable, "-c", "import taskfit.cli.app as c; print(c.__file__, c._config_path())"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert where == [str(site / "taskfit" / "cli" / "app.py"), "pkg://taskfit.conf"]
    out = taskfit(
        "debug=fast_dev_run",
        "test=false",
        "trainer.enable_model_summary=false",
        cwd=work,
        command=[str(site / "bin" / "taskfit")],
        env=env,
    ).stdout
    (run,) = run_dirs(work, "debug_digits")
    assert f"run directory:   {run}" in out and (run / ".hydra" / "config.yaml").is_file()


# ---- bad input: one error naming the key and what it takes, exit 1, no run directory -------------
@pytest.mark.parametrize("args, message", [
    (["+ckpt_pth=last"], r"MisconfigurationError: Unknown config key 'ckpt_pth' at the root of the "
                         r"config: taskfit does not read it.*\n  HINT: did you mean ckpt_path\? "
                         r"Root keys: name, mode, ckpt_path"),
    (["ckpt_pth=last"], r"MisconfigurationError: Unknown config key 'ckpt_pth'\.\n  HINT: did you "
                        r"mean ckpt_path\?"),
    (["task.batch_size=-4"], r"MisconfigurationError: Config value task\.batch_size=-4 is not "
                             r"valid: ValueError: batch_size should be a positive integer value, "
                             r"but got batch_size=-4 \(raised from train_dataloader\(\) in "
                             r"digits\.py"),
    (["task.optimizer.lr=fast"], r"MisconfigurationError: Config value task\.optimizer\.lr='fast' "
                                 r"is not valid: torch\.optim\.AdamW expects float or Tensor\."),
    (["task=null"], r"MisconfigurationError: task=null: 'task' is a config group, which takes the "
                    r"name of one of its options, not null\.\n  HINT: use one of task=diabetes, "
                    r"task=digits, task=sequence"),
    (["--config-dir", "mine", "task=broken"], r"MisconfigurationError: The config file "
                                              r".*mine/task/broken\.yaml is not valid YAML: while "
                                              r"parsing a flow sequence: expected ',' or '\]', but "
                                              r"got ':' \(.*broken\.yaml, line 3, column 7\)"),
    (["ckpt_path=/nonexistent"], r"CheckpointError: ckpt_path=/nonexistent: there is no checkpoint "
                                 r"there \(no such file or directory\)\.\n  HINT: ckpt_path takes "
                                 r"null \(a fresh run\), last"),
    # a root key of one's own, used
    (["+my_lr=0.01", "task.optimizer.lr=${my_lr}", "task._target_=nope.Task"],
     r"MisconfigurationError: task\._target_='nope\.Task': no module named 'nope'"),
])
def test_bad_input_is_one_error_naming_the_key_and_leaves_no_run_directory(tmp_path, args, message):
    (tmp_path / "mine" / "task").mkdir(parents=True)
    (tmp_path / "mine" / "task" / "broken.yaml").write_text(
        "_target_: taskfit.examples.digits.DigitsTask\nchannels: [8\nhidden: 16\n")
    result = taskfit(*args, *TINY, cwd=tmp_path, expect=1)
    assert re.fullmatch(rf"(?s){message}.*", result.stderr), result.stderr
    # the error, its hint (a typo's: 2
    assert len(result.stderr.strip().splitlines()) in (2, 3), result.stderr
    # lines, the suggestion then the valid keys): no traceback
    assert not (tmp_path / "logs").exists()
