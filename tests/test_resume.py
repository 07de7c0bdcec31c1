"""Exact resume: in this process, and with real processes and real signals (the contract of docs/checkpointing.md).

tests/resume_script.py runs every killed-process scenario in one interpreter, each training run in a forked child
that a real SIGKILL or SIGTERM stops; a resumed run must end with parameters ``torch.equal`` to an uninterrupted run
and log the same values after the resume point. The ddp test runs real gloo processes. The in-process tests cover
extending a run, the mid-epoch fast-forward, setup changes and a signal in this process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from taskfit import Trainer
from taskfit.callbacks import Callback
from taskfit.checkpoint import load_checkpoint
from tasks import RegressionTask, same_state
from torch.utils.data import DataLoader, Dataset

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCENARIOS = ("steps", "epochs", "write", "sigterm", "manual")


from tasks import checkpointing_trainer as _trainer
from tasks import seeded_task as _task


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TASKFIT_SEED", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "resume_script.py"), str(root)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


def _load(results, scenario):
    base = results / scenario
    with open(base / "result.json") as f:
        summary = json.load(f)
    logs = {}
    for name in ("final", "reference"):
        with open(base / f"{name}_log.json") as f:
            logs[name] = json.load(f)
    return base, summary, logs


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_interrupted_run_resumes_bitwise_equal(results, scenario):
    base, summary, logs = _load(results, scenario)
    expected = {"steps": [-9, -9, 0], "epochs": [-9, 0], "write": [-9, 0], "sigterm": [143, 0],
                "manual": [-9, 0]}[scenario]
    runs = summary["runs"]
    assert [r["status"] for r in runs] == expected, [r["output"][-2000:] for r in runs]
    assert summary["reference"]["status"] == 0, summary["reference"]["output"][-2000:]

    final = torch.load(base / "final_params.pt", weights_only=True)
    reference = torch.load(base / "reference_params.pt", weights_only=True)
    assert final.keys() == reference.keys()
    unequal = [k for k in final if not torch.equal(final[k], reference[k])]
    assert not unequal, f"{scenario}: parameters differ from the uninterrupted run: {unequal}"

    start = logs["final"]["start"]["global_step"]
    after = [r for r in logs["reference"]["records"] if r[0] > start]
    assert 0 < start < logs["reference"]["records"][-1][0]  # it really resumed, from the middle of the run
    assert after and logs["final"]["records"] == after  # every logged value after the resume point, bitwise


def test_resume_points(results):
    """Where each run resumed: the last checkpoint before the kill, mid-epoch or at an epoch end."""
    starts = {s: _load(results, s)[2]["final"]["start"] for s in SCENARIOS}
    # every_n_train_steps=4, accumulation 2: killed mid accumulation group at step 4+, then at step 8+ of epoch 1
    assert starts["steps"] == {"epoch": 1, "batches_done": 4, "global_step": 8}
    _, steps, _ = _load(results, "steps")
    assert "global step 4" in steps["runs"][1]["output"]  # the second run resumed from the first kill's step 4
    # epoch-end checkpoints only: killed in epoch 1, so it restarts epoch 1 from its first batch
    assert starts["epochs"] == {"epoch": 1, "batches_done": 0, "global_step": 6}
    # killed while writing the step-6 checkpoint: the step-3 one is intact and is what resumes
    assert starts["write"] == {"epoch": 0, "batches_done": 3, "global_step": 3}
    # SIGTERM after step 6: saved at that step boundary
    assert starts["sigterm"] == {"epoch": 0, "batches_done": 6, "global_step": 6}


def test_kill_during_write_leaves_previous_checkpoint_intact(results):
    base, summary, _ = _load(results, "write")
    killed = summary["runs"][0]
    tmp = killed["killed_tmp"]
    assert killed["left_tmp"], "the process was not killed in the middle of a write"
    name = os.path.basename(tmp)
    assert name.startswith(".") and name.endswith(".tmp")  # a partial file never carries a checkpoint's name
    # The folder as the killed run left it (the resumed run continues in it)
    folder = os.path.join(base, "after_run0")
    tmp = os.path.join(folder, name)
    assert os.path.getsize(tmp) > 2**20
    ckpts = sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))
    assert ckpts == ["epoch=0-step=3.ckpt", "last.ckpt"]
    for n in ckpts:  # every file with a checkpoint's name is complete
        assert load_checkpoint(os.path.join(folder, n))["loop"]["state"]["global_step"] == 3


def test_sigterm_saves_reports_and_exits_143(results):
    base, summary, _ = _load(results, "sigterm")
    run = summary["runs"][0]
    assert run["status"] == 128 + signal.SIGTERM == 143
    path = os.path.join(base, "runs", "version_0", "checkpoints", "last.ckpt")
    assert f"SIGTERM received; saved a checkpoint at epoch 0, batch 6, global step 6 to {path}" in run["output"]
    # The file as the signalled run left it (the resumed run continues in its folder)
    state = load_checkpoint(os.path.join(base, "after_run0", "last.ckpt"))["loop"]["state"]
    assert (state["global_step"], state["batches_done"], state["epoch_done"]) == (6, 6, False)


# ---- resuming in this process ------------------------------------------------------------------------------
class Counter(Callback):
    """A callback with state: counts the batches it saw; the count must survive a resume."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def test_stop_at_max_steps_mid_epoch_then_extend_is_exact(tmp_path):
    """The final last.ckpt of a run ended by max_steps mid-epoch continues it bitwise (found via "last" on disk)."""
    reference = _task(shuffle=True, dropout=0.2, val_n=16)
    _trainer(tmp_path / "ref", max_steps=13, enable_checkpointing=False, val_check_interval=3).fit(reference)
    short = _trainer(tmp_path / "run", max_steps=5, val_check_interval=3, callbacks=[Counter()])
    short.fit(_task(shuffle=True, dropout=0.2, val_n=16))
    state = load_checkpoint(short.checkpoint_callback.last_model_path)["loop"]["state"]
    assert (state["epoch"], state["batches_done"], state["epoch_done"]) == (0, 5, False)
    counter = Counter()
    extended = _trainer(tmp_path / "run", max_steps=13, val_check_interval=3, callbacks=[counter])
    task = _task(shuffle=True, dropout=0.2, val_n=16)
    extended.fit(task, ckpt_path="last")
    assert all(torch.equal(a, b) for a, b in zip(task.parameters(), reference.parameters()))
    # Without a logger the resume continues in the run directory it resumes (issue 47 row 1;
    # version_1 before)
    assert counter.batches == 13 and extended.log_dir.endswith("version_0")


class CountingDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.data = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.reads = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        self.reads.append(i)
        return self.data[i], self.data[i].sum()


class CountingTask(RegressionTask):
    def __init__(self) -> None:
        super().__init__(shuffle=True)
        self.counting = CountingDataset(64)

    def train_dataloader(self):
        return DataLoader(self.counting, batch_size=8, shuffle=True)


def test_mid_epoch_resume_fast_forwards_without_loading_skipped_batches(tmp_path):
    trainer = _trainer(tmp_path, max_steps=6)
    first = _task(CountingTask)
    trainer.fit(first)
    task = _task(CountingTask)
    _trainer(tmp_path, max_steps=8).fit(task, ckpt_path="last")
    assert len(task.counting.reads) == 2 * 8  # only the two remaining batches of the epoch were read
    # the run's epoch-0 order: RandomSampler's from the seed the epoch drew (in the checkpoint)
    seed = trainer.train_dataloader.sampler.order_seed
    order = torch.randperm(64, generator=torch.Generator().manual_seed(seed)).tolist()
    assert first.counting.reads == order[:48] and task.counting.reads == order[48:64]


def test_changed_setup_warns_and_says_what_changed(tmp_path):
    _trainer(tmp_path, max_steps=3, accumulate_grad_batches=1).fit(_task(batch_size=8))
    with pytest.warns(UserWarning, match=r"mid-epoch \(batch 3\)\) with a changed setup: batch size 8 -> 16; "
                                         r"accumulate_grad_batches 1 -> 2; batches per epoch 8 -> 4"):
        _trainer(tmp_path, max_steps=4, accumulate_grad_batches=2).fit(_task(batch_size=16), ckpt_path="last")


