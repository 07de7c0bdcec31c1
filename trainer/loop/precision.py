"""Precision: the autocast context and, for float16, the GradScaler. Built once per run, not per step."""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable

import torch

from ..errors import MisconfigurationError

_ALIASES = {"32": "32", "32-true": "32", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
            "16": "16-mixed", "16-mixed": "16-mixed"}


def normalize_precision(precision: Any) -> str:
    value = _ALIASES.get(str(precision))
    if value is None:
        raise MisconfigurationError(
            f"Unknown precision {precision!r}.",
            'use one of "32" (full precision), "bf16-mixed" or "16-mixed".')
    return value


_SLOW_FP16_ON_CPU = (
    'precision="16-mixed" on the CPU: float16 autocast has few fast CPU kernels, and with its GradScaler it trained '
    'the digits CNN about 13x slower than precision="32" (5.2 s against 0.39 s for 2 epochs, one thread; '
    'docs/performance.md). HINT: use precision="bf16-mixed" on the CPU (0.32 s there), or "16-mixed" on a CUDA GPU.')
_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A UserWarning the first time ``message`` is given in this process (not once per Trainer or per fit)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


class Precision:
    """``autocast`` is a reusable context (a no-op ``nullcontext`` for "32": no autocast entered per step)."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.precision = normalize_precision(precision)
        self.scaler: Any = None
        self.unscaled: set[int] = set()  # optimizers unscaled since their last step (GradScaler refuses a second)
        if self.precision == "32":
            self.autocast: Any = contextlib.nullcontext()
        else:
            dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
            self.autocast = torch.autocast(device_type=device.type, dtype=dtype)
            if self.precision == "16-mixed":
                self.scaler = torch.amp.GradScaler(device.type)
                if device.type == "cpu":
                    warn_once(_SLOW_FP16_ON_CPU)

    def autocasting(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step`` run under :attr:`autocast`; for "32" ``step`` itself (the loop enters no context per batch)."""
        if self.precision == "32":
            return step

        def step_under_autocast(*args: Any) -> Any:
            with self.autocast:
                return step(*args)
        return step_under_autocast

    def backward_call(self) -> Callable[..., None]:
        """What the step calls for backward: ``torch.Tensor.backward`` itself in full and bf16 precision (no frame
        of taskfit's per step), :meth:`backward` with a GradScaler."""
        return torch.Tensor.backward if self.scaler is None else self.backward

    def step_call(self, optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        """What the step calls to step ``optimizer``: its ``step`` itself without a GradScaler (no frame of taskfit's
        between the loop and the optimizer), else :meth:`step` for it. Returns False only for a skipped step."""
        return optimizer.step if self.scaler is None else functools.partial(self.step, optimizer)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(*args, **kwargs)``, scaled under 16-mixed (``retain_graph=True`` from manual_backward)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward(*args, **kwargs)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place (before clipping), so clip values mean what they say; once per step (a
        manual ``self.clip_gradients`` unscales before ``opt.step()`` does)."""
        if self.scaler is not None and id(optimizer) not in self.unscaled:
            self.scaler.unscale_(optimizer)
            self.unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the scaler skipped it (inf/NaN gradients)."""
        if self.scaler is None:
            optimizer.step()
            return True
        # GradScaler.step already synchronises (it reads found_inf on the host), so reading the scale
        # before and after update() adds no extra stall: a lowered scale means the step was skipped.
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self.unscaled.discard(id(optimizer))
        return self.scaler.get_scale() >= before

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
