"""Seeding: one call makes python, numpy, torch (CPU and CUDA) and DataLoader workers
reproducible."""
from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import torch

_SEED_ENV = "TASKFIT_SEED"
# Lightning's name for the same: code ported from it may read it seed_everything(workers=True):
# Lightning's worker_init_fn (Lightning's name)
_LIGHTNING_SEED_ENV = "PL_GLOBAL_SEED"
_WORKERS_ENV = "PL_SEED_WORKERS"


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = False) -> int:
    """Seed python, numpy, torch and CUDA; the Trainer also derives its data order and worker seeds
    from it.

    The seed is exported as ``TASKFIT_SEED`` (and Lightning's ``PL_GLOBAL_SEED``) so that spawned
    ddp workers and DataLoader workers see it. Without ``seed``, the one exported before is used
    again (0 when there is none), as Lightning does. DataLoader workers are seeded by torch from a
    base seed each iterator draws from the global RNG (distinct and reproducible); ``workers=True``
    (exported as ``PL_SEED_WORKERS``) seeds them as Lightning's does, from that base seed, the
    worker and the rank (:func:`seed_worker`). ``verbose`` prints the seed.
    """
    if seed is None:
        exported = os.environ.get(_SEED_ENV, os.environ.get(_LIGHTNING_SEED_ENV))
        seed = int(exported) if exported is not None else 0
    seed = int(seed)
    if verbose:
        print(f"Seed set to {seed}")
    os.environ[_SEED_ENV] = os.environ[_LIGHTNING_SEED_ENV] = str(seed)
    os.environ[_WORKERS_ENV] = str(int(workers))
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def current_seed() -> int | None:
    """The seed given to :func:`seed_everything`, or None when the run was not seeded."""
    value = os.environ.get(_SEED_ENV)
    return None if value is None else int(value)


def seeds_workers() -> bool:
    """``seed_everything(workers=True)`` was called (in this process or the one that started it)."""
    return os.environ.get(_WORKERS_ENV, "0") == "1"


def seed_worker(worker_id: int, rank: int = 0) -> None:
    """Lightning's ``worker_init_fn`` (``pl_worker_init_function``, Lightning 2.6): torch, python
    and numpy seeded from the worker's base seed, its id and the process's rank, mixed
    (MurmurHash3's finalizer, then an LCG)."""
    base_seed = torch.initial_seed() - worker_id
    seeds = _seed_sequence(base_seed, worker_id, rank, count=4)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 32) | seeds[2])
    try:
        import numpy as np

        np.random.seed(np.random.SeedSequence([base_seed, worker_id, rank]).generate_state(4))
    except ImportError:
        pass


def _seed_sequence(base_seed: int, worker_id: int, rank: int, count: int) -> list[int]:
    mask = (1 << 64) - 1
    mixed = (base_seed << 32) | (worker_id << 16) | rank
    mixed ^= mixed >> 33
    mixed = (mixed * 0xFF51AFD7ED558CCD) & mask
    mixed ^= mixed >> 33
    mixed = (mixed * 0xC4CEB9FE1A85EC53) & mask
    mixed ^= mixed >> 33
    seeds = []
    for _ in range(count):
        mixed = (mixed * 6364136223846793005 + 1) & mask
        seeds.append(mixed)
    return seeds


def run_seed() -> int:
    """The seed a run derives its data order from: :func:`seed_everything`'s, else torch's initial
    seed."""
    seed = current_seed()
    return seed if seed is not None else torch.initial_seed() % 2**31


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` inside when ``enabled``; the process's setting,
    as it was, after."""
    was = torch.are_deterministic_algorithms_enabled()
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
