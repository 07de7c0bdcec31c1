"""Overhead as a user measures it: the hand-written loop and ``Trainer(max_epochs=N)`` each in a fresh process.

A user who benchmarks a framework writes two scripts and times them: no interleaving, whatever the machine
does in between counts, and the Trainer runs with its defaults (progress bar to a file, TensorBoard, an
epoch-end checkpoint, the model summary). Each run here is a subprocess (``python benchmarks/separate.py
--child ...``) that trains ``epochs`` epochs and reports the wall time of each epoch, taken at the start of
every epoch by a callback ordered first (so everything the Trainer does between epochs is counted) and at the
end of fit; the first epoch is dropped, the median of the others kept. The variants take turns within a
round (rotated each round); a round's ratio is a variant's median over the hand-written loop's median of the
same round. The final parameters are compared with the hand-written loop's (0: the same work was done).
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

ALL_OFF = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
VARIANTS = {"hand": None, "taskfit, defaults": {}, "taskfit, all off": ALL_OFF}
BREAKDOWN = {  # --breakdown: the defaults one by one on top of "all off"
    "taskfit, + progress bar": dict(ALL_OFF, enable_progress_bar=True),
    "taskfit, + logger": dict(ALL_OFF, logger=True),
    "taskfit, + checkpointing": dict(ALL_OFF, enable_checkpointing=True),
}


def child(workload: str, variant: str, epochs: int, shuffle: bool, out: str) -> None:
    """One run in this process: print the per-epoch wall times as JSON, save the final parameters to ``out``."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, HERE)
    from workloads import WORKLOADS, make_data, make_hand, make_task

    torch.set_num_threads(1)
    spec = dict(WORKLOADS[workload], shuffle=shuffle)
    data = make_data(spec)
    marks: list[float] = []
    if variant == "hand":
        model, optimizer, loader = make_hand(spec, data)
        for epoch in range(epochs):
            marks.append(time.perf_counter())
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
        marks.append(time.perf_counter())
        net = model.net
    else:
        from taskfit import Trainer
        from taskfit.callbacks import Callback

        class EpochClock(Callback):
            order = -10**6  # first of all callbacks

            def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
                marks.append(time.perf_counter())

            def on_fit_end(self, trainer: Any, task: Any) -> None:
                marks.append(time.perf_counter())

        with tempfile.TemporaryDirectory() as root:
            task = make_task(spec, data)
            Trainer(max_epochs=epochs, accelerator="cpu", default_root_dir=root, callbacks=[EpochClock()],
                    **{**VARIANTS, **BREAKDOWN}[variant]).fit(task)
        net = task.net
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, out)
    print(json.dumps([b - a for a, b in zip(marks, marks[1:])]))


def run_once(workload: str, variant: str, epochs: int, shuffle: bool, params: str) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TASKFIT_SEED", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, variant, str(epochs), params]
    out = subprocess.run(cmd + (["--shuffle"] if shuffle else []), capture_output=True, text=True, env=env)
    if out.returncode:  # the child's own error, not only its exit status
        raise SystemExit(f"{' '.join(cmd)} failed with exit status {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(workload: str, epochs: int, rounds: int, shuffle: bool, breakdown: bool = False) -> dict[str, Any]:
    """Per variant: the per-round ratios to the hand-written loop, the median epoch, the max parameter diff."""
    import torch

    names = list(VARIANTS) + (list(BREAKDOWN) if breakdown else [])
    ratios: dict[str, list[float]] = {v: [] for v in names}
    medians: dict[str, list[float]] = {v: [] for v in names}
    epochs_s: dict[str, list[float]] = {v: [] for v in names}  # every kept epoch of every round
    diffs: dict[str, float] = {v: 0.0 for v in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            median, params = {}, {}
            for variant in order:
                path = os.path.join(tmp, f"{variant}.pt")
                kept = run_once(workload, variant, epochs, shuffle, path)[1:]
                median[variant] = statistics.median(kept)
                epochs_s[variant] += kept
                params[variant] = torch.load(path, weights_only=True)
            for variant in names:
                ratios[variant].append(median[variant] / median["hand"])
                medians[variant].append(median[variant])
                diffs[variant] = max(diffs[variant], max(float((params[variant][k] - v).abs().max())
                                                         for k, v in params["hand"].items()))
            print(f"  separate processes, {workload}: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {"ratios": ratios, "medians": medians, "diffs": diffs,
            "pooled": {v: statistics.median(epochs_s[v]) / statistics.median(epochs_s["hand"]) for v in names}}


def print_table(results: dict[str, dict[str, Any]], epochs: dict[str, int], rounds: int, shuffle: bool) -> None:
    print(f"\nSeparate processes, as a user measures: each run a fresh `python` process, {rounds} rounds of the "
          f"variants in turn (rotated), per-epoch wall time from a callback ordered first, the first epoch dropped; "
          f"shuffle {'on' if shuffle else 'off'}.\n")
    print("| workload | variant | epochs per run | median epoch (ms) | ratio to hand: median [min-max] over rounds "
          "| ratio of the medians of all epochs | max abs param diff vs hand |")
    print("|---|---|---|---|---|---|---|")
    for workload, result in results.items():
        for variant, ratios in result["ratios"].items():
            print(f"| {workload} | {variant} | {epochs[workload]} | "
                  f"{statistics.median(result['medians'][variant]) * 1000:.1f} | {statistics.median(ratios):.3f} "
                  f"[{min(ratios):.3f}-{max(ratios):.3f}] | {result['pooled'][variant]:.3f} | "
                  f"{result['diffs'][variant]:.1e} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=4, metavar=("WORKLOAD", "VARIANT", "EPOCHS", "PARAMS"))
    parser.add_argument("--shuffle", action="store_true")
    args = parser.parse_args()
    if args.child:
        workload, variant, n, params = args.child
        child(workload, variant, int(n), args.shuffle, params)
