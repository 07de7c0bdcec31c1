"""DataLoader workers that a preemption signal cannot kill: the trainer process saves and exits, the
workers keep serving batches until it does.

A signal sent to the whole process group (``kill -TERM -<pgid>``, ``timeout``, ``scancel``, a
Kubernetes pod deletion) reaches every DataLoader worker too. A worker that dies of it fails the run
before the trainer has saved (``DataLoader worker (pid ...) is killed by signal: Terminated``), so
workers must ignore the preemption signals, at every moment of their life. Ignoring them in
``worker_init_fn`` alone leaves a window: torch installs its own SIGTERM handler in a new worker (it
re-raises the signal unless the parent sent it) before it calls ``worker_init_fn``. So the loader
gets a multiprocessing context (``DataLoader(multiprocessing_context=...)``, a public argument)
whose processes start with the signals *blocked* (``pthread_sigmask`` around ``start()``: the child
inherits the mask), and ``worker_init_fn`` sets them to ignored and only then unblocks them: a
signal that arrived in between stays pending and is discarded when it becomes ignored.

A worker that ignores SIGTERM cannot be stopped by ``Process.terminate()``, which torch and
multiprocessing's exit handler use for workers that do not stop on their own: here ``terminate()``
sends SIGKILL, so whatever happens to a worker, the main process never waits for one that ignores
it.

Fork and spawn children inherit the mask; a ``"forkserver"`` context's children inherit the
server's, which is blocked when the server starts with the loader's first workers (a window remains
if something else started it).

A worker that dies (the out-of-memory killer's SIGKILL) must end the run, never hang it. torch's
DataLoader installs, with the first multi-worker iterator of a process, a SIGCHLD handler that
raises the death in the main thread at whatever instruction the signal lands on; inside
``multiprocessing.Queue.put``, with the queue's lock taken, that lock is never released and the
iterator's ``__del__`` deadlocks in ``_shutdown_workers``. So during a run the loops start their
iterators with :func:`iterate`, which puts :data:`DEATHS` in the place of torch's handler
(SIGCHLD blocked meanwhile, so that none is lost or raised): it only counts the signal, and the
loader's own check (no batch for 5 s and a worker not alive) raises the death at the next batch,
outside any lock. :func:`restore_sigchld` gives torch's handler back when the run ends.
"""
from __future__ import annotations

import copy
import functools
import multiprocessing
import multiprocessing.context
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

_CAN_BLOCK = hasattr(signal, "pthread_sigmask")


class _Shielded:
    """A worker process started with ``blocked`` signals masked; ``terminate()`` is ``kill()`` (it
    ignores SIGTERM)."""

    blocked: tuple[int, ...] = ()

    def start(self) -> None:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, self.blocked) if _CAN_BLOCK else None
        try:
            super().start()  # type: ignore[misc]
        finally:
            if previous is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def terminate(self) -> None:
        self.kill()  # type: ignore[attr-defined]


# One class per start method, at module level: a "spawn" or "forkserver" child unpickles its process
# object.
_PROCESS_CLASSES: dict[str, type] = {}
for _method, _base in (
    ("fork", "ForkProcess"),
    ("spawn", "SpawnProcess"),
    ("forkserver", "ForkServerProcess"),
):
    if hasattr(multiprocessing.context, _base):
        _PROCESS_CLASSES[_method] = type(
            f"Shielded{_base}",
            (_Shielded, getattr(multiprocessing.context, _base)),
            {"__module__": __name__, "__qualname__": f"Shielded{_base}"},
        )
        globals()[f"Shielded{_base}"] = _PROCESS_CLASSES[_method]


