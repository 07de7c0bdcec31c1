"""The learning-rate finder on the digits job: a range test suggests an lr, then the job trains with
it and, on the same seed, with its default lr (AdamW, 3e-3), and the two are compared.

    python examples/lr_find.py            # 100 finder steps, then 10 epochs each (~30 s, 2 cores)
    python examples/lr_find.py --quick    # 100 finder steps, 3 epochs each (the test's)
    taskfit mode=lr_find                  # the same range test from the command line: prints the
                                          # override to use

The curve is written to taskfit_logs/lr_find/version_N (lr_find.png, a TensorBoard image,
lr_find.json).
"""
from __future__ import annotations

import os
import sys

from taskfit import Trainer, seed_everything
from taskfit.examples.digits import DigitsTask
from taskfit.tools.lr_finder import lr_find

QUIET = dict(enable_progress_bar=False, enable_model_summary=False)


def train(task: DigitsTask, epochs: int, name: str) -> tuple[dict[str, float], dict[str, float]]:
    trainer = Trainer(
        max_epochs=epochs, default_root_dir=os.path.join("taskfit_logs", name), **QUIET
    )
    return trainer.fit(task), trainer.test(task)[0]


def main() -> None:
    quick = "--quick" in sys.argv[1:] or os.environ.get("TASKFIT_QUICK") == "1"
    epochs = 3 if quick else 10
    seed_everything(0)
    task = DigitsTask()  # AdamW(lr=3e-3)
    finder = lr_find(Trainer(max_epochs=epochs, **QUIET), task, num_training=100, update_attr=True)
    suggested = finder.suggestion()  # update_attr=True: the task's optimizer now uses it
    print(f"lr_find: {len(finder.results['lr'])} steps, suggestion lr={suggested:.3g}; curve: "
          f"{finder.png_path}")
    tuned = train(task, epochs, "suggested")
    seed_everything(0)
    # the same initial weights: the finder restored the task
    default = train(DigitsTask(), epochs, "default")
    print(f"\ndigits, {epochs} epochs, seed 0\n")
    print("| lr | val/acc | val/loss | test/acc | test/loss |\n|---|---|---|---|---|")
    for lr, (fitted, tested) in ((suggested, tuned), (3e-3, default)):
        print(f"| {lr:.3g} | {fitted['val/acc']:.4f} | {fitted['val/loss']:.4f} | "
              f"{tested['test/acc']:.4f} | {tested['test/loss']:.4f} |")
    print(f"\n(run directory: {os.path.dirname(finder.png_path)})")


if __name__ == "__main__":
    main()
