"""The profilers (trainer/profiler.py, trainer/torch_profiler.py): the stage and hook tables account for the whole fit
and count what ran; the torch profiler writes a trace and an operator table per rank (real gloo processes under
ddp). Structure and accounting only: what the profiler costs is measured in benchmarks/tuning.py."""
from __future__ import annotations

import json
import os

import pytest
from taskfit import MisconfigurationError, Trainer, seed_everything
from taskfit.callbacks import Callback
from taskfit.profilers.choice import PassThroughProfiler, profiler_for
from taskfit.profilers.pytorch import PyTorchProfiler
from taskfit.profilers.simple import SimpleProfiler
from tasks import ClassifierTask

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)


class Busy(Callback):
    """A callback with work in a hook (a save, which runs ModelCheckpoint-free here) and a profiled block."""

    def on_train_epoch_end(self, trainer, task) -> None:
        with trainer.callbacks[0].profile("my block"):
            sum(range(1000))


def _fit(profiler, tmp_path, epochs=2, **kwargs):
    seed_everything(0)
    task = ClassifierTask()  # 96 samples, batch 16: 6 batches per epoch; 45 validation samples
    trainer = Trainer(max_epochs=epochs, default_root_dir=str(tmp_path), callbacks=[profiler, Busy()],
                      **{**QUIET, **kwargs})
    trainer.fit(task)
    return trainer


def test_simple_profiler_tables_account_for_the_fit_and_count_what_ran(tmp_path, capsys):
    profiler = SimpleProfiler(filename="profile")
    trainer = _fit(profiler, tmp_path, epochs=2, num_sanity_val_steps=1)
    stages = profiler.stages
    batches = 12
    for stage in ("data wait", "forward+loss", "backward", "optimizer step"):
        assert stages[stage][0] == batches, stage
    assert stages["validation"][0] == 2 and stages["sanity check"][0] == 1
    assert {"checkpoint", "callback hooks", "loop"} <= set(stages)
    accounted = sum(seconds for _, seconds in stages.values())
    assert accounted == pytest.approx(profiler.fit_seconds, rel=1e-3)  # every interval lands in one stage
    assert all(seconds >= 0 for _, seconds in stages.values())
    hooks = profiler.hook_times
    assert hooks["ModelCheckpoint.on_fit_end"][0] == 1 and hooks["Busy.on_train_epoch_end"][0] == 2
    assert sum(s for name, (_, s) in hooks.items() if name.startswith("ModelCheckpoint.")) == \
        pytest.approx(stages["checkpoint"][1])  # ModelCheckpoint's hooks are the checkpoint stage
    assert profiler.actions["my block"][0] == 2
    out = capsys.readouterr().out
    assert "Profiler (SimpleProfiler): fit took" in out and "ModelCheckpoint.on_fit_end" in out
    assert "my block" in out and out.count("\nvalidation ") == 1
    with open(os.path.join(trainer.log_dir, "profile.txt")) as fh:
        assert fh.read().strip() == profiler.report


def test_profiler_off_adds_nothing_to_the_hook_table(tmp_path):
    seed_everything(0)
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    assert isinstance(trainer.profiler, PassThroughProfiler) and not any(
        isinstance(cb, SimpleProfiler) for cb in trainer.callbacks)
    with trainer.profiler.profile("anything"):  # Lightning code that profiles a block runs unchanged
        pass
    trainer.fit(ClassifierTask())
    assert not any(type(fn).__name__ in ("_Mark", "_Timed") for fns in trainer.hooks.values() for fn in fns)
    assert trainer.hooks["on_train_batch_start"] == []  # no per-batch call at all


@pytest.mark.parametrize("value,message", [
    ("advanced", r"Trainer\(profiler='advanced'\) is not a profiler taskfit has"),
    (3, r"Trainer\(profiler=...\) got int"),
])
def test_unknown_profilers_are_refused(value, message):
    with pytest.raises(MisconfigurationError, match=message):
        profiler_for(value, [])


def test_trainer_argument_and_command_line(tmp_path):
    from test_cli import TINY, _env, taskfit

    assert isinstance(Trainer(profiler="simple", **QUIET).profiler, SimpleProfiler)
    assert isinstance(Trainer(profiler="torch", **QUIET).profiler, PyTorchProfiler)
    out = taskfit("trainer.profiler=simple", *TINY, f"paths.log_dir={tmp_path}", cwd=tmp_path, env=_env()).stdout
    assert "Profiler (SimpleProfiler): fit took" in out and "ModelCheckpoint.on_fit_end" in out, out


def test_torch_profiler_writes_a_trace_with_the_stages_and_the_operator_table(tmp_path, capsys):
    profiler = PyTorchProfiler()
    trainer = _fit(profiler, tmp_path, epochs=1)
    folder = os.path.join(trainer.log_dir, "profiler")
    assert profiler.trace_path == os.path.join(folder, "trace_rank0.json")
    with open(profiler.trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    names = {e.get("name") for e in events}
    assert any(n and n.startswith("taskfit: forward+loss") for n in names)  # the stages, labelled
    assert "aten::addmm" in names  # the operators of the 3 recorded steps
    with open(os.path.join(folder, "operators_rank0.txt")) as fh:
        table = fh.read()
    assert "aten::addmm" in table and "CPU total" in table
    out = capsys.readouterr().out
    assert "torch.profiler, cpu_time_total" in out and "trace:" in out and "Profiler (PyTorchProfiler)" in out


def test_torch_profiler_under_ddp_writes_one_trace_per_rank(tmp_path):
    seed_everything(0)
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, default_root_dir=str(tmp_path),
                      callbacks=[PyTorchProfiler()], **QUIET)
    trainer.fit(ClassifierTask(batch_size=8))
    folder = os.path.join(trainer.log_dir, "profiler")
    assert sorted(os.listdir(folder)) == ["operators_rank0.txt", "operators_rank1.txt", "trace_rank0.json",
                                          "trace_rank1.json"]
    for rank in (0, 1):
        with open(os.path.join(folder, f"trace_rank{rank}.json")) as fh:
            assert any(e.get("name") == "taskfit: loop" for e in json.load(fh)["traceEvents"])
