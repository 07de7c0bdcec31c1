"""What the tuning tools cost on the digits example (examples/digits.py, DigitsTask, one process): weight averaging
(memory, time per update) and the simple profiler (how much of fit's wall time its table accounts for, and its own
time), with fits alternated in one process (the median of each).

    python benchmarks/tuning.py               # 5 repetitions of 3-epoch fits (~1 min on 2 idle cores)
    python benchmarks/tuning.py --reps 2      # quicker

Costs are timed directly (the EMA update's wall time; the profiler's marks and timers, which time themselves) and
as the difference of whole fits; the first is the cost, the second shows whether it is lost in the noise of a
loaded machine. "Accounted" is the profiler's table total against ``trainer.fit``'s wall time measured around the
call, in a warm process (the first fit of a process also imports torch._dynamo and tensorboard, before the first
hook: see the first row).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from taskfit import Trainer, seed_everything  # noqa: E402
from taskfit.callbacks import EMAWeightAveraging, StochasticWeightAveraging  # noqa: E402
from taskfit.examples.digits import DigitsTask  # noqa: E402
from taskfit.profilers.simple import SimpleProfiler  # noqa: E402


class TimedEMA(EMAWeightAveraging):
    """EMAWeightAveraging with its update timed (the only per-step work it adds)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.update_s = 0.0

    def _update(self) -> None:
        start = time.perf_counter()
        super()._update()
        self.update_s += time.perf_counter() - start


def fit(callbacks: list, epochs: int) -> tuple[float, DigitsTask]:
    """One fit with the example's defaults (progress bar, logger, checkpoints), its output swallowed."""
    seed_everything(0)
    task = DigitsTask()
    trainer = Trainer(max_epochs=epochs, callbacks=callbacks, enable_progress_bar=False,
                      default_root_dir=os.path.join("taskfit_logs", "benchmark_tuning"))
    with contextlib.redirect_stdout(io.StringIO()):
        start = time.perf_counter()
        trainer.fit(task)
        return time.perf_counter() - start, task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    first = SimpleProfiler()
    cold, _ = fit([first], 1)  # the first fit of the process: imports before the first hook
    runs: dict[str, list[float]] = {"plain": [], "ema": [], "swa": [], "profiler": []}
    update_s, accounted, own = [], [], []
    for _ in range(args.reps):
        runs["plain"].append(fit([], args.epochs)[0])
        ema = TimedEMA(decay=0.999)
        seconds, task = fit([ema], args.epochs)
        runs["ema"].append(seconds)
        update_s.append(ema.update_s)
        runs["swa"].append(fit([StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)], args.epochs)[0])
        profiler = SimpleProfiler()
        seconds, _ = fit([profiler], args.epochs)
        runs["profiler"].append(seconds)
        accounted.append(sum(s for _, s in profiler.stages.values()) / seconds)
        own.append(profiler.stages["profiler"][1] / seconds)
    med = {k: statistics.median(v) for k, v in runs.items()}
    params = sum(p.numel() * p.element_size() for p in task.parameters())
    steps = ema.weights.count
    print(f"digits: {sum(p.numel() for p in task.parameters()):,} parameters ({params / 2**10:.0f} KiB), "
          f"{args.epochs} epochs = {steps} optimizer steps, {torch.get_num_threads()} thread(s), median of "
          f"{args.reps}\n")
    print("| | fit (s) | vs plain | memory | own time, timed directly |\n|---|---|---|---|---|")
    print(f"| plain | {med['plain']:.3f} | 1.000 | | |")
    print(f"| EMAWeightAveraging (every step) | {med['ema']:.3f} | {med['ema'] / med['plain']:.3f} | "
          f"{params / 2**10:.0f} KiB (1 x the parameters) | {statistics.median(update_s) / steps * 1e6:.1f} us per "
          f"update, {statistics.median(update_s) / med['plain']:.2%} of the fit |")
    print(f"| StochasticWeightAveraging (per epoch) | {med['swa']:.3f} | {med['swa'] / med['plain']:.3f} | "
          f"{params / 2**10:.0f} KiB | |")
    print(f"| SimpleProfiler | {med['profiler']:.3f} | {med['profiler'] / med['plain']:.3f} | | "
          f"{statistics.median(own):.2%} of the fit (min {min(own):.2%}, max {max(own):.2%}) |")
    print(f"\nSimpleProfiler's table accounts for {statistics.median(accounted):.1%} of trainer.fit's wall time "
          f"(min {min(accounted):.1%}, max {max(accounted):.1%}); the first fit of the process: "
          f"{sum(s for _, s in first.stages.values()) / cold:.1%} ({cold:.2f} s, imports included)")


if __name__ == "__main__":
    main()
