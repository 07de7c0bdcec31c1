"""What each piece of the Trainer's per-step work costs: the interleaved harness (overhead.py) run on the tiny MLP,
all defaults off, with the step reduced to the hand-written loop's own calls and then each piece put back.

    python benchmarks/step_budget.py              # 3 repetitions of every variant (~3 minutes on 2 cores)
    python benchmarks/step_budget.py --reps 1     # a smoke run

An attribution experiment, not the product: the reduced steps below are stand-ins, swapped into one Trainer
for the run (they skip what the real step owes the user: the loss curve and epoch means, batch-size weights,
hooks, accumulation, precision), and the loop variants drop its data-wait clock or its stop checks. A piece's
price is its variant's ratio minus the reduced step's, in points of the hand-written loop's epoch.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import os
import statistics
import sys
import tempfile
import textwrap
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from interleaved import run_harness_check, run_interleaved  # noqa: E402
from separate import ALL_OFF  # noqa: E402
from workloads import WORKLOADS, make_data, max_param_diff  # noqa: E402


def reduced_step(batch_size: bool = False, step_function: bool = False, keep_loss: bool = False) -> Callable:
    """The hand-written loop's step inside the Trainer (zero_grad, forward, loss, backward, step), plus the pieces
    named: ``batch_size_of`` (the weights of epoch means), the task's step function (``forward_and_loss`` and
    ``split_batch``), the loss kept for logging (``detach`` and ``add_loss``)."""
    from taskfit.data.loaders import batch_size_of

    full = WORKLOADS["tiny MLP"]["batch_size"]  # every batch of the tiny MLP's epoch is full (16,384 / 32)

    def step(trainer: Any, batch: Any, batch_idx: int) -> Any:
        trainer.optimizer.zero_grad(set_to_none=True)
        samples = full
        if batch_size:
            trainer.logs.train.weight = samples = batch_size_of(batch)
        if step_function:
            loss = trainer.run.training_step(batch, batch_idx)
        else:
            inputs, targets = batch
            loss = trainer.task.loss(trainer.model(inputs), targets)
        if keep_loss:
            trainer.logs.add_loss(loss.detach(), samples)
        loss.backward()
        trainer.optimizer.step()
        trainer.state.global_step += 1
        return loss
    return step


def loop_without(*pieces: str) -> Callable:
    """``Trainer._fit`` with the named pieces of its batch loop removed ("clock": the DataLoader wait timing,
    "stop checks": the step ReduceLROnPlateau, stop, preemption and max_steps checks after each optimizer step)."""
    from taskfit import trainer as module

    source = textwrap.dedent(inspect.getsource(module.Trainer._fit))
    cuts = {"clock": [("st.data_wait_s += clock() - waited", "pass"), ("waited = clock()\n", "pass\n")],
            "stop checks": [("stop = run.preemption.should_break(st) and self._can_stop\n",
                             "stop = False\n"),
                            ("if stop or st.global_step >= max_steps:", "if st.should_stop:")]}
    for piece in pieces:
        for old, new in cuts[piece]:
            if old not in source:  # the loop changed: say so rather than time the unchanged loop
                raise SystemExit(f"step_budget.py: the loop no longer contains {old.strip()!r}; update `cuts`.")
            source = source.replace(old, new)
    namespace: dict[str, Any] = {}
    exec(compile(source, module.__file__, "exec"), module.__dict__, namespace)
    return namespace["_fit"]


def variants() -> dict[str, tuple[Callable | None, Callable | None] | None]:
    """name -> (step, loop) swapped into the Trainer (None: the Trainer's own); None: the harness check."""
    reduced = reduced_step()
    return {
        "the Trainer's step and loop": (None, None),
        "reduced step": (reduced, None),
        "reduced step + batch_size_of": (reduced_step(batch_size=True), None),
        "reduced step + the step function": (reduced_step(step_function=True), None),
        "reduced step + the loss kept": (reduced_step(keep_loss=True), None),
        "reduced step, loop without the clock": (reduced, loop_without("clock")),
        "reduced step, loop without the clock and stop checks": (reduced, loop_without("clock", "stop checks")),
        "harness check (a hand-written loop in the Trainer's place)": None,
    }


def measure(reps: int, epochs: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per variant: the median per-epoch ratio of each repetition, and the largest final-parameter difference
    from the hand-written loop (0: the variant did the same work)."""
    from taskfit import Trainer

    spec = WORKLOADS["tiny MLP"]
    data = make_data(spec)
    own = Trainer._train_step, Trainer._fit
    ratios: dict[str, list[float]] = {}
    diffs: dict[str, float] = {}
    swaps = variants()
    try:
        for _ in range(reps):  # the variants take turns, so slow drifts of the machine spread over all of them
            for name, swap in swaps.items():
                step, loop = swap or (None, None)
                Trainer._train_step, Trainer._fit = step or own[0], loop or own[1]
                pairs = []
                for _ in range(2):
                    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()), \
                            contextlib.redirect_stderr(io.StringIO()):
                        run, settings = (run_interleaved, ALL_OFF) if swap is not None else (run_harness_check, {})
                        epoch_s, net, hand_net = run(spec, data, epochs, root, **settings)
                    pairs += epoch_s[1:]
                    diffs[name] = max(diffs.get(name, 0.0), max_param_diff(net, hand_net))
                ratios.setdefault(name, []).append(statistics.median(t / h for t, h in pairs))
    finally:
        Trainer._train_step, Trainer._fit = own
    return ratios, diffs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run (the first of each is dropped)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ratios, diffs = measure(args.reps, args.epochs)
    base = statistics.median(ratios["reduced step"])
    print(f"\nInterleaved, tiny MLP, all defaults off, {args.reps} repetitions x 2 runs x {args.epochs} epochs; the "
          "ratio to the hand-written loop (median per-epoch ratio), and the points against the reduced step.\n")
    print("| variant | ratio to hand: median | [min-max] | points against the reduced step "
          "| max abs param diff vs hand |")
    print("|---|---|---|---|---|")
    for name, values in ratios.items():
        delta = "" if "harness" in name else f"{(statistics.median(values) - base) * 100:+.2f}"
        print(f"| {name} | {statistics.median(values):.4f} | [{min(values):.4f}-{max(values):.4f}] | {delta} | "
              f"{diffs[name]:.1e} |")