def _new_process(cls: type, blocked: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    process = cls(*args, **kwargs)
    process.blocked = blocked
    return process


def signal_numbers(names: Sequence[str]) -> tuple[int, ...]:
    return tuple(int(getattr(signal, name)) for name in names if hasattr(signal, name))


def shielded_context(context: Any, names: Sequence[str]) -> Any:
    """A copy of ``context`` (a multiprocessing context, a start method name, or None for the
    default) whose processes start with the signals ``names`` blocked and are stopped with SIGKILL.
    ``context`` itself is left as it is (contexts are process-wide singletons)."""
    if context is None or isinstance(context, (str, multiprocessing.context.DefaultContext)):
        method = (
            context
            if isinstance(context, str)
            else multiprocessing.get_start_method(allow_none=True)
            or multiprocessing.get_all_start_methods()[0]
        )  # the platform's default, without fixing it for the process
        context = multiprocessing.get_context(method)
    if not isinstance(context, multiprocessing.context.BaseContext):
        return context
    cls = _PROCESS_CLASSES.get(context.get_start_method())
    if cls is None:
        # a context of another kind: used as it is (worker_init_fn still ignores the signals)
        return context
    shielded = copy.copy(context)
    shielded.Process = functools.partial(_new_process, cls, signal_numbers(names))
    return shielded


def init_worker(user_init: Callable[[int], Any] | None, ignored_signals: tuple[str, ...],
                worker_id: int) -> None:
    """``worker_init_fn`` of a fit's DataLoader workers: ignore the preemption signals, then unblock
    them (a signal that came while they were blocked is discarded), then the loader's own init."""
    numbers = signal_numbers(ignored_signals)
    for signum in numbers:
        signal.signal(signum, signal.SIG_IGN)
    if _CAN_BLOCK:
        # (SIGCHLD too: blocked by iterate() while the worker started; a worker's children keep
        # theirs)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, numbers + _SIGCHLD)
    if user_init is not None:
        user_init(worker_id)


def shield(loader: Any, names: Sequence[str]) -> None:
    """Make a DataLoader's future workers immune to the signals ``names`` (its context and
    ``worker_init_fn``)."""
    init = loader.worker_init_fn
    if not (isinstance(init, functools.partial) and init.func is init_worker):
        loader.worker_init_fn = functools.partial(init_worker, init, tuple(names))
    loader.multiprocessing_context = shielded_context(loader.multiprocessing_context, names)


# ---- a worker's death during a run: counted, raised by the loader at its next batch ----
_SIGCHLD = signal_numbers(["SIGCHLD"])
_TORCH_HANDLERS = "torch.utils.data._utils.signal_handling"


class _Deaths:
    """The SIGCHLD handler of a run: counts the signals (a worker that exited, or died), raises
    nothing. ``replaced``: torch's handler it stands in for, given back by
    :func:`restore_sigchld`."""

    def __init__(self) -> None:
        self.count = 0
        self.replaced: Any = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1


DEATHS = _Deaths()


def iterate(loader: Iterable[Any]) -> Iterator[Any]:
    """``iter(loader)`` for a run's loop. A shielded loader's workers (a fit's: :func:`shield`)
    start with SIGCHLD blocked in the main thread, and torch's SIGCHLD handler, if the iterator
    installed it, is replaced by :data:`DEATHS` before SIGCHLD is unblocked: a worker's death is
    never raised inside a lock. A loader without workers: ``iter(loader)``, nothing else."""
    init = getattr(loader, "worker_init_fn", None)
    shielded = isinstance(init, functools.partial) and init.func is init_worker
    if not (shielded and _CAN_BLOCK and _SIGCHLD) or \
            threading.current_thread() is not threading.main_thread():
        return iter(loader)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGCHLD)
    try:
        batches = iter(loader)
        _replace_torch_handler()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return batches


def _replace_torch_handler() -> None:
    handler = signal.getsignal(_SIGCHLD[0])
    if getattr(handler, "__module__", None) == _TORCH_HANDLERS:
        DEATHS.replaced = handler
        signal.signal(_SIGCHLD[0], DEATHS)


def restore_sigchld() -> None:
    """At a run's end: torch's SIGCHLD handler again, where :func:`iterate` replaced it."""
    if DEATHS.replaced is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(_SIGCHLD[0]) is DEATHS:
        signal.signal(_SIGCHLD[0], DEATHS.replaced)
    DEATHS.replaced = None
