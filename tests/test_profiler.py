"""The profilers (trainer/profiler.py, trainer/torch_profiler.py): the stage and hook tables account for the whole fit
and count what ran; the torch profiler writes a trace and an operator table per rank (real gloo processes under
ddp). Structure and accounting only: what the profiler costs is measured in benchmarks/tuning.py."""
from __future__ import annotations

import importlib
import json
import os
import sys
import uuid

import pytest
import torch
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


class ProfilerOn(Callback):
    """Whether torch.profiler records, in the middle of every training batch (after forward+loss)."""

    def __init__(self) -> None:
        self.on: list[bool] = []

    def on_before_backward(self, trainer, task, loss) -> None:
        self.on.append(torch.autograd._profiler_enabled())


def test_torch_profiler_records_the_documented_batches_once_then_stops(tmp_path):
    """docs/tuning.md: batches 2-4 of the fit (ProfilerStep#2-#4), one window, each stage labelled once per batch;
    after the window torch.profiler is stopped, so the later batches run without it (issue 38: it cycled through the
    whole fit, and forward+loss / optimizer step were labelled twice per batch)."""
    profiler, probe = PyTorchProfiler(), ProfilerOn()
    seed_everything(0)
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), callbacks=[profiler, probe], **QUIET)
    trainer.fit(ClassifierTask())  # 12 batches
    with open(profiler.trace_path) as fh:
        names = [e.get("name", "") for e in json.load(fh)["traceEvents"]]
    steps = sorted(int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#"))
    assert steps == [2, 3, 4]
    for stage in ("forward+loss", "backward", "optimizer step"):
        assert names.count(f"taskfit: {stage}") == 3, stage  # once per recorded batch
    assert probe.on == [False, False, True, True, True] + [False] * 7  # recording in batches 2-4 only
    assert profiler.window_done and profiler._torch.step_num == 5  # stopped after batch 4: no step, no cycle since
    assert not torch.autograd._profiler_enabled()
    stages = profiler.stages
    assert stages["forward+loss"][0] == stages["backward"][0] == stages["optimizer step"][0] == 12


def test_torch_profiler_short_fit_writes_its_partial_window(tmp_path):
    profiler, probe = PyTorchProfiler(), ProfilerOn()
    seed_everything(0)
    trainer = Trainer(max_steps=4, default_root_dir=str(tmp_path), callbacks=[profiler, probe], **QUIET)
    trainer.fit(ClassifierTask())  # batches 0-3: the window is cut at the end of fit (#4: the fit's end)
    with open(profiler.trace_path) as fh:
        names = [e.get("name", "") for e in json.load(fh)["traceEvents"]]
    assert names.count("taskfit: backward") == 2 and "ProfilerStep#3" in names
    assert profiler.window_done and probe.on == [False, False, True, True]
    assert not torch.autograd._profiler_enabled()


def _fresh_module(tmp_path, monkeypatch) -> str:
    """A package never imported in this process, which imports a submodule of its own."""
    name = f"fresh_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("from . import inner\n")
    (tmp_path / name / "inner.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return name


class ImportsInSetup(Callback):
    def __init__(self, module: str) -> None:
        self.module = module

    def setup(self, trainer, task, stage) -> None:
        importlib.import_module(self.module)  # a lazy import, as TensorBoardLogger's of tensorboard


def test_simple_profiler_shows_first_imports_apart_from_setup(tmp_path, monkeypatch, capsys):
    """Issue 38: the first fit of a process spent most of "setup" importing; the imports are a row of their own,
    taken out of the stage or hook that did them, and the report says they are paid once per process."""
    name = _fresh_module(tmp_path, monkeypatch)
    before = list(sys.meta_path)
    profiler = SimpleProfiler(extended=True)
    seed_everything(0)
    Trainer(max_epochs=1, default_root_dir=str(tmp_path), callbacks=[profiler, ImportsInSetup(name)],
            **QUIET).fit(ClassifierTask())
    assert sys.meta_path == before  # the import clock is gone after the fit
    assert name in sys.modules and f"{name}.inner" in sys.modules
    stages = profiler.stages
    assert stages["imports"][0] >= 2 and set(profiler.imports) >= {name}  # the package and its submodule
    assert f"{name}.inner" not in profiler.imports  # nested: inside its package's time
    assert sum(seconds for _, seconds in stages.values()) == pytest.approx(profiler.fit_seconds, rel=1e-3)
    out = capsys.readouterr().out
    rows = out.splitlines()
    assert rows.index(next(r for r in rows if r.startswith("imports "))) == \
        rows.index(next(r for r in rows if r.startswith("setup "))) + 1
    assert "modules this process imported for the first time during the fit (slowest: " in out and name in out
    assert "a later fit in the same process does not pay them" in out

    again = SimpleProfiler()  # the same process, the modules imported: no row, no note
    seed_everything(0)
    Trainer(max_epochs=1, default_root_dir=str(tmp_path), callbacks=[again, ImportsInSetup(name)],
            **QUIET).fit(ClassifierTask())
    assert "imports" not in again.stages and "imported for the first time" not in capsys.readouterr().out


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
