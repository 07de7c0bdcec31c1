"""The strategies by name: ``Trainer(strategy="ddp")`` is built here. strategies.py, ddp.py and
fsdp.py import nothing from this module; ddp.py (torch.distributed, DDP and torch._dynamo: about a
second) and fsdp.py (FSDP2 and torch.distributed.checkpoint: about a second more) load only when
asked for."""
from __future__ import annotations

from typing import Any, Callable

from ..cluster import detect
from ..errors import MisconfigurationError
from .base import DataParallelStrategy, Strategy, parse_devices


def _ddp(accelerator: str, devices: Any) -> Strategy:
    from .ddp import DDPStrategy  # lazy: see the module docstring

    return DDPStrategy(accelerator, devices)


def _fsdp(accelerator: str, devices: Any) -> Strategy:
    from .fsdp import FSDPStrategy  # lazy: see the module docstring

    return FSDPStrategy(accelerator, devices)


# "ddp_spawn" is Lightning's name for what taskfit's ddp does when not under torchrun: it starts its
# workers as fresh processes (spawn.py) and brings rank 0's result back to the launching one.
STRATEGIES: dict[str, Callable[[str, Any], Strategy]] = {
    "single": Strategy,
    "dp": DataParallelStrategy,
    "ddp": _ddp,
    "ddp_spawn": _ddp,
    "fsdp": _fsdp,
}
# the strategies that run one process per device (and under torchrun)
_MULTIPROCESS = ("ddp", "ddp_spawn", "fsdp")


def select_strategy(strategy: Any, accelerator: str, devices: Any) -> Strategy:
    """Build the strategy named by ``strategy`` ("auto", "single", "dp", "ddp", "fsdp") or take a
    Strategy instance.

    "auto" is ddp under torchrun or SLURM's srun (more than one process) or when ``devices`` asks
    for more than one device, else single.
    """
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str) or strategy not in ("auto", *STRATEGIES):
        raise MisconfigurationError(f"Unknown strategy {strategy!r}.",
                                    'use "auto", "single", "dp", "ddp" (or Lightning\'s '
                                    '"ddp_spawn", the same) or "fsdp" (or pass a Strategy '
                                    'instance).')
    launcher = detect()
    distributed = launcher is not None and launcher.world_size > 1
    if strategy == "auto":
        parsed = parse_devices(devices)
        several = (len(parsed) if isinstance(parsed, list) else parsed or 1) > 1
        strategy = "ddp" if distributed or several else "single"
    if distributed and strategy not in _MULTIPROCESS:
        raise MisconfigurationError(
            f"This process was started by {launcher.launcher} with "
            f"{'WORLD_SIZE' if launcher.launcher == 'torchrun' else 'SLURM_NTASKS'}="
            f"{launcher.world_size}, but strategy={strategy!r} would train a separate copy of the "
            "model in every process.",
            f'use strategy="ddp" (or "auto") under {launcher.launcher}, or run the script with '
            "plain `python`.",
        )
    return STRATEGIES[strategy](accelerator, devices)
