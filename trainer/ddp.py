"""DDPStrategy: one process per device; ``DistributedDataParallel`` all-reduces the gradients during backward.

Two ways to start the processes, one code path inside them:

* ``torchrun --nproc-per-node=N script.py`` (one or several machines): the processes exist already; RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT say who is who, and ``setup_environment`` joins the
  process group (``env://``).
* ``python script.py`` with ``Trainer(strategy="ddp", devices=N)``: ``launch`` starts N workers with
  ``torch.multiprocessing`` (forkserver where available, else spawn) on a free port, runs the entry point in
  each and returns rank 0's result in the parent, where the task gets the trained weights and the Trainer
  rank 0's state (metrics, log_dir, callback states). A worker that raises stops the others, and the parent
  re-raises that worker's error.

Backend: nccl on CUDA, gloo on the CPU (``accelerator="cpu", devices=2`` is a real 2-process run).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import io
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

from .errors import MisconfigurationError
from .seed import current_seed, seed_everything
from .strategies import Strategy, gpu_indices, launched_by_torchrun, parse_devices, resolve_accelerator, unwrap

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_RESULT = "rank0.pt"
_FAILED = False  # an entry point raised in this process (under torchrun)
# What the forkserver imports once, so that workers start without importing torch (DDP also imports torch._dynamo).
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torchmetrics", "taskfit")


class DDPStrategy(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` over ``devices`` processes (or torchrun's).

    Args:
        accelerator: "cpu" (gloo), "cuda" (nccl) or "auto".
        devices: processes on this machine: a count, a list of GPU indices, or "auto" (every GPU; 1 on a CPU).
            Under torchrun the launcher decides and this is ignored.
        timeout: seconds a collective may wait for the other ranks before it fails (the process-group timeout).
            A rank that *raises* stops the run at once; this bounds a rank that hangs.
        find_unused_parameters: DDP's option for models whose forward skips some parameters (costs a graph walk).
        start_method: how ``launch`` starts workers: "forkserver" (the default where the platform has it: a
            server process imports torch once and forks the workers from it, so a launch takes well under a
            second after the first) or "spawn" (a fresh interpreter per worker). Both are safe with CUDA and
            both need a picklable task; neither inherits the parent's memory.
    """

    name = "ddp"

    def __init__(self, accelerator: str = "auto", devices: Any = "auto", *, timeout: float = 600.0,
                 find_unused_parameters: bool = False, start_method: str | None = None) -> None:
        self.accelerator = resolve_accelerator(accelerator)
        if self.accelerator == "mps":
            raise MisconfigurationError('strategy="ddp" does not run on accelerator="mps".',
                                        'use accelerator="cpu" (gloo processes), or strategy="single" for the '
                                        "Apple GPU.")
        if start_method is None:
            start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        if start_method not in ("spawn", "forkserver"):
            raise MisconfigurationError(f"DDPStrategy(start_method={start_method!r}) is not supported.",
                                        'use "forkserver" (the default on Linux and macOS) or "spawn".')
        self.timeout, self.find_unused_parameters, self.start_method = timeout, find_unused_parameters, start_method
        self.backend = "nccl" if self.accelerator == "cuda" else "gloo"
        parsed = parse_devices(devices)
        self.external = launched_by_torchrun()
        if self.external:
            self.rank, self.local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
            self.world_size = int(os.environ["WORLD_SIZE"])
            self.num_processes = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        else:
            self.rank = self.local_rank = 0
            count = len(parsed) if isinstance(parsed, list) else parsed
            if count is None:
                count = torch.cuda.device_count() if self.accelerator == "cuda" else 1
            self.world_size = self.num_processes = count
        self._gpus = gpu_indices(parsed) if self.accelerator == "cuda" else []
        if self._gpus and len(self._gpus) < self.num_processes:
            raise MisconfigurationError(f"{self.num_processes} ddp processes on this machine need as many GPUs, "
                                        f"but devices={devices!r} gives {len(self._gpus)}.",
                                        "start one process per GPU: torchrun --nproc-per-node=<number of GPUs>.")
        self._init_method = "env://"
        self._owns_group = False
        self._place(self.local_rank)

    def _place(self, local_rank: int) -> None:
        self._set_device(torch.device("cuda", self._gpus[local_rank]) if self._gpus else torch.device("cpu"))

    # ---- processes --------------------------------------------------------------------------------
    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on every rank and return rank 0's result (spawning the workers unless torchrun did)."""
        if self.external or dist.is_initialized():
            try:
                return fn(*args)
            except BaseException as exc:
                _rank_failed(exc)
                raise
        port = _free_port()
        self._init_method = f"tcp://127.0.0.1:{port}"
        try:
            if self.world_size == 1:  # one process: no workers to start, but the same process-group code path
                try:
                    return fn(*args)
                finally:
                    self.teardown()
            return self._spawn(fn, args, port)
        finally:
            self._init_method = "env://"

    def _spawn(self, fn: Callable[..., Any], args: tuple[Any, ...], port: int) -> Any:
        # Serialise by value, once: torch.multiprocessing would otherwise put the task's tensors in shared
        # memory, and every rank's optimizer would then step the same weights (the parent's included).
        buffer = io.BytesIO()
        try:
            torch.save((self, fn, args), buffer)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise MisconfigurationError(
                f"strategy='ddp' sends the Trainer and the task to {self.world_size} new processes, but they "
                f"cannot be pickled ({exc}).",
                "define the TaskModule, its data and any callbacks at the top level of a module or script (not "
                "inside a function or a notebook cell), guard the script with `if __name__ == '__main__':`, "
                "or start the processes with `torchrun --nproc-per-node=N script.py`.") from exc
        out = tempfile.mkdtemp(prefix="taskfit-ddp-")
        try:
            if self.start_method == "forkserver":  # imported once by the server, not by every worker of every launch
                multiprocessing.get_context("forkserver").set_forkserver_preload(list(_PRELOAD))
            # The parent's environment and stdout/stderr as they are now (a forkserver child has the server's).
            parent = (dict(os.environ), _ParentFd(1), _ParentFd(2))
            context = mp.start_processes(_worker, args=(buffer.getvalue(), parent, out, port),
                                         nprocs=self.world_size, join=False, start_method=self.start_method)
            signals = getattr(getattr(fn, "__self__", None), "preempt_signals", ("SIGTERM", "SIGUSR1"))
            try:
                with _forwarding(signals, context.processes):
                    # On a failure, join() gives the other workers `grace_period` s to stop on their own (they do
                    # at once: their collectives fail when the peer's sockets close), then SIGTERM, then SIGKILL.
                    while not context.join(grace_period=5.0):
                        pass
            except ProcessException as exc:
                _reraise_worker_error(out, exc, self.world_size)
            finally:  # KeyboardInterrupt in the parent: do not leave workers behind
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                    process.join()
            payload = torch.load(os.path.join(out, _RESULT), map_location="cpu", weights_only=False)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        _restore(fn, args, payload["snapshot"])
        return payload["result"]

    def setup_environment(self) -> None:
        """Select this rank's GPU and join the process group (once per process; reused by later entry points)."""
        super().setup_environment()
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise MisconfigurationError(
                    f"A process group of {dist.get_world_size()} processes exists already, but this Trainer's ddp "
                    f"strategy expects {self.world_size}.",
                    "use one process count per script (torchrun --nproc-per-node and Trainer(devices=...)).")
            return
        dist.init_process_group(self.backend, init_method=self._init_method, rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=self.timeout))
        self._owns_group = True
        if self.external:  # torchrun: the group lives as long as the process
            atexit.register(_leave_at_exit)

    def teardown(self) -> None:
        """Leave the process group this strategy joined. A barrier first: every rank's collectives are done
        and gloo's threads are idle when the group is destroyed."""
        if self._owns_group and dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()
        self._owns_group = False

    # ---- the module -------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move to this rank's device and wrap in DDP (which broadcasts rank 0's weights and buffers)."""
        module = module.to(self.device)
        return DistributedDataParallel(module, device_ids=[self.device.index] if self._gpus else None,
                                       find_unused_parameters=self.find_unused_parameters)

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """The plain module: DDP's forward would broadcast buffers (a collective) on every evaluation batch, and
        ranks may have one batch more or less there."""
        return unwrap(wrapped)

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on accumulation micro-batches; the stepping one syncs their sum."""
        while not isinstance(wrapped, DistributedDataParallel):
            wrapped = getattr(wrapped, "_orig_mod", None)  # under torch.compile
            if wrapped is None:
                return contextlib.nullcontext()
        return wrapped.no_sync()

    # ---- collectives (each one waits for every rank) ------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if op not in _OPS:
            raise MisconfigurationError(f"all_reduce(op={op!r}) is not supported.",
                                        'use op="sum", "mean", "max" or "min".')
        if self.world_size == 1 or not dist.is_initialized():
            return tensor
        out = tensor.clone()  # out of place: the caller's tensor is left as it was
        dist.all_reduce(out, op=_OPS[op])
        return out / self.world_size if op == "mean" else out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1 or not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier(device_ids=[self.device.index]) if self.backend == "nccl" else dist.barrier()


# ---- the spawned workers ---------------------------------------------------------------------------
def _worker(local_rank: int, payload: bytes, parent: tuple[Any, ...], out: str, port: int) -> None:
    """Entry point of spawned worker ``local_rank``: become that rank, run ``fn``, report to the parent."""
    env, *streams = parent
    os.environ.clear()
    os.environ.update(env)
    for fd, target in zip(streams, (1, 2)):
        if fd is not None and fd != target:
            os.dup2(fd, target)
            os.close(fd)
    strategy, fn, args = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    strategy.rank = strategy.local_rank = local_rank
    strategy._place(local_rank)
    world = str(strategy.world_size)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: N processes must not each use every core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // strategy.world_size))
    if current_seed() is not None:  # a fresh interpreter: seed it as the parent was seeded (same seed on every rank)
        seed_everything(current_seed())
    try:
        result = fn(*args)
        if local_rank == 0:
            torch.save({"result": result, "snapshot": _snapshot(fn, args)}, os.path.join(out, _RESULT))
    except BaseException as exc:  # report, then leave at once: the peers may be gone, so wait for nothing
        _write_error(out, local_rank, exc)
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # Free DDP while the process group is still registered: if DDP held the group's last reference, the group's
    # destructor would join gloo's threads while holding the GIL, and a thread that needs the GIL to free a
    # finished collective's tensors would deadlock with it.
    del fn, args, result
    gc.collect()
    strategy.teardown()


class _ParentFd:
    """The parent's file descriptor ``fd``, duplicated into the worker when the worker is started."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            os.fstat(self.fd)
        except OSError:  # closed in the parent: the worker keeps its own
            return (_no_fd, ())
        return (_detach_fd, (multiprocessing.reduction.DupFd(self.fd),))


