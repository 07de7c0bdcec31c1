"""What taskfit's Trainer costs over a hand-written PyTorch loop (and PyTorch Lightning, when it is installed).

    python benchmarks/overhead.py               # the full benchmark (~15 minutes on 2 busy CPU cores)
    python benchmarks/overhead.py --workload "tiny MLP" --no-interleaved --no-alternating --no-memory --no-import
                                                # only the separate-process runs (what a user sees), ~3 minutes
    python benchmarks/overhead.py --breakdown   # + interleaved runs with the defaults switched on one by one
    python benchmarks/overhead.py --quick       # a smoke run (fewer rounds and epochs)

Every variant trains the same model on the same data in the same order (``shuffle=False``; with ``--shuffle`` the
separate-process runs shuffle, all in the same seeded order), with the same optimizer, batch size, seed and thread
count (1). Reported:

- separate processes (``separate.py``): the hand-written loop and the Trainer with its defaults (and with all of
  them off), each in a fresh process, as a user benchmarks a framework: what a user sees;
- alternating runs: the variants take turns (hand, taskfit, lightning, then the next round in a rotated
  order); median epoch time (the first epoch of every run dropped), wall and process CPU time, and the ratio
  to the hand-written loop;
- interleaved runs: the Trainer and the hand-written loop in lock-step in one fit (one hand-written step
  after each Trainer batch, wall time split at every switch), the measurement that survives a busy machine;
  plus a harness check, the same interleaving with a hand-written loop in the Trainer's place;
- the largest difference between the final parameters of each framework run and the hand-written loop's
  (0 means both did exactly the same work);
- the peak RSS of each variant, each in its own subprocess, and the import time of ``trainer`` + ``callbacks``
  against ``torch`` alone.

The framework runs use their defaults: a progress bar (to a non-terminal stream, as in a log file),
TensorBoard logging at the default interval (taskfit logs the training loss, learning rate and throughput;
Lightning logs the loss with ``self.log`` every step), a checkpoint at each epoch end, the model summary, no
validation.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from interleaved import HARNESS_CHECK, run_harness_check, run_interleaved  # noqa: E402
from separate import measure as measure_separate  # noqa: E402
from separate import print_table as print_separate
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from workloads import WORKLOADS, make_data, make_hand, make_loader, make_net, make_optimizer, make_task, max_param_diff  # noqa: E402


# ---- (1) the hand-written loop ---------------------------------------------------------------------
def clock() -> tuple[float, float]:
    """(wall, CPU) seconds. CPU time of the whole process (all threads, e.g. TensorBoard's writer) is far less
    disturbed than wall time by other processes on a shared machine; both are reported."""
    return time.perf_counter(), time.process_time()


def durations(marks: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]


def run_hand(spec: dict[str, Any], data: TensorDataset, epochs: int) -> tuple[list[tuple[float, float]], nn.Module]:
    model, optimizer, loader = make_hand(spec, data)
    marks = [clock()]
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        marks.append(clock())
    return durations(marks), model.net


# ---- (2) taskfit's Trainer with its defaults ---------------------------------------------------------
# --breakdown adds these runs: the defaults switched on one at a time, to show what each costs.
BREAKDOWN = {
    "taskfit, all off": dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             logger=False),
    "taskfit, + progress bar": dict(enable_model_summary=False, enable_checkpointing=False, logger=False),
    "taskfit, + logger": dict(enable_model_summary=False, enable_checkpointing=False),
}


def run_taskfit(spec: dict[str, Any], data: TensorDataset, epochs: int, root: str,
                **settings: Any) -> tuple[list[tuple[float, float]], nn.Module]:
    from taskfit import Trainer
    from taskfit.callbacks import Callback

    class EpochClock(Callback):
        order = -1000  # first: an epoch runs from one on_train_epoch_start to the next (or to on_fit_end)

        def __init__(self) -> None:
            self.marks: list[tuple[float, float]] = []

        def on_train_epoch_start(self, trainer: Any, task: Any) -> None:
            self.marks.append(clock())

        def on_fit_end(self, trainer: Any, task: Any) -> None:
            self.marks.append(clock())

    timer = EpochClock()
    trainer = Trainer(max_epochs=epochs, accelerator="cpu", default_root_dir=root, callbacks=[timer], **settings)
    task = make_task(spec, data)
    trainer.fit(task)
    return durations(timer.marks), task.net


# ---- (3) PyTorch Lightning with the same settings ----------------------------------------------------
def run_lightning(spec: dict[str, Any], data: TensorDataset, epochs: int,
                  root: str) -> tuple[list[tuple[float, float]], nn.Module]:
    import lightning.pytorch as pl

    class LitTask(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(spec)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters(), spec)

        def train_dataloader(self) -> DataLoader:
            return make_loader(data, spec)

    class EpochClock(pl.Callback):
        def __init__(self) -> None:
            self.marks: list[tuple[float, float]] = []

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.marks.append(clock())

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.marks.append(clock())

    timer = EpochClock()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, default_root_dir=root, callbacks=[timer])
    task = LitTask()
    trainer.fit(task)
    return durations(timer.marks), task.net


def lightning_available() -> bool:
    return importlib.util.find_spec("lightning") is not None


# ---- running, alternating, measuring ---------------------------------------------------------------
@contextlib.contextmanager
def quiet_run():
    """Framework output (progress lines, summary, info logs, warnings) goes to a non-terminal buffer."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.INFO)
        try:
            yield sink
        finally:
            logging.disable(logging.NOTSET)


def run_variant(variant: str, spec: dict[str, Any], data: TensorDataset,
                epochs: int) -> tuple[list[tuple[float, float]], nn.Module]:
    if variant == "hand":
        return run_hand(spec, data, epochs)
    with tempfile.TemporaryDirectory() as root, quiet_run():
        if variant == "lightning":
            return run_lightning(spec, data, epochs, root)
        return run_taskfit(spec, data, epochs, root, **BREAKDOWN.get(variant, {}))


def bench_workload(name: str, spec: dict[str, Any], variants: list[str], rounds: int, epochs: int) -> dict[str, Any]:
    data = make_data(spec)
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    paired: dict[str, list[float]] = {v: [] for v in variants}  # per round: median CPU epoch / hand's
    diffs: dict[str, float] = {v: 0.0 for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]  # rotate: no variant always runs first
        finals, medians = {}, {}
        for variant in order:
            epoch_times, net = run_variant(variant, spec, data, epochs)
            if len(epoch_times) != epochs:
                raise RuntimeError(f"{variant} reported {len(epoch_times)} epoch times, expected {epochs}")
            wall[variant] += [w for w, _ in epoch_times[1:]]  # the first epoch (warm-up, lazy imports) is dropped
            cpu[variant] += [c for _, c in epoch_times[1:]]
            medians[variant] = statistics.median(c for _, c in epoch_times[1:])
            finals[variant] = net
        for variant in variants:
            paired[variant].append(medians[variant] / medians["hand"])
            diffs[variant] = max(diffs[variant], max_param_diff(finals[variant], finals["hand"]))
        print(f"  {name}: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    steps = -(-spec["samples"] // spec["batch_size"])
    return {"wall": wall, "cpu": cpu, "paired": paired, "diffs": diffs, "steps": steps}


def peak_rss_mb() -> float:
    """The peak resident set size of this process (VmHWM; unlike ru_maxrss it is not inherited across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def memory_child(workload: str, variant: str, epochs: int) -> None:
    """Entry of a subprocess: train one variant, print the process's peak RSS (imports included) as JSON."""
    torch.set_num_threads(1)
    spec = WORKLOADS[workload]
    data = make_data(spec)
    before = peak_rss_mb()
    run_variant(variant, spec, data, epochs)
    print(json.dumps({"before": before, "peak": peak_rss_mb()}))


def measure_memory(workload: str, variant: str, epochs: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child", workload, variant,
                          "--epochs", str(epochs)], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def import_time(module: str, pycache: str) -> tuple[float, float]:
    """(seconds of ``import torch``, seconds of ``import <module>`` right after it) in a fresh interpreter.

    Timing both in one process gives the extra cost directly: two separate interpreters differ by more than
    that on a busy machine. Bytecode is cached in ``pycache`` (as after an install, even where
    PYTHONDONTWRITEBYTECODE is set); the caller warms that cache with a first, dropped sample.
    """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONPYCACHEPREFIX=pycache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    code = (f"import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); import {module}; "
            f"print(t1 - t0, time.perf_counter() - t1)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         check=True).stdout.split()
    return float(out[0]), float(out[1])


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds (1 of separate processes) of 3 "
                        "epochs (or --epochs)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per workload (default 5)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per run (default: per workload)")
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--breakdown", action="store_true",
                        help="runs of the Trainer with its defaults switched on one at a time, too")
    parser.add_argument("--no-lightning", action="store_true", help="skip PyTorch Lightning even if installed")
    parser.add_argument("--no-separate", action="store_true", help="skip the separate-process runs")
    parser.add_argument("--shuffle", action="store_true",
                        help="separate-process runs: shuffle the data (a plain shuffled "
                        "DataLoader in the hand-written loop; the Trainer draws its order as it "
                        "does: the weights match)")
    parser.add_argument("--no-alternating", action="store_true", help="skip the alternating runs")
    parser.add_argument("--no-interleaved", action="store_true", help="skip the interleaved runs")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--no-import", action="store_true", help="skip the import-time subprocesses")
    parser.add_argument("--memory-child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.epochs is not None and args.epochs < 2:
        parser.error("--epochs must be >= 2 (the first epoch of each run is dropped)")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    torch.set_num_threads(1)
    os.environ.pop("TASKFIT_SEED", None)
    if args.memory_child:
        memory_child(*args.memory_child, epochs=args.epochs or 2)
        return

    variants = ["hand", "taskfit"]
    notes = []
    if args.no_lightning:
        notes.append("lightning: skipped (--no-lightning).")
    elif lightning_available():
        import lightning

        variants.append("lightning")
        notes.append(f"lightning: {lightning.__version__}.")
    else:
        notes.append("lightning: not installed, skipped (`pip install lightning` to compare).")
    rounds = 2 if args.quick else args.rounds
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    print(f"# taskfit overhead benchmark\n\npython {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPU cores, torch threads: {torch.get_num_threads()}; {rounds} alternating rounds; "
          f"first epoch of each run dropped.\n")
    for note in notes:
        print(f"- {note}")

    if not args.no_separate:
        epochs = {name: args.epochs or (3 if args.quick else 2 * WORKLOADS[name]["epochs"]) for name in workloads}
        separate_rounds = 1 if args.quick else max(5, rounds)
        results = {name: measure_separate(name, epochs[name], separate_rounds, args.shuffle, args.breakdown)
                   for name in workloads}
        print_separate(results, epochs, separate_rounds, args.shuffle)

    if not args.no_alternating:
        print("\n| workload | variant | steps/epoch | median epoch, wall (ms) | ratio to hand, wall | median epoch, "
              "CPU (ms) | ratio to hand, CPU | paired ratio, CPU: median [min-max] | max abs param diff vs hand |")
        print("|---|---|---|---|---|---|---|---|---|")
    for name in workloads if not args.no_alternating else []:
        spec = WORKLOADS[name]
        epochs = args.epochs or (3 if args.quick else spec["epochs"])
        result = bench_workload(name, spec, variants, rounds, epochs)
        base_wall, base_cpu = (statistics.median(result[k]["hand"]) for k in ("wall", "cpu"))
        for v in variants:
            wall, cpu, paired = (statistics.median(result[k][v]) for k in ("wall", "cpu", "paired"))
            print(f"| {name} | {v} | {result['steps']} | {fmt_ms(wall)} | {wall / base_wall:.3f} | {fmt_ms(cpu)} | "
                  f"{cpu / base_cpu:.3f} | {paired:.3f} [{min(result['paired'][v]):.3f}-"
                  f"{max(result['paired'][v]):.3f}] | {result['diffs'][v]:.1e} |", flush=True)

    if not args.no_interleaved:
        settings = {"taskfit": {}, **(BREAKDOWN if args.breakdown else {}), HARNESS_CHECK: {}}
        print(f"\nInterleaved: the Trainer and the hand-written loop in one run, one hand-written step after each "
              f"Trainer batch; wall time split at every switch. {rounds} runs per row; ratio per epoch (first of "
              f"each run dropped), median and [min-max].\n")
        print("| workload | variant | median epoch, Trainer (ms) | median epoch, hand (ms) | ratio: median [min-max] "
              "| ratio of total times | max abs param diff |")
        print("|---|---|---|---|---|---|---|")
        for name in workloads:
            spec = WORKLOADS[name]
            epochs = args.epochs or (3 if args.quick else spec["epochs"])
            data = make_data(spec)
            for variant, kwargs in settings.items():
                pairs, diff = [], 0.0
                for _ in range(rounds):
                    with tempfile.TemporaryDirectory() as root, quiet_run():
                        run = run_harness_check if variant == HARNESS_CHECK else run_interleaved
                        epoch_pairs, net, hand_net = run(spec, data, epochs, root, **kwargs)
                    pairs += epoch_pairs[1:]
                    diff = max(diff, max_param_diff(net, hand_net))
                ratios = [t / h for t, h in pairs]
                t_med, h_med = (statistics.median(p[i] for p in pairs) for i in (0, 1))
                total = sum(t for t, _ in pairs) / sum(h for _, h in pairs)
                print(f"| {name} | {variant} | {fmt_ms(t_med)} | {fmt_ms(h_med)} | {statistics.median(ratios):.3f} "
                      f"[{min(ratios):.3f}-{max(ratios):.3f}] | {total:.3f} | {diff:.1e} |", flush=True)

    if not args.no_memory:
        print("\nPeak memory: each variant trains 2 epochs in its own subprocess; the peak RSS of that process "
              "(VmHWM, imports included), and how much it grew from the start of training.\n")
        print("| workload | variant | peak RSS (MB) | vs hand (MB) | growth during training (MB) |")
        print("|---|---|---|---|---|")
        for name in workloads:
            mem = {v: measure_memory(name, v, 2) for v in variants}
            for v in variants:
                peak, before = mem[v]["peak"], mem[v]["before"]
                print(f"| {name} | {v} | {peak:.0f} | {peak - mem['hand']['peak']:+.0f} | {peak - before:.0f} |")

    if not args.no_import:
        repeats = 3 if args.quick else 7
        modules = ["taskfit"] + (["lightning.pytorch"] if "lightning" in variants else [])
        torch_s: list[float] = []
        extra: dict[str, list[float]] = {m: [] for m in modules}
        with tempfile.TemporaryDirectory() as pycache:
            for module in modules:
                import_time(module, pycache)  # writes the bytecode cache
            for _ in range(repeats):  # alternate, like the training runs
                for module in modules:
                    t, e = import_time(module, pycache)
                    torch_s.append(t)
                    extra[module].append(e)
        print(f"\nImport time: a fresh `python -c` per sample that imports torch, then the package; bytecode "
              f"cached; {repeats} alternating samples, median.\n")
        print("| import | median (s) | [min-max] (s) |")
        print("|---|---|---|")
        print(f"| `import torch` | {statistics.median(torch_s):.2f} | [{min(torch_s):.2f}-{max(torch_s):.2f}] |")
        for module, values in extra.items():
            print(f"| `import {module}` after torch | +{statistics.median(values):.3f} | "
                  f"[{min(values):.3f}-{max(values):.3f}] |")


if __name__ == "__main__":
    main()
