"""ddp's self-launch: ``python script.py`` with ``Trainer(strategy="ddp", devices=N)`` starts N
worker processes here, runs the entry point in each, forwards preemption signals to them, and brings
rank 0's result (and the first error, with the rank that raised it) back to the parent. Under
torchrun none of this runs.

The workers never outlive the launching process: each holds the read end of a pipe whose only write
end the launcher holds, and a thread that reads it sees end-of-file the instant the launcher is
gone, however it died (the out-of-memory killer's SIGKILL included), and ends the worker at once,
before it writes anything more. (``PR_SET_PDEATHSIG`` would watch the wrong process: the workers'
parent is the forkserver.)"""
from __future__ import annotations

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
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessException

from ..checkpoint.rng import rng_state, set_rng_state
from ..cluster import orphaned
from ..errors import MisconfigurationError
from ..seed import current_seed, seed_everything, seeds_workers
from .model_memory import has_meta

_RESULT = "rank0.pt"
# What the forkserver imports once, so that workers start without importing torch (DDP also imports
# torch._dynamo).
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torchmetrics", "taskfit")


def spawn(strategy: Any, fn: Callable[..., Any], args: tuple[Any, ...], port: int) -> Any:
    """Run ``fn(*args)`` in ``strategy.world_size`` new processes; return rank 0's result, re-raise
    the first error."""
    # Serialise by value, once: torch.multiprocessing would otherwise put the task's tensors in
    # shared memory, and every rank's optimizer would then step the same weights (the parent's
    # included).
    buffer = io.BytesIO()
    try:
        torch.save((strategy, fn, args), buffer)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise MisconfigurationError(
            f"strategy={strategy.name!r} sends the Trainer and the task to {strategy.world_size} "
            f"new processes, but they cannot be pickled ({exc}).",
            "define the TaskModule, its data and any callbacks at the top level of a module or "
            "script (not inside a function or a notebook cell), guard the script with `if __name__ "
            "== '__main__':`, or start the processes with `torchrun --nproc-per-node=N "
            "script.py`.") from exc
    out = tempfile.mkdtemp(prefix="taskfit-ddp-")
    try:
        # imported once by the server, not by every worker of every launch
        if strategy.start_method == "forkserver":
            multiprocessing.get_context("forkserver").set_forkserver_preload(
                # taskfit.fsdp: FSDP2 and DCP too
                list(dict.fromkeys((*_PRELOAD, type(strategy).__module__))))
        # The parent's environment and stdout/stderr as they are now (a forkserver child has the
        # server's), and the read end of the pipe that tells the workers this process is alive (its
        # write end stays here).
        alive, keep_alive = os.pipe()
        parent = (dict(os.environ), _ParentFd(1), _ParentFd(2), _ParentFd(alive), os.getpid())
        try:
            context = mp.start_processes(
                _worker,
                args=(buffer.getvalue(), parent, out, port),
                nprocs=strategy.world_size,
                join=False,
                start_method=strategy.start_method,
            )
        except BaseException:
            os.close(keep_alive)
            raise
        finally:
            os.close(alive)
        signals = getattr(
            getattr(fn, "__self__", None), "preempt_signals", ("SIGTERM", "SIGUSR1", "SIGINT")
        )
        try:
            with _forwarding(signals, context.processes):
                # On a failure, join() gives the other workers `grace_period` s to stop on their own
                # (they do at once: their collectives fail when the peer's sockets close), then
                # SIGTERM, then SIGKILL.
                while not context.join(grace_period=5.0):
                    pass
        except ProcessException as exc:
            _reraise_worker_error(out, exc, strategy.world_size, context.processes, strategy.name)
        finally:  # KeyboardInterrupt in the parent: do not leave workers behind
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
            os.close(keep_alive)
        payload = torch.load(os.path.join(out, _RESULT), map_location="cpu", weights_only=False)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    _restore(fn, args, payload["snapshot"])
    return payload["result"]


