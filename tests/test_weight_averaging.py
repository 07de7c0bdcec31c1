"""EMA and SWA (callbacks/weight_averaging.py): the same numbers as torch.optim.swa_utils, validation on the average,
exact resume (SIGKILLed real processes, and a run extended after its end), ddp and fsdp (real gloo processes)
equal to one process with the same global batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from fsdp_tasks import MLPTask
from taskfit import MisconfigurationError, Trainer, seed_everything
from taskfit.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from taskfit.checkpoint import load_checkpoint
from tasks import ClassifierTask, checkpointing_trainer, one_process_of_ddp, same_state
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn

HERE = os.path.dirname(os.path.abspath(__file__))
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)


class Reference(Callback):
    """torch.optim.swa_utils' own AveragedModel, updated where the callback under test updates; records the lr."""

    def __init__(self, ema: float | None, start_epoch: int = 0) -> None:
        self.ema, self.start_epoch, self.lrs = ema, start_epoch, []

    def on_fit_start(self, trainer, task) -> None:
        fn = get_ema_multi_avg_fn(self.ema) if self.ema is not None else None
        self.model = AveragedModel(task.net, multi_avg_fn=fn, use_buffers=True)

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if self.ema is not None:
            self.model.update_parameters(task.net)

    def on_train_epoch_end(self, trainer, task) -> None:
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])
        if self.ema is None and trainer.state.epoch >= self.start_epoch:
            self.model.update_parameters(task.net)


def _fit(callbacks, epochs=3, task_cls=ClassifierTask, **kwargs):
    seed_everything(0)
    task = task_cls()
    trainer = Trainer(max_epochs=epochs, callbacks=callbacks, **{**QUIET, **kwargs})
    return task, trainer, trainer.fit(task)


def test_ema_equals_averaged_model_and_validation_uses_the_average(capsys):
    reference, ema = Reference(ema=0.9), EMAWeightAveraging(decay=0.9)
    task, trainer, metrics = _fit([reference, ema])
    assert ema.weights.count == int(reference.model.n_averaged) == 18  # 6 steps x 3 epochs
    averaged = reference.model.module.state_dict()
    assert all(torch.equal(task.net.state_dict()[k], v) for k, v in averaged.items())  # bit for bit
    assert "EMAWeightAveraging: the task now holds the average of 18 updates" in capsys.readouterr().out
    # the last validation (after the last update) ran on the average: validating the task now gives its numbers
    (again,) = Trainer(**QUIET).validate(task)
    assert again["val/loss"] == metrics["val/loss"] and again["val/acc"] == metrics["val/acc"]
    training = ema.state_dict()["weights"]  # the training weights are kept in the callback's state
    assert not torch.equal(training["net.0.weight"], task.net[0].weight)
    task.load_state_dict(training)
    (own,) = Trainer(**QUIET).validate(task)
    assert own["val/loss"] != metrics["val/loss"]


def test_ema_schedule_warmup_and_start():
    ema = EMAWeightAveraging(decay=0.9, update_every_n_steps=2, update_starting_at_step=3, warmup_steps=4)
    assert [s for s in range(12) if ema.should_update(step_idx=s)] == [3, 5, 7, 9, 11]
    assert not ema.should_update(epoch_idx=1)
    ema.weights = type("W", (), {"count": 2})()
    assert ema.update_weight() == pytest.approx(1 - 0.9 * 2 / 4)
    ema.weights.count = 9
    assert ema.update_weight() == pytest.approx(0.1)


def test_swa_equals_swa_utils_recipe():
    """From epoch 2 of 4 (1-based): SWALR anneals the lr over 2 epochs (cos) and each epoch's end enters the equal
    average, as AveragedModel.update_parameters + SWALR.step in torch's recipe; the task's scheduler pauses."""
    reference = Reference(ema=None, start_epoch=1)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2)
    seed_everything(0)
    task = ClassifierTask()
    optimizer = torch.optim.SGD(task.parameters(), lr=0.1)
    task.configure_optimizers = lambda: (optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))  # pauses
    Trainer(max_epochs=4, callbacks=[reference, swa], **QUIET).fit(task)
    assert swa.weights.count == int(reference.model.n_averaged) == 3
    for k, v in reference.model.module.state_dict().items():
        torch.testing.assert_close(task.net.state_dict()[k], v, rtol=0, atol=1e-7)
    stand_in = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)  # epoch 0 ran at 0.1, StepLR halved it
    course = SWALR(stand_in, swa_lr=0.01, anneal_epochs=2)
    expected = [0.05]  # the lr of epochs 1, 2, 3 (recorded at their end, before SWALR steps)
    for _ in range(3):
        expected.append(stand_in.param_groups[0]["lr"])
        stand_in.step()
        course.step()
    assert reference.lrs == pytest.approx(expected) == [0.05, 0.05, 0.03, 0.01]  # StepLR would have halved it


