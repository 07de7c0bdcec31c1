"""RNG states of python, numpy, torch and CUDA as tensors and lists, so a checkpoint loads with
``torch.load(weights_only=True)`` (no pickled objects), and a resume draws the same random
numbers."""
from __future__ import annotations

import array
import contextlib
import random
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..strategies.base import Strategy


def gather_rng_states(strategy: Strategy) -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order, on every rank (each rank must call this)."""
    mine = rng_state()
    if strategy.world_size == 1:
        return [mine]
    return [
        strategy.broadcast(mine if strategy.rank == r else None, src=r)
        for r in range(strategy.world_size)
    ]


def rng_state() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    # array packs the 625 ints in C; torch.tensor(tuple) inspects each one (about twice as slow,
    # every save).
    out: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.frombuffer(array.array("q", state), dtype=torch.int64),
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
    }
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return out


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Python's, numpy's, torch's and CUDA's random states as they were before the block
    (Lightning's ``isolate_rng``, around the sanity check: what it draws does not shift the training
    run's numbers)."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


def set_rng_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    saved_np = state.get("numpy")
    if saved_np is not None:
        import numpy as np

        np.random.set_state(
            (
                saved_np["name"],
                saved_np["keys"].numpy().astype(np.uint32),
                saved_np["pos"],
                saved_np["has_gauss"],
                saved_np["gauss"],
            )
        )
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(f"The checkpoint has CUDA RNG states of {len(cuda)} devices, this "
                          f"machine has {torch.cuda.device_count()}: CUDA random numbers (dropout "
                          "on the GPU) will differ from the original run. HINT: resume on as many "
                          "GPUs for a bitwise-equal result.", stacklevel=3)
