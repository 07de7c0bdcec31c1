"""The monitoring callbacks: EarlyStopping on scripted metric sequences (and across a checkpoint
resume), LearningRateMonitor against the scheduler, ThroughputMonitor's counts, data-wait advice and
validation time.
"""
from __future__ import annotations

import io
import math
import time

import pytest
import torch
from taskfit import MisconfigurationError, Trainer
from taskfit.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    TensorBoardLogger,
    ThroughputMonitor,
)
from tasks import RegressionTask
from torch.utils.data import DataLoader, Dataset

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def logged(trainer, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` in the run's event files, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = EventAccumulator(trainer.log_dir, size_guidance={"scalars": 0})
    run.Reload()
    return [(e.step, e.value) for e in run.Scalars(tag)]


# ---- EarlyStopping -------------------------------------------------------------------------------
class ScriptedTask(RegressionTask):
    """Logs ``val/score = script[epoch]`` at each validation (``sanity`` during the sanity
    check)."""

    def __init__(self, script, sanity: float = 0.0, lr: float = 0.05) -> None:
        # one validation batch: the mean is the value
        super().__init__(n=16, batch_size=8, val_n=8, lr=lr)
        self.script, self.sanity, self.epoch = list(script), sanity, -1

    def loss(self, outputs, targets):
        if self.stage == "val":
            self.log("val/score", self.sanity if self.epoch < 0 else self.script[self.epoch])
        return super().loss(outputs, targets)


class EpochToTask(Callback):
    def on_train_epoch_start(self, trainer, task):
        task.epoch = trainer.state.epoch


def fit_scripted(script, stopper, max_epochs=None, **kwargs):
    trainer = Trainer(
        max_epochs=max_epochs or len(script),
        logger=False,
        callbacks=[stopper, EpochToTask()],
        **QUIET,
        **kwargs,
    )
    task = ScriptedTask(script)
    trainer.fit(task)
    return trainer, task


def test_early_stopping_counts_patience_and_min_delta(capsys):
    # best 0.8 at epoch 1; 0.75 is not better by more than 0.1; epochs 2, 3, 4 without improvement
    # -> stop at 4. The sanity check logs 0.0: were it counted, nothing would improve on it and fit
    # would stop at epoch 2.
    stopper = EarlyStopping(monitor="val/score", mode="min", patience=3, min_delta=0.1)
    trainer, _ = fit_scripted([1.0, 0.8, 0.75, 0.79, 0.85, 0.5, 0.4, 0.3], stopper)
    assert stopper.stopped_epoch == 4 and trainer.state.epoch == 5  # epoch 4 completes, no epoch 5
    assert trainer.state.global_step == 5 * 2
    assert float(stopper.best_score) == pytest.approx(0.8) and stopper.wait_count == 3
    reason = trainer.state.stop_reason
    assert reason == ("EarlyStopping: Monitored metric val/score did not improve in the last 3 "
                      "records. Best score: 0.800. Signaling Trainer to stop."), reason
    assert "EarlyStopping: stopping at epoch 4 (global step 10)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "script, kwargs, epoch, why",
    [
        (
            [0.5, 0.7, 0.91, 0.95, 0.99],
            dict(mode="max", stopping_threshold=0.9),
            2,
            "Stopping threshold reached",
        ),
        ([1.0, 0.9, math.nan, 0.1], dict(mode="min"), 2, "val/score = nan is not finite"),
        (
            [1.0, 0.9, 4.0, 0.1],
            dict(mode="min", divergence_threshold=3.0),
            2,
            "Divergence threshold reached",
        ),
        # always improving: never stops (stopped_epoch 0)
        ([0.1, 0.2, 0.3, 0.35, 0.4], dict(mode="max"), 0, None),
    ],
)
def test_early_stopping_thresholds_and_non_finite(script, kwargs, epoch, why):
    stopper = EarlyStopping(monitor="val/score", patience=2, verbose=False, **kwargs)
    trainer, _ = fit_scripted(script, stopper)
    assert stopper.stopped_epoch == epoch
    assert trainer.state.epoch == (len(script) if why is None else epoch + 1)
    assert (why or "") in trainer.state.stop_reason and bool(trainer.state.stop_reason) == (
        why is not None
    )


def test_early_stopping_on_a_training_key_checks_at_epoch_end():
    stopper = EarlyStopping(monitor="train/loss_epoch", patience=2, verbose=False)
    trainer = Trainer(max_epochs=10, logger=False, callbacks=[stopper], **QUIET)
    trainer.fit(RegressionTask(n=16, lr=0.0))  # lr 0: the epoch loss never changes after epoch 0
    assert stopper.stopped_epoch == 2 and trainer.state.epoch == 3


def test_early_stopping_survives_a_checkpoint_resume(tmp_path):
    script = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]  # never improves after epoch 0
    first = EarlyStopping(monitor="val/score", patience=4, verbose=False)
    trainer, task = fit_scripted(script, first, max_epochs=3)  # checks at epochs 1, 2: wait 2
    assert (float(first.best_score), first.wait_count, first.stopped_epoch) == (1.0, 2, 0)
    path = str(tmp_path / "after3.ckpt")
    trainer.save_checkpoint(path)

    resumed = EarlyStopping(monitor="val/score", patience=4, verbose=False)
    trainer = Trainer(
        max_epochs=len(script), logger=False, callbacks=[resumed, EpochToTask()], **QUIET
    )
    trainer.fit(ScriptedTask(script), ckpt_path=path)
    # 2 restored + epochs 3, 4; a fresh counter would stop at epoch 7
    assert resumed.stopped_epoch == 4
    assert float(resumed.best_score) == 1.0 and trainer.state.epoch == 5

    fresh = EarlyStopping(monitor="val/score", patience=4, verbose=False)
    fresh.load_state_dict(first.state_dict())
    assert fresh.state_dict() == first.state_dict()
    # Lightning's key
    assert fresh.state_key == "EarlyStopping{'monitor': 'val/score', 'mode': 'min'}"


def test_early_stopping_explains_an_unknown_key():
    stopper = EarlyStopping(monitor="val/acc")
    with pytest.raises(MisconfigurationError, match=r"monitors 'val/acc', which was not logged "
                                                    r"\(Lightning's words: Early stopping "
                                                    r"conditioned on metric `val/acc` which is not "
                                                    r"available\)\. Logged keys: train/loss, "
                                                    r"train/loss_epoch, val/loss, val/score\.\n  "
                                                    r"HINT: did you mean 'val/score'\?"):
        fit_scripted([1.0, 0.5], stopper)


def test_early_stopping_without_validation_data_fails_before_training():
    trainer = Trainer(max_epochs=2, logger=False, callbacks=[EarlyStopping()], **QUIET)
    task = RegressionTask(n=16)
    with pytest.raises(MisconfigurationError, match=r"monitors 'val/loss', but RegressionTask has "
                                                    r"no validation"):
        trainer.fit(task)
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="best"), r"mode='best'\) is not valid"),
        (dict(patience=-1), r"patience=-1\) is not valid"),
        (dict(min_delta=-0.1), r"min_delta=-0.1\) is not valid"),
        (dict(monitor=""), r"monitor=''\) is not valid"),
    ],
)
def test_early_stopping_rejects_bad_arguments(kwargs, match):
    with pytest.raises(MisconfigurationError, match=match):
        EarlyStopping(**kwargs)


# ---- LearningRateMonitor -------------------------------------------------------------------------
class TwoGroupTask(RegressionTask):
    """Two param groups (one named) and a scheduler stepping every optimizer step or every epoch."""

    def __init__(self, interval: str = "step", momentum: float = 0.0) -> None:
        super().__init__(n=32, batch_size=8)
        self.interval, self.momentum = interval, momentum

    def build(self, params):
        weight, bias = params
        optimizer = torch.optim.SGD(
            [{"params": [weight], "lr": 0.1, "name": "weights"}, {"params": [bias]}],
            lr=0.02,
            momentum=self.momentum,
        )
        scheduler = (
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
            if self.interval == "step"
            else torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
        )
        return optimizer, scheduler

    def configure_optimizers(self):
        optimizer, scheduler = self.build([self.net[1].weight, self.net[1].bias])
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.interval},
        }


def expected_rates(task, scheduler_steps: int) -> list[float]:
    """Replay the task's scheduler on a throwaway optimizer: the rates after ``scheduler_steps``
    steps."""
    optimizer, scheduler = task.build(
        [torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)]
    )
    for _ in range(scheduler_steps):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()


class ManualTwoGroupTask(TwoGroupTask):
    """TwoGroupTask under manual optimization: the training step steps the optimizer and its
    scheduler."""

    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss = self.loss(self(batch[0]), batch[1])
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()
        return loss


# Lightning 2.6.6's LearningRateMonitor(log_momentum=True) on the same optimizer (SGD, groups
# "weights" at 0.1 and one unnamed at 0.02, momentum 0.9), StepLR(step_size=3, gamma=0.5) at
# interval "step", 4 batches per epoch. Observed with `pip install lightning==2.6.6` and a
# LightningModule of the same optimizer, scheduler and loader (CSVLogger; its metrics.csv rows of
# lr-SGD/weights as (step, value), and the monitor's `lrs`): Lightning reads the rates in
# on_train_batch_start of a batch whose step logs, before its optimizer and scheduler step, at the
# count of batches that stepped before it; under accumulation every batch of the logged group logs
# (the same value).
LIGHTNING_STEP_RATES = [
    (
        dict(max_steps=10, log_every_n_steps=1),
        TwoGroupTask,
        [
            (0, 0.1),
            (1, 0.1),
            (2, 0.1),
            (3, 0.05),
            (4, 0.05),
            (5, 0.05),
            (6, 0.025),
            (7, 0.025),
            (8, 0.025),
            (9, 0.0125),
        ],
    ),
    (
        dict(max_steps=12, log_every_n_steps=3),
        TwoGroupTask,
        [(2, 0.1), (5, 0.05), (8, 0.025), (11, 0.0125)],
    ),
    (
        dict(max_steps=6, log_every_n_steps=2, accumulate_grad_batches=2),
        TwoGroupTask,
        [(1, 0.1), (1, 0.1), (3, 0.05), (3, 0.05), (5, 0.05), (5, 0.05)],
    ),
    (
        dict(max_steps=6, log_every_n_steps=3, accumulate_grad_batches=3),
        TwoGroupTask,
        [(2, 0.1), (2, 0.1), (2, 0.1), (5, 0.05)],
    ),
    (
        dict(max_steps=10, log_every_n_steps=2),
        ManualTwoGroupTask,
        [(1, 0.1), (3, 0.05), (5, 0.05), (7, 0.025), (9, 0.0125)],
    ),
]


@pytest.mark.parametrize(
    "settings, kind, lightning",
    LIGHTNING_STEP_RATES,
    ids=["every-step", "every-3", "accumulate-2", "accumulate-3", "manual"],
)
def test_lr_monitor_logs_lightnings_rates_with_a_per_step_scheduler(
    tmp_path, settings, kind, lightning
):
    monitor = LearningRateMonitor(log_momentum=True)
    trainer = Trainer(default_root_dir=str(tmp_path), callbacks=[monitor], **settings, **QUIET)
    trainer.fit(kind("step", momentum=0.9))
    # Lightning's lrs (the second group at a fifth of the first), and its points in the loggers
    assert monitor.lrs == {"lr-SGD/weights": pytest.approx([v for _, v in lightning]),
                           "lr-SGD/pg2": pytest.approx([v / 5 for _, v in lightning])}
    assert logged(trainer, "lr-SGD/weights") == [(s, pytest.approx(v)) for s, v in lightning]
    assert [v for _, v in logged(trainer, "lr-SGD/weights-momentum")] == pytest.approx(
        [0.9] * len(lightning)
    )


class Unscheduled(RegressionTask):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "interval, steps",
    [(None, [0, 2, 4, 5, 8, 8, 11]), ("step", [2, 5, 8, 11]), ("epoch", [0, 4, 8])],
)
def test_lr_monitor_logs_an_optimizer_without_scheduler_when_lightnings_does(
    tmp_path, interval, steps
):
    """Lightning 2.6.6 (`pip install lightning==2.6.6`, the same SGD without a scheduler, 3 epochs of 4 batches,
    log_every_n_steps=3; its metrics.csv rows of lr-SGD): without logging_interval such an optimizer is logged at every
    epoch start (0, 4, 8) and every logged step's batch start (2, 5, 8, 11)."""
    monitor = LearningRateMonitor(logging_interval=interval)
    trainer = Trainer(
        max_epochs=3,
        log_every_n_steps=3,
        default_root_dir=str(tmp_path),
        callbacks=[monitor],
        **QUIET,
    )
    trainer.fit(Unscheduled(n=32, batch_size=8))
    assert logged(trainer, "lr-SGD") == [(s, pytest.approx(0.1)) for s in steps]
    assert monitor.lrs == {"lr-SGD": pytest.approx([0.1] * len(steps))}


def test_lr_monitor_vitals_log_the_rates_lightnings_names_do(tmp_path):
    """The monitor taskfit adds (names="vitals") logs at the same steps, the same rates: each step's
    own."""
    trainer = Trainer(max_steps=10, log_every_n_steps=1, default_root_dir=str(tmp_path),
                      callbacks=[LearningRateMonitor(names="vitals")], **QUIET)
    task = TwoGroupTask("step")
    trainer.fit(task)
    weights, bias = logged(trainer, "vitals/lr/SGD/weights"), logged(trainer, "vitals/lr/SGD/pg1")
    assert weights == [(s, pytest.approx(v)) for s, v in LIGHTNING_STEP_RATES[0][2]]
    # at step s: the rates of the step from s to s + 1, after s scheduler steps
    for (step, w), (_, b) in zip(weights, bias):
        assert [w, b] == pytest.approx(expected_rates(task, step)), step


def test_lr_monitor_vitals_log_the_last_step_of_an_epoch_shorter_than_the_interval(tmp_path):
    """taskfit's curves of a short run: an epoch of fewer steps than log_every_n_steps logs its last
    step at its end; the vitals' rate is there too (Lightning's names are not: Lightning's monitor
    logs nothing there)."""
    lightning, vitals = LearningRateMonitor(), LearningRateMonitor(names="vitals")
    trainer = Trainer(
        max_epochs=2, default_root_dir=str(tmp_path), callbacks=[lightning, vitals], **QUIET
    )
    task = TwoGroupTask("step")
    trainer.fit(task)
    assert [s for s, _ in logged(trainer, "train/loss")] == [3, 7]
    assert logged(trainer, "vitals/lr/SGD/weights") == [
        (s, pytest.approx(expected_rates(task, s + 1)[0])) for s in (3, 7)
    ]
    assert lightning.lrs == {"lr-SGD/weights": [], "lr-SGD/pg2": []}


def test_lr_monitor_epoch_interval_logs_at_epoch_start(tmp_path):
    task = TwoGroupTask("epoch")
    trainer = Trainer(
        max_epochs=3,
        default_root_dir=str(tmp_path),
        callbacks=[LearningRateMonitor(logging_interval="epoch", names="vitals")],
        **QUIET,
    )
    trainer.fit(task)
    assert logged(trainer, "vitals/lr/SGD/weights") == [
        (0, pytest.approx(0.1)),
        (4, pytest.approx(0.05)),
        (8, pytest.approx(0.025)),
    ]
    assert [v for _, v in logged(trainer, "vitals/lr/SGD/pg1")] == pytest.approx(
        [expected_rates(task, e)[1] for e in range(3)])


def test_lr_monitor_rejects_a_bad_interval():
    with pytest.raises(MisconfigurationError, match=r"logging_interval='batch'\) is not valid"):
        LearningRateMonitor(logging_interval="batch")


def test_logger_adds_the_monitors_by_default_and_logger_false_removes_them():
    def kinds(trainer):
        return {type(cb) for cb in trainer.callbacks}

    assert {TensorBoardLogger, LearningRateMonitor, ThroughputMonitor} <= kinds(
        Trainer(max_epochs=1, **QUIET)
    )
    assert not {TensorBoardLogger, LearningRateMonitor, ThroughputMonitor} & kinds(
        Trainer(max_epochs=1, logger=False, **QUIET))
    mine = LearningRateMonitor(logging_interval="epoch")
    trainer = Trainer(max_epochs=1, callbacks=[mine], **QUIET)
    assert [cb for cb in trainer.callbacks if isinstance(cb, LearningRateMonitor)] == [mine]


# ---- ThroughputMonitor ---------------------------------------------------------------------------
def test_throughput_counts_samples_and_logs_perf(tmp_path):
    stream = io.StringIO()
    monitor = ThroughputMonitor(stream=stream)
    task = RegressionTask(n=60, batch_size=8, val_n=16)  # 7 full batches and one of 4 per epoch
    trainer = Trainer(
        max_epochs=2,
        log_every_n_steps=3,
        default_root_dir=str(tmp_path),
        callbacks=[monitor],
        **QUIET,
    )
    trainer.fit(task)
    s = monitor.summary
    assert (s["samples"], s["batches"], s["epochs"]) == (120, 16, 2)
    assert s["samples_per_sec"] == pytest.approx(120 / s["train_time_s"])
    assert s["step_time_ms"] == pytest.approx(1000 * s["train_time_s"] / 16)
    assert 0 <= s["data_wait_pct"] <= 100 and "peak_memory_gib" not in s  # CPU: no CUDA memory
    report = stream.getvalue()
    assert (
        report.startswith("Throughput: ")
        and "samples/s" in report
        and "16 batches (120 samples)" in report
    )
    # every log_every_n_steps (each epoch had a log interval, so its end adds none)
    assert [step for step, _ in logged(trainer, "vitals/samples_per_sec")] == [2, 5, 8, 11, 14]
    # each epoch's last step
    assert [step for step, _ in logged(trainer, "vitals/epoch_time_s")] == [7, 15]
    assert logged(trainer, "vitals/fit/samples_per_sec") == [
        (15, pytest.approx(s["samples_per_sec"], rel=1e-6))
    ]


class SlowData(Dataset):
    """Each sample costs ``delay`` seconds to load: a data-bound loop."""

    def __init__(self, n: int, delay: float) -> None:
        self.data, self.delay = RegressionTask(n=n).data, delay

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.data[i]


class SlowDataTask(RegressionTask):
    def __init__(self, delay: float) -> None:
        super().__init__(n=32, batch_size=4)
        self.slow = SlowData(32, delay)

    def train_dataloader(self):
        return DataLoader(self.slow, batch_size=4)


def test_throughput_says_when_the_dataloader_is_the_bottleneck():
    stream = io.StringIO()
    monitor = ThroughputMonitor(min_data_wait_s=0.1, stream=stream)
    trainer = Trainer(max_epochs=1, logger=False, callbacks=[monitor], **QUIET)
    trainer.fit(SlowDataTask(delay=0.005))
    assert monitor.summary["data_wait_pct"] > 50 and monitor.summary["data_wait_s"] >= 32 * 0.005
    # the loop's own timing
    assert monitor.summary["data_wait_s"] == pytest.approx(trainer.state.data_wait_s)
    report = stream.getvalue()
    assert (
        "the DataLoader is the bottleneck" in report
        and "(num_workers=0, pin_memory=False)" in report
    )
    assert "HINT: raise DataLoader(num_workers=...)" in report

    # the same loop without the delay, default thresholds
    quick = ThroughputMonitor(stream=io.StringIO())
    Trainer(max_epochs=1, logger=False, callbacks=[quick], **QUIET).fit(SlowDataTask(delay=0.0))
    assert "bottleneck" not in quick.stream.getvalue()


class SlowValidationTask(RegressionTask):
    def loss(self, outputs, targets):
        if self.stage == "val":
            time.sleep(0.1)
        return super().loss(outputs, targets)


def test_throughput_leaves_validation_out_of_the_step_time():
    monitor = ThroughputMonitor(verbose=False)
    trainer = Trainer(
        max_epochs=1,
        val_check_interval=2,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[monitor],
        **QUIET,
    )
    # 4 batches, 2 validations of 0.1 s
    trainer.fit(SlowValidationTask(n=32, batch_size=8, val_n=8))
    assert monitor.summary["batches"] == 4
    # The 0.2 s the two validations sleep are part of the epoch but not of the training time (a
    # bound on events, not on the machine's speed: training time is whatever the epoch took besides
    # the validations).
    assert trainer.state.metrics["vitals/epoch_time_s"] - monitor.summary["train_time_s"] >= 0.2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is reported on CUDA only")
def test_throughput_reports_cuda_peak_memory():
    monitor = ThroughputMonitor(verbose=False)
    trainer = Trainer(max_epochs=1, accelerator="cuda", logger=False, callbacks=[monitor], **QUIET)
    trainer.fit(RegressionTask(n=32, batch_size=8))
    assert 0 < monitor.summary["peak_memory_gib"] < 1
    assert trainer.state.metrics["vitals/fit/peak_memory_gib"] == monitor.summary["peak_memory_gib"]


def test_throughput_rejects_a_bad_threshold():
    with pytest.raises(MisconfigurationError, match=r"data_wait_warning=1.5\) is not valid"):
        ThroughputMonitor(data_wait_warning=1.5)