def test_a_run_extended_after_its_end_continues_exactly(tmp_path):
    """fit ends with the average in the task; last.ckpt keeps the training weights in the callback's state, so
    extending the run (3 -> 5 epochs) equals an uninterrupted 5-epoch run, average and training weights."""
    def run(root, epochs, ckpt_path=None):
        seed_everything(0)
        task, ema = ClassifierTask(), EMAWeightAveraging(decay=0.8, update_every_n_steps=2)
        checkpointing_trainer(root, max_epochs=epochs, callbacks=[ema]).fit(task, ckpt_path=ckpt_path)
        return task, ema

    reference, reference_ema = run(tmp_path / "ref", 5)
    run(tmp_path / "run", 3)
    last = load_checkpoint(str(tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"))
    assert last["callbacks"]["EMAWeightAveraging"]["swapped"] is True  # the file's module part is the average
    task, ema = run(tmp_path / "run", 5, ckpt_path="last")
    assert same_state(task.state_dict(), reference.state_dict())
    assert same_state(ema.state_dict()["weights"], reference_ema.state_dict()["weights"])


@pytest.mark.parametrize("save_average", [True, False])
def test_the_best_checkpoint_holds_the_averaged_model_it_was_ranked_by(tmp_path, save_average):
    """ModelCheckpoint ranks files by val/loss measured on the average; with save_average (the default, Lightning's
    layout) the file's weights are that average, so validating the file gives its score again."""
    seed_everything(0)
    ema = EMAWeightAveraging(decay=0.8, save_average=save_average)
    saving = ModelCheckpoint(monitor="val/loss", save_top_k=1, min_epoch_interval=0)
    trainer = checkpointing_trainer(tmp_path, max_epochs=3, callbacks=[ema, saving])
    trainer.fit(ClassifierTask())
    best = load_checkpoint(saving.best_model_path)
    assert best["callbacks"]["EMAWeightAveraging"]["swapped"] is save_average
    (again,) = Trainer(**QUIET).validate(ClassifierTask(), ckpt_path=saving.best_model_path)
    assert (again["val/loss"] == pytest.approx(float(saving.best_model_score), abs=1e-6)) is save_average
    loaded = ClassifierTask.load_from_checkpoint(saving.best_model_path)
    assert same_state(loaded.state_dict(), best["module"])


def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TASKFIT_SEED", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "averaging_script.py"), str(tmp_path)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for scenario, start in (("ema", {"epoch": 1, "batches_done": 4, "global_step": 8}),
                            ("swa", {"epoch": 2, "batches_done": 6, "global_step": 30})):
        base = tmp_path / scenario
        summary = json.loads((base / "result.json").read_text())
        assert [r["status"] for r in summary["runs"]] == [-9, 0], [r["output"][-2000:] for r in summary["runs"]]
        for part in ("params", "averaging"):  # the task (the average), the training weights, the count, the lr
            final, reference = (torch.load(base / f"{n}_{part}.pt", weights_only=True) for n in ("final", "reference"))
            assert same_state(final, reference), (scenario, part)
        logs = {n: json.loads((base / f"{n}_log.json").read_text()) for n in ("final", "reference")}
        assert logs["final"]["start"] == start  # resumed mid-epoch, after averaging had begun
        after = [r for r in logs["reference"]["records"] if r[0] > start["global_step"]]
        assert after and logs["final"]["records"] == after  # validation on the average, bitwise after the resume


# ---- ddp and fsdp: real gloo processes ---------------------------------------------------------------------
def test_ddp_swa_equals_one_process_with_the_same_global_batch(tmp_path):
    def swa():
        return StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2, annealing_epochs=1)

    single_cb, ddp_cb = swa(), swa()
    # the one-process reference trains on ddp's data order (tasks.one_process_of_ddp)
    single, _, expected = _fit([single_cb], epochs=4, task_cls=one_process_of_ddp(ClassifierTask))
    seed_everything(0)
    task = ClassifierTask(batch_size=8)  # x 2 ranks
    metrics = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=4, callbacks=[ddp_cb],
                      **QUIET).fit(task)
    worst = max((task.state_dict()[k] - v).abs().max().item() for k, v in single.state_dict().items())
    assert worst <= 1e-6  # the average (what the task holds after fit)
    training = ddp_cb.state_dict()["weights"]  # rank 0's callback state came back to this process
    for k, v in single_cb.state_dict()["weights"].items():
        assert (training[k] - v).abs().max().item() <= 1e-6, k
    assert ddp_cb.state_dict()["count"] == 3
    for key in ("val/loss", "val/acc"):  # validated on the average on both
        assert metrics[key] == pytest.approx(expected[key], abs=1e-6)


