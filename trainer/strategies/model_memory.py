"""Memory for models that outgrow a device: activation checkpointing of chosen layers, and layers
built on the meta device (no memory) that are materialised when a run sets the task up, under fsdp
one shard at a time.

* ``Trainer(activation_checkpointing={Block})``: each outermost submodule of those classes keeps
  only its inputs in the forward and recomputes its activations in the backward
  (``torch.utils.checkpoint``, non-reentrant, the RNG state preserved so dropout draws the same
  masks): one more forward of those layers for their activations' memory. The forward is replaced on
  the instance, so parameter names, state dicts and checkpoints are unchanged.
* ``with trainer.init_module(empty_init=True): task = MyTask()``: every parameter and buffer a layer
  registers is put on the meta device (shapes only; data the task makes in ``__init__`` stays real).
  When a run sets the task up, each layer is given memory and initialised by its
  ``reset_parameters()``, children first, with the random numbers the eager construction would have
  drawn: a model of torch's layers gets exactly its eager weights. Under fsdp each wrapped unit is
  sharded as soon as it is initialised, so a rank holds its shards plus one unit in full, never the
  whole model.

:func:`prepare_module` is what the Trainer calls before the strategy wraps the task;
docs/big-models.md has the measurements and the arithmetic.
"""
from __future__ import annotations

import contextlib
import importlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import MisconfigurationError, TaskModuleError

Policy = Callable[[nn.Module], bool] | frozenset | None
# On each module built inside init_module(empty_init=True): the CPU random state when that block
# began (an attribute, so that it travels with the task to spawned ddp/fsdp workers); removed once
# materialised.
_RNG = "_taskfit_empty_init_rng"


# ---- activation checkpointing --------------------------------------------------------------------
def checkpoint_policy(policy: Any) -> Policy:
    """``Trainer(activation_checkpointing=...)`` checked at construction: None, a module class,
    several (classes or their import paths, e.g. ``"torch.nn.TransformerEncoderLayer"`` from the
    command line), or a function ``module -> bool``."""
    if policy is None or isinstance(policy, (list, tuple, set, frozenset)) and not policy:
        return None
    if callable(policy) and not isinstance(policy, (type, nn.Module)):
        return policy
    classes = [policy] if isinstance(policy, (type, str)) else policy
    if isinstance(classes, Iterable) and not isinstance(classes, (str, bytes, dict)):
        found = frozenset(_class(c, policy) for c in classes)
        if all(isinstance(c, type) and issubclass(c, nn.Module) for c in found):
            return found
    raise MisconfigurationError(
        f"Trainer(activation_checkpointing={policy!r}) is not valid.",
        "pass the layer classes to checkpoint (e.g. {nn.TransformerEncoderLayer} or "
        "[\"mypkg.model.Block\"]), a function module -> bool, or None.")


def _class(spec: Any, policy: Any) -> Any:
    if not isinstance(spec, str):
        return spec
    module, _, name = spec.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise MisconfigurationError(
            f"Trainer(activation_checkpointing={policy!r}): {spec!r} is not an importable class.",
            'give the full import path of a layer class, e.g. "torch.nn.TransformerEncoderLayer".',
        ) from None


