"""fsdp for real: FSDP2 (``fully_shard``) over 2 gloo processes on the CPU, with sharded (DCP) checkpoints.

Process start-up dominates (the Trainer's forkserver pays the imports once per pytest process), so one module-scoped
set of runs (``runs``) is checked by several tests: the same MLP trained by one process with batch 16, by fsdp and by
ddp with 2 x batch 8, with gradient accumulation, clipping and validation on 45 samples whose shards run a different
number of batches per rank (23 samples = 3 batches of 11 on rank 0, 22 = 2 on rank 1). The tasks: tests/fsdp_tasks.py.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tasks import one_process_of_ddp
from fsdp_tasks import (
    BatchNormTask,
    HeadOutsideForward,
    KillAt,
    ManualTwoOptimizers,
    MLPTask,
    ShardProbe,
    TransformerTask,
)
from taskfit import (
    CheckpointError,
    MisconfigurationError,
    Strategy,
    TaskModuleError,
    Trainer,
    seed_everything,
    sharded_checkpoint,
    sharded_index,
)
from taskfit.callbacks import ModelCheckpoint
from taskfit.checkpoint.files import CheckpointWriter
from taskfit.checkpoint import load_checkpoint
from taskfit.checkpoint.sharded import MARKER, STATE_FILE, consolidate, load_skeleton, read_shards, save_sharded
from taskfit.consolidate import main as consolidate_main
from taskfit.strategies.fsdp import FSDPStrategy
from tasks import same_state
from torch import nn

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)
COMMON = dict(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.5, **QUIET)


def _fit(task_cls, batch_size, root, strategy="single", callbacks=(), ckpt_path=None, **kwargs):
    seed_everything(0)
    # batch 16 is one process (= 2 ranks x 8): ddp's data order, whole (tasks.one_process_of_ddp)
    task = (one_process_of_ddp(task_cls) if batch_size == 16 else task_cls)(batch_size=batch_size)
    # a save every 2 steps, unless the caller turns checkpointing off (a ModelCheckpoint then is
    # refused, as Lightning refuses it)
    saves = [ModelCheckpoint(every_n_train_steps=2, every_n_epochs=None, save_top_k=-1)]
    if kwargs.get("enable_checkpointing") is False:
        saves = []
    trainer = Trainer(strategy=strategy, default_root_dir=str(root), callbacks=[*saves, *callbacks],
                      **{**COMMON, **kwargs})
    return task, trainer.fit(task, ckpt_path=ckpt_path), trainer


def _fsdp(**kwargs):
    return FSDPStrategy("cpu", 2, **kwargs)


def _close(got, expected, atol=1e-5):
    assert list(got) == list(expected)
    worst = {k: (got[k] - v).abs().max().item() for k, v in expected.items()}
    assert max(worst.values()) <= atol, worst
    return max(worst.values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    single, single_metrics, _ = _fit(MLPTask, 16, root / "single")
    task, metrics, trainer = _fit(MLPTask, 8, root / "fsdp", _fsdp(auto_wrap_policy={nn.Linear}),
                                  callbacks=[ShardProbe(str(root))])
    ddp, ddp_metrics, _ = _fit(MLPTask, 8, root / "ddp", "ddp", accelerator="cpu", devices=2)
    return dict(root=root, single=single, single_metrics=single_metrics, task=task, metrics=metrics, trainer=trainer,
                ddp=ddp, ddp_metrics=ddp_metrics, folder=root / "fsdp" / "version_0" / "checkpoints")


def test_fsdp_equals_one_process_and_ddp(runs):
    """2 ranks x batch 8 == 1 process x batch 16 == ddp, after 6 steps with accumulation 2 and clipping (the clip
    norm is the global one: clip_grad_norm_ over the DTensor gradients); validation metrics equal too."""
    _close(runs["task"].state_dict(), runs["single"].state_dict())  # the parent holds rank 0's gathered weights
    _close(runs["task"].state_dict(), runs["ddp"].state_dict())
    for key in ("val/acc", "val/loss", "train/loss_epoch"):
        assert runs["metrics"][key] == pytest.approx(runs["single_metrics"][key], abs=1e-6), key
        assert runs["metrics"][key] == pytest.approx(runs["ddp_metrics"][key], abs=1e-6), key
    assert runs["trainer"].state.global_step == 6 and runs["trainer"].strategy.name == "fsdp"
    # the sanity check (2 batches each), then 2 validations of 3 batches (23 samples) on rank 0, 2 (22) on rank 1:
    # the ranks ran different numbers of forwards, which FSDP's all-gathers would deadlock on if not gathered first
    forwards = [torch.load(runs["root"] / f"shards_rank{r}.pt", weights_only=True)["eval_forwards"] for r in (0, 1)]
    assert forwards == [2 + 2 * 3, 2 + 2 * 2]


def test_each_rank_holds_half_of_the_parameters_and_optimizer_state(runs):
    ranks = [torch.load(runs["root"] / f"shards_rank{r}.pt", weights_only=True) for r in (0, 1)]
    total = ranks[0]["param_global"]
    assert total == 8 * 32 + 32 + 32 * 32 + 32 + 32 * 3 + 3 == 1443
    assert [r["param_local"] for r in ranks] == [738, 705]  # rows split 16+16, 16+16, 2+1 (dim 0, rounded up)
    assert sum(r["param_local"] for r in ranks) == total and all(r["sharded"] for r in ranks)
    assert [r["state_local"] for r in ranks] == [738, 705]  # SGD momentum: one buffer per parameter, sharded alike
    assert ranks[0]["units"] == ["<root>", "net.0", "net.2", "net.4"] and ranks[0]["class"] == "FSDPMLPTask"


def test_sharded_checkpoint_layout_is_complete_safe_and_one_directory_per_checkpoint(runs):
    folder = runs["folder"]
    assert sorted(os.listdir(folder)) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=1-step=6.ckpt",
                                          "last.ckpt"]  # no temporary directory left behind
    last = folder / "last.ckpt"
    assert sorted(os.listdir(last)) == [".metadata", MARKER, "__0_0.distcp", "__1_0.distcp", STATE_FILE]
    assert os.stat(last / "__0_0.distcp").st_ino == os.stat(folder / "epoch=1-step=6.ckpt" / "__0_0.distcp").st_ino
    state = torch.load(last / STATE_FILE, weights_only=True)  # the run's state; meta tensors where the shards are
    assert state["loop"]["state"]["global_step"] == 6 and len(state["rng"]) == 2
    assert all(t.is_meta for t in state["module"].values()) and state["module"]["net.4.weight"].shape == (3, 32)
    assert load_checkpoint(str(folder / "epoch=1-step=4.ckpt"))["data"]["batches_done"] == 2  # mid-epoch


def _wide_fit(folder, ckpt_path=None):
    """An fsdp fit of an MLP wide enough for shard files of about 260 KiB, checkpoints every 2
    steps in ``folder``."""
    seed_everything(0)
    task = MLPTask(batch_size=8, hidden=256)
    checkpointing = ModelCheckpoint(dirpath=str(folder), every_n_train_steps=2, every_n_epochs=None,
                                    save_top_k=-1)
    trainer = Trainer(strategy=_fsdp(auto_wrap_policy={nn.Linear}),
                      default_root_dir=str(folder.parent), callbacks=[checkpointing],
                      **{**COMMON, "max_epochs": 1})
    trainer.fit(task, ckpt_path=ckpt_path)
    return task, trainer


def test_bytes_flipped_mid_shard_are_refused_and_last_falls_back(tmp_path, capfd):
    """Issue 47, row 3: 16 bytes flipped in the middle of a shard file of last.ckpt, beyond the
    64 KiB at each end that the marker's fingerprint covers. Every byte is checksummed: loading it
    is refused by name, and fit(ckpt_path="last") resumes from the newest intact checkpoint instead,
    saying so, and ends exactly where the undamaged run ended. (Before: loaded silently, with wrong
    weights.)"""
    folder = tmp_path / "ckpts"
    reference, _ = _wide_fit(folder)
    last = folder / "last.ckpt"
    # a hard link of the step=3 checkpoint's shard file: both are damaged
    shard = last / "__0_0.distcp"
    size = os.path.getsize(shard)
    assert size > 3 * 65536
    with open(shard, "r+b") as fh:
        fh.seek(size // 2)
        data = fh.read(16)
        fh.seek(size // 2)
        fh.write(bytes(b ^ 0xFF for b in data))
    damaged = (r"Sharded checkpoint .*last\.ckpt is damaged: the bytes of its shard file "
               r"__0_0\.distcp do not match")
    with pytest.raises(CheckpointError, match=damaged):
        MLPTask.load_from_checkpoint(str(last))
    with pytest.raises(CheckpointError, match=damaged):
        consolidate(str(last), str(tmp_path / "out.ckpt"))
    capfd.readouterr()
    # (the warning comes from rank 0's process)
    resumed, trainer = _wide_fit(folder, ckpt_path="last")
    out, err = capfd.readouterr()
    assert re.search(r"Skipped .*/last\.ckpt: Sharded checkpoint .*/last\.ckpt is damaged: .*; "
                     r"resuming from .*/epoch=0-step=2\.ckpt, the newest intact checkpoint", err)
    assert "Resumed from" in out and "epoch=0-step=2.ckpt: epoch 0, batch 4, global step 2." in out
    assert trainer.state.resumed and trainer.state.global_step == 3 and "Traceback" not in err
    expected = reference.state_dict()
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in expected.items())


def test_sigkill_mid_epoch_then_resume_from_last_is_bitwise_exact(runs, tmp_path):
    """Rank 1 is SIGKILLed at batch 2 of epoch 1; the resume from last (step 4, mid-epoch) ends bitwise equal to the
    uninterrupted run: weights, optimizer state, RNG of each rank, logged values."""
    with pytest.raises(RuntimeError, match="fsdp rank 1 of 2 was killed by SIGKILL"):
        _fit(MLPTask, 8, tmp_path, _fsdp(auto_wrap_policy={nn.Linear}), callbacks=[KillAt(1, 2)])
    assert load_checkpoint(str(tmp_path / "version_0" / "checkpoints" / "last.ckpt"))["loop"]["state"][
        "global_step"] == 4
    task, metrics, trainer = _fit(MLPTask, 8, tmp_path, _fsdp(auto_wrap_policy={nn.Linear}), ckpt_path="last")
    assert trainer.state.resumed and trainer.state.global_step == 6
    got, expected = task.state_dict(), runs["task"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    # The resume continues in the run directory it resumes (issue 47 row 1; version_1 before)
    resumed = consolidate(str(tmp_path / "version_0" / "checkpoints" / "last.ckpt"),
                          str(tmp_path / "resumed.ckpt"))
    reference = consolidate(str(runs["folder"] / "last.ckpt"), str(tmp_path / "reference.ckpt"))
    a, b = (torch.load(p, weights_only=True) for p in (resumed, reference))
    for key in ("module", "optimizer", "schedulers", "rng"):
        assert same_state(a[key], b[key]), key
    assert {k: v for k, v in metrics.items() if k != "train/loss"} == \
        {k: v for k, v in runs["metrics"].items() if k != "train/loss"}


def test_reshard_two_processes_to_one_validates_with_the_same_metrics(runs):
    """The 2-rank checkpoint read by 1 fsdp process (a 1-rank mesh) and by strategy="single": same val metrics."""
    last = str(runs["folder"] / "last.ckpt")
    one = Trainer(strategy=FSDPStrategy("cpu", 1), enable_checkpointing=False, **QUIET)
    (fsdp_one,) = one.validate(MLPTask(batch_size=8), ckpt_path=last)
    (single,) = Trainer(enable_checkpointing=False, **QUIET).validate(MLPTask(batch_size=8), ckpt_path=last)
    for key in ("val/acc", "val/loss"):
        assert fsdp_one[key] == pytest.approx(runs["metrics"][key], abs=1e-6), key
        assert single[key] == pytest.approx(runs["metrics"][key], abs=1e-6), key


def test_reshard_one_process_to_two_continues_the_run(runs, tmp_path, capfd):
    """Epoch 1 by 1 fsdp process (batch 16), epoch 2 resumed by 2 (batch 8 each): the weights of the 1-process run."""
    _fit(MLPTask, 16, tmp_path, FSDPStrategy("cpu", 1, auto_wrap_policy={nn.Linear}), max_epochs=1)
    ckpt = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert sorted(p for p in os.listdir(ckpt) if p.endswith(".distcp")) == ["__0_0.distcp"]
    capfd.readouterr()
    task, _, _ = _fit(MLPTask, 8, tmp_path, _fsdp(), ckpt_path=str(ckpt))  # root-only sharding now
    assert "batch size 16 -> 8; world size 1 -> 2" in capfd.readouterr().err  # each rank warns
    _close(task.state_dict(), runs["single"].state_dict())


def test_consolidated_file_loads_into_a_plain_module_with_the_same_predictions(runs, tmp_path, capsys):
    src = runs["folder"] / "last.ckpt"
    assert consolidate_main([str(src), str(tmp_path / "model.ckpt")]) == 0
    assert "model.ckpt" in capsys.readouterr().out
    ckpt = torch.load(tmp_path / "model.ckpt", weights_only=True)  # today's single-file format
    assert ckpt["format"] == "taskfit.checkpoint" and not any(t.is_meta for t in ckpt["module"].values())
    assert sorted(ckpt["optimizer"]["state"]) == list(range(6))  # by parameter index, full tensors
    plain = MLPTask.load_from_checkpoint(str(tmp_path / "model.ckpt"))
    _close(plain.state_dict(), runs["task"].state_dict(), atol=0)
    predictions = Trainer(strategy=_fsdp(), enable_checkpointing=False, **QUIET).predict(MLPTask(batch_size=8),
                                                                                         ckpt_path=str(src))
    inputs = plain.val_data.tensors[0]
    with torch.no_grad():
        expected = plain(inputs)
    got = torch.cat(predictions)
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-6)
    sharded = MLPTask.load_from_checkpoint(str(src))  # the directory itself loads too, read whole
    _close(sharded.state_dict(), plain.state_dict(), atol=0)


def test_transformer_equals_one_process_and_ddp_with_layer_units(tmp_path):
    single, _, _ = _fit(TransformerTask, 16, tmp_path / "single", enable_checkpointing=False)
    probe = ShardProbe(str(tmp_path))
    task, _, _ = _fit(TransformerTask, 8, tmp_path / "fsdp", _fsdp(), callbacks=[probe])  # default policy
    ddp, _, _ = _fit(TransformerTask, 8, tmp_path / "ddp", "ddp", accelerator="cpu", devices=2,
                     enable_checkpointing=False)
    _close(task.state_dict(), single.state_dict())
    _close(task.state_dict(), ddp.state_dict())
    ranks = [torch.load(tmp_path / f"shards_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["units"] == ["<root>", "encoder.layers.0", "encoder.layers.1"]
    assert ranks[0]["param_global"] == 144 + 2 * 2224 + 51 == 4643  # embed, 2 layers, head
    assert [r["param_local"] for r in ranks] == [2330, 2313]  # 50.2% and 49.8%: odd row counts round up on rank 0
    assert [r["state_local"] for r in ranks] == [2 * 2330, 2 * 2313]  # AdamW: two moments, sharded like the weights


def test_under_torchrun_equals_one_process(runs, tmp_path):
    """torchrun starts the 2 processes; the task stays sharded after fit, and full_state_dict gathers it on rank 0."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import torch
        from fsdp_tasks import MLPTask
        from taskfit import Trainer, seed_everything

        seed_everything(0)
        task = MLPTask(batch_size=8)
        trainer = Trainer(strategy="fsdp", accelerator="cpu", enable_checkpointing=False, default_root_dir=sys.argv[1],
                          **{COMMON!r})
        metrics = trainer.fit(task)
        weights = trainer.strategy.full_state_dict(task)  # every rank calls it; rank 0 gets the full tensors
        if trainer.is_main:
            torch.save({{"weights": weights, "metrics": metrics, "world": trainer.strategy.world_size,
                        "class": type(task).__name__}}, sys.argv[1] + "/result.pt")
        # torch 2.13 + gloo: a DDP or FSDP module still alive when the interpreter exits aborts that rank now and
        # then ("terminate called without an active exception": 4 of 24 runs of a plain-torch DDP script); freed
        # first, 0 of 24. ddp's wrapper does the same; fsdp adds nothing to it.
        del trainer, task, weights
        import gc
        gc.collect()
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                                                           os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TASKFIT_SEED"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(script), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    saved = torch.load(tmp_path / "result.pt", weights_only=True)
    assert (saved["world"], saved["class"]) == (2, "FSDPMLPTask")
    _close(saved["weights"], runs["single"].state_dict())
    assert saved["metrics"]["val/acc"] == pytest.approx(runs["single_metrics"]["val/acc"], abs=1e-6)


