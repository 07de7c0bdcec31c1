"""Memory for models that outgrow a device: what ``Trainer(activation_checkpointing=...)`` and
``trainer.init_module(empty_init=True)`` under fsdp save, measured as peak RSS on the CPU (each variant in its own
process), with the final weights compared against the variant without the feature.

    python benchmarks/model_memory.py           # both tables (~3 minutes on 2 cores)
    python benchmarks/model_memory.py --quick   # tiny sizes, every variant in this process: a smoke run
                                                # (structure and weights, not memory)
    python benchmarks/model_memory.py --part=fsdp   # one table (checkpointing, fsdp; default both)

1. **Activation checkpointing**: a stack of MLP blocks over many tokens, where activations dominate the memory
   (AdamW). The peak is the peak RSS of the training steps above the RSS before the first (weights and data
   there): activations, plus the gradients and AdamW's state (3x the weights). Step time: the median step after
   the first two. Large blocks are returned to the system as soon as they are freed (glibc's
   ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB), so that RSS follows what is allocated.
2. **Meta-device init under fsdp** (2 gloo processes): a stack of large Linear layers (SGD: no optimizer state), one
   FSDP unit each, built eagerly in the launching process or inside ``trainer.init_module(empty_init=True)``; one
   training step. Peak RSS of the launching process and of each rank above a process that trains a tiny model
   the same way (torch, gloo and taskfit themselves).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from process_memory import memory, reset_peak  # noqa: E402
from taskfit import TaskModule, Trainer  # noqa: E402
from taskfit.callbacks import Callback  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
             num_sanity_val_steps=0, accelerator="cpu")


# ---- 1. activation checkpointing ---------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Blocks(TaskModule):
    def __init__(self, depth: int, width: int, tokens: int, steps: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(steps, tokens, width, generator=g),
                                  torch.randn(steps, tokens, width, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=None)  # one (tokens, width) sample per step


class StepClock(Callback):
    """Step start times, and the RSS before the first step (the weights and the data are there)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.base = 0

    def on_train_batch_start(self, trainer: Any, task: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.base = reset_peak()
        self.starts.append(time.perf_counter())


def run_checkpointing(args: argparse.Namespace, on: bool, out: str) -> dict[str, Any]:
    torch.manual_seed(0)
    task = Blocks(args.depth, args.width, args.tokens, args.steps)
    clock = StepClock()
    trainer = Trainer(max_steps=args.steps, seed=0, callbacks=[clock], activation_checkpointing={Block} if on else None,
                      **QUIET)
    trainer.fit(task)
    torch.save(task.state_dict(), out)
    steps = [b - a for a, b in zip(clock.starts[2:], clock.starts[3:])]
    params = sum(p.numel() * p.element_size() for p in task.parameters())
    return {"step": statistics.median(steps), "peak": memory("VmHWM") - clock.base, "params": params}


# ---- 2. meta-device initialisation under fsdp ----------------------------------------------------------------------
class Wide(TaskModule):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(4, width, generator=g), torch.randn(4, width, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=2)


class RankPeak(Callback):
    """Each rank writes its peak RSS (VmHWM) once the task is set up (materialised and sharded: ``on_fit_start``)
    and at the end of fit (after the step, and after rank 0 gathered the weights for the launcher) to
    ``<folder>/rank<r>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder, self.setup = folder, 0

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        self.setup = memory("VmHWM")

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        with open(os.path.join(self.folder, f"rank{trainer.strategy.rank}.json"), "w") as fh:
            json.dump({"setup": self.setup, "end": memory("VmHWM")}, fh)


def run_fsdp_init(args: argparse.Namespace, empty: bool, width: int, out: str) -> dict[str, Any]:
    from taskfit.strategies.fsdp import FSDPStrategy

    folder = tempfile.mkdtemp(prefix="memory-")
    strategy = FSDPStrategy("cpu", 2, auto_wrap_policy={nn.Linear})
    trainer = Trainer(max_steps=1, seed=0, callbacks=[RankPeak(folder)], strategy=strategy, **QUIET)
    torch.manual_seed(0)
    start = memory("VmRSS")
    with trainer.init_module(empty_init=empty):
        task = Wide(args.fsdp_depth, width)
    built = memory("VmRSS") - start
    trainer.fit(task)
    if out:
        torch.save(task.state_dict(), out)
    ranks = []
    for r in (0, 1):
        with open(os.path.join(folder, f"rank{r}.json")) as fh:
            ranks.append(json.load(fh))
    shutil.rmtree(folder, ignore_errors=True)
    return {"built": built, "parent": memory("VmHWM"), "setup": [r["setup"] for r in ranks],
            "end": [r["end"] for r in ranks], "params": sum(p.numel() * p.element_size() for p in task.parameters())}


# ---- the parent ----------------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace, name: str, out: str = "") -> dict[str, Any]:
    """One variant (``checkpointing:on``, ``fsdp:empty``...): its numbers; its final weights to ``out``."""
    torch.set_num_threads(args.threads)
    kind, _, variant = name.partition(":")
    if kind == "checkpointing":
        return run_checkpointing(args, variant == "on", out)
    width = 16 if variant == "baseline" else args.fsdp_width
    return run_fsdp_init(args, variant == "empty", width, out)


def worker(args: argparse.Namespace) -> None:
    print(json.dumps(measure(args, args.worker, args.out)))


def diff(a: str, b: str) -> float:
    """The largest absolute difference between the weights saved in files ``a`` and ``b``."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return max((x[k] - y[k]).abs().max().item() for k in x)


def checkpointing_table(args: argparse.Namespace, run: Any, scratch: str) -> None:
    """Activation checkpointing off and on: each variant run by ``run``; weights compared from ``scratch``."""
    mib = 2**20
    off, on = (run(f"checkpointing:{v}", os.path.join(scratch, f"ac_{v}.pt")) for v in ("off", "on"))
    print(f"Activation checkpointing: {args.depth} blocks of LayerNorm + Linear({args.width}, {4 * args.width}) + GELU "
          f"+ Linear({4 * args.width}, {args.width}), {args.tokens} tokens per step, AdamW, {args.threads} thread(s); "
          f"weights {off['params'] / mib:.0f} MiB.\n")
    print("| activation_checkpointing | step (s) | peak RSS of the steps (MiB) | max abs weight difference to off |")
    print("|---|---|---|---|")
    ac_diff = diff(os.path.join(scratch, "ac_on.pt"), os.path.join(scratch, "ac_off.pt"))
    print(f"| None | {off['step']:.3f} | {off['peak'] / mib:.0f} | - |")
    print(f"| {{Block}} | {on['step']:.3f} | {on['peak'] / mib:.0f} | {ac_diff:.1e} |")
    state = 3 * off["params"]
    print(f"\nStep time with / without: {on['step'] / off['step']:.2f}; peak with / without: "
          f"{on['peak'] / off['peak']:.2f}; activations alone (the peak less gradients and AdamW state, "
          f"{state / mib:.0f} MiB): {(on['peak'] - state) / mib:.0f} against {(off['peak'] - state) / mib:.0f} MiB.\n")


def fsdp_table(args: argparse.Namespace, run: Any, scratch: str) -> None:
    """fsdp's eager and empty init against a tiny baseline: each run by ``run``; weights from ``scratch``."""
    mib = 2**20
    base = run("fsdp:baseline")
    eager, empty = (run(f"fsdp:{v}", os.path.join(scratch, f"fsdp_{v}.pt")) for v in ("eager", "empty"))
    model = eager["params"]
    print(f"Meta-device init under fsdp, 2 gloo processes: {args.fsdp_depth} x Linear({args.fsdp_width}, "
          f"{args.fsdp_width}), one FSDP unit each: {model / mib:.0f} MiB of fp32 weights ({model / mib / 2:.0f} MiB "
          f"per rank once sharded, {model / mib / args.fsdp_depth:.0f} MiB per unit); SGD, one step. Peak RSS "
          f"(VmHWM) above a run of a 16-wide model the same way (launcher {base['parent'] / mib:.0f} MiB, ranks "
          f"{base['setup'][0] / mib:.0f} / {base['setup'][1] / mib:.0f} MiB by the first step).\n")
    print("| init | launcher: the built task (MiB) | rank 0 / rank 1: set up, by the first step (MiB) | rank 0 / "
          "rank 1: whole fit (MiB) | launcher: whole fit (MiB) | max abs weight difference to eager |")
    print("|---|---|---|---|---|---|")
    for name, r in (("eager", eager), ("init_module(empty_init=True)", empty)):
        setup = [(a - b) / mib for a, b in zip(r["setup"], base["setup"])]
        end = [(a - b) / mib for a, b in zip(r["end"], base["end"])]
        d = "-" if r is eager else \
            f"{diff(os.path.join(scratch, 'fsdp_empty.pt'), os.path.join(scratch, 'fsdp_eager.pt')):.1e}"
        print(f"| {name} | {r['built'] / mib:.0f} | {setup[0]:.0f} / {setup[1]:.0f} | {end[0]:.0f} / {end[1]:.0f} | "
              f"{(r['parent'] - base['parent']) / mib:.0f} | {d} |")
    print("\nAt the end of a spawned fit rank 0 gathers the full weights and the launcher receives them (the task in "
          "your script holds the trained weights): the whole-fit columns include that copy; under torchrun there is "
          "no launcher and no gather.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8, help="MLP blocks (default 8)")
    parser.add_argument("--width", type=int, default=256, help="block width (default 256; hidden 4x)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (default 4096)")
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    parser.add_argument("--fsdp-depth", type=int, default=8, help="Linear layers of the fsdp model (default 8)")
    parser.add_argument("--fsdp-width", type=int, default=5792, help="their width (default 5792: 1.07 GB fp32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, every variant in this process: a smoke run (not memory)")
    parser.add_argument("--part", choices=("both", "checkpointing", "fsdp"), default="both",
                        help="the tables to make (default both)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.depth, args.width, args.tokens, args.steps, args.fsdp_depth, args.fsdp_width = 2, 16, 64, 4, 2, 64
    if args.worker:
        return worker(args)
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
              ("depth", "width", "tokens", "steps", "fsdp_depth", "fsdp_width", "threads")]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_="131072")
    scratch = tempfile.mkdtemp(prefix="model-memory-")

    def run(variant: str, out: str = "") -> dict[str, Any]:
        if args.quick:  # the structure and the weights: no process of its own to measure
            return measure(args, variant, out)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--worker={variant}", f"--out={out}",
                               *common], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    try:
        if args.part in ("both", "checkpointing"):
            checkpointing_table(args, run, scratch)
        if args.part in ("both", "fsdp"):
            fsdp_table(args, run, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
