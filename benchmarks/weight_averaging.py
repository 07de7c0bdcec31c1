"""What EMA and SWA cost on the digits example (examples/digits.py): memory of the average, time per update, and
fits with and without the callback, alternated in one process (the median of each).

    python benchmarks/weight_averaging.py             # 5 fits of 3 epochs each way (~1 min on 2 cores)
    python benchmarks/weight_averaging.py --reps 2    # quicker

The update is timed directly (its own wall time, summed over the fit's updates) and as the difference of whole
fits; the first is the cost, the second shows it is lost in the noise of a loaded machine or not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from taskfit import Trainer, seed_everything  # noqa: E402
from taskfit.callbacks import EMAWeightAveraging, StochasticWeightAveraging  # noqa: E402
from taskfit.examples.digits import DigitsTask  # noqa: E402

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)


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
    seed_everything(0)
    task = DigitsTask()
    trainer = Trainer(max_epochs=epochs, num_sanity_val_steps=0, callbacks=callbacks, **QUIET)
    start = time.perf_counter()
    trainer.fit(task)
    return time.perf_counter() - start, task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    fit([], 1)  # warm-up: imports, first-call costs
    plain, ema, swa, update_s, updates = [], [], [], [], 0
    for _ in range(args.reps):
        plain.append(fit([], args.epochs)[0])
        cb = TimedEMA(decay=0.999)
        seconds, task = fit([cb], args.epochs)
        ema.append(seconds)
        update_s.append(cb.update_s)
        updates = cb.weights.count
        swa.append(fit([StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)], args.epochs)[0])
    params = sum(p.numel() * p.element_size() for p in task.parameters())
    steps = updates
    base, with_ema, with_swa = statistics.median(plain), statistics.median(ema), statistics.median(swa)
    per_update_us = statistics.median(update_s) / updates * 1e6
    print(f"digits: {sum(p.numel() for p in task.parameters()):,} parameters ({params / 2**10:.0f} KiB), "
          f"{args.epochs} epochs = {steps} optimizer steps, {torch.get_num_threads()} thread(s), median of {args.reps}\n")
    print("| | fit (s) | vs no averaging | averaging's memory |")
    print("|---|---|---|---|")
    print(f"| no averaging | {base:.3f} | 1.000 | 0 |")
    print(f"| EMAWeightAveraging (every step) | {with_ema:.3f} | {with_ema / base:.3f} | {params / 2**10:.0f} KiB "
          "(1 x the parameters) |")
    print(f"| StochasticWeightAveraging (per epoch) | {with_swa:.3f} | {with_swa / base:.3f} | {params / 2**10:.0f} KiB |")
    print(f"\nEMA update, timed directly: {per_update_us:.1f} us per optimizer step "
          f"({statistics.median(update_s) / base * 100:.2f}% of the fit without averaging)")


if __name__ == "__main__":
    main()
