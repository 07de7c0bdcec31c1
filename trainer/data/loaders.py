"""Data plumbing: a deterministic, shardable, resumable sampler; DataLoader re-creation; moving
batches.

A shuffled loader's order is the one Lightning's sampler gives, drawn from the global RNG at the
same moment: single-process, ``RandomSampler``'s (a seed drawn from the global torch RNG when the
epoch's iteration starts, then ``randperm(n)`` from it); under ddp, ``DistributedSampler``'s
``randperm(n, seed + epoch)``, which draws nothing (a training loader with ``shuffle=False``
included, as Lightning's). Creating an iterator draws the DataLoader's base
seed from the global RNG, as torch does. The epoch's seed is recorded, so a resume jumps to sample
``k`` of the epoch without loading (or replaying) the batches before it and without drawing again:
the global RNG after a resume is the one of the uninterrupted run.
"""
from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from ..errors import MisconfigurationError, TaskModuleError
from ..seed import seed_worker, seeds_workers
from ..trainer_config import Limits, TrainerConfig
from .workers import iterate, shield


class ResumableSampler(Sampler[int]):
    """Sample indices in Lightning's order; shard them over ranks; start mid-epoch.

    Single-process, a shuffled epoch draws its seed from the global torch RNG when its iteration
    starts, as ``RandomSampler`` does, and keeps it (``order_seed``, in checkpoints); under ddp its
    order is ``randperm(n, seed + epoch)``, as ``DistributedSampler``'s. ``pad=True`` (training)
    repeats a few indices so every rank gets the same number of samples, as DistributedSampler does;
    ``pad=False`` (evaluation) shards without duplicates, so no sample is counted twice.
    """

    def __init__(self, size: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1,
                 pad: bool = True, generator: torch.Generator | None = None) -> None:
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size, self.pad = rank, world_size, pad
        # the loader's own generator (None: the global RNG), which its iterators draw from
        self.generator = generator
        self.epoch = 0
        # the seed the current epoch's order was drawn with (single-process)
        self.order_seed: int | None = None
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, samples: int) -> None:
        """Start the next iteration ``samples`` indices into this rank's order, with the recorded
        ``order_seed`` (a resume: nothing is drawn)."""
        self._skip = samples

    def indices(self) -> Sequence[int]:
        """This rank's order of the current epoch (single-process: the last iteration's draw)."""
        if self.shuffle:
            drawn = self.world_size == 1 and self.order_seed is not None
            seed = self.order_seed if drawn else self.seed + self.epoch
            generator = torch.Generator().manual_seed(seed)
            order: Sequence[int] = torch.randperm(self.size, generator=generator).tolist()
        else:
            # not a list of n ints per epoch (a slice of a range is a range)
            order = range(self.size)
        if self.world_size > 1:
            order = list(order)
            if self.pad:
                total = math.ceil(self.size / self.world_size) * self.world_size
                order += (order * math.ceil(total / max(1, self.size)))[: total - self.size]
            order = order[self.rank:: self.world_size]
        return order

    def __iter__(self) -> Iterator[int]:
        start, self._skip = self._skip, 0
        if self.shuffle and self.world_size == 1 and not start:
            # RandomSampler's draw, at the same moment
            self.order_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return iter(self.indices()[start:])

    def __len__(self) -> int:
        if self.world_size == 1:
            return self.size
        if self.pad:
            return math.ceil(self.size / self.world_size)
        return len(range(self.rank, self.size, self.world_size))


