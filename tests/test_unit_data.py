"""The data plumbing without a Trainer: limit_*_batches, the resumable sampler's order (seeded per epoch, sharded,
started mid-epoch), a DataLoader re-created around it, batch sizes, and the errors for missing or empty data."""
from __future__ import annotations

import types

import pytest
import torch
from taskfit.data.loaders import (
    ResumableSampler,
    batch_size_of,
    empty_train_loader,
    eval_loader,
    finite,
    length,
    limit_batches,
    prepare_loader,
    sample_order,
    set_epoch,
    stateful,
)
from taskfit.errors import TaskModuleError
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

INF = float("inf")
CPU = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))


def dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))


# ---- limit_batches ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("total, limit, expected", [
    (10, 1.0, 10), (10, 0.5, 5), (10, 0.25, 2), (10, 0.01, 1),  # a fraction: at least one batch...
    (10, 0.0, 0), (0, 0.5, 0),  # ...unless it is 0, or there are none
    (10, 3, 3), (10, 20, 10), (10, 0, 0),  # an int: that many batches at most
    (INF, 0.5, INF), (INF, 1.0, INF), (INF, 7, 7),  # no length: a fraction cannot apply, a count can
])
def test_limit_batches(total, limit, expected):
    assert limit_batches(total, limit) == expected


def test_length_and_finite_of_loaders_with_and_without_a_length():
    assert length(DataLoader(dataset(10), batch_size=4)) == 3
    assert length(DataLoader(Stream(), batch_size=2)) == INF and length(iter([1, 2])) == INF
    assert finite(INF) is None and finite(3.0) == 3 and isinstance(finite(3.0), int)


# ---- ResumableSampler -------------------------------------------------------------------------------------------
def test_the_order_is_random_samplers_from_a_seed_drawn_from_the_global_rng():
    torch.manual_seed(3)
    expected = list(torch.utils.data.RandomSampler(range(10)))
    after = torch.rand(1)
    torch.manual_seed(3)
    sampler = ResumableSampler(10, shuffle=True, seed=7)
    sampler.set_epoch(2)
    # the same order, the same draw (Lightning's)
    assert list(sampler) == expected and torch.rand(1) == after
    assert sampler.order_seed is not None and list(sampler) != expected  # each epoch draws anew


def test_under_ddp_the_order_is_randperm_of_seed_plus_epoch_drawing_nothing():
    ranks = [ResumableSampler(10, shuffle=True, seed=7, rank=r, world_size=2) for r in range(2)]
    for sampler in ranks:
        sampler.set_epoch(2)
    state = torch.get_rng_state()
    # DistributedSampler's
    order = torch.randperm(10, generator=torch.Generator().manual_seed(9)).tolist()
    assert [list(s) for s in ranks] == [order[0::2], order[1::2]]
    assert torch.equal(torch.get_rng_state(), state) and ranks[0].order_seed is None


def test_without_shuffle_the_order_is_the_dataset_order():
    sampler = ResumableSampler(6, shuffle=False, seed=123)
    sampler.set_epoch(5)
    assert list(sampler) == [0, 1, 2, 3, 4, 5] and len(sampler) == 6


def test_skip_starts_the_next_iteration_mid_epoch_only_once_with_the_recorded_order():
    sampler = ResumableSampler(8, shuffle=True, seed=0)
    full = list(sampler)
    sampler.skip(5)
    state = torch.get_rng_state()
    # a resume draws nothing; the iteration after it starts at the beginning again
    assert list(sampler) == full[5:] and torch.equal(torch.get_rng_state(), state)
    assert sorted(sampler) == list(range(8))


def test_training_shards_are_padded_to_equal_length_by_repeating_the_first_indices():
    ranks = [ResumableSampler(5, shuffle=False, seed=0, rank=r, world_size=2, pad=True) for r in range(2)]
    assert [list(s) for s in ranks] == [[0, 2, 4], [1, 3, 0]]
    assert [len(s) for s in ranks] == [3, 3]


def test_evaluation_shards_have_every_sample_once():
    ranks = [ResumableSampler(7, shuffle=True, seed=3, rank=r, world_size=3, pad=False) for r in range(3)]
    shards = [list(s) for s in ranks]
    assert [len(s) for s in ranks] == [len(shard) for shard in shards] == [3, 2, 2]
    assert sorted(i for shard in shards for i in shard) == list(range(7))
    order = torch.randperm(7, generator=torch.Generator().manual_seed(3)).tolist()
    assert shards[1] == order[1::3]  # rank r takes every world_size-th index of the one order, from r


# ---- prepare_loader / set_epoch / sample_order ------------------------------------------------------------------
def test_a_plain_loader_is_recreated_around_the_sampler_with_its_settings():
    collate = torch.utils.data.default_collate
    loader = DataLoader(dataset(10), batch_size=4, shuffle=True, drop_last=True, collate_fn=collate)
    new = prepare_loader(loader, train=True, seed=5)
    assert new is not loader and isinstance(new.sampler, ResumableSampler)
    assert new.sampler.shuffle and new.sampler.seed == 5
    assert (new.batch_size, new.drop_last, new.collate_fn, new.dataset) == (4, True, collate, loader.dataset)
    assert len(new) == 2
    evaluation = prepare_loader(DataLoader(dataset(10), batch_size=4), train=False, seed=5)
    assert not evaluation.sampler.shuffle and sample_order(evaluation) == range(10)