class CheckpointedForward:
    """A module's forward run under ``torch.utils.checkpoint`` while gradients are recorded (else as
    it is)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(task: nn.Module, policy: Policy) -> list[str]:
    """Checkpoint the outermost submodules of ``task`` that ``policy`` picks (once: a second fit
    finds them done); returns their names. A policy that picks nothing is an error: a setting that
    does nothing must say so."""
    if policy is None:
        return []
    picks = (lambda m: isinstance(m, tuple(policy))) if isinstance(policy, frozenset) else policy
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in task.named_modules():
        if module is task or any(name.startswith(outer + ".") for outer, _ in chosen):
            # the task itself runs the step; inside a checkpointed layer everything is recomputed
            # anyway
            continue
        if picks(module):
            chosen.append((name, module))
    if not chosen:
        kinds = sorted({type(m).__name__ for m in task.modules()
                        if m is not task and any(True for _ in m.parameters())})
        raise MisconfigurationError(
            f"Trainer(activation_checkpointing={_describe(policy)}) picks no submodule of "
            f"{type(task).__name__}; its layers with parameters are {kinds}.",
            "name the classes of the blocks whose activations should be recomputed (e.g. the "
            "transformer block), or leave activation_checkpointing=None.")
    for _, module in chosen:
        if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
            module.forward = CheckpointedForward(module)
    return [name for name, _ in chosen]


def _describe(policy: Policy) -> str:
    if isinstance(policy, frozenset):
        return "{" + ", ".join(sorted(c.__name__ for c in policy)) + "}"
    return getattr(policy, "__name__", repr(policy))


# ---- meta-device initialisation ------------------------------------------------------------------
@contextlib.contextmanager
def init_module(strategy: Any, empty_init: bool | None = None) -> Iterator[None]:
    """``with trainer.init_module(empty_init=True): task = MyTask()``: the layers' parameters and
    buffers are made on the meta device (no memory, no initialisation) and materialised when the run
    sets the task up (fsdp: one unit at a time, each rank keeping its shard). ``empty_init=None``
    decides as Lightning does: empty under fsdp, else a plain construction (the strategy moves the
    task to its device)."""
    if empty_init is None:
        empty_init = bool(strategy.sharded_checkpoints)
    if not empty_init:
        yield
        return
    rng = torch.get_rng_state()
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if (
            param is not None
            and not param.is_meta
            and not isinstance(param, nn.parameter.UninitializedParameter)
        ):
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            module.__dict__[_RNG] = rng
        register_parameter(module, name, param)

    def buffer_on_meta(
        module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        if (
            tensor is not None
            and not tensor.is_meta
            and not isinstance(tensor, nn.parameter.UninitializedBuffer)
        ):
            tensor = tensor.to("meta")
            module.__dict__[_RNG] = rng
        register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter = parameter_on_meta  # type: ignore
    nn.Module.register_buffer = buffer_on_meta  # type: ignore
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = (
            register_parameter,
            register_buffer,
        )  # type: ignore


def has_meta(module: nn.Module) -> bool:
    """``module`` has a parameter or buffer on the meta device (built inside
    ``init_module(empty_init=True)``)."""
    return any(t.is_meta for t in _own_tensors(module, recurse=True))


def materialize(root: nn.Module, on_done: Callable[[nn.Module], None] | None = None) -> None:
    """Give every meta parameter and buffer of ``root`` CPU memory and initialise it with its
    module's ``reset_parameters()``, children before their parent (the order of an eager
    construction), with the random numbers drawn from the state ``init_module`` began with. If
    nothing has drawn random numbers since, the random stream is left where an eager build would
    have left it; otherwise (a seed set since) as it was. ``on_done(module)`` is called after each
    module's subtree is done (fsdp shards a unit there)."""
    states = [m.__dict__.pop(_RNG) for m in root.modules() if _RNG in m.__dict__]
    # Tied parameters stay tied: a meta tensor seen again gets the same tensor, held weakly (fsdp
    # frees a unit's full tensors once it has sharded them); the meta tensor is kept, so that its id
    # is not reused.
    made: dict[int, tuple[torch.Tensor, weakref.ref]] = {}
    done: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in done:
            return
        done.add(id(module))
        for child in module.children():
            visit(child)
        empty = [(n, t) for n, t in _own_tensors(module, recurse=False, named=True) if t.is_meta]
        if empty:
            reset = getattr(module, "reset_parameters", None) or (
                module._reset_parameters if isinstance(module, nn.MultiheadAttention) else None)
            if reset is None:
                raise TaskModuleError(
                    f"{type(module).__name__} was built inside "
                    f"trainer.init_module(empty_init=True), so its {[n for n, _ in empty]} have no "
                    "values, and it has no reset_parameters() to initialise them.",
                    f"define {type(module).__name__}.reset_parameters() to fill its parameters and "
                    "buffers (torch's layers have one), or build this layer outside init_module.")
            for name, meta in empty:
                real = made[id(meta)][1]() if id(meta) in made else None
                if real is None:
                    real = torch.empty_like(meta, device="cpu")
                    if isinstance(meta, nn.Parameter):
                        real = type(meta)(real, requires_grad=meta.requires_grad)
                    made[id(meta)] = (meta, weakref.ref(real))
                setattr(module, name, real)
            with torch.no_grad():
                reset()
        if on_done is not None:
            on_done(module)

    caller = torch.get_rng_state()
    # no random number drawn since the with block
    untouched = bool(states) and torch.equal(caller, states[0])
    if states:
        torch.set_rng_state(states[0])
    try:
        visit(root)
    finally:
        if not untouched:  # else the stream goes on where an eager build would have left it
            torch.set_rng_state(caller)


def _own_tensors(module: nn.Module, recurse: bool, named: bool = False) -> Iterator[Any]:
    for name, tensor in [
        *module.named_parameters(recurse=recurse),
        *module.named_buffers(recurse=recurse),
    ]:
        yield (name, tensor) if named else tensor


# ---- before the strategy wraps the task ----------------------------------------------------------
def prepare_module(task: nn.Module, strategy: Any, policy: Any, channels_last: bool) -> nn.Module:
    """The task as the strategy receives it: meta layers materialised (fsdp does that itself, unit
    by unit: its ``setup_module``), chosen layers checkpointed, ``channels_last`` applied. Returns
    ``task``."""
    if not strategy.sharded_checkpoints and has_meta(task):
        materialize(task)
    checkpoint_activations(task, policy)
    if channels_last:
        task.to(memory_format=torch.channels_last)
    return task