def prepare_loader(
    loader: Any,
    *,
    train: bool,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: bool = False,
    shuffle: bool | None = None,
    ignore_signals: tuple[str, ...] = (),
) -> Any:
    """Re-create a plain DataLoader around a :class:`ResumableSampler`, keeping every user setting.

    Anything else (an iterable, a DataLoader subclass, an IterableDataset, a custom sampler) is
    returned as is: it still trains, but without sharding or exact mid-epoch resume (a warning says
    so under ddp).
    """
    if loader is None or not isinstance(loader, DataLoader):
        return loader
    # fit: workers leave those signals to the trainer
    shielded = bool(ignore_signals) and loader.num_workers > 0
    sampler = loader.sampler
    plain = (
        type(loader) is DataLoader
        and not isinstance(loader.dataset, IterableDataset)
        and isinstance(loader.batch_sampler, BatchSampler)
        and type(loader.batch_sampler) is BatchSampler
        and (
            isinstance(sampler, SequentialSampler)
            or (
                isinstance(sampler, RandomSampler)
                and not sampler.replacement
                and sampler.num_samples == len(sampler.data_source)  # num_samples not set
                # its own generator: kept as it is, but ddp replaces it (DistributedSampler)
                and (sampler.generator is None or world_size > 1)
            )
        )
    )
    # Lightning's worker_init_fn after seed_everything(workers=True)
    seeding = worker_seeding(loader, rank)
    if not plain:
        if world_size > 1:
            warnings.warn(f"The {'train' if train else 'evaluation'} DataLoader uses a custom "
                          "sampler, dataset or class, so taskfit cannot shard it: every rank sees "
                          "all of its data. HINT: use a plain DataLoader over a map-style "
                          "dataset, or shard the data yourself.", stacklevel=3)
        if seeding is not None:  # as Lightning does to any DataLoader
            loader.worker_init_fn = seeding
        # the user's own loader, as it is: only how its workers start and take signals changes
        if shielded:
            shield(loader, ignore_signals)
        return loader
    if shuffle is None:
        # Under ddp the training order is DistributedSampler's shuffled one even for a loader with
        # shuffle=False, as Lightning's (use_distributed_sampler: shuffle=True for training).
        shuffle = isinstance(sampler, RandomSampler) or (train and world_size > 1)
    new_sampler = ResumableSampler(len(loader.dataset), shuffle, seed, rank, world_size, train,
                                   loader.generator)
    kwargs: dict[str, Any] = {}
    if loader.num_workers > 0:
        kwargs.update(
            prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers
        )
    new = DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=new_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory or pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=seeding or loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        **kwargs,
    )
    if shielded:
        # loader_workers.py: no moment of a worker's life where the signal kills it
        shield(new, ignore_signals)
    return new



def worker_seeding(loader: Any, rank: int) -> Callable[[int], None] | None:
    """Lightning's ``worker_init_fn`` for a DataLoader without one, after
    ``seed_everything(workers=True)``; else None: torch seeds each worker from the base seed
    (python's and torch's RNG, numpy's) by itself."""
    if getattr(loader, "worker_init_fn", None) is not None or not seeds_workers():
        return None
    return functools.partial(seed_worker, rank=rank)


def set_epoch(loader: Any, epoch: int, skip_batches: int = 0) -> None:
    """Fix the order (sampler) of ``epoch``; optionally skip batches (a resume: the recorded
    order, no draw)."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, ResumableSampler):
        sampler.set_epoch(epoch)
        if skip_batches:
            sampler.skip(skip_batches * loader.batch_size)
        # The iterator draws the workers' base seed from the global RNG, as torch does, where the
        # uninterrupted run made one: not mid-epoch after a resume, nor after the first epoch with
        # persistent workers (those draw from a generator of their own).
        again = skip_batches or (epoch and loader.persistent_workers and loader.num_workers)
        own = torch.Generator().manual_seed(sampler.seed + epoch) if again else None
        loader.generator = own or sampler.generator
    elif hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def order_seed(loader: Any) -> int | None:
    """The seed of the current epoch's order, for a checkpoint (None where nothing was drawn)."""
    sampler = getattr(loader, "sampler", None)
    return sampler.order_seed if isinstance(sampler, ResumableSampler) else None


class OneAhead:
    """Iterate ``iterable`` one item ahead, as Lightning's prefetching fetcher does for a loader
    without a length: an item's side effects (an IterableDataset's) happen one step early, and
    ``done`` says, when an item is returned, whether it was the last."""

    __slots__ = ("_iterator", "_next", "done")

    def __init__(self, iterable: Iterable[Any]) -> None:
        self._iterator = iter(iterable)
        self._next = next(self._iterator, _END)
        self.done = self._next is _END

    def __iter__(self) -> OneAhead:
        return self

    def __next__(self) -> Any:
        item = self._next
        if item is _END:
            raise StopIteration
        self._next = next(self._iterator, _END)
        self.done = self._next is _END
        return item


_END = object()


def epoch_batches(loader: Any, batches: float, done: int = 0) -> Iterable[Any]:
    """The batches ``done`` to ``batches`` of ``loader``, fetched as Lightning fetches them: one
    batch ahead (:class:`OneAhead`) when their number is not known, never one past a limit
    (``limit_*_batches``), and else the loader itself, which ends the epoch (a stateful loader,
    mid-epoch after a resume, where it stands). Each iterator is started by workers.iterate (a
    worker's death is raised at the next batch, never inside a lock)."""
    if batches == float("inf"):
        return OneAhead(iterate(loader))
    if batches < length(loader):
        return itertools.islice(iterate(loader), max(0, int(batches) - done))
    return Iterated(loader)


class Iterated:
    """``loader``, whose iterator workers.iterate starts when the loop begins (not before: creating
    it draws from the global RNG, at the point where Lightning's loop creates it)."""

    __slots__ = ("loader",)

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iterate(self.loader)


