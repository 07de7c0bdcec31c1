"""ddp for real: 2 gloo processes on the CPU, started by the Trainer (from pytest and from a script) and by torchrun.

A fresh set of processes costs seconds (each imports torch, and DDP imports torch._dynamo); the Trainer's
forkserver pays that once per pytest process, torchrun and a script every time. So each test checks several
things of one run. The tasks and callbacks live in tests/tasks.py: the workers unpickle them by reference, so
they must be importable.
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from taskfit import Trainer, seed_everything
from tasks import (
    ClassifierTask,
    EpochAccClassifierTask,
    RaiseAtStep,
    RankProbe,
    RegressionTask,
    SignalAt,
    SlowSteps,
    one_process_of_ddp,
)

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("TASKFIT_SEED", None)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _single_reference(epochs: int, root: Path, **kwargs) -> tuple[ClassifierTask, dict[str, float], Trainer]:
    """The 1-process run every ddp run is compared with: batch 16 = 2 ranks x 8, same seed, same
    data order (ddp's: tasks.one_process_of_ddp)."""
    seed_everything(0)
    task = one_process_of_ddp(EpochAccClassifierTask)(batch_size=16)
    trainer = Trainer(max_epochs=epochs, default_root_dir=str(root), **QUIET, **kwargs)
    return task, trainer.fit(task), trainer


def _assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)  # same keys, no `module.` prefix
    for key, value in expected.items():
        assert torch.allclose(got[key], value, atol=1e-6, rtol=0), (key, (got[key] - value).abs().max())


def test_ddp_spawn_equals_one_process_and_checkpoints_cross_over(tmp_path, capfd):
    """2 ranks x batch 8 == 1 process x batch 16, across a single -> ddp resume and a ddp -> single load.

    Epoch 1 runs in one process and writes a checkpoint; ddp (spawned from pytest) resumes it for epoch 2, with
    gradient accumulation, so no_sync must skip every other all-reduce. Validation uses 45 samples (23 + 22 per
    rank), and its metrics must equal the single-process ones.
    """
    common = dict(accumulate_grad_batches=2, num_sanity_val_steps=0)
    reference, expected, _ = _single_reference(2, tmp_path / "reference", enable_checkpointing=False, **common)

    seed_everything(0)
    first = one_process_of_ddp(EpochAccClassifierTask)(batch_size=16)
    single = Trainer(max_epochs=1, default_root_dir=str(tmp_path / "single"), **QUIET, **common)
    single.fit(first)
    single_ckpt = single.checkpoint_callback.last_model_path

    task = EpochAccClassifierTask(batch_size=8)  # per rank
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, callbacks=[RankProbe(str(tmp_path))],
                      default_root_dir=str(tmp_path / "ddp"), **QUIET, **common)
    capfd.readouterr()
    metrics = trainer.fit(task, ckpt_path=single_ckpt)
    printed = capfd.readouterr().out  # the workers write to this process's stdout as it is now
    assert printed.count("Resumed from") == 1, printed  # rank 0 only

    # the parent holds rank 0's results: trained weights, state, run directory, the checkpoint callback's paths
    _assert_same_weights(task.state_dict(), reference.state_dict())
    assert trainer.state.global_step == 2 * 3 and trainer.state.epoch == 2 and metrics == trainer.state.metrics
    for key in ("val/acc", "val/loss", "val/acc_batch", "train/loss_epoch", "train/acc_batch_epoch"):
        assert metrics[key] == pytest.approx(expected[key], abs=1e-6), key
    assert Path(trainer.log_dir).parent == tmp_path / "ddp" and Path(trainer.log_dir).is_dir()
    assert [p.name for p in (tmp_path / "ddp").iterdir()] == [Path(trainer.log_dir).name]  # rank 0 wrote alone

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["is_main"]) for r in ranks] == [(0, 2, True), (1, 2, False)]
    assert ranks[0]["log_dir"] == ranks[1]["log_dir"] == trainer.log_dir  # decided on rank 0, broadcast
    assert ranks[0]["data_seed"] == ranks[1]["data_seed"] == 0
    assert [r["allreduces"] for r in ranks] == [3, 3]  # 6 micro-batches in epoch 2, all-reduced only when stepping
    assert all(k.startswith("module.") for k in ranks[0]["wrapper"])  # really DDP-wrapped ...
    _assert_same_weights(ranks[0]["saved"], reference.state_dict())  # ... and saved without the prefix

    # ddp's checkpoint loads into a single-process run and gives the same validation metrics
    ddp_ckpt = trainer.checkpoint_callback.last_model_path
    assert Path(ddp_ckpt).is_file() and Path(trainer.log_dir) in Path(ddp_ckpt).parents
    assert list(torch.load(ddp_ckpt, weights_only=True)["module"]) == list(reference.state_dict())
    (again,) = Trainer(enable_checkpointing=False, **QUIET).validate(ClassifierTask(), ckpt_path=ddp_ckpt)
    for key in ("val/acc", "val/loss", "val/acc_batch"):
        assert again[key] == pytest.approx(metrics[key], abs=1e-6), key

    # a second launch from the same Trainer: test on 45 samples, sharded 23 + 22, equals one process
    (tested,) = trainer.test(task)
    (expected_test,) = Trainer(enable_checkpointing=False, **QUIET).test(reference)
    assert tested.keys() == expected_test.keys() and trainer.state.metrics["test/acc"] == tested["test/acc"]
    for key, value in expected_test.items():
        assert tested[key] == pytest.approx(value, abs=1e-6), key