def _detach_fd(duplicate: Any) -> int:
    return duplicate.detach()


def _no_fd() -> None:
    return None


def _snapshot(fn: Callable[..., Any], args: tuple[Any, ...]) -> dict[str, Any]:
    """What the parent should see of rank 0's run: the Trainer's state and, after fit, the task's weights."""
    trainer = getattr(fn, "__self__", None)
    task = next((a for a in args if isinstance(a, nn.Module)), None)
    snapshot: dict[str, Any] = {}
    if task is not None and args[:1] == ("fit",):  # Trainer._run(stage, task, ckpt_path)
        snapshot["weights"] = {k: v.detach().cpu() for k, v in unwrap(task).state_dict().items()}
    if trainer is not None and hasattr(trainer, "state") and hasattr(trainer, "callbacks"):
        snapshot["state"] = trainer.state.state_dict()
        snapshot["log_dir"] = trainer.log_dir
        snapshot["callbacks"] = {cb.state_key: cb.state_dict() for cb in trainer.callbacks}
    return snapshot


def _restore(fn: Callable[..., Any], args: tuple[Any, ...], snapshot: dict[str, Any]) -> None:
    trainer = getattr(fn, "__self__", None)
    task = next((a for a in args if isinstance(a, nn.Module)), None)
    if task is not None and "weights" in snapshot:
        task.load_state_dict(snapshot["weights"])
    if trainer is not None and "state" in snapshot:
        trainer.state.load_state_dict(snapshot["state"])
        trainer.log_dir = snapshot["log_dir"]
        trainer.task = task
        for cb in trainer.callbacks:
            if cb.state_key in snapshot["callbacks"]:
                cb.load_state_dict(snapshot["callbacks"][cb.state_key])


