"""Strategies in one process: choosing them, dp (a passthrough on the CPU), portable state dicts, ddp's errors.

The multi-process ddp runs (spawn and torchrun) are in tests/test_ddp.py.
"""
from __future__ import annotations

import contextlib
import importlib.util
import re

import pytest
import torch
import torch.distributed as dist
from taskfit import MisconfigurationError, Trainer, seed_everything
from taskfit.strategies.base import DataParallelStrategy, Strategy, normalize_state_dict
from taskfit.strategies.ddp import DDPStrategy
from tasks import ClassifierTask, RegressionTask
from torch import nn

no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---- choosing a strategy ----------------------------------------------------------------------------------
def test_strategy_names_pick_the_right_strategy(quiet):
    assert type(Trainer(**quiet).strategy) is Strategy  # "auto" on a single device
    ddp = Trainer(strategy="ddp", accelerator="cpu", devices=2, **quiet).strategy
    assert isinstance(ddp, DDPStrategy) and (ddp.world_size, ddp.rank, ddp.backend) == (2, 0, "gloo")
    assert ddp.is_main and ddp.device == torch.device("cpu") and not dist.is_initialized()  # joins only in launch
    assert isinstance(Trainer(accelerator="cpu", devices=2, **quiet).strategy, DDPStrategy)  # auto, 2 devices
    spawn = Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, **quiet).strategy  # Lightning's name
    assert isinstance(spawn, DDPStrategy) and spawn.world_size == 2
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match=r"strategy='dp' needs CUDA GPUs; this run uses one device \(cpu\)"):
            dp = Trainer(strategy="dp", **quiet).strategy
        assert isinstance(dp, DataParallelStrategy) and dp.device_ids == [] and dp.world_size == 1


def test_under_torchrun_auto_is_ddp_with_the_launchers_ranks(monkeypatch, quiet):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    trainer = Trainer(accelerator="cpu", **quiet)
    s = trainer.strategy
    assert isinstance(s, DDPStrategy) and (s.rank, s.local_rank, s.world_size, s.num_processes) == (3, 1, 4, 2)
    assert not trainer.is_main  # only global rank 0 logs and writes
    with pytest.raises(MisconfigurationError, match=r"started by torchrun with WORLD_SIZE=4, but strategy='single' "
                                                    r"would train a separate copy"):
        Trainer(strategy="single", **quiet)


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="deepspeed"), r"Unknown strategy 'deepspeed'"),
    (dict(devices=0), r"Trainer\(devices=0\) is not valid"),
    (dict(devices="two"), r"Trainer\(devices='two'\) is not valid"),
    (dict(devices=[0, 0]), r"Trainer\(devices=\[0, 0\]\) names a device twice"),
    (dict(strategy="single", devices=2), r"strategy='single' runs on one device, got devices=2"),
    (dict(strategy="ddp", accelerator="cpu", start_method="fork"), None),
])
def test_bad_strategy_arguments_fail_before_work(kwargs, message, quiet):
    if message is None:  # DDPStrategy's own options
        with pytest.raises(MisconfigurationError, match=r"DDPStrategy\(start_method='fork'\) is not supported"):
            DDPStrategy("cpu", 2, start_method="fork")
        return
    with pytest.raises(MisconfigurationError, match=message) as info:
        Trainer(**kwargs, **quiet)
    assert "HINT:" in str(info.value)


def test_ddp_rejects_an_unknown_reduction():
    with pytest.raises(MisconfigurationError, match=r"all_reduce\(op='avg'\) is not supported"):
        DDPStrategy("cpu", 2).all_reduce(torch.ones(2), op="avg")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_ddp_on_cuda_without_cuda_is_one_clear_error(quiet):
    with pytest.raises(MisconfigurationError, match=r'accelerator="cuda" was requested but CUDA is not available'):
        Trainer(strategy="ddp", accelerator="cuda", devices=2, **quiet)


