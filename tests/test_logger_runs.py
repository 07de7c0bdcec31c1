"""Where a logger's run goes and how it continues: Lightning's constructor arguments (save_dir,
name, version, prefix...), the catalogued error for the ones taskfit does not take,
LearningRateMonitor over two optimizers, and a fit killed with SIGKILL then resumed: the same run
directory, TensorBoard's redone steps hidden (read back with its reader), no duplicate CSV rows, the
same MLflow run (its killed state recorded, no step sent twice)."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from taskfit import MisconfigurationError, Trainer
from taskfit.callbacks import (
    CSVLogger,
    LearningRateMonitor,
    MLFlowLogger,
    ProgressBar,
    TensorBoardLogger,
    ThroughputMonitor,
)
from tasks import RegressionTask

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def read_run(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = EventAccumulator(str(path), size_guidance={"scalars": 0})
    run.Reload()
    return run


# ---- Lightning's arguments and the run directory -------------------------------------------------
def test_the_run_directory_follows_the_first_logger_as_in_lightning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = RegressionTask(n=16)
    first = Trainer(max_epochs=1, logger=CSVLogger("logs", name="exp"), enable_checkpointing=True,
                    enable_progress_bar=False, enable_model_summary=False)
    first.fit(task)
    assert first.log_dir == str(tmp_path / "logs" / "exp" / "version_0") == first.logger.log_dir
    assert (Path(first.log_dir) / "metrics.csv").is_file() and (
        Path(first.log_dir) / "checkpoints"
    ).is_dir()
    assert (first.logger.save_dir, first.logger.name, first.logger.version) == (
        str(tmp_path / "logs"),
        "exp",
        0,
    )
    assert first.logger.root_dir == str(tmp_path / "logs" / "exp")
    second = Trainer(max_epochs=1, logger=CSVLogger("logs", name="exp"), **QUIET)
    second.fit(task)
    assert Path(second.log_dir).name == "version_1"  # the next free version, as Lightning counts

    tb = TensorBoardLogger(str(tmp_path / "tb"), "exp", 3)  # positional, as Lightning allows
    # a second logger with a directory of its own
    own = CSVLogger(str(tmp_path / "csv"), version="a")
    third = Trainer(
        max_epochs=1, logger=[tb, own], default_root_dir=str(tmp_path / "unused"), **QUIET
    )
    third.fit(task)
    assert third.log_dir == str(tmp_path / "tb" / "exp" / "version_3") == tb.log_dir
    assert list(Path(third.log_dir).glob("events.out.tfevents.*")) and own.log_dir == str(
        tmp_path / "csv" / "a"
    )
    assert (tmp_path / "csv" / "a" / "metrics.csv").is_file() and not (tmp_path / "unused").exists()

    flat = Trainer(
        max_epochs=1, logger=TensorBoardLogger(str(tmp_path / "flat"), version=""), **QUIET
    )
    flat.fit(task)
    assert flat.log_dir == str(tmp_path / "flat")  # version="": the folder itself
    plain = Trainer(
        max_epochs=1, logger=CSVLogger(), default_root_dir=str(tmp_path / "root"), **QUIET
    )
    plain.fit(task)
    # nothing given: default_root_dir, as before
    assert plain.log_dir == str(tmp_path / "root" / "version_0")


def test_lightning_arguments_taskfit_does_not_take_get_the_catalogued_error():
    cases = [
        (
            lambda: TensorBoardLogger("logs", purge_step=3),
            "TensorBoardLogger",
            "purge_step",
            "purges the steps it redoes",
        ),
        (lambda: MLFlowLogger(synchronous=True), "MLFlowLogger", "synchronous", "in batches"),
        (
            lambda: MLFlowLogger(checkpoint_path_prefix="x"),
            "MLFlowLogger",
            "checkpoint_path_prefix",
            "checkpoints/ artifacts",
        ),
        (
            lambda: ThroughputMonitor(batch_size_fn=len),
            "ThroughputMonitor",
            "batch_size_fn",
            "batch_size",
        ),
        (
            lambda: ProgressBar(refresh_rate=10),
            "ProgressBar",
            "refresh_rate",
            "enable_progress_bar=False",
        ),
    ]
    for build, cls, arg, hint in cases:
        if cls == "MLFlowLogger":
            pytest.importorskip("mlflow")
        with pytest.raises(MisconfigurationError, match=rf"{cls}\({arg}=\.\.\.\) is an argument of "
                                                        rf"Lightning's {cls}[\s\S]*HINT: remove "
                                                        rf"it: .*{hint}"):
            build()
    with pytest.raises(MisconfigurationError, match=r"CSVLogger\(\) got an unknown argument "
                                                    r"'save_dr'[\s\S]*did you mean save_dir\?"):
        CSVLogger(save_dr="logs")
    with pytest.raises(MisconfigurationError, match=r"CSVLogger\(\) takes at most 5 positional "
                                                    r"arguments"):
        CSVLogger("logs", "exp", 0, "", 100, "extra")
    with pytest.raises(MisconfigurationError, match=r"CSVLogger\(version=-1\) is not valid"):
        CSVLogger(version=-1)
    with pytest.raises(
        MisconfigurationError, match=r"LearningRateMonitor\(logging_interval='batch'\) is not valid"
    ):
        LearningRateMonitor(logging_interval="batch")


def test_prefix_goes_before_every_key(tmp_path):
    logger = CSVLogger(str(tmp_path), prefix="fold1")
    trainer = Trainer(max_epochs=1, log_every_n_steps=1, logger=logger, **QUIET)
    trainer.fit(RegressionTask(n=16, val_n=8))
    header = list(rows(Path(trainer.log_dir) / "metrics.csv")[0])
    assert (
        header[:2] == ["step", "epoch"]
        and "fold1-train/loss" in header
        and "fold1-val/loss" in header
    )
    assert all(key.startswith("fold1-") for key in header[2:])
    # the prefix is the logger's: published names are unchanged
    assert "train/loss" in trainer.state.metrics


# ---- LearningRateMonitor: every optimizer --------------------------------------------------------
class TwoOptimizers(RegressionTask):
    """Manual optimization with an SGD (a step scheduler) and an Adam over two param groups (an
    epoch scheduler)."""

    automatic_optimization = False

    def __init__(self) -> None:
        super().__init__(n=32)
        self.head = torch.nn.Linear(4, 1)

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        adam = torch.optim.Adam(
            [{"params": [self.head.weight], "name": "weights"}, {"params": [self.head.bias]}],
            lr=0.01,
        )
        return [
            {
                "optimizer": sgd,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.StepLR(sgd, 2, 0.5),
                    "interval": "step",
                },
            },
            {"optimizer": adam, "lr_scheduler": torch.optim.lr_scheduler.StepLR(adam, 1, 0.1)},
        ]

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        sgd, adam = self.optimizers()
        for optimizer, model in ((sgd, self.net), (adam, self.head)):
            loss = torch.nn.functional.mse_loss(model(inputs).squeeze(-1), targets)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        step_sched, epoch_sched = self.lr_schedulers()
        step_sched.step()
        if self.trainer.state.batches_done + 1 == 4:  # an epoch's last batch (32 samples / 8)
            epoch_sched.step()
        return loss


def test_lr_monitor_logs_every_optimizer_at_its_schedulers_interval(tmp_path):
    # logging_interval=None: Lightning's
    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    trainer = Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        default_root_dir=str(tmp_path),
        callbacks=[monitor],
        logger=CSVLogger(),
        **QUIET,
    )
    trainer.fit(TwoOptimizers())
    table = rows(Path(trainer.log_dir) / "metrics.csv")

    def logged(key):
        return [(int(r["step"]), float(r[key])) for r in table if r.get(key)]

    # SGD's scheduler steps per step: at every log interval; Adam's per epoch: at every epoch start.
    # As Lightning's, the interval and the step count batches under manual optimization (4 per
    # epoch), not the 8 optimizer steps Lightning's names: one group is lr-SGD, two are
    # lr-Adam/<"name"> and lr-Adam/pg2 (counted from 1)
    assert [s for s, _ in logged("lr-SGD")] == [s for s, _ in logged("train/loss")] == [1, 3, 5, 7]
    assert logged("lr-Adam/weights") == [(0, pytest.approx(0.01)), (4, pytest.approx(0.001))]
    assert logged("lr-Adam/pg2") == logged("lr-Adam/weights")  # both groups of the second optimizer
    assert {v for _, v in logged("lr-SGD-weight_decay")} == {0.01}
    assert {v for _, v in logged("lr-SGD-momentum")} == {0.9} and logged("lr-Adam/pg2-momentum")
    # and Lightning's attributes: every rate logged, the last momentum and weight decay
    assert list(monitor.lrs) == ["lr-SGD", "lr-Adam/weights", "lr-Adam/pg2"]
    assert monitor.lrs["lr-SGD"] == [v for _, v in logged("lr-SGD")]
    assert monitor.last_momentum_values == {"lr-SGD-momentum": 0.9, "lr-Adam/weights-momentum": 0.9,
                                            "lr-Adam/pg2-momentum": 0.9}
    assert monitor.last_weight_decay_values["lr-SGD-weight_decay"] == 0.01
    # monitor="lr-SGD" can rank checkpoints, as in Lightning
    assert "lr-SGD" in trainer.callback_metrics


def test_a_lr_monitor_without_a_logger_is_refused_and_the_built_in_one_keeps_the_vitals_names(
    tmp_path,
):
    with pytest.raises(MisconfigurationError, match=r"LearningRateMonitor\(\) was added to a "
                                                    r"Trainer without a logger"):
        Trainer(max_epochs=1, logger=False, callbacks=[LearningRateMonitor()], **QUIET).fit(
            RegressionTask(n=16)
        )
    trainer = Trainer(
        max_epochs=1,
        log_every_n_steps=1,
        default_root_dir=str(tmp_path),
        logger=CSVLogger(),
        **QUIET,
    )
    trainer.fit(RegressionTask(n=16))
    header = (Path(trainer.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "vitals/lr/SGD/pg0" in header and not any(name.startswith("lr-") for name in header)


# ---- resume: the same run, nothing twice ---------------------------------------------------------
def logged_run(root: Path, uri: str, what: str) -> subprocess.CompletedProcess:
    """tests/logger_resume_script.py in a process of its own: killed at global step ``what``, or
    ``"resume"``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("logger_resume_script.py")),
            str(root),
            uri,
            what,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_killed_run_resumes_into_the_same_logger_runs_without_duplicates(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    killed_run = logged_run(tmp_path, uri, "11")  # the newest checkpoint: step 8 (epoch 1, batch 2)
    assert killed_run.returncode == -signal.SIGKILL, killed_run.stderr[-3000:]
    run_dir = tmp_path / "version_0"
    # 10's was not complete
    assert [int(r["step"]) for r in rows(run_dir / "metrics.csv")] == list(range(10))
    # past the checkpoint
    assert [e.step for e in read_run(run_dir).Scalars("train/loss")][-3:] == [7, 8, 9]
    client = mlflow.tracking.MlflowClient(uri)
    (killed,) = client.search_runs([client.get_experiment_by_name("taskfit").experiment_id])
    assert killed.info.status == "RUNNING"  # nobody closed it

    resumed_run = logged_run(tmp_path, uri, "resume")
    assert resumed_run.returncode == 0, resumed_run.stderr[-3000:]
    assert f"log_dir={run_dir}" in resumed_run.stdout and "Resumed from" in resumed_run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "version_0"]

    table = rows(run_dir / "metrics.csv")
    # each step once, the redone 8-10 included
    assert [int(r["step"]) for r in table] == list(range(18))
    assert [r["epoch"] for r in table] == [str(e) for e in range(3) for _ in range(6)]
    epoch_times = [int(r["step"]) for r in table if r["vitals/epoch_time_s"]]
    # not the resumed epoch 1, whose time would be that of its rest only
    assert epoch_times == [5, 17]

    # the killed run's steps 8-9 are hidden by the resumed writer's purge_step
    run = read_run(run_dir)
    assert [e.step for e in run.Scalars("train/loss")] == list(range(18))
    assert [e.value for e in run.Scalars("train/loss")] == pytest.approx(
        [float(r["train/loss"]) for r in table]
    )
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2

    (resumed,) = client.search_runs([killed.info.experiment_id])
    assert resumed.info.run_id == killed.info.run_id and resumed.info.status == "FINISHED"
    assert "died without closing the run" in resumed.data.tags["taskfit.killed"]
    assert resumed.data.tags["taskfit.resumed_at"] == "7"
    history = client.get_metric_history(resumed.info.run_id, "train/loss")
    # the steps the killed run sent are not sent again
    assert [m.step for m in history] == list(range(18))
    assert [m.value for m in history] == pytest.approx([float(r["train/loss"]) for r in table])