class RaiseAt(Callback):
    """Stops the run with an error at global step ``step`` (the checkpoint of that step is on disk)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        if trainer.state.global_step == self.step:
            trainer.checkpoint_writer.wait()
            raise RuntimeError(f"stopped at step {self.step}")


def test_fsdp_ema_averages_the_shards_and_resumes_exactly(tmp_path):
    """FSDP2 over 2 processes: each rank averages its shard (the 3-row head splits 2 + 1); the result equals one
    process with batch 16, and a run stopped at step 4 resumes from its sharded checkpoint to the same end, bit for
    bit (the average is gathered into the checkpoint and cut back to each rank's shard)."""
    from taskfit.strategies.fsdp import FSDPStrategy

    def run(root, batch_size, strategy="single", callbacks=(), ckpt_path=None):
        seed_everything(0)
        # batch 16 is one process on ddp's data order (tasks.one_process_of_ddp)
        task_cls = one_process_of_ddp(MLPTask) if batch_size == 16 else MLPTask
        task, ema = task_cls(batch_size=batch_size), EMAWeightAveraging(decay=0.7)
        saving = ModelCheckpoint(every_n_train_steps=2, every_n_epochs=None, save_top_k=-1)
        trainer = Trainer(strategy=strategy, max_epochs=2, accumulate_grad_batches=2, default_root_dir=str(root),
                          callbacks=[saving, ema, *callbacks], enable_progress_bar=False, enable_model_summary=False,
                          logger=False)
        return task, ema, trainer.fit(task, ckpt_path=ckpt_path)

    single, single_ema, expected = run(tmp_path / "single", 16)
    task, ema, metrics = run(tmp_path / "fsdp", 8, FSDPStrategy("cpu", 2, auto_wrap_policy={nn.Linear}))
    for k, v in single.state_dict().items():
        assert (task.state_dict()[k] - v).abs().max().item() <= 1e-6, k
    for k, v in single_ema.state_dict()["weights"].items():
        assert (ema.state_dict()["weights"][k] - v).abs().max().item() <= 1e-6, k
    assert metrics["val/loss"] == pytest.approx(expected["val/loss"], abs=1e-6)

    with pytest.raises(RuntimeError, match="stopped at step 4"):
        run(tmp_path / "stopped", 8, FSDPStrategy("cpu", 2, auto_wrap_policy={nn.Linear}), callbacks=[RaiseAt(4)])
    step4 = tmp_path / "stopped" / "version_0" / "checkpoints" / "epoch=1-step=4.ckpt"
    assert load_checkpoint(str(step4))["callbacks"]["EMAWeightAveraging"]["count"] == 4
    resumed, resumed_ema, _ = run(tmp_path / "resumed", 8, FSDPStrategy("cpu", 2, auto_wrap_policy={nn.Linear}),
                                  ckpt_path=str(step4))
    assert same_state(resumed.state_dict(), task.state_dict())
    assert same_state(resumed_ema.state_dict()["weights"], ema.state_dict()["weights"])


# ---- mistakes: one clear error each ---------------------------------------------------------------------------
@pytest.mark.parametrize("make,message", [
    (lambda: EMAWeightAveraging(decay=1.5), r"EMAWeightAveraging\(decay=1.5\) is not valid"),
    (lambda: EMAWeightAveraging(update_every_n_steps=0), r"update_every_n_steps=0\) is not valid"),
    (lambda: EMAWeightAveraging(decay_rate=0.9), r"(?s)unknown argument 'decay_rate'.*did you mean decay"),
    (lambda: StochasticWeightAveraging(swa_lrs=-1), r"swa_lrs=-1\) is not valid"),
    (lambda: StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=0), r"swa_epoch_start=0\) is not valid"),
    (lambda: StochasticWeightAveraging(swa_lrs=0.1, annealing_strategy="exp"), r"annealing_strategy='exp'"),
])
def test_bad_arguments_fail_at_once(make, message):
    with pytest.raises(MisconfigurationError, match=message):
        make()


def test_two_averages_and_a_fraction_without_max_epochs_are_refused():
    with pytest.raises(MisconfigurationError, match="keep one weight-averaging callback"):
        _fit([EMAWeightAveraging(), StochasticWeightAveraging(swa_lrs=0.1)], epochs=1)
    with pytest.raises(MisconfigurationError, match=r"swa_epoch_start=0.8\) is a fraction of max_epochs"):
        seed_everything(0)
        Trainer(max_steps=5, callbacks=[StochasticWeightAveraging(swa_lrs=0.1)], **QUIET).fit(ClassifierTask())