# ---- dp ----------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU passthrough path")
def test_dp_on_cpu_trains_like_single_and_saves_plain_keys(tmp_path, quiet):
    seed_everything(0)
    task = ClassifierTask()
    reference = ClassifierTask()
    reference.load_state_dict(task.state_dict())
    common = dict(max_epochs=2, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                  logger=False)
    with pytest.warns(UserWarning, match="needs CUDA GPUs"):
        trainer = Trainer(strategy="dp", default_root_dir=str(tmp_path / "dp"), **common)
    torch.manual_seed(1)  # each fit from the same global RNG: a shuffled order is drawn from it
    metrics = trainer.fit(task)
    torch.manual_seed(1)
    Trainer(strategy="single", default_root_dir=str(tmp_path / "single"), **common).fit(reference)
    for key, value in params(reference).items():  # DataParallel without CUDA calls the module as it is
        assert torch.equal(task.state_dict()[key], value), key

    wrapped = trainer.model
    assert isinstance(wrapped, nn.DataParallel) and wrapped.device_ids == []  # the real wrapper, passthrough
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    saved = trainer.strategy.module_state_dict(wrapped)
    assert list(saved) == list(reference.state_dict())
    ckpt = torch.load(trainer.checkpoint_callback.last_model_path, weights_only=True)
    assert list(ckpt["module"]) == list(reference.state_dict())  # no `module.` in the checkpoint either
    (again,) = Trainer(**quiet).validate(ClassifierTask(), ckpt_path=trainer.checkpoint_callback.last_model_path)
    assert again["val/acc"] == pytest.approx(metrics["val/acc"], abs=1e-6)
    assert again["val/loss"] == pytest.approx(metrics["val/loss"], abs=1e-6)


@two_gpus
def test_dp_over_gpus_warns_once_handles_a_short_last_batch_and_saves_plain_keys(tmp_path, quiet):
    seed_everything(0)
    task = RegressionTask(n=2 * 8 + 1, batch_size=8)  # the last batch holds 1 sample for 2 GPUs
    with pytest.warns(UserWarning, match=r"copies the module to GPUs \[0, 1\] on every step") as record:
        trainer = Trainer(strategy="dp", devices=[0, 1], max_epochs=2, **quiet)
    assert len([w for w in record if "copies the module" in str(w.message)]) == 1
    trainer.fit(task)
    assert trainer.state.global_step == 2 * 3
    assert isinstance(trainer.model, nn.DataParallel) and trainer.model.device_ids == [0, 1]
    assert not any(k.startswith("module.") for k in trainer.strategy.module_state_dict(trainer.model))
    assert trainer.strategy.device == torch.device("cuda", 0)


@no_cuda
def test_single_on_a_chosen_gpu(quiet):
    index = torch.cuda.device_count() - 1
    trainer = Trainer(strategy="single", devices=[index], max_epochs=1, **quiet)
    task = RegressionTask()
    trainer.fit(task)
    assert next(task.parameters()).device == torch.device("cuda", index)


# ---- portable state dicts -----------------------------------------------------------------------------------
def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_normalize_state_dict_strips_wrapper_prefixes():
    model = _model()
    plain = model.state_dict()
    wrapped_dp = nn.DataParallel(model).state_dict()  # `module.` (CPU passthrough still prefixes)
    compiled = torch.compile(model).state_dict()  # `_orig_mod.` (compiles lazily: nothing is compiled here)
    both = torch.compile(nn.DataParallel(model)).state_dict()  # `_orig_mod.module.`
    assert all(k.startswith("module.") for k in wrapped_dp) and all(k.startswith("_orig_mod.") for k in compiled)
    assert all(k.startswith("_orig_mod.module.") for k in both)
    for foreign in (wrapped_dp, compiled, both):
        normalized = normalize_state_dict(foreign)
        assert list(normalized) == list(plain)
        assert normalized._metadata[""] == plain._metadata[""]  # BatchNorm's version survives the renaming
        fresh = _model()
        fresh.load_state_dict(normalized)  # strict
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in plain.items())
    assert normalize_state_dict(plain) is plain


def test_normalize_state_dict_keeps_a_real_child_named_module():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    holder = Holder()
    assert list(holder.state_dict()) == ["module.weight", "module.bias"]
    # With the module to load into, stripping stops once the keys fit it ...
    assert normalize_state_dict(holder.state_dict(), reference=holder) is not None
    assert list(normalize_state_dict(holder.state_dict(), reference=holder)) == ["module.weight", "module.bias"]
    foreign = nn.DataParallel(holder).state_dict()
    assert list(normalize_state_dict(foreign, reference=holder)) == ["module.weight", "module.bias"]
    # ... without it, every prefix shared by all keys goes (documented: pass reference for such modules).
    assert list(normalize_state_dict(foreign)) == ["weight", "bias"]


