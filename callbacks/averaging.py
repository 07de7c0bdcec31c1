"""A running average of a module's weights kept beside it, for EMA and SWA
(callbacks/weight_averaging.py).

``AveragedWeights`` holds one tensor per floating-point parameter (and per floating-point buffer
with ``use_buffers``) of the module being trained, and updates them in place with
``torch._foreach_lerp_``, the kernel ``torch.optim.swa_utils`` uses: one extra copy of the weights
in memory and, per update, one pass over them (read two copies, write one), about the cost of an SGD
step. Under fsdp each rank averages its own shard of every parameter (the average is elementwise: no
communication), so the copy is 1/N of the model per rank; under ddp every rank holds the same
weights after each step, so every rank's average is the same.

The model and the average can trade places (``swap``): validation runs on the average, training goes
on with the model's own weights. ``state`` / ``load`` give a checkpoint's part: whichever of the two
is not in the model at the time, and where it is (under fsdp gathered whole: the checkpoint's
callback part is one file).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

AvgFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MultiAvgFn = Callable[[list[torch.Tensor], list[torch.Tensor], Any], None]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return None
    return DTensor


class AveragedWeights:
    """The running average of ``module``'s floating-point parameters (and buffers, with
    ``use_buffers``).

    ``device``: where the average lives (None: beside each tensor). Nothing is allocated until the
    first :meth:`update`, which copies the weights (as ``AveragedModel`` does); later updates blend
    them in.
    """

    def __init__(
        self, module: nn.Module, use_buffers: bool = True, device: torch.device | str | None = None
    ) -> None:
        dtensor = _dtensor_type()
        named = list(module.named_parameters())
        if use_buffers:
            named += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        self.names: list[str] = []
        # the module's own tensors (this rank's shard under fsdp), detached
        self.live: list[torch.Tensor] = []
        # per tensor: (mesh, placements, shape, stride) of a DTensor, else None
        self.layouts: list[Any] = []
        for name, tensor in named:
            if not tensor.is_floating_point():
                continue
            if dtensor is not None and isinstance(tensor, dtensor):
                self.layouts.append(
                    (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
                )
                tensor = tensor.to_local()
            else:
                self.layouts.append(None)
            self.names.append(name)
            self.live.append(tensor.detach())
        self.device = torch.device(device) if device is not None else None
        self.average: list[torch.Tensor] | None = None  # allocated by the first update
        self._grouped: list[tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None
        self.count = 0  # updates so far (AveragedModel's n_averaged)
        # True while the module holds the average and ``average`` the module's own weights
        self.swapped = False

    @property
    def nbytes(self) -> int:
        """Memory the average takes on this rank (0 before the first update)."""
        return sum(t.numel() * t.element_size() for t in self.average or [])

    # ---- updating --------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, weight: float | None = None, avg_fn: AvgFn | None = None,
               multi_avg_fn: MultiAvgFn | None = None) -> None:
        """Blend the module's current weights into the average.

        The first update copies them. Then, by precedence: ``weight`` (``avg += weight * (w -
        avg)``: EMA with ``weight = 1 - decay``), ``multi_avg_fn`` / ``avg_fn``
        (``torch.optim.swa_utils`` signatures, called with the number of updates so far), else the
        equal average of every update (SWA: ``weight = 1 / (count + 1)``).
        """
        if self.swapped:
            raise RuntimeError(
                "AveragedWeights.update while the average is swapped into the module"
            )
        if self.average is None:
            self.average = [
                t.to(self.device, copy=True) if self.device else t.clone() for t in self.live
            ]
            self._grouped = None
        elif weight is not None or (avg_fn is None and multi_avg_fn is None):
            weight = 1.0 / (self.count + 1) if weight is None else weight
            for averaged, current in self._groups():
                torch._foreach_lerp_(averaged, current, weight)
        elif multi_avg_fn is not None:
            for averaged, current in self._groups():
                multi_avg_fn(averaged, current, torch.tensor(self.count, device=averaged[0].device))
        else:
            for averaged, current in zip(self.average, self._current()):
                averaged.copy_(
                    avg_fn(averaged, current, torch.tensor(self.count, device=averaged.device))
                )
        self.count += 1

    def _current(self) -> list[torch.Tensor]:
        """The module's weights where the average is (a copy per update when ``device`` differs)."""
        if self.device is None:
            return self.live
        return [t.to(self.device, non_blocking=True) for t in self.live]

    def _groups(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """(average, current) lists of one device and dtype each: what a ``_foreach`` kernel takes
        at once. Built once (the lists hold the tensors themselves) unless the average lives
        elsewhere (fresh copies each time)."""
        if self._grouped is not None:
            return self._grouped
        groups: dict[
            tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]
        ] = {}
        for averaged, current in zip(self.average or [], self._current()):
            pair = groups.setdefault((averaged.device, averaged.dtype), ([], []))
            pair[0].append(averaged)
            pair[1].append(current)
        if self.device is None:
            self._grouped = list(groups.values())
        return list(groups.values())

    # ---- using the average -----------------------------------------------------------------------
    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the module's weights and the average (exact copies: swapping twice restores both
        bit for bit). Under fsdp it exchanges this rank's shards: call it while the module is
        sharded (not gathered)."""
        if self.average is None:
            return
        for averaged, live in zip(self.average, self.live):
            kept = live.clone()
            live.copy_(averaged)
            averaged.copy_(kept)
        self.swapped = not self.swapped

    # ---- checkpoints -----------------------------------------------------------------------------
    def state(self, gather: bool) -> dict[str, Any]:
        """The average (or, while swapped, the module's own weights) by name, with the update count.
        ``gather``: under fsdp, all-gather each shard to the whole tensor (a collective: every rank
        must call it)."""
        tensors = None
        if self.average is not None:
            tensors = {name: self._whole(t, layout) if gather else t
                       for name, t, layout in zip(self.names, self.average, self.layouts)}
        return {"count": self.count, "swapped": self.swapped, "weights": tensors}

    def _whole(self, local: torch.Tensor, layout: Any) -> torch.Tensor:
        if layout is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = layout
        on_mesh = local.to(self.live[0].device)
        return (
            DTensor.from_local(on_mesh, mesh, placements, shape=shape, stride=stride)
            .full_tensor()
            .cpu()
        )

    def exchange(self, module_state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """In a checkpoint's ``module`` state (a state dict of the module, sharded under fsdp): put
        the average in place of the weights, and return those weights, whole (under fsdp gathered:
        every rank must call it)."""
        training = {}
        for name, averaged, layout in zip(self.names, self.average or [], self.layouts):
            current = module_state[name]
            if layout is None:  # no copy: the file is serialised before the next step
                training[name], module_state[name] = current, averaged
                continue
            from torch.distributed.tensor import DTensor

            mesh, placements, shape, stride = layout
            training[name] = current.full_tensor().cpu()
            module_state[name] = DTensor.from_local(
                averaged.to(current.device), mesh, placements, shape=shape, stride=stride
            )
        return training

    @torch.no_grad()
    def load(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state`: the module holds what the checkpoint's ``module`` part holds
        (loaded first); if that was the average (``swapped``), the two trade places so that training
        goes on with its own weights."""
        weights = state.get("weights")
        self.count, self.swapped = int(state["count"]), False
        if weights is None:
            self.average, self._grouped = None, None
            return
        missing = [n for n in self.names if n not in weights]
        if missing:
            raise KeyError(missing[0])
        self._grouped = None
        self.average = [self._local(weights[name], live, layout)
                        for name, live, layout in zip(self.names, self.live, self.layouts)]
        if state.get("swapped"):
            self.swapped = True
            self.swap()

    def _local(self, saved: torch.Tensor, live: torch.Tensor, layout: Any) -> torch.Tensor:
        """``saved`` as this rank keeps it: its shard (fsdp) on the average's device, a tensor of
        its own."""
        if layout is not None and tuple(saved.shape) != tuple(live.shape):
            from torch.distributed.tensor import distribute_tensor

            mesh, placements, _, _ = layout
            saved = distribute_tensor(
                saved.to(live.device), mesh, placements, src_data_rank=None
            ).to_local()
        return saved.to(self.device or live.device, dtype=live.dtype, copy=True)