def _write_error(out: str, rank: int, exc: BaseException) -> None:
    """Leave the exception for the parent, with the time it was raised: the earliest one is the cause, the
    others are usually ranks whose collectives failed because that rank stopped."""
    try:
        blob = pickle.dumps(exc)
    except Exception:  # an exception that cannot be pickled: the parent shows its text instead
        blob = None
    record = {"time": time.time(), "rank": rank, "exception": blob, "type": type(exc).__name__,
              "message": str(exc), "traceback": traceback.format_exc()}
    with open(os.path.join(out, f"error_rank{rank}.pkl"), "wb") as fh:
        pickle.dump(record, fh)


class _RemoteTraceback(Exception):
    """Carries a worker's traceback text as the cause of the re-raised error (as concurrent.futures does)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _reraise_worker_error(out: str, exc: ProcessException, world_size: int) -> None:
    records = []
    for name in os.listdir(out):
        if name.startswith("error_rank"):
            with open(os.path.join(out, name), "rb") as fh:
                records.append(pickle.load(fh))
    if not records:  # killed by a signal (e.g. out of memory) or os._exit: torch's message says which
        raise exc
    first = min(records, key=lambda r: r["time"])
    try:  # the same exception class, unless it cannot be rebuilt here (e.g. defined in the workers' __mp_main__)
        error = pickle.loads(first["exception"])
    except Exception:
        error = RuntimeError(f"{first['type']}: {first['message']}")
    if first["type"] == "SystemExit":  # a preempted run exits with its exit code, in the parent too
        raise SystemExit(error.code if isinstance(error, SystemExit) else 1)
    if hasattr(error, "add_note"):
        error.add_note(f"(raised on ddp rank {first['rank']} of {world_size}; the other ranks were stopped)")
    raise error from _RemoteTraceback(f'\n"""\n{first["traceback"]}"""')


def _leave_at_exit() -> None:
    """torchrun: destroy the group at a normal exit, with no collective (a peer may be ahead, behind or gone);
    after an error, do nothing at all, so that this process ends at once and its peers' collectives fail."""
    if dist.is_initialized() and not _FAILED and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()


def _rank_failed(exc: BaseException) -> None:
    """Remember the failure (no teardown at exit) and, under torchrun, write the error file its agent reads,
    so that its summary shows this rank's traceback."""
    global _FAILED
    _FAILED = True
    if isinstance(exc, Exception) and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


@contextlib.contextmanager
def _forwarding(names: Sequence[str], processes: list[Any]) -> Iterator[None]:
    """While the parent waits, pass preemption signals on to the workers: a scheduler may signal only the
    process it started, and the workers are the ones that save and exit (the parent then exits with their code)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    previous = {}
    for name in names:
        signum = getattr(signal, name, None)
        if signum is not None:
            previous[signum] = signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