class CustomSamplerTask(RegressionTask):
    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8, sampler=list(range(len(self.data))))  # a custom sampler


def test_mid_epoch_resume_of_a_loader_taskfit_cannot_fast_forward_warns(tmp_path):
    _trainer(tmp_path, max_steps=3).fit(_task(CustomSamplerTask))
    with pytest.warns(UserWarning, match=r"Resuming mid-epoch \(batch 3\) .* taskfit cannot fast-forward it"):
        _trainer(tmp_path, max_steps=4).fit(_task(CustomSamplerTask), ckpt_path="last")


class SendSignal(Callback):
    order = 2000

    def __init__(self, signum: int, batch_idx: int) -> None:
        self.signum, self.batch_idx = signum, batch_idx

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if (trainer.state.epoch, trainer.state.batch_idx) == (0, self.batch_idx):
            os.kill(os.getpid(), self.signum)


def test_sigusr1_saves_at_the_next_step_boundary_and_exits_with_the_configured_code(tmp_path, capsys):
    settings = dict(max_epochs=2, accumulate_grad_batches=2, enable_checkpointing=False)
    reference = _task(shuffle=True, dropout=0.2)
    _trainer(tmp_path / "ref", **settings).fit(reference)
    trainer = _trainer(tmp_path, preempt_exit_code=99, callbacks=[SendSignal(signal.SIGUSR1, 4)], **settings)
    previous = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(SystemExit) as exit_info:
        trainer.fit(_task(shuffle=True, dropout=0.2))  # signalled after batch 4: inside an accumulation group
    assert exit_info.value.code == 99
    assert signal.getsignal(signal.SIGUSR1) is previous  # the handler is uninstalled again
    path = tmp_path / "version_0" / "checkpoints" / "last.ckpt"  # no ModelCheckpoint: the default place
    # saved at the end of the group (batch 5, step 3), never inside it
    notice = capsys.readouterr().err
    assert f"SIGUSR1 received; saved a checkpoint at epoch 0, batch 6, global step 3 to {path}" in notice
    resumed = _trainer(tmp_path, **settings)
    task = _task(shuffle=True, dropout=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same setup: no warning
        resumed.fit(task, ckpt_path="last")
    assert resumed.state.global_step == 8
    assert all(torch.equal(a, b) for a, b in zip(task.parameters(), reference.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_mixed_precision_extend_is_exact(tmp_path):
    """On a GPU with deterministic=True: CUDA RNG (dropout) and GradScaler state come back; the run continues bitwise."""
    settings = dict(accelerator="cuda", precision="16-mixed", deterministic=True, val_check_interval=3)
    reference = _task(shuffle=True, dropout=0.3, val_n=16)
    _trainer(tmp_path / "ref", max_steps=12, enable_checkpointing=False, **settings).fit(reference)
    short = _trainer(tmp_path / "run", max_steps=5, **settings)
    short.fit(_task(shuffle=True, dropout=0.3, val_n=16))
    ckpt = load_checkpoint(short.checkpoint_callback.last_model_path)
    assert ckpt["rng"][0]["cuda"] and ckpt["precision"]["scale"] > 0
    task = _task(shuffle=True, dropout=0.3, val_n=16)
    _trainer(tmp_path / "run", max_steps=12, **settings).fit(task, ckpt_path="last")
    for (name, a), b in zip(reference.state_dict().items(), task.state_dict().values()):
        assert torch.equal(a, b), name


# ---- ddp ----------------------------------------------------------------------------------------------------
def _ddp_trainer(root, **kwargs):
    from taskfit.callbacks import ModelCheckpoint

    callbacks = kwargs.pop("callbacks", [])
    return Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, accumulate_grad_batches=2,
                   log_every_n_steps=2, seed=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(root), callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1),
                                                          *callbacks], **kwargs)