def test_bf16_mixed_gathers_and_computes_in_bfloat16(tmp_path):
    """precision="bf16-mixed": FSDP all-gathers bfloat16 parameters and reduces gradients in float32 (the shards stay
    float32); the run stays within bfloat16's rounding of the single-process one."""
    single, expected, _ = _fit(TransformerTask, 16, tmp_path / "single", enable_checkpointing=False,
                               precision="bf16-mixed")
    task, metrics, _ = _fit(TransformerTask, 8, tmp_path / "fsdp", _fsdp(), precision="bf16-mixed",
                            enable_checkpointing=False, callbacks=[ShardProbe(str(tmp_path))])
    assert torch.load(tmp_path / "shards_rank1.pt", weights_only=True)["gather_dtype"] == "torch.bfloat16"
    assert all(v.dtype == torch.float32 for v in task.state_dict().values())
    _close(task.state_dict(), single.state_dict(), atol=0.05)
    assert metrics["val/loss"] == pytest.approx(expected["val/loss"], abs=0.01)


def test_bf16_mixed_keeps_batchnorm_in_float32(tmp_path):
    """bfloat16 BatchNorm weights against its float32 running statistics fail in forward ("expected scalar type
    BFloat16 but found Float"): each BatchNorm becomes a unit of its own that gathers in float32."""
    probe = ShardProbe(str(tmp_path))
    metrics = Trainer(strategy=FSDPStrategy("cpu", 1), precision="bf16-mixed", max_epochs=1, callbacks=[probe],
                      default_root_dir=str(tmp_path), **QUIET).fit(BatchNormTask())
    assert metrics["val/loss"] < 1.5
    assert torch.load(tmp_path / "shards_rank0.pt", weights_only=True)["units"] == ["<root>", "net.1"]