def test_a_foreign_dataparallel_state_dict_loads_through_ckpt_path(tmp_path, quiet):
    seed_everything(0)
    source = ClassifierTask()
    path = tmp_path / "foreign.pt"
    torch.save(nn.DataParallel(source).state_dict(), path)  # what a hand-written DataParallel loop saves
    (from_file,) = Trainer(**quiet).validate(ClassifierTask(), ckpt_path=str(path))
    (direct,) = Trainer(**quiet).validate(source)
    assert from_file == pytest.approx(direct, abs=1e-7)


# ---- ddp in this process --------------------------------------------------------------------------------------
def test_ddp_with_one_device_runs_here_and_leaves_no_process_group(quiet):
    seed_everything(0)
    task = RegressionTask(shuffle=True)
    reference = RegressionTask(shuffle=True)
    reference.load_state_dict(task.state_dict())
    common = dict(max_epochs=2, accumulate_grad_batches=2, **quiet)
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=1, **common)
    torch.manual_seed(1)  # each fit from the same global RNG: a shuffled order is drawn from it
    trainer.fit(task)
    assert not dist.is_initialized()  # the group of one lived for the run only
    assert trainer.strategy.world_size == 1 and trainer.state.global_step == 2 * 4
    torch.manual_seed(1)
    Trainer(**common).fit(reference)
    for key, value in params(reference).items():
        assert torch.allclose(task.state_dict()[key], value, atol=1e-6), key


@pytest.mark.integration  # refused before any process starts (the tier rule reads devices=2 as several)
def test_ddp_with_a_task_that_cannot_be_pickled_says_how_to_fix_it(quiet):
    class LocalTask(RegressionTask):  # defined in a function: spawn cannot send it to the workers
        pass

    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, **quiet)
    with pytest.raises(MisconfigurationError, match=r"strategy='ddp' sends the Trainer and the task to 2 new "
                                                    r"processes, but they cannot be pickled") as info:
        trainer.fit(LocalTask())
    assert "top level of a module" in str(info.value) and "torchrun" in str(info.value)


# ---- the dp example -------------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="the example uses scikit-learn's digits")
def test_dp_example_runs_and_its_checkpoint_loads_into_a_plain_module(tmp_path, capsys):
    from taskfit.examples.dp import main  # in this process: dp starts no processes, and torch is imported already

    warns = pytest.warns(UserWarning, match="strategy='dp' needs CUDA GPUs") if not torch.cuda.is_available() \
        else contextlib.nullcontext()
    with warns:
        reloaded = main(["--quick", "--root", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    match = re.search(r"validation accuracy: ([0-9.]+), reloaded from last.ckpt into a plain module: ([0-9.]+)", out)
    assert match, out[-2000:]
    accuracy, again = map(float, match.groups())
    assert accuracy >= 0.85 and again == accuracy and reloaded["val/acc"] == pytest.approx(accuracy, abs=1e-4)
    runs = list((tmp_path / "runs").glob("version_*"))
    assert len(runs) == 1 and list(runs[0].rglob("events.out.tfevents.*"))


# ---- gradient accumulation: which micro-batches reduce gradients over ranks ------------------------------------
def test_under_accumulation_only_the_micro_batch_that_steps_syncs_gradients(quiet):
    # ddp/fsdp skip the gradient all-reduce on the micro-batches that do not step: the loop tells the strategy
    # before each one (groups of 3 over 5 batches: [0, 1, 2], [3, 4]); without accumulation it never asks.
    calls = []

    class Recording(Strategy):
        def gradient_sync(self, wrapped, enabled):
            calls.append((wrapped is trainer.model, enabled))

    trainer = Trainer(strategy=Recording(), max_epochs=1, accumulate_grad_batches=3, **quiet)
    trainer.fit(RegressionTask(n=40, batch_size=8))
    assert calls == [(True, False), (True, False), (True, True), (True, False), (True, True),
                     (True, True)]  # the last: fit's end turns it back on
    calls.clear()
    Trainer(strategy=Recording(), max_epochs=1, **quiet).fit(RegressionTask(n=40, batch_size=8))
    assert calls == []