def _ddp_task():
    torch.manual_seed(0)
    return RegressionTask(n=64, batch_size=4, shuffle=True, dropout=0.2)


@pytest.mark.timeout(300)
def test_ddp_preemption_and_resume_are_exact(tmp_path):
    """2 gloo processes. Run A is signalled (SIGTERM, rank 1 only) after step 5: both ranks stop at the next log
    interval (no collective per step), save at step 6 and exit 143. Run B resumes from A's mid-epoch step-2
    checkpoint and trains to step 6: its state there equals A's bitwise (weights, optimizer, RNG of each rank,
    logged values)."""
    from resume_script import Signal

    a = _ddp_trainer(tmp_path / "a", callbacks=[Signal(signal.SIGTERM, 1, 1, rank=1)])
    with pytest.raises(SystemExit) as exit_info:
        a.fit(_ddp_task())
    assert exit_info.value.code == 143
    folder = tmp_path / "a" / "version_0" / "checkpoints"
    preempted = load_checkpoint(str(folder / "last.ckpt"))
    assert preempted["loop"]["state"]["global_step"] == 6  # rank 0 was not signalled, yet it stopped there too
    assert len(preempted["rng"]) == 2  # one RNG state per rank
    assert not any(k.startswith("module.") for k in preempted["module"])
    mid = folder / "epoch=0-step=2.ckpt"
    assert load_checkpoint(str(mid))["loop"]["state"]["batches_done"] == 4  # mid-epoch (8 batches per rank)

    b = _ddp_trainer(tmp_path / "b", max_steps=6)
    b.fit(_ddp_task(), ckpt_path=str(mid))
    resumed = load_checkpoint(str(tmp_path / "b" / "version_0" / "checkpoints" / "last.ckpt"))
    for key in ("module", "optimizer", "schedulers", "rng", "logbook"):
        assert same_state(resumed[key], preempted[key]), key
    run_length = ("max_epochs", "max_steps")  # B was given max_steps=6: where the data is, not how long the run is
    assert same_state({k: v for k, v in resumed["data"].items() if k not in run_length},
                 {k: v for k, v in preempted["data"].items() if k not in run_length})
    state = {k: v for k, v in resumed["loop"]["state"].items() if k != "metrics"}
    assert state == {k: v for k, v in preempted["loop"]["state"].items() if k != "metrics"}


# ---- the gallery examples (run as scripts, in this process; the preemption demo starts real job processes) -----
def _run_example(name, tmp_path, monkeypatch, capsys, *args):
    import runpy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [name, *args])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runpy.run_path(os.path.join(ROOT, "examples", name), run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.timeout(180)
def test_preemption_example(tmp_path, monkeypatch, capsys):
    out = _run_example("preemption.py", tmp_path, monkeypatch, capsys)
    assert "1st start: exit status 143 (128 + SIGTERM)" in out and "SIGTERM received; saved a checkpoint" in out
    assert "Resumed from" in out and "epoch 1, batch" in out  # the requeued job continued mid-epoch
    assert "preempted + resumed run bitwise equal to the uninterrupted one: True" in out, out
    job = tmp_path / "taskfit_logs" / "preemption" / "demo_0" / "job"
    assert sorted(os.listdir(job)) == ["version_0"]  # the requeued job continued the run its checkpoint recorded


@pytest.mark.timeout(120)
def test_predict_from_checkpoint_example(tmp_path, monkeypatch, capsys):
    out = _run_example("predict_from_checkpoint.py", tmp_path, monkeypatch, capsys)
    accuracy = float(out.split("trainer.predict: accuracy ")[1].split()[0])
    assert accuracy > 0.85, out  # 3 short epochs; chance is 0.1
    assert "training=False" in out and "same predictions as the direct forward: True" in out, out