def map_tensors(batch: Any, fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> Any:
    """``batch`` with ``fn(tensor, *args, **kwargs)`` for each tensor in nested tuples, lists,
    dicts (and namedtuples, Mapping subclasses); anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch, *args, **kwargs)
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(v, fn, *args, **kwargs) for k, v in batch.items()}
        return mapped if type(batch) is dict else type(batch)(mapped)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn, *args, **kwargs) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn, *args, **kwargs) for v in batch)
    return batch


def batch_to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor in nested tuples/lists/dicts (and namedtuples) to ``device``."""
    return map_tensors(batch, torch.Tensor.to, device, non_blocking=non_blocking)


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor (1 when there is
    none)."""
    # the usual (inputs, targets): answered
    first = batch[0] if type(batch) in (tuple, list) and batch else batch
    # here, without recursion, an ABC check or
    if type(first) is torch.Tensor and first.dim() and first.shape[0]:
        return first.shape[0]  # Tensor.__len__ (Python code)
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size_of(item)
            if size:
                return size
    return 1


def limit_batches(total: float, limit: int | float) -> float:
    """Apply a ``limit_*_batches`` value to a loader of ``total`` batches (inf when it has no
    length)."""
    if isinstance(limit, float):
        if limit == 1.0 or total == float("inf"):
            return total
        return max(1, int(total * limit)) if limit > 0 and total > 0 else 0
    return min(total, limit)


def finite(n: float) -> int | None:
    """A batch count as an int, None for a loader without a length (what a checkpoint records)."""
    return None if n == float("inf") else int(n)


def length(loader: Any) -> float:
    """``len(loader)``, or inf for a loader without a length (an IterableDataset, a generator)."""
    try:
        return len(loader)
    except TypeError:
        return float("inf")


def empty_train_loader(loader: Any) -> MisconfigurationError:
    """The error for a training loader that yields no batches."""
    dataset = getattr(loader, "dataset", None)
    size = len(dataset) if hasattr(dataset, "__len__") else "?"
    return MisconfigurationError(
        f"train_dataloader() yields no batches (dataset of {size} samples, batch_size="
        f"{getattr(loader, 'batch_size', '?')}, drop_last={getattr(loader, 'drop_last', '?')}).",
        "check the dataset is not empty, and use drop_last=False or a batch_size <= the dataset "
        "size.")


ASK = object()  # fit_loaders' val_source: ask the task for its validation loader


def fit_loaders(task: Any, limits: Limits, overfit: bool, seed: int,
                strategy: Any, ignore_signals: tuple[str, ...] = (),
                val_source: Any = ASK) -> tuple[Any, float, Any, list[float]]:
    """``(train loader, its batches per epoch, val loader or None, the batches of each validation
    loader)`` for fit, after ``limit_*_batches``; ``task`` is where the loaders come from (the task,
    or a ``DataSource``: loaders passed, a DataModule).

    With ``overfit_batches`` the training batches, unshuffled, are also the validation batches.
    ``val_source``: the validation loader when the caller asked for it already."""
    args = dict(seed=seed, rank=strategy.rank, world_size=strategy.world_size,
                pin_memory=strategy.device.type == "cuda", ignore_signals=ignore_signals)
    train = prepare_loader(
        task.train_dataloader(), train=True, shuffle=False if overfit else None, **args
    )
    total = length(train)
    if total == 0:
        raise empty_train_loader(train)
    if overfit:
        val = prepare_loader(task.train_dataloader(), train=False, shuffle=False, **args)
    else:
        val = prepare_evaluation(task.val_dataloader() if val_source is ASK else val_source, **args)
    if val is not None and length(val) == 0:
        warnings.warn("val_dataloader() yields no batches, so this fit does not validate (no val/* "
                      "values, and callbacks that monitor them have nothing to rank). HINT: check "
                      "the validation dataset is not empty and its batch_size/drop_last, or return "
                      "None from val_dataloader().", stacklevel=4)
    num_val = [] if val is None else evaluation_batches(val, limits["val"])
    if not any(num_val):  # no loader, or limit_val_batches=0: no validation
        val, num_val = None, []
    return train, limit_batches(total, limits["train"]), val, num_val


def eval_loader(task: Any, fn: str, seed: int, strategy: Any) -> Any:
    """The loader of a ``validate``/``test``/``predict`` call, sharded over the ranks without
    duplicates."""
    method = {
        "validate": "val_dataloader",
        "test": "test_dataloader",
        "predict": "predict_dataloader",
    }[fn]
    loader = getattr(task, method)()
    if loader is None:
        owner = getattr(task, "owner", type(task).__name__)
        raise TaskModuleError(f"Trainer.{fn} needs data, but {owner}.{method}() returned None.",
                              f"define `def {method}(self): return DataLoader(...)`, or pass the "
                              f"loader: trainer.{fn}(task, dataloaders=...).")
    return prepare_evaluation(loader, seed=seed, rank=strategy.rank, world_size=strategy.world_size,
                              pin_memory=strategy.device.type == "cuda")


class SequentialLoaders:
    """Several evaluation loaders (a list, tuple or dict of DataLoaders from
    ``val_dataloader()``...), evaluated one after the other, as Lightning's "sequential" mode: each
    batch goes to the step with its loader's index (``dataloader_idx``), and ``limit_*_batches``
    applies to each loader."""

    def __init__(self, loaders: list[Any]) -> None:
        self.loaders = loaders

    def __len__(self) -> int:
        # TypeError (inf in length()) when one has no length
        return sum(len(loader) for loader in self.loaders)


def evaluation_loaders(loader: Any) -> Any:
    """``loader``, or :class:`SequentialLoaders` when it is several DataLoaders (one in a list is
    itself)."""
    several = list(loader.values()) if isinstance(loader, Mapping) else loader \
        if isinstance(loader, (list, tuple)) else None
    if not several or not all(isinstance(item, DataLoader) for item in several):
        return loader
    return several[0] if len(several) == 1 else SequentialLoaders(several)


def parts(loader: Any) -> list[Any]:
    """The loaders an evaluation pass runs: the loaders of a :class:`SequentialLoaders`, else
    ``[loader]``."""
    return loader.loaders if isinstance(loader, SequentialLoaders) else [loader]


def indexed_parts(loader: Any) -> list[tuple[Any, tuple[int, ...]]]:
    """Each loader an evaluation pass runs, with what its step and batch hooks get after
    ``batch_idx``: ``(i,)`` (Lightning's ``dataloader_idx``) when there are several loaders, else
    ``()``."""
    loaders = parts(loader)
    return [(part, (idx,) if len(loaders) > 1 else ()) for idx, part in enumerate(loaders)]


def evaluation_batches(loader: Any, limit: int | float) -> list[float]:
    """The batches an evaluation pass runs of each loader of ``loader``: ``limit``
    (``limit_*_batches``) applied to each (Lightning's ``num_val_batches``, a list)."""
    return [limit_batches(length(part), limit) for part in parts(loader)]


def prepare_evaluation(loader: Any, **args: Any) -> Any:
    """:func:`prepare_loader` for evaluation, for each of several loaders."""
    loader = evaluation_loaders(loader)
    if isinstance(loader, SequentialLoaders):
        return SequentialLoaders(
            [prepare_loader(part, train=False, **args) for part in loader.loaders]
        )
    return prepare_loader(loader, train=False, **args)


def sample_order(loader: Any) -> Sequence[int] | None:
    """The dataset indices this rank's evaluation loader visits, in order (None when taskfit does
    not choose them: a sampler or an IterableDataset of the user's)."""
    sampler = getattr(loader, "sampler", None)
    return sampler.indices() if isinstance(sampler, ResumableSampler) else None


def stateful(loader: Any) -> bool:
    """A loader that keeps its own position (``torchdata``'s ``StatefulDataLoader``, or any loader
    with ``state_dict``/``load_state_dict``) and that taskfit does not re-create: its own state is
    saved and restored."""
    sampler = getattr(loader, "sampler", None)
    return (
        not isinstance(sampler, ResumableSampler)
        and callable(getattr(loader, "state_dict", None))
        and callable(getattr(loader, "load_state_dict", None))
    )


def restore_position(train: Any, val: Any, data: Mapping[str, Any]) -> None:
    """Continue the saved data position: the run's seed for the resumable samplers and the epoch's
    drawn seed for the training one (a checkpoint without it: ``seed + epoch``, the order before),
    the saved state of a stateful training loader (which then resumes mid-epoch by itself)."""
    for loader in (train, *parts(val)):
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ResumableSampler):
            sampler.seed = int(data["seed"])
            sampler.order_seed = data.get("order_seed") if loader is train else None
    if stateful(train) and data.get("loader") is not None:
        train.load_state_dict(data["loader"])


def data_position(loader: Any, num_train_batches: float, state: Any, seed: int, world_size: int,
                  config: TrainerConfig) -> dict[str, Any]:
    """Where the data stands, for a checkpoint: the order (seed, the epoch's drawn seed, epoch), the
    batches done, and the settings that give a batch position its meaning, the run's planned length
    included (a resume warns when they changed)."""
    return {"seed": int(seed), "order_seed": order_seed(loader), "epoch": state.epoch,
            "batches_done": state.batches_done, "batch_size": getattr(loader, "batch_size", None),
            "world_size": world_size, "accumulate_grad_batches": config.accumulate_grad_batches,
            "num_train_batches": finite(num_train_batches),
            "max_epochs": config.max_epochs, "max_steps": config.max_steps,
            "loader": loader.state_dict() if stateful(loader) else None}