def _worker(local_rank: int, payload: bytes, parent: tuple[Any, ...], out: str, port: int) -> None:
    """Entry point of spawned worker ``local_rank``: become that rank, run ``fn``, report to the
    parent."""
    env, out_fd, err_fd, alive, launcher = parent
    _watch_launcher(alive, launcher)
    os.environ.clear()
    os.environ.update(env)
    for fd, target in ((out_fd, 1), (err_fd, 2)):
        if fd is not None and fd != target:
            os.dup2(fd, target)
            os.close(fd)
    strategy, fn, args = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    strategy.rank = strategy.local_rank = local_rank
    strategy.place(local_rank)
    world = str(strategy.world_size)
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=world,
        LOCAL_WORLD_SIZE=world,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # as torchrun does: N processes must not each use every core
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // strategy.world_size))
    # a fresh interpreter: seed it as the parent was seeded (same seed on every rank)
    if current_seed() is not None:
        seed_everything(current_seed(), workers=seeds_workers())
    try:
        result = fn(*args)
        # every rank: under fsdp the shards are gathered to rank 0
        weights = _final_weights(strategy, fn, args)
        if local_rank == 0:
            torch.save(
                {"result": result, "snapshot": _snapshot(fn, args, weights)},
                os.path.join(out, _RESULT),
            )
    # report, then leave at once: the peers may be gone, so wait for nothing
    except BaseException as exc:
        _write_error(out, local_rank, exc)
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # Free DDP while the process group is still registered: if DDP held the group's last reference,
    # the group's destructor would join gloo's threads while holding the GIL, and a thread that
    # needs the GIL to free a finished collective's tensors would deadlock with it.
    del fn, args, result, weights
    gc.collect()
    strategy.teardown()


def _watch_launcher(alive: int | None, launcher: int) -> None:
    """End this worker the moment the launching process is gone: ``alive`` is the read end of a pipe
    whose write end only the launcher holds, so a read returns (end of file) when it exits or is
    killed."""
    if alive is None:
        return

    def watch() -> None:
        try:
            # nothing is ever written: this returns b"" once the launcher is gone
            while os.read(alive, 1):
                pass
        except OSError:
            pass
        orphaned("the process that launched the ddp workers", launcher)  # ends this process

    threading.Thread(target=watch, name="taskfit-launcher-watch", daemon=True).start()


class _ParentFd:
    """The parent's file descriptor ``fd``, duplicated into the worker when the worker is
    started."""

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


def _final_weights(
    strategy: Any, fn: Callable[..., Any], args: tuple[Any, ...]
) -> dict[str, Any] | None:
    """After fit, the task's full weights on rank 0 (``strategy.full_state_dict``: every rank calls
    it)."""
    owner = _owner(fn)
    task = next((a for a in args if isinstance(a, nn.Module)), None)
    if task is None or owner is None or owner.state.fn != "fit":
        return None
    return strategy.full_state_dict(task)


class WorkerSnapshots(Protocol):
    """What :func:`spawn` asks of the object whose method it launches (the Trainer's ``_fit``):
    rank 0's view of the run, sent to the parent process and taken up there, and which entry point
    ran (``state.fn``: after ``"fit"`` the fitted weights go back too). Nothing else is read."""

    state: Any

    def worker_snapshot(self) -> dict[str, Any]: ...

    def load_worker_snapshot(self, snapshot: dict[str, Any], task: Any) -> None: ...


def _owner(fn: Callable[..., Any]) -> WorkerSnapshots | None:
    """The object ``fn`` is a method of, if it carries its run across processes
    (:class:`WorkerSnapshots`)."""
    owner = getattr(fn, "__self__", None)
    carries = hasattr(owner, "worker_snapshot") and hasattr(owner, "load_worker_snapshot")
    return owner if carries else None


def _snapshot(
    fn: Callable[..., Any], args: tuple[Any, ...], weights: dict[str, Any] | None
) -> dict[str, Any]:
    """What the parent should see of rank 0's run: the launcher's (``worker_snapshot``), after
    fit the weights, and in a seeded run the global random state."""
    owner = _owner(fn)
    snapshot: dict[str, Any] = {}
    if weights is not None:
        snapshot["weights"] = weights
    # A seeded run: rank 0's random state (python, numpy, torch's CPU generator), so that the
    # script draws after fit what Lightning's, whose rank 0 is the launching process, draws.
    if current_seed() is not None:
        snapshot["rng"] = {k: v for k, v in rng_state().items() if k != "cuda"}
    if owner is not None:
        snapshot["trainer"] = owner.worker_snapshot()
    return snapshot


