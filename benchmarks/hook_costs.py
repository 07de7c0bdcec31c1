"""Where the defaults' fixed costs go: the time spent in each default callback's hooks, per epoch, and the CPU
time of the Trainer's background threads, in one fit of the tiny MLP with ``Trainer(max_epochs=N)``'s defaults.

    python benchmarks/hook_costs.py              # 12 epochs (~5 s)
    python benchmarks/hook_costs.py --epochs 30  # a longer fit: TensorBoard's hand-overs every 5 s show

Separate-process ratios on a shared machine swing by more than these costs; the hooks' own wall time does not
(it is a sum of short intervals, each read right around the call). What it cannot show: the time a background
thread takes the GIL from the loop (its CPU time is the upper bound), and per-step costs (overhead.py's
interleaved rows and instructions.py measure those).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import os
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from workloads import WORKLOADS, make_data, make_task  # noqa: E402


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of every thread but the main one, by name (the writer threads of TensorBoard and checkpoints)."""
    seconds = {}
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and thread.ident is not None:
            with contextlib.suppress(OSError, ProcessLookupError):  # a thread that just ended
                seconds[thread.name] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return seconds


def timed(fn: Any, key: str, spent: collections.Counter, calls: collections.Counter) -> Any:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
            calls[key] += 1
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args()
    if args.epochs < 3:
        parser.error("--epochs must be >= 3 (the first epoch is dropped)")
    from taskfit import Trainer
    from taskfit.callbacks import Callback

    torch.set_num_threads(1)
    spec = dict(WORKLOADS["tiny MLP"], shuffle=True)
    marks: list[tuple[float, dict[str, float]]] = []

    class EpochClock(Callback):
        order = -10**6  # first: everything the Trainer does between two epoch starts counts

        def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
            marks.append((time.perf_counter(), thread_cpu_s()))

        def on_fit_end(self, trainer: Any, task: Any) -> None:
            marks.append((time.perf_counter(), thread_cpu_s()))

    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(max_epochs=args.epochs, accelerator="cpu", default_root_dir=root, callbacks=[EpochClock()])
        for cb in trainer.callbacks:
            if isinstance(cb, EpochClock):
                continue
            for name in dir(type(cb)):  # batch hooks stay as they are: the loop asks their owners whether to call
                if name.startswith("on_") and "_batch_" not in name and callable(getattr(cb, name)):
                    setattr(cb, name, timed(getattr(cb, name), f"{type(cb).__name__}.{name}", spent, calls))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer.fit(make_task(spec, make_data(spec)))
    epochs = len(marks) - 2  # from the second epoch's start to the end of fit
    wall = (marks[-1][0] - marks[1][0]) / epochs
    print(f"# Fixed costs of the defaults: tiny MLP, {args.epochs} epochs of 512 steps, torch {torch.__version__}, "
          f"{os.cpu_count()} CPU cores\n\nMean epoch (epochs 2-{args.epochs}, fit's end included): "
          f"{wall * 1000:.1f} ms.\n")
    print("| hook (or thread) | calls per fit | ms per epoch | share of an epoch |")
    print("|---|---|---|---|")
    for key, seconds in spent.most_common():
        if "fit_start" in key:  # once, before the first epoch: not an epoch's cost
            continue
        print(f"| `{key}` | {calls[key]} | {seconds / args.epochs * 1000:.3f} | {seconds / args.epochs / wall:.2%} |")
    before, after = marks[1][1], marks[-1][1]
    for name, seconds in after.items():
        cpu = (seconds - before.get(name, 0.0)) / epochs
        print(f"| thread `{name}` (CPU time) | | {cpu * 1000:.3f} | {cpu / wall:.2%} |")
    total = sum(s for k, s in spent.items() if "fit_start" not in k) / args.epochs
    print(f"\nAll hooks but fit start: {total * 1000:.2f} ms per epoch, {total / wall:.2%} of an epoch.")


if __name__ == "__main__":
    main()
