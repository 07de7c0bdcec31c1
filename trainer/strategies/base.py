"""Device strategies: where the module and the data live. The loop only talks to this small
interface.

``Strategy`` is the single-device strategy; ``DataParallelStrategy`` (here), ``DDPStrategy``
(``ddp.py``) and ``FSDPStrategy`` (``fsdp.py``) subclass it; ``strategy_registry.py`` picks one by
name. The interface, in the spirit of Lightning Fabric: ``launch``, ``setup_environment``,
``setup_module``, ``eval_module``, ``batch_to_device``, ``module_state_dict``, ``gradient_sync``,
``average_gradients``, ``all_reduce``, ``broadcast``, ``barrier``, ``is_main``, ``teardown``;
checkpoints ask it for the module's and the optimizers' state (``optimizer_state_dict``, ``load_*``,
``full_state_dict``). See docs/strategies.md.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from ..data.loaders import batch_to_device
from ..errors import MisconfigurationError

if TYPE_CHECKING:
    from ..precision import Precision

_ACCELERATORS = ("auto", "cpu", "cuda", "mps")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DataParallel/DDP, torch.compile


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
        raise MisconfigurationError('accelerator="cuda" was requested but CUDA is not available on '
                                    'this machine.',
                                    'use accelerator="cpu" (or "auto"), or install a CUDA build of '
                                    'torch '
                                    "(see the README) on a machine with an NVIDIA GPU.")
    if accelerator == "mps" and not (
        getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
    ):
        raise MisconfigurationError('accelerator="mps" was requested but MPS is not available.',
                                    'use accelerator="cpu" or "auto".')
    return accelerator


def parse_devices(devices: Any) -> int | list[int] | None:
    """``devices`` as None ("auto"), a count, or a list of device indices; one clear error for
    anything else."""
    if devices == "auto" or devices is None:
        return None
    if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        return devices
    if isinstance(devices, Sequence) and not isinstance(devices, str) and len(devices) > 0 and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
        if len(set(devices)) != len(devices):
            raise MisconfigurationError(f"Trainer(devices={list(devices)}) names a device twice.",
                                        "list each device index once, e.g. devices=[0, 1].")
        return [int(d) for d in devices]
    raise MisconfigurationError(f"Trainer(devices={devices!r}) is not valid.",
                                'pass "auto", a number of devices (e.g. devices=2) or a list of '
                                'GPU indices '
                                "(e.g. devices=[0, 2]).")


def gpu_indices(devices: int | list[int] | None) -> list[int]:
    """The CUDA device indices ``devices`` names: all visible GPUs for None, the first N for a
    count."""
    available = torch.cuda.device_count()
    wanted = list(range(available)) if devices is None else \
        list(range(devices)) if isinstance(devices, int) else devices
    if not wanted or max(wanted) >= available:
        raise MisconfigurationError(f"Trainer(devices={devices!r}) asks for GPUs {wanted}, but "
                                    f"this machine shows {available} CUDA device(s).",
                                    f"use devices <= {available} or indices below {available}, and "
                                    "check CUDA_VISIBLE_DEVICES.")
    return wanted


def unwrap(module: nn.Module) -> nn.Module:
    """The user's module under DataParallel/DistributedDataParallel/torch.compile wrappers."""
    while True:
        inner = (
            getattr(module, "module", None)
            if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel))
            else getattr(module, "_orig_mod", None)
        )
        if inner is None:
            return module
        module = inner


