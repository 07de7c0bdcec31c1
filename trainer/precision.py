"""Precision: the one place that decides number formats (docs/trainer.md, "Precision and
optimization").

It decides a mode's name and aliases, the autocast context, the GradScaler (backward, unscale,
step), the module's and the inputs' dtype ("true" modes), the default dtype while layers are
built, the FSDP mixed-precision policy, and which strategy a mode cannot run under. The Trainer
keeps the normalized name (:func:`normalize_precision`); each run builds one :class:`Precision`
(a GradScaler's state is a run's).

The modes are Lightning's: "32", "bf16-mixed" and "16-mixed" (autocast; float32 parameters),
"bf16-true" and "16-true" (parameters, inputs and compute in that dtype; no autocast, no
GradScaler: Lightning's HalfPrecision). A new mode is a row of :data:`DTYPES` and, if it needs
more than a dtype, a branch of :class:`Precision`.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .data.loaders import map_tensors
from .errors import MisconfigurationError

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

# Each mode's compute dtype, in the order the error for an unknown mode lists them.
DTYPES = {"32": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
          "bf16-true": torch.bfloat16, "16-true": torch.float16}
# Other spellings, Lightning's: an int is read as its string (16 -> "16").
ALIASES = {"32-true": "32", "bf16": "bf16-mixed", "16": "16-mixed"}


def normalize_precision(precision: Any) -> str:
    """The mode's name ("bf16" -> "bf16-mixed", 16 -> "16-mixed"); an unknown one is an error
    naming every valid one."""
    name = str(precision)
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        modes = ", ".join(f'"{m}"' for m in DTYPES)
        aliases = ", ".join(f'"{a}"' for a in ALIASES)
        raise MisconfigurationError(
            f"Unknown precision {precision!r}.",
            f"use one of {modes} (aliases: 32, 16, {aliases}; docs/trainer.md).")
    return name


def is_true(name: str) -> bool:
    """Parameters, inputs and compute in the mode's dtype (Lightning's "-true" half modes)."""
    return name.endswith("-true")


def init_context(name: str) -> contextlib.AbstractContextManager[Any]:
    """Where layers are built (``trainer.init_module``, ``configure_model``): a true mode's
    default dtype, so that they are made in it (Lightning's ``module_init_context``)."""
    return DefaultDtype(DTYPES[name]) if is_true(name) else contextlib.nullcontext()


@contextlib.contextmanager
def building(name: str, layers: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    """``layers`` (``trainer.init_module``'s meta-device context) inside :func:`init_context`."""
    with init_context(name), layers:
        yield


def check_strategy(name: str, strategy: Any) -> None:
    """Before any process starts: a mode the strategy cannot run is one error (16-mixed under
    fsdp, the one strategy whose ranks each hold a shard of the gradients)."""
    if name == "16-mixed" and getattr(strategy, "shards_gradients", False):
        raise MisconfigurationError(
            'Trainer(precision="16-mixed") cannot run under strategy="fsdp": its GradScaler '
            "decides on each rank whether the gradients overflowed, and under fsdp each rank "
            "sees only its shard of them, so ranks could skip different steps.",
            'use precision="bf16-mixed" (no scaler needed; FSDP then gathers in bfloat16 and '
            'reduces in float32), "bf16-true", or "32".')


def fsdp_norm_policy() -> MixedPrecisionPolicy:
    """FSDP's policy for a BatchNorm unit when the rest gathers in a lower dtype: float32, as its
    running statistics are (bfloat16 weights next to them fail in forward)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


class DefaultDtype:
    """``torch.set_default_dtype(dtype)`` inside, the previous one restored on exit. Reusable:
    the previous dtype is read at each entry, not when the context is made."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.previous: list[torch.dtype] = []

    def __enter__(self) -> None:
        self.previous.append(torch.get_default_dtype())
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self.previous.pop())


_SLOW_FP16_ON_CPU = (
    'precision="16-mixed" on the CPU: float16 autocast has few fast CPU kernels, and with its '
    'GradScaler it trained the digits CNN about 13x slower than precision="32" (5.2 s against '
    '0.39 s for 2 epochs, one thread; docs/performance.md). HINT: use precision="bf16-mixed" '
    'on the CPU (0.32 s there), or "16-mixed" on a CUDA GPU.')
_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A UserWarning the first time ``message`` is given in this process (not once per fit)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def _to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor


class Precision:
    """One run's precision: built once per run, not per step.

    ``forward_context`` is a reusable context: autocast (mixed), the default dtype (true), a
    no-op ``nullcontext`` for "32" (where the step is not wrapped at all: nothing per step).
    """

    def __init__(self, precision: str, device: torch.device) -> None:
        self.precision = normalize_precision(precision)
        self.dtype = DTYPES[self.precision]
        self.true = is_true(self.precision)
        self.scaler: Any = None
        # optimizers unscaled since their last step (a GradScaler refuses a second unscale)
        self.unscaled: set[int] = set()
        self.forward_context: Any = contextlib.nullcontext()
        if self.true:
            self.forward_context = DefaultDtype(self.dtype)
        elif self.precision != "32":
            self.forward_context = torch.autocast(device_type=device.type, dtype=self.dtype)
        if self.precision == "16-mixed":
            self.scaler = torch.amp.GradScaler(device.type)
            if device.type == "cpu":
                warn_once(_SLOW_FP16_ON_CPU)

    @property
    def scales_loss(self) -> bool:
        """A GradScaler scales the loss (16-mixed): gradients to unscale, overflows skipped."""
        return self.scaler is not None

    # ---- the module, the inputs, the forward ------------------------------------------------
    def init_context(self) -> contextlib.AbstractContextManager[Any]:
        """Around ``configure_model``: see :func:`init_context`."""
        return init_context(self.precision)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """A true mode's module in its dtype, parameters and buffers (Lightning's
        ``module.to(dtype)``); any other mode's as it is."""
        return module.to(dtype=self.dtype) if self.true else module

    def convert_input(self, batch: Any) -> Any:
        """A true mode's batch with its floating tensors in the dtype (integer targets stay)."""
        return map_tensors(batch, _to_dtype, self.dtype) if self.true else batch

    def batch_mover(self, move: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """What the loop calls to bring a batch to the device, ``move``: a true mode converts the
        batch first (before the batch hooks and the transfer, as Lightning), the others do not."""
        if not self.true:
            return move

        def convert_then_move(batch: Any) -> Any:
            return move(self.convert_input(batch))
        return convert_then_move

    def wrap_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step(batch, batch_idx, ...)`` in this precision: under autocast (mixed), under the
        default dtype (true: tensors made in the forward are made in it); ``step`` itself
        for "32" (no context entered per batch)."""
        if self.precision == "32":
            return step
        context = self.forward_context

        def step_in_context(*args: Any) -> Any:
            with context:
                return step(*args)
        return step_in_context

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """FSDP's policy for ``mixed_precision="auto"``: bf16-mixed gathers and computes in
        bfloat16 and reduces in float32 (float32 shards); otherwise the parameters' own dtype (a
        true mode's module is converted before it is sharded)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    # ---- backward, unscale, step ------------------------------------------------------------
    def backward_call(self) -> Callable[..., None]:
        """What the step calls for backward: ``torch.Tensor.backward`` itself without a
        GradScaler (no frame of taskfit's per step), :meth:`backward` with one."""
        return torch.Tensor.backward if self.scaler is None else self.backward

    def step_call(self, optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        """What the step calls to step ``optimizer``: its ``step`` itself without a GradScaler (no
        frame of taskfit's in between), else :meth:`step` for it. False: a skipped step."""
        if self.scaler is None:
            return optimizer.step
        return functools.partial(self.step, optimizer)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as backward must see it: scaled under 16-mixed, else itself."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(*args, **kwargs)``, scaled under 16-mixed (``retain_graph=True`` from
        manual_backward)."""
        self.scale(loss).backward(*args, **kwargs)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place (before clipping), so clip values mean what they say; once
        per step (a manual ``self.clip_gradients`` unscales before ``opt.step()`` does)."""
        if self.scaler is not None and id(optimizer) not in self.unscaled:
            self.scaler.unscale_(optimizer)
            self.unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the scaler skipped it (inf/NaN gradients)."""
        if self.scaler is None:
            optimizer.step()
            return True
        # GradScaler.step already synchronises (it reads found_inf on the host), so reading the
        # scale before and after update() adds no stall: a lowered scale means a skipped step.
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self.unscaled.discard(id(optimizer))
        return self.scaler.get_scale() >= before

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The GradScaler's state (16-mixed), else empty."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the GradScaler's state (a checkpoint of a 16-mixed run)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
