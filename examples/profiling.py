"""Where the digits job's time goes: ``Trainer(profiler="simple")`` prints a table per stage (data
wait, forward+loss, backward, optimizer step, validation, checkpoint...) and per callback hook at
the end of fit; ``profiler="torch"`` adds a torch.profiler trace of three steps (Chrome/Perfetto)
and an operator table per rank.

    python examples/profiling.py            # 10 epochs with the simple profiler, then 1 with the
    torch one python examples/profiling.py --quick    # 3 epochs, then 1 (what
    tests/test_examples.py runs) taskfit trainer.profiler=simple         # the same from the command
    line (or trainer.profiler=torch)
"""
from __future__ import annotations

import os
import sys

from taskfit import Trainer, seed_everything
from taskfit.examples.digits import DigitsTask


def main() -> None:
    quick = "--quick" in sys.argv[1:] or os.environ.get("TASKFIT_QUICK") == "1"
    seed_everything(0)
    task = DigitsTask()
    trainer = Trainer(max_epochs=3 if quick else 10, profiler="simple", enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(task)  # prints the tables at the end
    stages = trainer.profiler.stages
    # imports: once
    busiest = max((name for name in stages if name != "imports"), key=lambda name: stages[name][1])
    print(f"\nthe busiest stage: {busiest}, "
          f"{stages[busiest][1] / trainer.profiler.fit_seconds:.0%} of the fit (run directory: "
          f"{trainer.log_dir})")

    seed_everything(0)
    traced = Trainer(
        max_epochs=1, profiler="torch", enable_progress_bar=False, enable_model_summary=False
    )
    traced.fit(DigitsTask())  # prints the operator table of steps 2-4 and where the trace is
    print(f"trace of steps 2-4: {traced.profiler.trace_path}")


if __name__ == "__main__":
    main()
