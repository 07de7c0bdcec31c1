"""WandbLogger, for real and offline: a fit next to a TensorBoardLogger writes a W&B offline run whose transaction log
(``run-<id>.wandb``, read here record by record into wandb's own protobuf ``Record``) holds the same keys, steps and
values as the TensorBoard event file, the hyperparameters as its config, the run's name, tags, the model artifact and
its exit code; a resumed fit continues the same run id; an exception and a SIGKILL mark the run; the `taskfit`
command with ``logger=wandb``; the install hint without wandb. Nothing reaches wandb.ai (``mode="offline"``)."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections import defaultdict
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")

from taskfit import MisconfigurationError, Trainer  # noqa: E402
from taskfit.callbacks import Callback, TensorBoardLogger, WandbLogger  # noqa: E402
from tasks import RegressionTask  # noqa: E402

QUIET = dict(enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    """W&B offline and silent, its caches and settings in the test's folder (never the user's ~/.config/wandb)."""
    for key in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for key, folder in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(key, str(tmp_path / ".wandb-home" / folder))


# ---- reading an offline run: W&B's transaction log (LevelDB's log format) of wandb's protobuf records ----------
def records(path: Path):
    """Every ``wandb_internal_pb2.Record`` of a ``run-<id>.wandb`` file, checksums verified."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailer
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, length, kind) == (0, 0, 0):  # zero padding up to the next block
            pos += block - pos % block
            continue
        if pos + 7 + length > len(data):  # the record W&B's service is writing now: not there yet
            break
        body = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at {pos} in {path}"
        pos += 7 + length
        chunks = body if kind in (1, 2) else chunks + body  # FULL/FIRST start a record, MIDDLE/LAST continue it
        if kind in (1, 4):  # FULL or LAST: complete
            yield wandb_internal_pb2.Record.FromString(chunks)
            chunks = b""


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


class OfflineRun:
    """What one offline run folder (``<dir>/wandb/offline-run-<time>-<id>``) holds."""

    def __init__(self, folder: Path) -> None:
        (log,) = folder.glob("run-*.wandb")
        self.folder, self.run, self.exit_code, self.artifacts = folder, None, None, []
        self.config, self.summary, self.history = {}, {}, []
        for record in records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
                self.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                self.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                self.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
            elif kind == "summary":
                self.summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
            elif kind == "artifact":
                self.artifacts.append(record.artifact)
            elif kind == "exit":
                self.exit_code = record.exit.exit_code

    def steps(self) -> dict[str, list[tuple[int, float]]]:
        """{key: [(trainer/global_step, value), ...]} of the logged values (W&B's own _keys left out)."""
        out: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for row in self.history:
            for key, value in row.items():
                if not key.startswith("_") and key != "trainer/global_step":
                    out[key].append((row["trainer/global_step"], value))
        return dict(out)


def closed_run(folder: Path) -> OfflineRun:
    """The run of ``folder`` once it holds its exit record: ``run.finish()`` returns before W&B's service has
    written the end of the log (waits up to 60 s)."""
    deadline = time.monotonic() + 60
    while (run := OfflineRun(folder)).exit_code is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return run


def offline_runs(save_dir: Path, closed: bool = True) -> list[OfflineRun]:
    """The offline runs below ``save_dir``, oldest first (``closed``: each once it holds its exit record)."""
    folders = sorted((save_dir / "wandb").glob("offline-run-*"))
    return [closed_run(f) if closed else OfflineRun(f) for f in folders]