def _restore(fn: Callable[..., Any], args: tuple[Any, ...], snapshot: dict[str, Any]) -> None:
    owner = _owner(fn)
    task = next((a for a in args if isinstance(a, nn.Module)), None)
    # (a task built on the meta device takes the tensors as they are)
    if task is not None and "weights" in snapshot:
        task.load_state_dict(snapshot["weights"], assign=has_meta(task))
    if "trainer" in snapshot and owner is not None:
        owner.load_worker_snapshot(snapshot["trainer"], task)
    if "rng" in snapshot:
        set_rng_state(snapshot["rng"])


def _write_error(out: str, rank: int, exc: BaseException) -> None:
    """Leave the exception for the parent, with the time it was raised: the earliest one is the
    cause, the others are usually ranks whose collectives failed because that rank stopped."""
    try:
        blob = pickle.dumps(exc)
    except Exception:  # an exception that cannot be pickled: the parent shows its text instead
        blob = None
    record = {"time": time.time(), "rank": rank, "exception": blob, "type": type(exc).__name__,
              "message": str(exc), "traceback": traceback.format_exc()}
    with open(os.path.join(out, f"error_rank{rank}.pkl"), "wb") as fh:
        pickle.dump(record, fh)


class _RemoteTraceback(Exception):
    """Carries a worker's traceback text as the cause of the re-raised error (as concurrent.futures
    does)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _reraise_worker_error(out: str, exc: ProcessException, world_size: int, processes: list[Any],
                          strategy: str = "ddp") -> None:
    records = []
    for name in os.listdir(out):
        if name.startswith("error_rank"):
            with open(os.path.join(out, name), "rb") as fh:
                records.append(pickle.load(fh))
    reported = {r["rank"] for r in records}
    killed = [(rank, p.exitcode) for rank, p in enumerate(processes)
              if p.exitcode is not None and p.exitcode < 0 and rank not in reported]
    # a rank killed by a signal (the out-of-memory killer: SIGKILL) is the cause; the errors of the
    if killed:
        # others ("connection closed by peer" in a collective) are its consequences
        rank, code = killed[0]
        try:
            signame = signal.Signals(-code).name
        except ValueError:
            signame = f"signal {-code}"
        after = "; ".join(f"rank {r['rank']} then failed: {r['type']}: "
                          f"{str(r['message']).splitlines()[0][:160]}"
                          for r in sorted(records, key=lambda r: r["time"]))
        raise RuntimeError(
            f"{strategy} rank {rank} of {world_size} was killed by {signame} (pid "
            f"{processes[rank].pid})"
            + (f"; {after} (a consequence: its peer was gone)" if after else "")
            + ". HINT: SIGKILL with no "
            "error is usually the out-of-memory killer (see `dmesg`): lower the batch size or "
            "num_workers, or use "
            "fewer processes per machine."
        ) from None
    if not records:  # os._exit without a record: torch's message says which rank and code
        raise exc
    first = min(records, key=lambda r: r["time"])
    # the same exception class, unless it cannot be rebuilt here (e.g. defined in the workers'
    # __mp_main__)
    try:
        error = pickle.loads(first["exception"])
    except Exception:
        error = RuntimeError(f"{first['type']}: {first['message']}")
    if first["type"] == "SystemExit":  # a preempted run exits with its exit code, in the parent too
        raise SystemExit(error.code if isinstance(error, SystemExit) else 1)
    if hasattr(error, "add_note"):
        error.add_note(f"(raised on {strategy} rank {first['rank']} of {world_size}; the other "
                       "ranks were stopped)")
    raise error from _RemoteTraceback(f'\n"""\n{first["traceback"]}"""')


@contextlib.contextmanager
def _forwarding(names: Sequence[str], processes: list[Any]) -> Iterator[None]:
    """While the parent waits, pass preemption signals on to the workers: a scheduler may signal
    only the process it started, and the workers are the ones that save and exit (the parent then
    exits with their code)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    interrupted = []

    def forward(signum: int, frame: Any) -> None:
        # Ctrl-C at a terminal reached the workers too (one process group): no double
        if signum == signal.SIGINT:
            if interrupted:
                # a second Ctrl-C: abort (the workers are killed on the way out)
                raise KeyboardInterrupt
            interrupted.append(signum)
            return
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
