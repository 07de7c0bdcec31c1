"""FSDPStrategy: fully sharded data parallel with PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``).

Each of N processes holds 1/N of every parameter, gradient and optimizer state (parameters are
DTensors sharded on dim 0). A forward all-gathers one wrapped unit at a time (the auto-wrap policy
decides the units: every ``nn.TransformerEncoderLayer``/``DecoderLayer`` by default, or a set of
classes, a parameter count, a function), and backward reduce-scatters the gradients, so every rank
steps only its own shard. Processes start exactly as under ddp (``DDPStrategy``: torchrun, or
``python script.py`` with self-launched workers); checkpoints are directories of per-rank shards
(``sharded_checkpoint.py``). docs/strategies.md, "fsdp", has the arithmetic.

Evaluation gathers the parameters once per pass (one all-gather per unit when the pass starts) and
runs without collectives, so ranks may run different numbers of evaluation batches (taskfit shards
evaluation data without padding: 23 + 22 samples); the first training forward after it frees them
again.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from ..errors import MisconfigurationError, TaskModuleError
from ..precision import fsdp_norm_policy
from .base import resolve_accelerator, unwrap
from .ddp import DDPStrategy
from .model_memory import has_meta, materialize
from .wrapped_step import ThroughWrapper

if TYPE_CHECKING:
    from ..precision import Precision

DEFAULT_WRAP = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
WrapPolicy = Iterable[type] | int | Callable[[nn.Module], bool] | None
# roots whose parameters evaluation has gathered
_GATHERED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# root -> reshard_after_forward
_RESHARD: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


class FSDPStrategy(DDPStrategy):
    """FSDP2 over ``devices`` processes (or torchrun's): parameters, gradients and optimizer states
    sharded.

    Args:
        accelerator: "cpu" (gloo), "cuda" (nccl) or "auto".
        devices: processes on this machine, as for ddp ("auto": every GPU; 1 on a CPU).
        auto_wrap_policy: which submodules become their own FSDP unit (all-gathered and freed on
            their own), before the root takes the rest: a set of module classes (default:
            ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``), an int (every
            submodule holding at least that many parameters not already in a smaller unit), a
            function ``module -> bool``, or an empty set (the root only).
        reshard_after_forward: free a unit's gathered parameters after its forward (and gather them
            again in backward): less memory, one more all-gather per unit and step.
        mixed_precision: "auto" (the Trainer's precision decides, precision.py's
            ``Precision.fsdp_policy``: ``"bf16-mixed"`` gathers and computes in bfloat16 and reduces
            gradients in float32), None (parameters as they are), or a ``MixedPrecisionPolicy``.
        cpu_offload: keep the shards, gradients and optimizer states in CPU memory (CUDA only).
        timeout: as for :class:`~taskfit.ddp.DDPStrategy`.
        start_method: as for :class:`~taskfit.ddp.DDPStrategy`.
    """

    name = "fsdp"
    shards_gradients = True
    sharded_checkpoints = True

    def __init__(
        self,
        accelerator: str = "auto",
        devices: Any = "auto",
        *,
        auto_wrap_policy: WrapPolicy = None,
        reshard_after_forward: bool = True,
        mixed_precision: Any = "auto",
        cpu_offload: bool = False,
        timeout: float = 600.0,
        start_method: str | None = None,
    ) -> None:
        resolved = resolve_accelerator(accelerator)
        if resolved == "mps":
            raise MisconfigurationError('strategy="fsdp" does not run on accelerator="mps".',
                                        'use accelerator="cpu" (gloo processes), or '
                                        'strategy="single" for the '
                                        "Apple GPU.")
        if cpu_offload and resolved != "cuda":
            raise MisconfigurationError("FSDPStrategy(cpu_offload=True) moves shards between GPU "
                                        "and CPU memory, but this run is on "
                                        f"accelerator={resolved!r}.",
                                        "use cpu_offload only with accelerator=\"cuda\"; on the "
                                        "CPU every shard is in CPU memory already.")
        self.auto_wrap_policy = _check_policy(auto_wrap_policy)
        if not isinstance(reshard_after_forward, bool):
            raise MisconfigurationError(
                f"FSDPStrategy(reshard_after_forward={reshard_after_forward!r}) is not valid.",
                "pass True (free gathered parameters after each unit's forward) or False.",
            )
        if not (
            mixed_precision in ("auto", None) or isinstance(mixed_precision, MixedPrecisionPolicy)
        ):
            raise MisconfigurationError(f"FSDPStrategy(mixed_precision={mixed_precision!r}) is not "
                                        "valid.",
                                        'pass "auto" (from Trainer(precision=...)), None, or a '
                                        "torch.distributed.fsdp.MixedPrecisionPolicy.")
        self.reshard_after_forward, self.mixed_precision = reshard_after_forward, mixed_precision
        self.cpu_offload = cpu_offload
        super().__init__(resolved, devices, timeout=timeout, start_method=start_method)

    # ---- the module ------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, precision: Precision | None = None) -> nn.Module:
        """Shard ``module`` in place: each unit the wrap policy picks (innermost first), then the
        root. Layers built on the meta device (``trainer.init_module``) are materialised one unit at
        a time, each sharded at once.

        Returns the module itself (its class becomes ``FSDP<Task>``): the loop calls it, the
        optimizers built afterwards by ``configure_optimizers`` hold its sharded parameters. A
        module sharded by an earlier run in this process is used as it is.
        """
        if isinstance(module, FSDPModule):
            mesh = getattr(next(iter(module.parameters()), None), "device_mesh", None)
            if mesh is not None and mesh.size() != self.world_size:
                raise MisconfigurationError(
                    f"{type(module).__name__} was sharded over {mesh.size()} processes by an "
                    "earlier run; this strategy has "
                    f"{self.world_size}.", "build a new task for a run with another number of "
                    "processes (or load its weights from a checkpoint into a new one).")
            release(module)
            return module
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        options = dict(mesh=mesh, mp_policy=self._mp_policy(precision),
                       offload_policy=CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy())
        units = wrapped_units(module, self.auto_wrap_policy)
        # BatchNorm's running statistics stay float32, so its
        if options["mp_policy"].param_dtype is not None:
            # weights must
            norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     # too: units of their own, float32
                     and m is not module and not any(m is u for u in units)]
            units = norms + units  # innermost first: a normalisation layer has no submodules

        def shard(unit: nn.Module) -> None:
            fp32 = (
                isinstance(unit, nn.modules.batchnorm._BatchNorm)
                and options["mp_policy"].param_dtype is not None
            )
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward,
                        **{**options, "mp_policy": fsdp_norm_policy()} if fp32 else options)

        # built by trainer.init_module: each unit is initialised, then sharded at once
        if has_meta(module):
            ids = {id(u) for u in units}
            materialize(module, on_done=lambda m: shard(m) if id(m) in ids else None)
        else:
            for unit in units:
                shard(unit)
        fully_shard(module, **options)
        _lazy_init(module)
        _RESHARD[module] = self.reshard_after_forward
        module.register_forward_pre_hook(_release_before_training, prepend=True)
        # their parameters are gathered only inside the root's forward
        for name, sub in _root_owned(module, units):
            sub.register_forward_pre_hook(_refuse_sharded_call(name))
        return module

    def _mp_policy(self, precision: Precision | None) -> MixedPrecisionPolicy:
        if isinstance(self.mixed_precision, MixedPrecisionPolicy):
            return self.mixed_precision
        if self.mixed_precision == "auto" and precision is not None:
            return precision.fsdp_policy()
        return MixedPrecisionPolicy()

    def eval_module(self, wrapped: nn.Module) -> Any:
        """What evaluation (and manual optimization's step) calls: the sharded module, whose
        ``eval()`` gathers every unit's parameters once (every rank calls it when a pass starts), so
        that the pass runs without collectives, whatever number of batches each rank has."""
        return GatheredEval(unwrap(wrapped))

    def gradient_sync(self, wrapped: nn.Module, enabled: bool) -> None:
        """Accumulation micro-batches keep their (unsharded) gradients locally; the stepping one
        reduce-scatters."""
        root = unwrap(wrapped)
        if isinstance(root, FSDPModule):
            root.set_requires_gradient_sync(enabled)

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Nothing to do: FSDP's backward has already reduce-scattered (averaged) every gradient
        shard."""

    # ---- state in checkpoints --------------------------------------------------------------------
    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The sharded state dict: a DTensor per parameter (this rank's shard), buffers as they
        are."""
        root = unwrap(module)
        release(root)
        return get_model_state_dict(root)

    def load_module_state_dict(self, module: nn.Module, state: Mapping[str, Any]) -> None:
        """Load a sharded state dict, or a full one (each rank keeps its part of every tensor)."""
        root = unwrap(module)
        release(root)
        full = not any(isinstance(v, DTensor) for v in state.values())
        set_model_state_dict(root, dict(state), options=StateDictOptions(full_state_dict=full))

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, Any]) -> None:
        """Load a sharded optimizer state, or a full one: each full per-parameter tensor is cut to
        this rank's shard of its parameter (no communication)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        local: dict[Any, Any] = {}
        for index, values in state["state"].items():
            param = params[int(index)]
            local[index] = (
                {k: _shard_like(v, param) for k, v in values.items()}
                if isinstance(values, Mapping)
                else values
            )
        optimizer.load_state_dict({**state, "state": local})

    def checkpoint_templates(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                             shapes: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A DTensor sharded like its parameter for every parameter and per-parameter optimizer
        state: each rank reads only its own part of a sharded checkpoint, whatever the number of
        processes that wrote it."""
        root = unwrap(module)
        release(root)
        named = dict(root.named_parameters())
        per_optimizer = [
            [p for group in o.param_groups for p in group["params"]] for o in optimizers
        ]
        templates = {}
        for key, meta in shapes.items():
            param = _parameter_of(key, named, per_optimizer)
            if isinstance(param, DTensor) and tuple(param.shape) == tuple(meta.shape):
                templates[key] = torch.empty_like(param, dtype=meta.dtype)
        return templates

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict on rank 0's CPU (gathered: every rank calls it; the others get
        ``{}``)."""
        root = unwrap(module)
        release(root)
        if not isinstance(root, FSDPModule):
            return super().full_state_dict(root)
        return get_model_state_dict(
            root, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )


# ---- the wrap policy -----------------------------------------------------------------------------
def _check_policy(policy: WrapPolicy) -> WrapPolicy:
    if policy is None:
        return set(DEFAULT_WRAP)
    if isinstance(policy, bool) or isinstance(policy, int) and policy < 1:
        raise _bad_policy(policy)
    if isinstance(policy, int) or (callable(policy) and not isinstance(policy, type)):
        return policy
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, Iterable) and not isinstance(policy, str):
        classes = set(policy)
        if all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            return classes
    raise _bad_policy(policy)


def _bad_policy(policy: Any) -> MisconfigurationError:
    return MisconfigurationError(f"FSDPStrategy(auto_wrap_policy={policy!r}) is not valid.",
                                 "pass a set of nn.Module classes (e.g. "
                                 "{nn.TransformerEncoderLayer}), a positive number of parameters, "
                                 "a function module -> bool, or an empty set for the root only.")


def wrapped_units(root: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """The submodules ``policy`` makes units of, innermost first (FSDP shards children before their
    parents)."""
    order = list(reversed(list(root.modules())))  # every module after all of its descendants
    if isinstance(policy, int):
        units, pending = [], {}
        for m in order:  # parameters not yet in a unit, counted bottom-up
            count = sum(p.numel() for p in m.parameters(recurse=False)) + sum(
                pending.get(c, 0) for c in m.children()
            )
            if m is not root and count >= policy:
                units.append(m)
                count = 0
            pending[m] = count
        return units
    if callable(policy) and not isinstance(policy, (set, frozenset)):
        return [m for m in order if m is not root and policy(m)]
    return [m for m in order if m is not root and isinstance(m, tuple(policy))]


def _root_owned(root: nn.Module, units: list[nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """Submodules with parameters of their own whose parameters belong to the root's unit."""
    inside = {id(m) for unit in units for m in unit.modules()}
    for name, m in root.named_modules():
        if m is not root and id(m) not in inside and any(True for _ in m.parameters(recurse=False)):
            yield name, m


def _refuse_sharded_call(name: str) -> Callable[..., None]:
    def check(module: nn.Module, args: Any) -> None:
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            raise TaskModuleError(
                f"The submodule {name!r} ({type(module).__name__}) was called outside the forward "
                "of the task, while its parameters are sharded over the fsdp processes (FSDP "
                "gathers them only inside the task's own forward).",
                "call it inside the task's forward and call self(...) in the step "
                "(docs/strategies.md, fsdp).")
    return check


# ---- evaluation: the parameters gathered once per pass -------------------------------------------
def _units(root: nn.Module) -> list[FSDPModule]:
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def gather(root: nn.Module) -> None:
    """All-gather every unit's parameters and keep them (every rank must call it, in the same
    order)."""
    if root in _GATHERED or not isinstance(root, FSDPModule):
        return
    root.set_reshard_after_forward(False)
    for unit in _units(root):
        unit.unshard()
    _GATHERED.add(root)


def release(root: nn.Module) -> None:
    """Free what :func:`gather` gathered (local: no communication) and restore the training
    behaviour."""
    if root not in _GATHERED:
        return
    for unit in _units(root):
        unit.reshard()
    root.set_reshard_after_forward(_RESHARD.get(root, True))
    # FSDP's default for the root: kept for backward
    root.set_reshard_after_forward(False, recurse=False)
    _GATHERED.discard(root)


def _lazy_init(root: nn.Module) -> None:
    """Make ``root`` FSDP's root now, as its first forward would: evaluation may gather before any
    forward, and a step may call a unit before the root (FSDP would then take that unit for the
    root)."""
    state = getattr(root, "_get_fsdp_state", None)
    init = getattr(state(), "_lazy_init", None) if state is not None else None
    if init is not None:
        init()


def _release_before_training(module: nn.Module, args: Any) -> None:
    if module.training and module in _GATHERED:
        release(module)


class GatheredEval:
    """The sharded module as evaluation calls it: ``eval()`` gathers the parameters (see
    :func:`gather`); a call runs the module, or the task's own step when a ``ThroughWrapper`` has
    swapped the step in for its forward (the step then calls ``self(...)``, the module's real
    forward)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root

    def eval(self) -> GatheredEval:
        gather(self.root)
        self.root.eval()
        return self

    def train(self, mode: bool = True) -> GatheredEval:
        # the pass is over: free the gathered copy (local), as the next training forward would
        if mode:
            release(self.root)
        self.root.train(mode)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # manual optimization's step: train on the shards, not on evaluation's gathered copy
        if self.root.training:
            release(self.root)
        step = self.root.__dict__.get("forward")
        if isinstance(getattr(step, "__self__", None), ThroughWrapper):
            return step(*args, **kwargs)
        return self.root(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.root, name)


# ---- helpers -------------------------------------------------------------------------------------
def _shard_like(value: Any, param: torch.Tensor) -> Any:
    """A full per-parameter tensor cut to ``param``'s local shard; anything else as it is."""
    if (
        isinstance(param, DTensor)
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and tuple(value.shape) == tuple(param.shape)
    ):
        return distribute_tensor(
            value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        )
    return value


def _parameter_of(key: str, named: Mapping[str, torch.Tensor],
                  per_optimizer: list[list[torch.Tensor]]) -> torch.Tensor | None:
    """The parameter a checkpoint entry belongs to: ``module/<name>``,
    ``optimizer[/<i>]/state/<index>/<state>``."""
    parts = key.split("/")
    if parts[0] == "module":
        return named.get(key[len("module/"):])
    if parts[0] != "optimizer" or len(parts) < 4:
        return None
    i, rest = (0, parts[1:]) if parts[1] == "state" else (int(parts[1]), parts[2:])
    if rest[0] != "state" or i >= len(per_optimizer) or not rest[1].isdigit():
        return None
    params = per_optimizer[i]
    return params[int(rest[1])] if int(rest[1]) < len(params) else None
