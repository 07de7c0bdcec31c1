"""What the defaults cost in a user's own measurement: one script, one process, the fits one after
another.

    python benchmarks/first_fit.py                  # 3 processes; the defaults and each default
    taken out python benchmarks/first_fit.py --runs 5 --epochs 4

A user who wants to know what the Trainer costs writes one script: time a hand-written loop, then
``Trainer(max_epochs=4).fit(task)`` with its defaults, then the loop again, and divides (issue 48:
1.080 for the tiny MLP). Unlike ``separate.py`` (per-epoch medians, the first epoch dropped) this
counts the whole ``fit`` call: everything the Trainer does once per fit (imports it makes on first
use, the model summary, the logger's files, the epoch-end checkpoints and their writer thread, the
progress bar) lands in the ratio.

Each run is a fresh process (``--child``) that runs one untimed epoch of the loop (torch's first
use), then times, in this order: the hand-written loop, the Trainer with one variant, the loop
again, the Trainer again. A ratio is a fit's wall time over the mean of the two loops: the first fit
pays what the Trainer does once per process (its imports on first use), the second what it costs per
fit. The variants are the defaults, the defaults with one of them switched off, and everything off;
each variant gets processes of its own, so one variant's first-use costs are not carried by the
next. Printed: per variant the median ratio over ``--runs`` processes and its range.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

OFF = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False,
           enable_model_summary=False)
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "defaults, no progress bar": dict(enable_progress_bar=False),
    "defaults, no logger": dict(logger=False),
    "defaults, no checkpointing": dict(enable_checkpointing=False),
    "defaults, no model summary": dict(enable_model_summary=False),
    "all four off": OFF,
}


def hand(spec: dict[str, Any], data: Any, epochs: int) -> float:
    """The hand-written loop's wall time for ``epochs`` epochs, its setup included."""
    import torch.nn.functional as F

    from workloads import make_hand

    start = time.perf_counter()
    model, optimizer, loader = make_hand(spec, data)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
    return time.perf_counter() - start


def trainer_fit(spec: dict[str, Any], data: Any, epochs: int, settings: dict[str, Any]) -> float:
    """``Trainer(max_epochs=epochs, **settings).fit(task)``'s wall time, the Trainer's creation
    included (the task is built first, as the loop's model is)."""
    from taskfit import Trainer
    from workloads import make_task

    with tempfile.TemporaryDirectory() as root:
        task = make_task(spec, data)
        start = time.perf_counter()
        Trainer(max_epochs=epochs, accelerator="cpu", default_root_dir=root, **settings).fit(task)
        return time.perf_counter() - start


def child(variant: str, epochs: int) -> None:
    """One process: loop, Trainer, loop; prints the three wall times as JSON."""
    import torch

    sys.path.insert(0, HERE)
    from workloads import WORKLOADS, make_data

    torch.set_num_threads(1)
    spec = WORKLOADS["tiny MLP"]
    data = make_data(spec)
    # an untimed epoch first: a process's first loop pays ~2 s of torch's first use (3.5 s against
    # 1.6 s for the same 4 epochs run again), which would flatter whatever comes second
    hand(spec, data, 1)
    # the Trainer's progress bar writes to stderr, as in a user's terminal-less run
    times = [hand(spec, data, epochs), trainer_fit(spec, data, epochs, VARIANTS[variant]),
             hand(spec, data, epochs), trainer_fit(spec, data, epochs, VARIANTS[variant])]
    print(json.dumps(times))


def run(variant: str, epochs: int) -> tuple[float, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TASKFIT_SEED", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--epochs", str(epochs)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    before, fit, after, again = json.loads(out.stdout.strip().splitlines()[-1])
    return fit / ((before + after) / 2), again / ((before + after) / 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=list(VARIANTS))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.epochs)
        return
    ratios: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.runs):  # the variants take turns within a round
        for variant in VARIANTS:
            ratios[variant].append(run(variant, args.epochs))
        print(f"  round {r + 1}/{args.runs} done", file=sys.stderr, flush=True)
    print(f"\nOne process per run (loop, Trainer, loop, Trainer again), tiny MLP, {args.epochs} "
          f"epochs, {args.runs} runs per variant; a whole fit over the loops' mean:\n")
    print("| variant | the process's first fit: median [min-max] | a second fit |")
    print("| --- | --- | --- |")
    for variant, pairs in ratios.items():
        first, second = [p[0] for p in pairs], [p[1] for p in pairs]
        print(f"| {variant} | {statistics.median(first):.3f} [{min(first):.3f}-{max(first):.3f}] "
              f"| {statistics.median(second):.3f} [{min(second):.3f}-{max(second):.3f}] |")


if __name__ == "__main__":
    main()