def test_a_prepared_loader_draws_as_torchs_and_skips_whole_batches_without_drawing():
    torch.manual_seed(4)
    expected = [b[1].tolist() for b in DataLoader(dataset(12), batch_size=3, shuffle=True)]
    after = torch.rand(1)
    torch.manual_seed(4)
    loader = prepare_loader(DataLoader(dataset(12), batch_size=3, shuffle=True), train=True, seed=1)
    set_epoch(loader, 4)
    first = [b[1].tolist() for b in loader]
    # the base seed, then the sampler's seed, as torch draws them
    assert first == expected and torch.rand(1) == after
    state = torch.get_rng_state()
    set_epoch(loader, 4, skip_batches=2)
    assert [b[1].tolist() for b in loader] == first[2:]
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("loader", [
    DataLoader(dataset(6), sampler=[5, 4, 3, 2, 1, 0]),  # a sampler of the user's
    DataLoader(Stream(), batch_size=2),  # an IterableDataset
    DataLoader(dataset(6), sampler=torch.utils.data.RandomSampler(dataset(6), num_samples=3)),
])
def test_a_loader_taskfit_cannot_shard_is_kept_as_it_is_with_a_warning_under_ddp(loader):
    assert prepare_loader(loader, train=True, seed=0) is loader
    assert sample_order(loader) is None
    with pytest.warns(UserWarning, match=r"The train DataLoader uses a custom sampler, dataset or class, so taskfit "
                                         r"cannot shard it: every rank sees all of its data"):
        assert prepare_loader(loader, train=True, seed=0, rank=1, world_size=2) is loader


def test_not_a_dataloader_is_returned_unchanged():
    batches = [(torch.zeros(2, 1), torch.zeros(2))]
    assert prepare_loader(batches, train=True, seed=0) is batches and prepare_loader(None, train=False, seed=0) is None


def test_a_loader_with_its_own_state_is_stateful_and_a_recreated_one_is_not():
    class Stateful:
        sampler = None

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    assert stateful(Stateful())
    assert not stateful(prepare_loader(DataLoader(dataset(4)), train=True, seed=0))


# ---- batches ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, size", [
    ((torch.zeros(6, 3), torch.zeros(6)), 6),
    ([torch.zeros(4, 2)], 4),
    ({"x": torch.zeros(5, 2), "y": torch.zeros(5)}, 5),
    ({"x": torch.zeros(3), "meta": ["a", "b"]}, 3),  # the first value's size
    (torch.zeros(7), 7),
    (torch.tensor(1.0), 1),  # a scalar: one sample
    (("text", 3), 1),  # no tensor at all
])
def test_batch_size_of(batch, size):
    assert batch_size_of(batch) == size


# ---- the errors for missing or empty data -----------------------------------------------------------------------
def test_an_empty_training_loader_is_explained():
    error = empty_train_loader(DataLoader(dataset(3), batch_size=4, drop_last=True))
    assert str(error) == ("train_dataloader() yields no batches (dataset of 3 samples, batch_size=4, drop_last=True)."
                          "\n  HINT: check the dataset is not empty, and use drop_last=False or a batch_size <= the "
                          "dataset size.")


def test_an_evaluation_without_data_names_the_method_to_define():
    class Task:
        def test_dataloader(self):
            return None

    with pytest.raises(TaskModuleError) as info:
        eval_loader(Task(), "test", seed=0, strategy=CPU)
    assert "Trainer.test needs data, but Task.test_dataloader() returned None." in str(info.value)
    assert "trainer.test(task, dataloaders=...)" in str(info.value)


def test_an_evaluation_loader_is_sharded_without_duplicates():
    class Task:
        def val_dataloader(self):
            return DataLoader(dataset(5), batch_size=2)

    rank1 = types.SimpleNamespace(rank=1, world_size=2, device=torch.device("cpu"))
    assert list(sample_order(eval_loader(Task(), "validate", seed=0, strategy=rank1))) == [1, 3]


def test_a_random_sampler_with_its_own_generator_keeps_its_order_in_one_process():
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(dataset(6), batch_size=2, shuffle=True, generator=generator)
    # Lightning's order: from that generator
    assert prepare_loader(loader, train=True, seed=0) is loader
    sharded = prepare_loader(loader, train=True, seed=0, rank=1, world_size=2)
    # ddp: DistributedSampler's order, as Lightning
    assert isinstance(sharded.sampler, ResumableSampler)


def test_under_ddp_a_training_loader_is_shuffled_even_with_shuffle_false():
    # Lightning's DistributedSampler for training is shuffled whatever the loader's sampler
    # (use_distributed_sampler); evaluation keeps its order; overfit_batches does not shuffle
    def sampler(train, **kwargs):
        loader = DataLoader(dataset(6), batch_size=2)
        return prepare_loader(loader, train=train, seed=0, rank=1, world_size=2, **kwargs).sampler

    assert sampler(True).shuffle and not sampler(False).shuffle
    assert not sampler(True, shuffle=False).shuffle
    assert not prepare_loader(DataLoader(dataset(6)), train=True, seed=0).sampler.shuffle
