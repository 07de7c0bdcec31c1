"""DataLoader workers that a preemption signal cannot kill: the trainer process saves and exits, the workers
keep serving batches until it does.

A signal sent to the whole process group (``kill -TERM -<pgid>``, ``timeout``, ``scancel``, a Kubernetes pod
deletion) reaches every DataLoader worker too. A worker that dies of it fails the run before the trainer has
saved (``DataLoader worker (pid ...) is killed by signal: Terminated``), so workers must ignore the preemption
signals, at every moment of their life. Ignoring them in ``worker_init_fn`` alone leaves a window: torch installs
its own SIGTERM handler in a new worker (it re-raises the signal unless the parent sent it) before it calls
``worker_init_fn``. So the loader gets a multiprocessing context (``DataLoader(multiprocessing_context=...)``, a
public argument) whose processes start with the signals *blocked* (``pthread_sigmask`` around ``start()``: the
child inherits the mask), and ``worker_init_fn`` sets them to ignored and only then unblocks them: a signal that
arrived in between stays pending and is discarded when it becomes ignored.

A worker that ignores SIGTERM cannot be stopped by ``Process.terminate()``, which torch and multiprocessing's exit
handler use for workers that do not stop on their own: here ``terminate()`` sends SIGKILL, so whatever happens to
a worker, the main process never waits for one that ignores it.

Fork and spawn children inherit the mask; a ``"forkserver"`` context's children inherit the server's, which is
blocked when the server starts with the loader's first workers (a window remains if something else started it).
"""
from __future__ import annotations

import copy
import functools
import multiprocessing
import multiprocessing.context
import signal
from collections.abc import Callable, Sequence
from typing import Any

_CAN_BLOCK = hasattr(signal, "pthread_sigmask")


class _Shielded:
    """A worker process started with ``blocked`` signals masked; ``terminate()`` is ``kill()`` (it ignores SIGTERM)."""

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


# One class per start method, at module level: a "spawn" or "forkserver" child unpickles its process object.
_PROCESS_CLASSES: dict[str, type] = {}
for _method, _base in (("fork", "ForkProcess"), ("spawn", "SpawnProcess"), ("forkserver", "ForkServerProcess")):
    if hasattr(multiprocessing.context, _base):
        _PROCESS_CLASSES[_method] = type(f"Shielded{_base}", (_Shielded, getattr(multiprocessing.context, _base)),
                                         {"__module__": __name__, "__qualname__": f"Shielded{_base}"})
        globals()[f"Shielded{_base}"] = _PROCESS_CLASSES[_method]


def _new_process(cls: type, blocked: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    process = cls(*args, **kwargs)
    process.blocked = blocked
    return process


def signal_numbers(names: Sequence[str]) -> tuple[int, ...]:
    return tuple(int(getattr(signal, name)) for name in names if hasattr(signal, name))


def shielded_context(context: Any, names: Sequence[str]) -> Any:
    """A copy of ``context`` (a multiprocessing context, a start method name, or None for the default) whose
    processes start with the signals ``names`` blocked and are stopped with SIGKILL. ``context`` itself is
    left as it is (contexts are process-wide singletons)."""
    if context is None or isinstance(context, (str, multiprocessing.context.DefaultContext)):
        method = context if isinstance(context, str) else multiprocessing.get_start_method(allow_none=True) or \
            multiprocessing.get_all_start_methods()[0]  # the platform's default, without fixing it for the process
        context = multiprocessing.get_context(method)
    if not isinstance(context, multiprocessing.context.BaseContext):
        return context
    cls = _PROCESS_CLASSES.get(context.get_start_method())
    if cls is None:
        return context  # a context of another kind: used as it is (worker_init_fn still ignores the signals)
    shielded = copy.copy(context)
    shielded.Process = functools.partial(_new_process, cls, signal_numbers(names))
    return shielded


def init_worker(user_init: Callable[[int], Any] | None, ignored_signals: tuple[str, ...],
                worker_id: int) -> None:
    """``worker_init_fn`` of a fit's DataLoader workers: ignore the preemption signals, then unblock them (a signal
    that came while they were blocked is discarded), then the loader's own init."""
    numbers = signal_numbers(ignored_signals)
    for signum in numbers:
        signal.signal(signum, signal.SIG_IGN)
    if _CAN_BLOCK:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, numbers)
    if user_init is not None:
        user_init(worker_id)


def shield(loader: Any, names: Sequence[str]) -> None:
    """Make a DataLoader's future workers immune to the signals ``names`` (its context and ``worker_init_fn``)."""
    init = loader.worker_init_fn
    if not (isinstance(init, functools.partial) and init.func is init_worker):
        loader.worker_init_fn = functools.partial(init_worker, init, tuple(names))
    loader.multiprocessing_context = shielded_context(loader.multiprocessing_context, names)
