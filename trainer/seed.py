"""Seeding: one call makes python, numpy, torch (CPU and CUDA) and DataLoader workers reproducible."""
from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import torch

_SEED_ENV = "TASKFIT_SEED"
_LIGHTNING_SEED_ENV = "PL_GLOBAL_SEED"  # Lightning's name for the same: code ported from it may read it


def seed_everything(seed: int | None = None, workers: bool = True, verbose: bool = False) -> int:
    """Seed python, numpy, torch and CUDA; the Trainer also derives its data order and worker seeds from it.

    The seed is exported as ``TASKFIT_SEED`` (and Lightning's ``PL_GLOBAL_SEED``) so that spawned ddp workers and
    DataLoader workers see it. Without ``seed``, the one exported before is used again (0 when there is none), as
    Lightning does. ``workers``: taskfit always seeds DataLoader workers (Lightning's ``workers=True``); False is
    accepted and changes nothing. ``verbose`` prints the seed.
    """
    if seed is None:
        exported = os.environ.get(_SEED_ENV, os.environ.get(_LIGHTNING_SEED_ENV))
        seed = int(exported) if exported is not None else 0
    seed = int(seed)
    if verbose:
        print(f"Seed set to {seed}")
    os.environ[_SEED_ENV] = os.environ[_LIGHTNING_SEED_ENV] = str(seed)
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


def worker_init_fn(worker_id: int) -> None:
    """Seed python and numpy inside a DataLoader worker from torch's per-worker seed (which the Trainer fixes)."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def run_seed() -> int:
    """The seed a run derives its data order from: :func:`seed_everything`'s, else torch's initial seed."""
    seed = current_seed()
    return seed if seed is not None else torch.initial_seed() % 2**31


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` inside when ``enabled``; the process's setting, as it was, after."""
    was = torch.are_deterministic_algorithms_enabled()
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
