"""Checkpoint stall: how long the training loop stops for each checkpoint save, for a model whose state is
~600 MB, against the loops a user would write by hand. Each variant trains in its own process.

    python benchmarks/checkpoint_stall.py             # 12 x Linear(2048, 2048) + Adam, a save every 20 steps
    python benchmarks/checkpoint_stall.py --quick     # tiny sizes: a smoke run (structure, not speed)

Variants: a hand-written ``torch.save`` loop (synchronous), a hand-written DCP ``async_save`` loop (as its docs
show it: staging allocated per save), the same with one ``DefaultStager`` reused between saves, taskfit's
``ModelCheckpoint(every_n_train_steps=N)``, and Lightning's when it is installed. The clock is read when each step
starts and when its optimizer step ends; a save's **stall** is the gap between that end and the next step's
start, beyond the median gap of the steps without a save: the time the loop stops for it (the first save also
allocates staging buffers, so it is shown on its own). **Added per save** is the whole loop's time beyond
``steps x median step interval``, per save: the stall plus whatever a background writer costs the steps that
follow (on a loaded machine, noisy). **Return** is the time from the end of the last step (a save step) to the
loop's or ``fit``'s return: what waiting for the last file costs. **Extra peak** is the peak RSS of the steps
with saves above the peak of the steps before the first save (Linux's VmHWM, reset in between). **Copy** is
copying the same state in memory into reused buffers, measured in the same process after the loop.
A second table times a resume of the taskfit checkpoint (``fit(ckpt_path=...)`` up to ``on_fit_start``) and a
hand-written ``torch.load`` + ``load_state_dict``, with their peak memory above the freshly built model: anonymous
memory (sampled every millisecond) and RSS (which also counts the page-cache pages of a mapped file).
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
from process_memory import AnonPeak, memory, reset_peak  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

VARIANTS = ("torch.save", "dcp async_save", "dcp async_save, reused stager", "taskfit", "lightning")
RESUMES = ("resume: taskfit", "resume: torch.load")


# ---- the workload every variant trains ----------------------------------------------------------------------
def build(args: argparse.Namespace) -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    steps = args.saves * args.every + 1
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(steps * args.batch, args.width, generator=g),
                         torch.randn(steps * args.batch, args.width, generator=g))
    return nn.Sequential(*layers[:-1]), DataLoader(data, batch_size=args.batch)


class Clock:
    """The time of each step's start and of the end of its optimizer step; the peak RSS of plain training (steps
    3 to ``every - 1``), after which the peak is reset to measure the steps with saves."""

    def __init__(self, every: int) -> None:
        self.every, self.starts, self.ends, self.rss = every, [], [], 0

    def start(self) -> None:
        if len(self.starts) == 2:
            reset_peak()
        elif len(self.starts) == self.every - 1:
            self.rss = memory("VmHWM")
            reset_peak()
        self.starts.append(time.perf_counter())

    def end(self) -> None:
        self.ends.append(time.perf_counter())

    def result(self, end: float) -> dict[str, Any]:
        return {"starts": self.starts, "ends": self.ends, "end": end, "rss": self.rss, "hwm": memory("VmHWM")}


def state_copy_seconds(state: Any) -> dict[str, float]:
    """Copy every tensor of ``state`` into buffers: once into new ones (cold pages), then 5 times into the same."""
    tensors: list[torch.Tensor] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(state)
    buffers = [torch.empty_like(t) for t in tensors]
    start = time.perf_counter()
    for b, t in zip(buffers, tensors):
        b.copy_(t)
    cold = time.perf_counter() - start
    warm = []
    for _ in range(5):
        start = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t)
        warm.append(time.perf_counter() - start)
    return {"copy_cold": cold, "copy_warm": statistics.median(warm),
            "state_bytes": sum(t.numel() * t.element_size() for t in tensors)}


def hand_loop(args: argparse.Namespace, folder: str, save: Any, finish: Any = None) -> dict[str, Any]:
    model, loader = build(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    clock = Clock(args.every)
    for step, (x, y) in enumerate(loader, 1):
        clock.start()
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        clock.end()
        if step % args.every == 0:
            save(model, optimizer, os.path.join(folder, f"step={step}"))
        if step == args.saves * args.every:
            break
    if finish is not None:
        finish()
    return {**clock.result(time.perf_counter()),
            **state_copy_seconds({"model": model.state_dict(), "optimizer": optimizer.state_dict()})}


def run_torch_save(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path + ".pt")

    return hand_loop(args, folder, save)


def run_dcp(args: argparse.Namespace, folder: str, reuse: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    pending: list[Any] = []
    stager = DefaultStager(StagingOptions(False, False, False, False)) if reuse else None

    def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        if pending:
            pending.pop().result()  # the previous save is complete before the next one starts
        model_state, optimizer_state = get_state_dict(model, optimizer)
        pending.append(dcp.async_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path,
                                      async_stager=stager))

    def finish() -> None:
        if pending:
            pending.pop().result()
        if stager is not None:
            stager.close()

    return hand_loop(args, folder, save, finish)


def as_task(model: nn.Module, loader: DataLoader) -> nn.Module:
    """The workload as a TaskModule: the loss and optimizer of the hand-written loops."""
    from taskfit import TaskModule

    class Task(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(outputs, targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return loader

    return Task()


def run_taskfit(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    from taskfit import Trainer
    from taskfit.callbacks import Callback, ModelCheckpoint

    clock = Clock(args.every)

    class Tick(Callback):  # order 0: its on_train_batch_end runs before ModelCheckpoint's (order 1000) saves
        def on_train_batch_start(self, trainer: Any, task: Any, batch: Any, batch_idx: int) -> None:
            clock.start()

        def on_train_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.end()

    checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=args.every, every_n_epochs=None)
    trainer = Trainer(max_steps=args.saves * args.every, callbacks=[checkpoint, Tick()], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                      default_root_dir=folder)
    task = as_task(*build(args))
    trainer.fit(task)
    return {**clock.result(time.perf_counter()), "checkpoint": checkpoint.last_model_path,
            **state_copy_seconds({"model": task.state_dict(), "optimizer": trainer.optimizer.state_dict()})}


def run_lightning(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    model, loader = build(args)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader:
            return loader

    clock = Clock(args.every)

    class Tick(L.Callback):  # Lightning runs its ModelCheckpoint after every other callback
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            clock.start()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.end()

    trainer = L.Trainer(max_steps=args.saves * args.every, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=args.every), Tick()],
                        default_root_dir=folder)
    module = Module()
    trainer.fit(module)
    return {**clock.result(time.perf_counter()),
            **state_copy_seconds({"model": module.state_dict(),
                                  "optimizer": trainer.optimizers[0].state_dict()})}


def run_resume(args: argparse.Namespace, path: str, taskfit: bool) -> dict[str, Any]:
    """Resume ``path`` into a freshly built model: the peak RSS above the model, and the time it takes."""
    model, loader = build(args)
    warm = nn.Linear(2, 2)  # an optimizer's first step imports torch._dynamo (seconds): not part of a resume
    torch.optim.Adam(warm.parameters()).step()
    base, anon = reset_peak(), AnonPeak()
    if taskfit:
        from taskfit import Trainer
        from taskfit.callbacks import Callback

        started: list[float] = []

        class Restored(Exception):
            pass

        class Started(Callback):
            def on_fit_start(self, trainer: Any, task: Any) -> None:
                started.append(time.perf_counter())
                raise Restored  # the state is restored: that is all this measures

        trainer = Trainer(max_steps=args.saves * args.every + 1, callbacks=[Started()], logger=False,
                          enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                          accelerator="cpu", default_root_dir=os.path.dirname(path))
        start = time.perf_counter()
        try:
            trainer.fit(as_task(model, loader), ckpt_path=path)
        except Restored:
            pass
        seconds = started[0] - start
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        start = time.perf_counter()
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict({k[len("net."):]: v for k, v in ckpt["module"].items()})
        optimizer.load_state_dict(ckpt["optimizer"])
        del ckpt
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "extra_peak": memory("VmHWM") - base, "after": memory("VmRSS") - base,
            "extra_anon": anon.stop()}


# ---- the parent: one process per variant, one table -----------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    folder = tempfile.mkdtemp(prefix="stall-", dir=args.dir)
    try:
        if args.worker == "torch.save":
            result = run_torch_save(args, folder)
        elif args.worker.startswith("dcp"):
            result = run_dcp(args, folder, reuse="reused" in args.worker)
        elif args.worker == "taskfit":
            result = run_taskfit(args, folder)
            if args.resume_from:
                shutil.copy(result["checkpoint"], args.resume_from)
        elif args.worker == "lightning":
            result = run_lightning(args, folder)
        else:
            result = run_resume(args, args.resume_from, taskfit=args.worker == "resume: taskfit")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    json.dump(result, sys.stdout)


def stalls(result: dict[str, Any], every: int) -> dict[str, float]:
    """Per save: the gap between the end of its step's optimizer step and the start of the next step, beyond the
    median gap without a save (the stall), and the whole loop's time beyond its steps at the median interval."""
    starts, ends = result["starts"], result["ends"]
    gaps = [b - a for a, b in zip(ends, starts[1:])]  # gaps[i]: after step i+1 (1-based), its save included
    saved = [i for i in range(len(gaps)) if (i + 1) % every == 0]
    plain_gap = statistics.median(d for i, d in enumerate(gaps) if i not in saved and i >= 2)
    per_save = [gaps[i] - plain_gap for i in saved]
    intervals = [b - a for a, b in zip(starts, starts[1:])]
    step = statistics.median(d for i, d in enumerate(intervals) if i not in saved and i >= 2)
    return {"step": step, "first": per_save[0], "later": statistics.median(per_save[1:]) if per_save[1:] else
            float("nan"), "added": (result["end"] - starts[2] - (len(starts) - 2) * step) / (len(saved) + 1),
            "return": result["end"] - ends[-1], "extra_peak": result["hwm"] - result["rss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="Linear(width, width) layers (default 12)")
    parser.add_argument("--width", type=int, default=2048, help="layer width (default 2048: 50M parameters)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument("--every", type=int, default=20, help="steps between saves (default 20)")
    parser.add_argument("--saves", type=int, default=5, help="saves per variant (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--no-resume", action="store_true", help="skip the resume table")
    parser.add_argument("--dir", default=None, help="folder for the checkpoints (default: the temp folder)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.batch, args.every, args.saves = 2, 64, 4, 5, 3
    if args.worker:
        return worker(args)
    try:
        import lightning  # noqa: F401
    except ImportError:
        args.variants = [v for v in args.variants if v != "lightning"]
        print("Lightning is not installed: its row is skipped (pip install lightning --no-deps to compare).\n")
    common = [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "batch", "every", "saves", "threads")]
    common += [f"--dir={args.dir}"] if args.dir else []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    scratch = tempfile.mkdtemp(prefix="stall-resume-", dir=args.dir)
    saved = os.path.join(scratch, "taskfit.ckpt")

    def run(variant: str, *extra: str) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--worker={variant}", *common, *extra],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    try:
        results = {}
        for variant in args.variants:
            extra = [f"--resume-from={saved}"] if variant == "taskfit" and not args.no_resume else []
            results[variant] = run(variant, *extra)
        resumes = {}
        if os.path.exists(saved):
            resumes = {name: run(name, f"--resume-from={saved}") for name in RESUMES}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    state = next(iter(results.values()))["state_bytes"]
    params = sum(p.numel() for p in build(args)[0].parameters())
    print(f"{args.layers} x Linear({args.width}, {args.width}) + Adam: {params / 1e6:.1f}M parameters, "
          f"{state / 2**20:.0f} MiB of state; batch {args.batch}, a save every {args.every} steps, {args.saves} saves, "
          f"{args.threads} torch thread(s); torch {torch.__version__}.\n")
    print("| variant | step (s) | stall, first save (s) | stall, later saves (s) | added per save (s) | return (s) "
          "| extra peak (MiB) | copy, reused buffers (s) | later stall / copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for variant, result in results.items():
        s = stalls(result, args.every)
        print(f"| {variant} | {s['step']:.3f} | {s['first']:.3f} | {s['later']:.3f} | {s['added']:.3f} | "
              f"{s['return']:.3f} | {s['extra_peak'] / 2**20:.0f} | {result['copy_warm']:.3f} | "
              f"{s['later'] / result['copy_warm']:.2f} |")
    if resumes:
        print("\n| resume of the taskfit checkpoint | seconds | peak anonymous memory above the model (MiB) | "
              "peak RSS above the model (MiB) | RSS after, above the model (MiB) |\n|---|---|---|---|---|")
        for name, r in resumes.items():
            print(f"| {name[len('resume: '):]} | {r['seconds']:.3f} | {r['extra_anon'] / 2**20:.0f} | "
                  f"{r['extra_peak'] / 2**20:.0f} | {r['after'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()
