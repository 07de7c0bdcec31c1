"""``Trainer(profiler=...)``: which profiler a run gets, and the pass-through ``trainer.profiler``
is when profiling is off (nothing added to the hook table: the loop pays nothing). The profilers:
trainer/profiler.py (simple) and trainer/torch_profiler.py (torch)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..callbacks import Callback
from ..errors import MisconfigurationError
from .simple import SimpleProfiler


class PassThroughProfiler:
    """``trainer.profiler`` when profiling is off: ``profile(name)`` does nothing (Lightning's
    PassThroughProfiler)."""

    @contextlib.contextmanager
    def profile(self, action_name: str) -> Iterator[None]:
        yield

    def describe(self) -> None:
        """Nothing to report."""


def profiler_for(profiler: Any, callbacks: list[Callback]) -> tuple[list[Callback], Any]:
    """``Trainer(profiler=...)``: the callbacks and ``trainer.profiler``. None: the callbacks as
    they are and a pass-through; ``"simple"``/``"torch"`` or a profiler instance: the profiler first
    among the callbacks."""
    if profiler is None or profiler is False:
        return callbacks, PassThroughProfiler()
    if isinstance(profiler, str):
        if profiler not in ("simple", "torch", "pytorch"):
            raise MisconfigurationError(
                f"Trainer(profiler={profiler!r}) is not a profiler taskfit has.",
                'use profiler="simple" (time per stage and hook, cheap enough to leave on) or '
                '"torch" (a '
                "torch.profiler trace of a few steps per rank); Lightning's \"advanced\" "
                "(cProfile) is not built in: "
                "run python -m cProfile -o fit.prof your_script.py.")
        if profiler == "simple":
            profiler = SimpleProfiler()
        else:
            from .pytorch import PyTorchProfiler

            profiler = PyTorchProfiler()
    if not isinstance(profiler, SimpleProfiler):
        raise MisconfigurationError(f"Trainer(profiler=...) got {type(profiler).__name__}.",
                                    'pass "simple", "torch", or a SimpleProfiler/PyTorchProfiler '
                                    'instance.')
    return ([profiler] if not any(cb is profiler for cb in callbacks) else []) + list(
        callbacks
    ), profiler
