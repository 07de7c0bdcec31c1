"""DDPStrategy: one process per device; ``DistributedDataParallel`` all-reduces the gradients during
backward.

Two ways to start the processes, one code path inside them:

* ``torchrun --nproc-per-node=N script.py`` (one or several machines), or ``srun python script.py``
  with ``--ntasks-per-node=N`` under SLURM: the processes exist already; torchrun's RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (or SLURM's SLURM_PROCID, SLURM_LOCALID,
  SLURM_NTASKS, SLURM_NODELIST: cluster.py) say who is who, and ``setup_environment`` joins the
  process group.
* ``python script.py`` with ``Trainer(strategy="ddp", devices=N)``: ``launch`` starts N workers with
  ``torch.multiprocessing`` (forkserver where available, else spawn) on a free port, runs the entry
  point in each and returns rank 0's result in the parent, where the task gets the trained weights
  and the Trainer rank 0's state (metrics, log_dir, callback states). A worker that raises stops the
  others, and the parent re-raises that worker's error.

Backend: nccl on CUDA, gloo on the CPU (``accelerator="cpu", devices=2`` is a real 2-process run).
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..cluster import detect, restart_store, watch_parent
from ..errors import MisconfigurationError
from .base import Strategy, gpu_indices, parse_devices, resolve_accelerator, unwrap
from .spawn import free_port, spawn

if TYPE_CHECKING:
    from ..precision import Precision

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_FAILED = False  # an entry point raised in this process (under torchrun)


class DDPStrategy(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` over ``devices`` processes (or torchrun's).

    Args:
        accelerator: "cpu" (gloo), "cuda" (nccl) or "auto".
        devices: processes on this machine: a count, a list of GPU indices, or "auto" (every GPU; 1
            on a CPU). Under torchrun or SLURM the launcher decides the count; a process that sees
            one GPU uses that one.
        timeout: seconds a collective may wait for the other ranks before it fails (the
            process-group timeout). A rank that *raises* stops the run at once; this bounds a rank
            that hangs.
        find_unused_parameters: DDP's option for models whose forward skips some parameters (costs a
            graph walk).
        start_method: how ``launch`` starts workers: "forkserver" (the default where the platform
            has it: a server process imports torch once and forks the workers from it, so a launch
            takes well under a second after the first) or "spawn" (a fresh interpreter per worker).
            Both are safe with CUDA and both need a picklable task; neither inherits the parent's
            memory.
    """

    name = "ddp"

    def __init__(self, accelerator: str = "auto", devices: Any = "auto", *, timeout: float = 600.0,
                 find_unused_parameters: bool = False, start_method: str | None = None) -> None:
        self.accelerator = resolve_accelerator(accelerator)
        if self.accelerator == "mps":
            raise MisconfigurationError('strategy="ddp" does not run on accelerator="mps".',
                                        'use accelerator="cpu" (gloo processes), or '
                                        'strategy="single" for the '
                                        "Apple GPU.")
        if start_method is None:
            start_method = (
                "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            )
        if start_method not in ("spawn", "forkserver"):
            raise MisconfigurationError(f"DDPStrategy(start_method={start_method!r}) is not "
                                        "supported.",
                                        'use "forkserver" (the default on Linux and macOS) or '
                                        '"spawn".')
        self.timeout, self.find_unused_parameters, self.start_method = (
            timeout,
            find_unused_parameters,
            start_method,
        )
        self.backend = "nccl" if self.accelerator == "cuda" else "gloo"
        parsed = parse_devices(devices)
        launcher = detect()
        self.external = launcher is not None  # torchrun or SLURM started the processes
        if launcher is not None:
            self.rank, self.local_rank, self.world_size = (
                launcher.rank,
                launcher.local_rank,
                launcher.world_size,
            )
            self.num_processes = launcher.local_world_size
        else:
            self.rank = self.local_rank = 0
            count = len(parsed) if isinstance(parsed, list) else parsed
            if count is None:
                count = torch.cuda.device_count() if self.accelerator == "cuda" else 1
            self.world_size = self.num_processes = count
        self._gpus = gpu_indices(parsed) if self.accelerator == "cuda" else []
        # srun --gpus-per-task=1: each process sees its own GPU
        if self.external and len(self._gpus) == 1:
            self._gpus *= self.num_processes
        if self._gpus and len(self._gpus) < self.num_processes:
            raise MisconfigurationError(f"{self.num_processes} ddp processes on this machine need "
                                        f"as many GPUs, but devices={devices!r} gives "
                                        f"{len(self._gpus)}.",
                                        "start one process per GPU: torchrun "
                                        "--nproc-per-node=<number of GPUs>.")
        self._init_method = launcher.init_method if launcher is not None else "env://"
        self._owns_group = False
        # a gloo group of its own for exchange_flags (created on first use)
        self._flag_group: Any = None
        self._last_work: Any = None  # all_reduce's last work (see there)
        self.place(self.local_rank)

    def place(self, local_rank: int) -> None:
        """Become local rank ``local_rank``: its GPU, or the CPU."""
        self._set_device(
            torch.device("cuda", self._gpus[local_rank]) if self._gpus else torch.device("cpu")
        )

    # ---- processes -------------------------------------------------------------------------------
    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on every rank and return rank 0's result (spawning the workers unless torchrun
        did)."""
        if self.external or dist.is_initialized():
            try:
                return fn(*args)
            except BaseException as exc:
                _rank_failed(exc)
                raise
        port = free_port()
        self._init_method = f"tcp://127.0.0.1:{port}"
        try:
            # one process: no workers to start, but the same process-group code path
            if self.world_size == 1:
                try:
                    return fn(*args)
                finally:
                    self.teardown()
            return spawn(self, fn, args, port)
        finally:
            self._init_method = "env://"

    def setup_environment(self) -> None:
        """Select this rank's GPU and join the process group (once per process; reused by later
        entry points)."""
        super().setup_environment()
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise MisconfigurationError(
                    f"A process group of {dist.get_world_size()} processes exists already, but "
                    f"this Trainer's ddp strategy expects {self.world_size}.",
                    "use one process count per script (torchrun --nproc-per-node and "
                    "Trainer(devices=...)).")
            return
        store = None
        if self.external and os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun
            watch_parent("torchrun's agent")  # its agent killed: no orphans training on
            # each --max-restarts attempt: keys of its own
            store = restart_store(self.world_size, self.timeout)
        dist.init_process_group(
            self.backend,
            init_method=None if store else self._init_method,
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.timeout),
        )
        self._owns_group = True
        if self.external:  # torchrun or SLURM: the group lives as long as the process
            atexit.register(_leave_at_exit)

    def teardown(self) -> None:
        """Leave the process group this strategy joined. A barrier first: every rank's collectives
        are done and gloo's threads are idle when the group is destroyed."""
        if self._owns_group and dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()
        self._owns_group = False
        self._flag_group = self._last_work = None  # destroyed with the default group

    # ---- the module ------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, precision: Precision | None = None) -> nn.Module:
        """Move to this rank's device and wrap in DDP (which broadcasts rank 0's weights and
        buffers)."""
        module = module.to(self.device)
        return DistributedDataParallel(
            module,
            device_ids=[self.device.index] if self._gpus else None,
            find_unused_parameters=self.find_unused_parameters,
        )

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """The plain module: DDP's forward would broadcast buffers (a collective) on every
        evaluation batch, and ranks may have one batch more or less there."""
        return unwrap(wrapped)

    def gradient_sync(self, wrapped: nn.Module, enabled: bool) -> None:
        """Skip the gradient all-reduce on accumulation micro-batches; the stepping one syncs their
        sum. DDP's own flag, the one its ``no_sync()`` context sets (a flag, not a context: the step
        enters no context per batch)."""
        while not isinstance(wrapped, DistributedDataParallel):
            wrapped = getattr(wrapped, "_orig_mod", None)  # under torch.compile
            if wrapped is None:
                return
        wrapped.require_backward_grad_sync = enabled

    # ---- collectives (each one waits for every rank) ---------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if op not in _OPS:
            raise MisconfigurationError(f"all_reduce(op={op!r}) is not supported.",
                                        'use op="sum", "mean", "max" or "min".')
        if self.world_size == 1 or not dist.is_initialized():
            return tensor
        out = tensor.clone()  # out of place: the caller's tensor is left as it was
        # Waited here, and kept until the next call: freed by gloo's thread instead, the work would
        # need the GIL for its Python tensor, and a process exiting right after (fit's last
        # agreement) could abort.
        self._last_work = dist.all_reduce(out, op=_OPS[op], async_op=True)
        self._last_work.wait()
        return out / self.world_size if op == "mean" else out

    def exchange_flags(self, flags: torch.Tensor) -> Any:
        """Start an all-reduce (max) of ``flags`` (a small CPU tensor, reduced in place) and return
        at once with the work; ``work.wait()`` gives the result. On a gloo group of its own (also
        under nccl): the work runs on gloo's threads, never waits behind DDP's gradient buckets, and
        reading the result is no device sync. Every rank must call it as many times, in the same
        order (preemption.py: once per optimizer step)."""
        # every rank gets here at the same step: new_group is a collective
        if self._flag_group is None:
            self._flag_group = dist.new_group(backend="gloo")
        return dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._flag_group, async_op=True)

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Manual optimization's gradient sync (DDP's hooks are not armed there): one all-reduce of
        the gradients ``params`` have, flattened into one buffer. Every rank must have gradients for
        the same ones."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.world_size == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world_size
        for grad, mean in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(mean.view_as(grad))

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1 or not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1 or not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier(
                device_ids=[self.device.index]
            ) if self.backend == "nccl" else dist.barrier()


# ---- under torchrun ------------------------------------------------------------------------------
def _leave_at_exit() -> None:
    """torchrun: destroy the group at a normal exit, with no collective (a peer may be ahead, behind
    or gone); after an error, do nothing at all, so that this process ends at once and its peers'
    collectives fail."""
    if dist.is_initialized() and not _FAILED and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()


def _rank_failed(exc: BaseException) -> None:
    """Remember the failure (no teardown at exit) and, under torchrun, write the error file its
    agent reads, so that its summary shows this rank's traceback."""
    global _FAILED
    _FAILED = True
    if isinstance(exc, Exception) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
