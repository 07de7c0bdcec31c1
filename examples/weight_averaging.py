"""Weight averaging on the digits job: the same seed trained three times, plain, with an exponential
moving average of the weights (EMAWeightAveraging) and with stochastic weight averaging
(StochasticWeightAveraging).

    python examples/weight_averaging.py            # 10 epochs each (~30 s on 2 CPU cores)
    python examples/weight_averaging.py --quick    # 3 epochs each (the test's)

Validation (and the test after fit) use the averaged weights; the three runs start from the same
initial weights and see the batches in the same order, so the difference is the averaging alone.
docs/tuning.md shows the numbers.
"""
from __future__ import annotations

import os
import sys

from taskfit import Trainer, seed_everything
from taskfit.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from taskfit.examples.digits import DigitsTask


def train(name: str, callbacks: list, epochs: int) -> dict[str, float]:
    seed_everything(0)  # the same initial weights and data order for every run
    task = DigitsTask()
    trainer = Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.join("taskfit_logs", "weight_averaging", name),
    )
    metrics = trainer.fit(task)
    # after fit the task holds the average (as with Lightning's callbacks)
    tested = trainer.test(task)[0]
    return {
        "val/acc": metrics["val/acc"],
        "val/loss": metrics["val/loss"],
        "test/acc": tested["test/acc"],
        "test/loss": tested["test/loss"],
        "run directory": trainer.log_dir,
    }


def main() -> None:
    quick = "--quick" in sys.argv[1:] or os.environ.get("TASKFIT_QUICK") == "1"
    epochs = 3 if quick else 10
    runs = {
        "plain": train("plain", [], epochs),
        "EMA (decay 0.95)": train("ema", [EMAWeightAveraging(decay=0.95)], epochs),
        "SWA (from half-way)": train(
            "swa",
            [StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=0.5, annealing_epochs=2)],
            epochs,
        ),
    }
    print(f"\ndigits, {epochs} epochs, seed 0\n")
    print("| run | val/acc | val/loss | test/acc | test/loss |\n|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['val/acc']:.4f} | {r['val/loss']:.4f} | {r['test/acc']:.4f} | "
              f"{r['test/loss']:.4f} |")
    where = runs["EMA (decay 0.95)"]["run directory"]
    print(f"\n(run directory: {where})  tensorboard --logdir taskfit_logs/weight_averaging")


if __name__ == "__main__":
    main()
