"""Randomness as Lightning consumes it, and one batch ahead (issue 45, items 1 and 6): the seeded
program of tests/rng_program.py, shuffled or not, with or without loader workers, ends with
Lightning 2.6.6's weights to the bit and the global RNG where Lightning leaves it after ``fit``,
``validate`` and ``test`` (Lightning's values are in tests/data/lightning_rng.json; the last tests
run Lightning itself where it is installed)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader

import ddp_rng_program
import rng_program
from taskfit import Trainer, seed_everything
from taskfit.data.loaders import OneAhead, epoch_batches

with open(os.path.join(os.path.dirname(__file__), "data", "lightning_rng.json")) as f:
    LIGHTNING = json.load(f)
# Lightning 2.6.6's values of tests/ddp_rng_program.py (2 gloo processes, strategy="ddp"), observed
# by `python tests/ddp_rng_program.py record tests/data/lightning_ddp.json`
with open(os.path.join(os.path.dirname(__file__), "data", "lightning_ddp.json")) as f:
    LIGHTNING_DDP = json.load(f)


@pytest.fixture(autouse=True)
def _seed_environment(monkeypatch):
    # seed_everything exports them
    for name in ("TASKFIT_SEED", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)


def _same(observed: dict, expected: dict) -> None:
    assert rng_program.max_difference(observed["weights"], expected["weights"]) == 0.0
    for key in ("rand_after_fit", "rand_after_validate", "rand_after_test"):
        assert observed[key] == expected[key], key


@pytest.mark.parametrize("setting", list(rng_program.SETTINGS))
def test_a_seeded_program_ends_with_lightnings_weights_and_random_state(setting, tmp_path):
    _same(rng_program.run("taskfit", setting, str(tmp_path)), LIGHTNING[setting])


def test_under_ddp_a_seeded_program_ends_with_lightnings_weights_order_and_random_state(tmp_path):
    """2 gloo processes, a training DataLoader with shuffle=False: Lightning shuffles it anyway
    (DistributedSampler, seed PL_GLOBAL_SEED), re-seeds each rank at setup, and its launching
    process is rank 0, so the script's next draw after fit is rank 0's."""
    observed = ddp_rng_program.run("taskfit", "unshuffled", str(tmp_path))
    expected = LIGHTNING_DDP["unshuffled"]
    assert rng_program.max_difference(observed["weights"], expected["weights"]) == 0.0
    # each rank's samples of epochs 0 and 1 (21 samples: rank 1's shard is padded with one)
    for rank in ("rank0", "rank1"):
        assert observed[rank]["seen"] == expected[rank]["seen"], rank
        assert observed[rank]["rand"] == expected[rank]["rand"], rank
    assert observed["rand_after_fit"] == expected["rand_after_fit"]
    assert observed["callback_metrics"] == expected["callback_metrics"]


def test_an_iterable_dataset_is_fetched_one_batch_ahead_as_lightning(tmp_path):
    observed = rng_program.stream("taskfit", str(tmp_path))
    # each step sees the next batch's samples already drawn; the last batch knows it is the last
    assert observed["seen"][:5] == [[8, False], [12, False], [16, False], [20, False], [20, True]]
    assert observed == {k: LIGHTNING["stream"][k] for k in ("seen", "drawn_epoch_mean")}


def test_one_ahead_fetches_the_next_item_before_returning_one():
    fetched = []

    def items():
        for i in range(3):
            fetched.append(i)
            yield i

    ahead = OneAhead(items())
    assert fetched == [0] and not ahead.done
    assert next(ahead) == 0 and fetched == [0, 1] and not ahead.done
    assert next(ahead) == 1 and next(ahead) == 2 and ahead.done
    assert list(ahead) == [] and list(OneAhead([])) == []


def test_a_loader_with_a_length_is_never_fetched_past_its_limit():
    fetched = []
    loader = DataLoader(range(10), batch_size=2, collate_fn=lambda b: fetched.append(b) or b)
    assert list(epoch_batches(loader, 3, done=1)) == [[0, 1], [2, 3]] and len(fetched) == 2
    assert isinstance(epoch_batches(loader, float("inf")), OneAhead)


def test_is_last_batch_with_a_length_and_a_limit(tmp_path):
    seen = []
    task = rng_program.make_module(rng_program.framework("taskfit")[1], "unshuffled")
    step = task.training_step
    task.training_step = lambda batch, i: seen.append(task.trainer.is_last_batch) or step(batch, i)
    Trainer(max_epochs=1, limit_train_batches=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, num_sanity_val_steps=0,
            default_root_dir=str(tmp_path)).fit(task)
    assert seen == [False, False, True]


def test_a_mid_epoch_resume_replays_the_drawn_order_and_the_uninterrupted_rng(tmp_path):
    def fit(max_steps, ckpt_path=None, root="a"):
        seed_everything(7)
        task = rng_program.make_module(rng_program.framework("taskfit")[1], "shuffled")
        Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=str(tmp_path / root)).fit(task, ckpt_path=ckpt_path)
        return [p.detach().clone() for p in task.parameters()], torch.rand(1)

    whole, after = fit(12, root="whole")
    fit(7)  # stops mid-epoch 1 (5 batches an epoch)
    weights, resumed_after = fit(12, ckpt_path="last")
    assert all(torch.equal(a, b) for a, b in zip(whole, weights))
    assert torch.equal(after, resumed_after)


# ---- against Lightning itself, where it is installed (CI has not) -------------------------------
@pytest.mark.parametrize("setting", ["shuffled-workers", "data-in-loaders"])
def test_lightning_gives_the_recorded_values(setting, tmp_path):
    pytest.importorskip("lightning")
    _same(rng_program.run("lightning", setting, str(tmp_path)), LIGHTNING[setting])


def test_lightning_fetches_an_iterable_dataset_as_recorded(tmp_path):
    pytest.importorskip("lightning")
    observed = rng_program.stream("lightning", str(tmp_path))
    assert observed == {k: LIGHTNING["stream"][k] for k in ("seen", "drawn_epoch_mean")}