def test_manual_optimization_with_two_optimizers(tmp_path):
    """Gradients are reduce-scattered in backward, so the optimizers' step averages nothing more (a no-op)."""
    single, _, _ = _fit(ManualTwoOptimizers, 16, tmp_path / "single", enable_checkpointing=False,
                        accumulate_grad_batches=1, gradient_clip_val=None)
    task, _, trainer = _fit(ManualTwoOptimizers, 8, tmp_path / "fsdp", _fsdp(), accumulate_grad_batches=1,
                            gradient_clip_val=None)
    _close(task.state_dict(), single.state_dict())
    assert trainer.state.global_step == 2 * 2 * 6  # two optimizer steps per batch, 6 batches per epoch
    saved = load_checkpoint(trainer.checkpoint_callback.last_model_path)
    assert len(saved["optimizer"]) == 2 and saved["optimizer"][1]["state"][1]["exp_avg"].is_meta


def test_a_submodule_called_outside_the_forward_is_one_clear_error(tmp_path):
    trainer = Trainer(strategy=FSDPStrategy("cpu", 1), max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    with pytest.raises(TaskModuleError, match=r"The submodule 'net.0' \(Linear\) was called outside the forward"):
        trainer.fit(HeadOutsideForward())


@pytest.mark.parametrize("kwargs, message", [
    (dict(auto_wrap_policy=0), r"auto_wrap_policy=0\) is not valid"),
    (dict(auto_wrap_policy=["Linear"]), r"auto_wrap_policy=\['Linear'\]\) is not valid"),
    (dict(reshard_after_forward=2), r"reshard_after_forward=2\) is not valid"),
    (dict(mixed_precision="bf16"), r"mixed_precision='bf16'\) is not valid"),
    (dict(cpu_offload=True), r"cpu_offload=True\) moves shards between GPU and CPU memory"),
])
def test_bad_fsdp_options_fail_before_work(kwargs, message):
    with pytest.raises(MisconfigurationError, match=message) as info:
        FSDPStrategy("cpu", 2, **kwargs)
    assert "HINT:" in str(info.value)


@pytest.mark.integration  # refused before any process starts (the tier rule reads devices=2 as several)
def test_16_mixed_is_refused_before_any_process_starts(tmp_path):
    trainer = Trainer(strategy="fsdp", accelerator="cpu", devices=2, precision="16-mixed", max_epochs=1,
                      default_root_dir=str(tmp_path), **QUIET)
    with pytest.raises(MisconfigurationError, match=r'precision="16-mixed"\) cannot run under strategy="fsdp"'):
        trainer.fit(MLPTask())
    assert not tmp_path.joinpath("version_0").exists()


def test_damaged_or_hostile_sharded_checkpoints_are_refused(runs, tmp_path):
    bad = tmp_path / "bad.ckpt"
    shutil.copytree(runs["folder"] / "last.ckpt", bad)
    os.remove(bad / MARKER)
    with pytest.raises(CheckpointError, match="incomplete sharded checkpoint"):
        load_checkpoint(str(bad))
    (bad / MARKER).write_text("complete\n")
    os.remove(bad / "__1_0.distcp")
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is missing: the index \(\.metadata\) of .* stores data"):
        read_shards(str(bad), load_checkpoint(str(bad)))

    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (bad / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match=r"needs to import and call `posix.system`"):
        MLPTask.load_from_checkpoint(str(bad))
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(CheckpointError, match="is not a sharded checkpoint directory"):
        consolidate(str(tmp_path), str(tmp_path / "out.ckpt"))


def test_an_index_pointing_outside_a_damaged_index_and_swapped_shards_are_one_error_each(runs, tmp_path, capfd):
    """Each refused before DCP reads a byte, with one CheckpointError naming the file and what is wrong, and no
    traceback printed by torch's reader (it logs one when the index fails to load inside it)."""
    def copy(name):
        (tmp_path / name).mkdir()
        return Path(shutil.copytree(runs["folder"] / "last.ckpt", tmp_path / name / "last.ckpt"))

    outside = copy("outside")  # .metadata sends rank 1's entries to ../../elsewhere.distcp, a real shard file
    shutil.copy(outside / "__1_0.distcp", tmp_path / "elsewhere.distcp")
    with open(outside / ".metadata", "rb") as fh:
        index = sharded_index._MetadataUnpickler(fh).load()
    for info in index.storage_data.values():
        if info.relative_path == "__1_0.distcp":
            info.relative_path = "../../elsewhere.distcp"
    (outside / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(CheckpointError, match=r"Refused to load .*outside/last\.ckpt: its index \(\.metadata\) "
                                              r"stores \S+ in '\.\./\.\./elsewhere\.distcp', which is outside"):
        MLPTask.load_from_checkpoint(str(outside))

    damaged = copy("damaged")
    data = (damaged / ".metadata").read_bytes()
    (damaged / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"Cannot read .*damaged/last\.ckpt/\.metadata, the index of the "
                                              r"sharded checkpoint: it is damaged \(UnpicklingError"):
        MLPTask.load_from_checkpoint(str(damaged))

    swapped = copy("swapped")
    os.rename(swapped / "__0_0.distcp", swapped / "tmp")
    os.rename(swapped / "__1_0.distcp", swapped / "__0_0.distcp")
    os.rename(swapped / "tmp", swapped / "__1_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is not the shard file written under that name: it "
                                              r"holds the data written as __1_0\.distcp"):
        Trainer(strategy="single", default_root_dir=str(tmp_path / "r"), max_epochs=3, **QUIET).fit(
            MLPTask(batch_size=8), ckpt_path=str(swapped))
    truncated = copy("truncated")
    with open(truncated / "__1_0.distcp", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is not the shard file .*: it changed since it was "
                                              r"written \(100 bytes now"):
        consolidate(str(truncated), str(tmp_path / "out.ckpt"))
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process without a group
@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save"])
def test_a_process_killed_while_it_writes_a_sharded_checkpoint_leaves_the_previous_one_whole(tmp_path, background):
    """A real process death (os._exit) just before COMPLETE would be written: the checkpoint under the name is the
    previous one, the partial one sits in a hidden .tmp directory and is refused. A complete save over an existing
    checkpoint swaps it in at once. The same with DCP's async_save (ModelCheckpoint's saves), where the death comes
    on the checkpoint writer's thread."""
    target = str(tmp_path / "last.ckpt")

    def save(value):
        writer = CheckpointWriter() if background else None
        save_sharded(Strategy("cpu"), {"module": {"w": torch.full((3,), value)}, "loop": {"step": value}}, target,
                     writer)
        if writer is not None:
            writer.close()

    save(1.0)
    pid = os.fork()
    if pid == 0:  # the child: dies in the middle of its save
        code = 1
        try:
            sharded_checkpoint._write_marker = lambda *args: os._exit(9)
            save(2.0)
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 9
    assert read_shards(target, load_skeleton(target))["module"]["w"].tolist() == [1.0, 1.0, 1.0]
    (partial,) = [p for p in os.listdir(tmp_path) if p != "last.ckpt"]
    assert partial.startswith(".last.ckpt.") and partial.endswith(".tmp")
    assert "__0_0.distcp" in os.listdir(tmp_path / partial) and MARKER not in os.listdir(tmp_path / partial)
    with pytest.raises(CheckpointError, match="incomplete sharded checkpoint"):
        load_skeleton(str(tmp_path / partial))
    save(3.0)  # over the existing directory: exchanged, the old one removed
    assert read_shards(target, load_skeleton(target))["module"]["w"].tolist() == [3.0, 3.0, 3.0]
    assert sorted(os.listdir(tmp_path)) == sorted([partial, "last.ckpt"])