def test_ddp_spawn_a_rank_that_raises_ends_the_run_with_its_error(tmp_path):
    """1000 epochs, but rank 1 raises at step 3: the run ends with that error. Rank 0 is stopped at once, not by
    its collectives' timeout (set to 900 s here, far past pytest's 300 s, so a rank left waiting fails the test)."""
    from taskfit.strategies.ddp import DDPStrategy

    trainer = Trainer(strategy=DDPStrategy("cpu", 2, timeout=900), max_epochs=1000, callbacks=[RaiseAtStep(3, 1)],
                      enable_checkpointing=False, default_root_dir=str(tmp_path), **QUIET)
    with pytest.raises(ValueError, match="boom at step 3 on rank 1") as info:
        trainer.fit(RegressionTask())
    assert "raised on ddp rank 1 of 2" in "".join(getattr(info.value, "__notes__", [])) or sys.version_info < (3, 11)
    assert "on_train_batch_start" in str(info.value.__cause__)  # the worker's traceback comes along


def test_ddp_spawn_a_preemption_signal_to_the_parent_reaches_every_rank(tmp_path, capfd):
    """A scheduler signals the process it started: the workers get it, agree, save one checkpoint and exit, and
    the parent exits with their code (128 + SIGTERM)."""
    seen = []

    def parent_handler(signum, frame):  # without forwarding, the signal would stop here and fit would run on
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, parent_handler)
    try:  # steps of 0.2 s: the parent's forwarding (a few ms, more on a busy machine) arrives within the next step
        trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=5, log_every_n_steps=1,
                          callbacks=[SlowSteps(0.2), SignalAt(step=2, pid=os.getpid(), signum=signal.SIGTERM)],
                          default_root_dir=str(tmp_path), **QUIET)
        with pytest.raises(SystemExit) as info:
            trainer.fit(RegressionTask())  # 5 epochs x 8 steps without the signal
        assert info.value.code == 128 + signal.SIGTERM and not seen
        # rank 0 reports on this process's stderr as it is now, even from a forkserver started by an earlier test
        assert capfd.readouterr().err.count("SIGTERM received; saved a checkpoint") == 1
        assert signal.getsignal(signal.SIGTERM) is parent_handler  # the parent's own handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
    (last,) = tmp_path.rglob("last.ckpt")
    state = torch.load(last, weights_only=True)["loop"]["state"]
    assert 2 <= state["global_step"] <= 4 and state["epoch"] == 0  # stopped within a step or two of the signal


def test_ddp_under_torchrun_equals_one_process_and_a_failing_rank_ends_the_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import torch
        from tasks import ClassifierTask, RaiseAtStep
        from taskfit import Trainer, seed_everything

        quiet = {QUIET!r}
        seed_everything(0)
        task = ClassifierTask(batch_size=8)
        trainer = Trainer(accelerator="cpu", max_epochs=2, enable_checkpointing=False, default_root_dir=sys.argv[1],
                          **quiet)  # strategy "auto": ddp under torchrun
        metrics = trainer.fit(task)
        if trainer.is_main:
            torch.save({{"weights": task.state_dict(), "metrics": metrics, "world_size": trainer.strategy.world_size,
                        "strategy": trainer.strategy.name}}, sys.argv[1] + "/result.pt")
        print(f"rank {{trainer.strategy.rank}} trained; failing run starts at {{time.time()}}", flush=True)
        Trainer(accelerator="cpu", max_epochs=1000, enable_checkpointing=False, callbacks=[RaiseAtStep(3, 1)],
                default_root_dir=sys.argv[1], **quiet).fit(task)
    """))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(script), str(tmp_path)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=240)  # a rank left waiting for the 600 s process-group timeout: caught here
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "ValueError: boom at step 3 on rank 1" in output, output[-4000:]
    assert len(re.findall(r"failing run starts at ([0-9.]+)", output)) == 2, output[-4000:]

    saved = torch.load(tmp_path / "result.pt", weights_only=True)
    assert (saved["world_size"], saved["strategy"]) == (2, "ddp")
    reference, expected, _ = _single_reference(2, tmp_path / "reference", enable_checkpointing=False)
    _assert_same_weights(saved["weights"], reference.state_dict())
    for key in ("val/acc", "val/loss", "val/acc_batch"):
        assert saved["metrics"][key] == pytest.approx(expected[key], abs=1e-6), key


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="the example uses scikit-learn's digits")
def test_ddp_example_spawned_from_a_plain_script(tmp_path):
    """`python examples/ddp_torchrun.py`: the Trainer starts the 2 processes; only rank 0 prints and writes."""
    env = _env()
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "ddp_torchrun.py"), "--quick", "--accelerator",
                             "cpu", "--root", str(tmp_path / "runs")], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = re.findall(r"validation accuracy: ([0-9.]+) with 2 processes of batch 32", result.stdout)
    assert len(lines) == 1 and float(lines[0]) >= 0.85, result.stdout[-2000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and list(runs[0].rglob("events.out.tfevents.*")) and list(runs[0].rglob("last.ckpt"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs 2 CUDA devices")
def test_ddp_nccl_on_two_gpus_equals_one_process(tmp_path):
    reference, expected, _ = _single_reference(1, tmp_path / "reference", enable_checkpointing=False,
                                               accelerator="cpu")
    seed_everything(0)
    task = ClassifierTask(batch_size=8)
    trainer = Trainer(strategy="ddp", accelerator="cuda", devices=2, max_epochs=1, enable_checkpointing=False,
                      default_root_dir=str(tmp_path), **QUIET)
    assert trainer.strategy.backend == "nccl"
    metrics = trainer.fit(task)
    for key, value in reference.state_dict().items():
        assert torch.allclose(task.state_dict()[key].cpu(), value, atol=1e-5), key
    assert metrics["val/acc"] == pytest.approx(expected["val/acc"], abs=1e-6)