def _subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child process, without the address of this process's W&B service (wandb sets
    WANDB_SERVICE when it starts one; a child would write its runs through it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)
    for key in ("WANDB_SERVICE", "TASKFIT_SEED", "HYDRA_FULL_ERROR", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    return env


def tensorboard_steps(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    run.Reload()
    # TensorBoard's own ~best/<key> (the HParams tab's best values) is not a published value
    return {tag: [(e.step, e.value) for e in run.Scalars(tag)] for tag in run.Tags()["scalars"]
            if not tag.startswith("~best/")}


def same_points(wandb_steps, tb_steps) -> None:
    assert sorted(wandb_steps) == sorted(tb_steps)
    for key, points in tb_steps.items():
        assert [s for s, _ in wandb_steps[key]] == [s for s, _ in points], key
        assert [v for _, v in wandb_steps[key]] == pytest.approx([v for _, v in points], rel=1e-6), key


# ---- the tests -----------------------------------------------------------------------------------------------------
def test_an_offline_run_reads_back_as_the_tensorboard_run_and_a_resume_continues_it(tmp_path):
    wb_dir = tmp_path / "wb"

    def fit(epochs, ckpt_path=None):
        logger = WandbLogger(offline=True, save_dir=str(wb_dir), project="demo", tags=["tiny"], log_model=True,
                             config={"dataset": "regression"})
        trainer = Trainer(max_epochs=epochs, log_every_n_steps=2, default_root_dir=str(tmp_path / "runs"),
                          logger=[TensorBoardLogger(), logger], **QUIET)
        trainer.fit(RegressionTask(n=32, val_n=16), ckpt_path=ckpt_path)
        return trainer, logger

    first, logger = fit(2)
    # as the process's exit would: the resume below is another process's, with a folder of its own
    logger.finish()
    (run,) = offline_runs(wb_dir)
    assert logger.run_id == run.run.run_id and logger.log_dir == str(run.folder)
    assert (run.run.project, run.run.display_name, list(run.run.tags)) == ("demo", "version_0", ["tiny"])
    tb = tensorboard_steps(first.log_dir)
    assert {"train/loss", "train/loss_epoch", "val/loss"} <= set(tb)
    same_points(run.steps(), tb)  # every key, step and value TensorBoard has, and nothing else
    # 32 samples / 8 per batch: 4 steps per epoch; validation at each epoch's last step (Lightning's: 3, 7)
    assert [s for s, _ in run.steps()["val/loss"]] == [3, 7]
    assert run.summary["val/loss"] == pytest.approx(first.state.metrics["val/loss"])
    hparams = dict(first.hparams)
    assert hparams and {k: run.config[k] for k in hparams} == hparams and run.config["dataset"] == "regression"
    assert run.exit_code == 0
    checkpoints = first.checkpoint_callback  # log_model=True: the best and the last file, versions of one artifact
    assert {(a.name, a.type) for a in run.artifacts} == {(f"model-{logger.run_id}", "model")}
    assert [[e.path for e in a.manifest.contents] for a in run.artifacts] == [
        [os.path.basename(checkpoints.best_model_path)], [os.path.basename(checkpoints.last_model_path)]]
    assert "best" in run.artifacts[0].aliases and "latest" in run.artifacts[-1].aliases

    second, resumed = fit(3, ckpt_path="last")  # one more epoch, in the same W&B run
    resumed.finish()
    assert second.log_dir == first.log_dir and resumed.run_id == logger.run_id
    runs = offline_runs(wb_dir)
    assert len(runs) == 2 and {r.run.run_id for r in runs} == {logger.run_id}  # offline: a folder per process
    later = next(r for r in runs if r.folder != run.folder)
    assert later.summary["taskfit.resumed_at"] == "7" and "taskfit.killed" not in later.summary
    assert [s for s, _ in later.steps()["train/loss"]] == [9, 11]
    merged = {k: run.steps().get(k, []) + later.steps().get(k, []) for k in tensorboard_steps(second.log_dir)}
    same_points(merged, tensorboard_steps(second.log_dir))  # what `wandb sync` uploads: TensorBoard's run
    assert later.exit_code == 0


def test_fit_test_validate_predict_and_a_resume_in_one_process_are_one_offline_run(tmp_path):
    wb, runs = tmp_path / "wb", tmp_path / "runs"

    def trainer(epochs, logger):
        return Trainer(max_epochs=epochs, log_every_n_steps=2, default_root_dir=str(runs),
                       logger=logger, **QUIET)

    logger = WandbLogger(offline=True, save_dir=str(wb))
    first, task = trainer(2, logger), RegressionTask(n=32, val_n=16)
    first.fit(task)
    first.test(task, task.val_dataloader())
    first.validate(task)
    first.predict(task, task.val_dataloader())
    # a new logger and Trainer, resumed from the checkpoint: the checkpoint's run
    resumed = WandbLogger(offline=True, save_dir=str(wb))
    trainer(3, resumed).fit(RegressionTask(n=32, val_n=16), ckpt_path="last")
    assert resumed.run_id == logger.run_id
    assert resumed.sync_lines() == [f"run {logger.run_id} (offline): {logger.log_dir}",
                                    f"sync it: wandb sync {logger.log_dir}"]
    resumed.finish()
    (run,) = offline_runs(wb)  # one folder, one id, closed once
    assert run.run.run_id == logger.run_id and run.exit_code == 0
    steps = run.steps()
    # fit, the validate after it, the resumed epoch (Lightning's steps: each epoch's last, the fit's count after)
    assert [s for s, _ in steps["val/loss"]] == [3, 7, 8, 11]
    assert [s for s, _ in steps["test/loss"]] == [8]
    assert [s for s, _ in steps["train/loss"]] == [1, 3, 5, 7, 9, 11]
    assert run.summary["taskfit.resumed_at"] == "7"


class Boom(Callback):
    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        if trainer.state.global_step == 3:
            raise ValueError("boom")


def test_an_exception_marks_the_run_failed(tmp_path):
    logger = WandbLogger(offline=True, save_dir=str(tmp_path))
    trainer = Trainer(max_epochs=2, log_every_n_steps=1, default_root_dir=str(tmp_path / "runs"), logger=logger,
                      callbacks=[Boom()], enable_checkpointing=False, **QUIET)
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(RegressionTask(n=32))
    (run,) = offline_runs(tmp_path)
    assert run.exit_code == 1  # W&B shows the run as failed
    assert [s for s, _ in run.steps()["train/loss"]] == [0, 1, 2]  # what was logged before the error is there
    assert json.loads((run.folder / "taskfit-status.json").read_text())["status"] == "failed"


_KILLED_FIT = """
import sys
sys.path.insert(0, {tests!r})
from taskfit import Trainer
from taskfit.callbacks import ModelCheckpoint, WandbLogger
from tasks import KillAt, RegressionTask


class KillAfterSaved(KillAt):  # SIGKILL at step 6, once the checkpoint of step 4 is on disk
    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        trainer.checkpoint_writer.wait()
        super().on_train_batch_end(trainer, task, outputs, batch, batch_idx)


trainer = Trainer(max_epochs=2, log_every_n_steps=1, default_root_dir={runs!r}, enable_progress_bar=False,
                  enable_model_summary=False, logger=WandbLogger(offline=True, save_dir={wb!r}),
                  callbacks=[ModelCheckpoint(min_epoch_interval=0), KillAfterSaved(6)])
trainer.fit(RegressionTask(n=32))
"""


def test_a_killed_run_is_marked_when_a_resume_continues_it(tmp_path):
    wb, runs = tmp_path / "wb", tmp_path / "runs"
    code = _KILLED_FIT.format(tests=str(Path(__file__).parent), runs=str(runs), wb=str(wb))
    killed = subprocess.run([sys.executable, "-c", code], env=_subprocess_env(), capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (first,) = offline_runs(wb, closed=False)
    assert first.exit_code is None  # nobody closed it (W&B flushes its log every 15 s: SIGKILL lost the rest)
    killed_id = first.folder.name.rsplit("-", 1)[1]  # offline-run-<time>-<id>

    logger = WandbLogger(offline=True, save_dir=str(wb))
    trainer = Trainer(max_epochs=2, log_every_n_steps=1, default_root_dir=str(runs), logger=logger, **QUIET)
    trainer.fit(RegressionTask(n=32), ckpt_path="last")  # the checkpoint of epoch 0: step 4
    assert logger.run_id == killed_id
    logger.finish()
    later = closed_run(next(f for f in (wb / "wandb").glob("offline-run-*") if f != first.folder))
    assert "died without closing the run" in later.summary["taskfit.killed"]
    assert later.summary["taskfit.resumed_at"] == "3" and later.exit_code == 0
    assert [s for s, _ in later.steps()["train/loss"]] == [4, 5, 6, 7]


def test_the_taskfit_command_logs_to_wandb(tmp_path):
    env = _subprocess_env(WANDB_MODE="offline")
    args = ["logger=[tensorboard,wandb]", "task=diabetes", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
            "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0",
            "trainer.enable_model_summary=false"]
    result = subprocess.run([sys.executable, "-m", "taskfit", *args], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    (version,) = (tmp_path / "logs" / "diabetes" / "runs").glob("*/version_0")
    (run,) = offline_runs(version)  # the default save_dir: the run directory
    assert run.run.project == "diabetes" and run.run.display_name.endswith("/version_0")
    # fit + test: one run
    assert run.steps()["train/loss"] and run.steps()["test/loss"] and run.exit_code == 0
    # the report names the run and its sync command
    report = result.stdout[result.stdout.index("taskfit: done"):]
    assert f"W&B:             run {run.run.run_id} (offline): {run.folder}" in report
    assert f"sync it: wandb sync {run.folder}" in report
    # the HParams tab's hyperparameters (the task's arguments, the keys the command line set, the trainer settings
    # that change results), not the whole config
    from test_cli import start_hparams

    shown = start_hparams(version)
    assert {"task.lr", "trainer.max_epochs"} <= set(shown) and "trainer.callbacks" not in run.config
    assert {k: v for k, v in run.config.items() if k != "_wandb"} == pytest.approx(shown)
    # TensorBoard keeps the test values for its HParams tab, as ~test/<key>
    tb = {k.removeprefix("~"): v for k, v in tensorboard_steps(str(version)).items()}
    same_points(run.steps(), tb)


def test_without_wandb_the_logger_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(MisconfigurationError, match="WandbLogger needs Weights & Biases") as info:
        WandbLogger()
    assert 'pip install "taskfit[wandb]"' in info.value.hint


def test_lightning_arguments_it_does_not_take_are_refused():
    with pytest.raises(MisconfigurationError, match=r"WandbLogger\(log_model='all'\) is not supported"):
        WandbLogger(log_model="all")
    with pytest.raises(MisconfigurationError, match="an argument of Lightning's WandbLogger"):
        WandbLogger(anonymous=True)
    logger = WandbLogger("run-a", "out", "abc123", True, project="p")  # positional, as Lightning allows
    assert (logger.run_name, logger.save_dir, logger.run_id, logger.offline) == ("run-a", os.path.abspath("out"),
                                                                                  "abc123", True)


def test_import_taskfit_does_not_import_wandb():
    code = "import sys, taskfit, taskfit.callbacks; assert 'wandb' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