def normalize_state_dict(state_dict: Mapping[str, Any],
                         reference: nn.Module | Iterable[str] | None = None) -> Mapping[str, Any]:
    """A state dict without the ``module.``/``_orig_mod.`` prefixes that DataParallel, DDP and
    torch.compile add.

    What taskfit saves never has them; this makes a foreign state dict (a hand-written DataParallel
    loop, a compiled model) load into the plain module. A prefix is stripped only when every key
    carries it. With ``reference`` (the module to load into, or its keys), stripping stops as soon
    as the keys fit it, so a module whose only child is really called ``module`` keeps its keys.
    Returns the input when nothing changes.
    """
    keys = [k for k in state_dict if isinstance(k, str)]
    if len(keys) != len(state_dict) or not keys:
        return state_dict
    wanted = None
    if reference is not None:
        wanted = set(reference.state_dict() if isinstance(reference, nn.Module) else reference)
    stripped = ""
    while not (wanted is not None and any(k in wanted for k in keys)):
        prefix = next((p for p in _WRAPPER_PREFIXES if all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        keys = [k[len(prefix):] for k in keys]
        stripped += prefix
    if not stripped:
        return state_dict
    out: OrderedDict[str, Any] = OrderedDict(zip(keys, state_dict.values()))
    # per-module versions that load_state_dict reads
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        root = stripped[:-1]
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            ("" if k == root else k[len(stripped):], v) for k, v in metadata.items()
            if k == root or k.startswith(stripped))
    return out


class Strategy:
    """One process, one device (cuda:k, mps or cpu)."""

    name = "single"
    # each rank holds only a shard of the gradients (fsdp): precision.check_strategy reads it
    shards_gradients = False
    rank = 0
    local_rank = 0
    world_size = 1

    def __init__(self, accelerator: str = "auto", devices: Any = "auto") -> None:
        self.accelerator = resolve_accelerator(accelerator)
        parsed = parse_devices(devices)
        if isinstance(parsed, list) and len(parsed) != 1 or isinstance(parsed, int) and parsed != 1:
            raise MisconfigurationError("strategy='single' runs on one device, got "
                                        f"devices={devices!r}.",
                                        'pass devices=1 or devices=[k] for GPU k, or use '
                                        'strategy="dp"/"ddp" '
                                        "for several.")
        index = parsed[0] if isinstance(parsed, list) else 0
        self._set_device(torch.device(self.accelerator, index) if self.accelerator == "cuda" else
                         torch.device(self.accelerator))

    def _set_device(self, device: torch.device) -> None:
        self.device = device

    @property
    def moves_batches(self) -> bool:
        """The loop calls :meth:`batch_to_device`: off the CPU, or when a strategy overrides it (it
        may do more). On the CPU batches are already where they belong: no call per step."""
        return (
            self.device.type != "cpu" or type(self).batch_to_device is not Strategy.batch_to_device
        )

    # processes on this machine (ddp: LOCAL_WORLD_SIZE, or the devices it starts)
    num_processes = 1

    @property
    def node_rank(self) -> int:
        """This machine's index among the run's machines (Lightning's ``trainer.node_rank``)."""
        return self.rank // self.num_processes

    @property
    def num_nodes(self) -> int:
        """How many machines the run spans (Lightning's ``trainer.num_nodes``)."""
        return max(1, self.world_size // self.num_processes)

    @property
    def is_main(self) -> bool:
        """True on rank 0: the process that logs, draws progress and writes files."""
        return self.rank == 0

    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in the processes this strategy needs (here: this one) and return rank 0's
        result."""
        return fn(*args)

    def setup_environment(self) -> None:
        """Join process groups, pick the device (called once per entry point, inside the worker)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def setup_module(self, module: nn.Module, precision: Precision | None = None) -> nn.Module:
        """Move the module to the device and wrap it; returns what the loop calls.
        ``precision``: the run's (a strategy that shards asks it for its mixed-precision policy)."""
        return module.to(self.device)

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """The module to call during validation/test/predict."""
        return wrapped

    def batch_to_device(self, batch: Any) -> Any:
        """``batch`` with every tensor on this strategy's device (the copies are
        ``non_blocking``)."""
        return batch_to_device(batch, self.device) if self.device.type != "cpu" else batch

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The state dict of the user's module: never prefixed with ``module.`` or
        ``_orig_mod.``."""
        return unwrap(module).state_dict()

    # ---- state in checkpoints (fsdp.py overrides these: its parameters and optimizer states are sh
    # True: checkpoints are directories of per-rank shards (sharded_checkpoint.py)
    sharded_checkpoints = False

    def optimizer_state_dict(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """``optimizer``'s state dict (keyed by parameter index, as ``torch.optim`` writes it)."""
        return optimizer.state_dict()

    def load_module_state_dict(self, module: nn.Module, state: Mapping[str, Any]) -> None:
        """Load ``state`` (a full, unprefixed state dict) into the user's module."""
        unwrap(module).load_state_dict(state)

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, Any]) -> None:
        """Load ``state`` (what :meth:`optimizer_state_dict` returned, or a full one) into
        ``optimizer``."""
        optimizer.load_state_dict(state)

    def checkpoint_templates(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                             shapes: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors to read a sharded checkpoint's entries into, by entry name (``shapes`` holds a
        meta tensor of each entry's full shape and dtype); entries left out are read whole. Here:
        all of them, whole."""
        return {}

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The user's module's full state dict on the CPU, on rank 0 (every rank calls it; the
        others get ``{}``)."""
        if not self.is_main:
            return {}
        return {k: v.detach().cpu() for k, v in unwrap(module).state_dict().items()}

    def gradient_sync(self, wrapped: nn.Module, enabled: bool) -> None:
        """Under gradient accumulation, before each micro-batch: whether its backward reduces the
        gradients over ranks (ddp and fsdp turn it off on the micro-batches that do not step). One
        process: nothing to do."""

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Average the gradients of ``params`` over ranks (manual optimization's ``opt.step()``);
        one process: nothing to do."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over all ranks with ``op`` ("sum", "mean", "max" or "min"); itself on
        one process."""
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        return [obj]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (a picklable object, e.g. the run directory)."""
        return obj

    def barrier(self) -> None:
        """Wait until every rank gets here."""

    def teardown(self) -> None:
        """Release what ``setup_environment`` acquired."""


class DataParallelStrategy(Strategy):
    """``torch.nn.DataParallel``: one process drives every visible GPU (or ``devices=[...]``).

    Each step scatters the batch over the GPUs, copies the module to each of them, runs the replicas
    in threads and gathers the outputs on the first GPU, where the loss is computed. Without CUDA it
    warns and runs on one device (DataParallel is then a passthrough), so the same config runs on a
    laptop.
    """

    name = "dp"

    def __init__(self, accelerator: str = "auto", devices: Any = "auto") -> None:
        self.accelerator = resolve_accelerator(accelerator)
        parsed = parse_devices(devices)
        if self.accelerator == "cuda":
            self.device_ids = gpu_indices(parsed)
            self._set_device(torch.device("cuda", self.device_ids[0]))
            if len(self.device_ids) > 1:
                warnings.warn(
                    "strategy='dp' (torch.nn.DataParallel) copies the module to GPUs "
                    f"{self.device_ids} on every step, so state set inside forward on a replica "
                    "(BatchNorm running statistics on all but the first GPU, counters, caches) is "
                    "lost, and one Python process drives every GPU. HINT: strategy='ddp' runs one "
                    "process per GPU and has none of these limits (docs/strategies.md).",
                    UserWarning, stacklevel=4)
            return
        self.device_ids = []
        self._set_device(torch.device(self.accelerator))
        warnings.warn("strategy='dp' needs CUDA GPUs; this run uses one device "
                      f"({self.accelerator}), as strategy='single' would. HINT: on a CPU machine, "
                      "strategy='ddp' with devices=N runs N processes; on a GPU machine "
                      "strategy='dp' uses every visible GPU.", UserWarning, stacklevel=4)

    def setup_module(self, module: nn.Module, precision: Precision | None = None) -> nn.Module:
        module = module.to(self.device)
        if self.device_ids:
            return nn.DataParallel(
                module, device_ids=self.device_ids, output_device=self.device_ids[0]
            )
        # DataParallel without CUDA is a passthrough: same code path, one device
        if not torch.cuda.is_available():
            return nn.DataParallel(module)
        return module  # accelerator="cpu" on a CUDA machine: DataParallel would claim the GPUs