def test_a_resume_whose_run_directory_is_gone_starts_a_new_one_and_says_so(tmp_path):
    def trainer():
        return Trainer(max_epochs=2, default_root_dir=str(tmp_path / "runs"), logger=CSVLogger(),
                       enable_progress_bar=False, enable_model_summary=False)

    first = trainer()
    first.fit(RegressionTask(n=16), ckpt_path=None)
    moved = tmp_path / "moved.ckpt"
    Path(first.checkpoint_callback.last_model_path).rename(moved)
    import shutil

    shutil.rmtree(first.log_dir)  # e.g. the checkpoint was copied to another machine
    second = trainer()
    second.max_epochs = 3
    with pytest.warns(RuntimeWarning, match=r"CSVLogger: the run this checkpoint was logged to "
                                            r"\(.*version_0\) is gone; the resumed fit starts a "
                                            r"new one in .*version_0"):
        second.fit(RegressionTask(n=16), ckpt_path=str(moved))
    # the third epoch only
    assert [int(r["step"]) for r in rows(Path(second.log_dir) / "metrics.csv")] == [5]


def test_a_resumed_fit_with_mlflow_alone_continues_its_run_and_directory(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def fit(epochs, ckpt_path=None):
        logger = MLFlowLogger(tracking_uri=uri)
        trainer = Trainer(max_epochs=epochs, default_root_dir=str(tmp_path / "runs"), logger=logger,
                          enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(RegressionTask(n=16), ckpt_path=ckpt_path)
        return trainer, logger

    first, first_logger = fit(1)
    second, second_logger = fit(2, ckpt_path="last")  # extend the finished fit by an epoch
    assert second.log_dir == first.log_dir and second_logger.run_id == first_logger.run_id
    run = mlflow.tracking.MlflowClient(uri).get_run(first_logger.run_id)
    # (the log step)
    assert run.info.status == "FINISHED" and run.data.tags["taskfit.resumed_at"] == "1"
    assert "taskfit.killed" not in run.data.tags  # it was closed: FINISHED, not left RUNNING
    assert [
        m.step
        for m in mlflow.tracking.MlflowClient(uri).get_metric_history(
            run.info.run_id, "train/loss_epoch"
        )
    ] == [1, 3]


def test_lr_monitor_refuses_two_param_groups_of_one_name_and_says_when_momentum_is_zero(tmp_path):
    class Groups(RegressionTask):
        def __init__(self, names, optimizer=torch.optim.SGD):
            super().__init__(n=16)
            self.names, self.optimizer = names, optimizer

        def configure_optimizers(self):
            weight, bias = self.net[1].weight, self.net[1].bias
            return self.optimizer([{"params": [weight], "name": self.names[0]},
                                   {"params": [bias], "name": self.names[1]}], lr=0.1)

    def fit(task, monitor):
        Trainer(
            max_epochs=1,
            log_every_n_steps=1,
            default_root_dir=str(tmp_path),
            logger=CSVLogger(),
            callbacks=[monitor],
            **QUIET,
        ).fit(task)

    with pytest.raises(MisconfigurationError, match=r"An optimizer \(SGD\) has several parameter "
                                                    r"groups with the same \"name\" "
                                                    r"\(\['head'\]\)"):
        fit(Groups(["head", "head"]), LearningRateMonitor())
    monitor = LearningRateMonitor(log_momentum=True)
    with pytest.warns(RuntimeWarning, match=r"some optimizers do not have momentum\. This will log "
                                            r"a value 0 for the momentum"):
        fit(Groups(["weight", "bias"], torch.optim.Adagrad), monitor)
    assert monitor.last_momentum_values == {
        "lr-Adagrad/weight-momentum": 0.0,
        "lr-Adagrad/bias-momentum": 0.0,
    }
