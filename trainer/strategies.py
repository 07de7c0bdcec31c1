"""Device strategies: where the module and the data live. The loop only talks to this small interface.

``Strategy`` is the single-device strategy; dp and ddp subclass it. The interface, in the spirit of
Lightning Fabric: ``setup_module``, ``batch_to_device``, ``all_reduce``, ``broadcast``, ``barrier``,
``is_main``, ``module_state_dict``, ``no_sync``, ``launch``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .data import batch_to_device
from .errors import MisconfigurationError

_ACCELERATORS = ("auto", "cpu", "cuda", "mps")


def resolve_accelerator(accelerator: str) -> str:
    if accelerator not in _ACCELERATORS:
        raise MisconfigurationError(f"Unknown accelerator {accelerator!r}.",
                                    f"use one of {', '.join(repr(a) for a in _ACCELERATORS)}.")
    if accelerator == "auto":
        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        return "mps" if mps is not None and mps.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise MisconfigurationError('accelerator="cuda" was requested but CUDA is not available on this machine.',
                                    'use accelerator="cpu" (or "auto"), or install a CUDA build of torch '
                                    "(see the README) on a machine with an NVIDIA GPU.")
    if accelerator == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise MisconfigurationError('accelerator="mps" was requested but MPS is not available.',
                                    'use accelerator="cpu" or "auto".')
    return accelerator


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module under DataParallel/DistributedDataParallel/torch.compile wrappers."""
    while True:
        inner = getattr(module, "module", None) if isinstance(
            module, (nn.DataParallel, nn.parallel.DistributedDataParallel)) else getattr(module, "_orig_mod", None)
        if inner is None:
            return module
        module = inner


class Strategy:
    """One process, one device (cuda:k, mps or cpu)."""

    name = "single"
    rank = 0
    local_rank = 0
    world_size = 1

    def __init__(self, accelerator: str = "auto", devices: Any = "auto") -> None:
        self.accelerator = resolve_accelerator(accelerator)
        index = 0
        if isinstance(devices, Sequence) and not isinstance(devices, str):
            if len(devices) != 1:
                raise MisconfigurationError(f"strategy='single' runs on one device, got devices={list(devices)}.",
                                            'pass devices=[k] for GPU k, or use strategy="dp"/"ddp" for several.')
            index = int(devices[0])
        self.device = torch.device(self.accelerator, index) if self.accelerator == "cuda" else \
            torch.device(self.accelerator)
        # On the CPU, batches are already where they belong: skip the per-step tree walk.
        self._move = self.device.type != "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in the processes this strategy needs (here: this one) and return rank 0's result."""
        return fn(*args)

    def setup_environment(self) -> None:
        """Join process groups, pick the device (called once per entry point, inside the worker)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move the module to the device and wrap it; returns what the loop calls."""
        return module.to(self.device)

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """The module to call during validation/test/predict."""
        return wrapped

    def batch_to_device(self, batch: Any) -> Any:
        return batch_to_device(batch, self.device) if self._move else batch

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The state dict of the user's module: never prefixed with ``module.`` or ``_orig_mod.``."""
        return unwrap(module).state_dict()

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager:
        """Context for micro-batches that do not step (ddp skips the gradient all-reduce there)."""
        return contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return tensor

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def teardown(self) -> None:
        pass


def select_strategy(strategy: Any, accelerator: str, devices: Any) -> Strategy:
    """Build the strategy named by ``strategy`` ("auto", "single", "dp", "ddp") or take a Strategy instance."""
    if isinstance(strategy, Strategy):
        return strategy
    if strategy in ("auto", "single"):
        return Strategy(accelerator, devices)
    raise MisconfigurationError(f"Unknown strategy {strategy!r}.",
                                'use "auto", "single", "dp" or "ddp" (or pass a Strategy instance).')
