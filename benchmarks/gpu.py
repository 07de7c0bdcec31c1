"""taskfit's Trainer against a hand-written loop on a GPU: a ResNet-18-sized model on synthetic images.

    python benchmarks/gpu.py            # the full table on one GPU, in about 3-4 minutes (dp rows need 2+ GPUs)
    python benchmarks/gpu.py --quick    # a tiny smoke run; also runs on the CPU (no compile there)

For each setting, fp32 / bf16-mixed / bf16-mixed + torch.compile, single device, DataParallel ("dp") and FSDP2
("fsdp": ``FSDPStrategy`` on one device, every BasicBlock a unit, against the hand-written single-device loop: what
sharding's machinery costs per step, and its memory), the hand-written loop and the Trainer train the same model
with the same optimizer (SGD, momentum 0.9), batch size, data and precision. Batches come from a DataLoader over
pre-made pinned CPU batches (no collate cost), so each
step includes its host-to-device copy, as in real training. Printed: samples/s, step time (after warm-up steps,
timed between two ``torch.cuda.synchronize()``), peak device memory (``torch.cuda.max_memory_allocated``) and
the Trainer/hand step-time ratio. The Trainer runs with its defaults (progress bar to a non-terminal stream,
TensorBoard every 50 steps, throughput monitor); its end-of-fit checkpoint is written after the timed steps.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


# ---- a ResNet-18 in plain torch (torchvision's layout: 11.7M parameters at width 64) --------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(width: int = 64, classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, cout in enumerate((width, width * 2, width * 4, width * 8)):
        layers += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class SyntheticBatches(Dataset):
    """``length`` whole batches (DataLoader(batch_size=None)), cycling through a few pre-made ones."""

    def __init__(self, batch_size: int, image_size: int, classes: int, length: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.batches = [(torch.randn(batch_size, 3, image_size, image_size, generator=g),
                         torch.randint(0, classes, (batch_size,), generator=g)) for _ in range(4)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[i % len(self.batches)]


# ---- the two loops ----------------------------------------------------------------------------------------
def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    model = resnet18(args.width, args.classes)
    return model.to(memory_format=torch.channels_last) if args.channels_last else model


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def make_loader(args: argparse.Namespace, device: torch.device) -> DataLoader:
    data = SyntheticBatches(args.batch_size, args.image_size, args.classes, args.warmup + args.steps + 1)
    return DataLoader(data, batch_size=None, shuffle=False, pin_memory=device.type == "cuda")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_loop(args: argparse.Namespace, device: torch.device, precision: str, compiled: bool, strategy: str) -> float:
    """The loop one would write: returns the seconds of ``args.steps`` steps after ``args.warmup`` steps (fsdp's
    reference is the single-device loop)."""
    model = make_model(args).to(device)
    if strategy == "dp":
        model = nn.DataParallel(model)
    optimizer = make_optimizer(model.parameters())
    step_model = torch.compile(model) if compiled else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else \
        contextlib.nullcontext()
    model.train()
    start = 0.0
    for i, (x, y) in enumerate(make_loader(args, device)):
        if i == args.warmup:
            sync(device)
            start = time.perf_counter()
        elif i == args.warmup + args.steps:
            break
        x = x.to(device, non_blocking=True)  # channels_last: the weights only, as Trainer(channels_last=True)
        y = y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(step_model(x), y)
        loss.backward()
        optimizer.step()
    sync(device)
    return time.perf_counter() - start


def trainer_loop(args: argparse.Namespace, device: torch.device, precision: str, compiled: bool,
                 strategy: str) -> float:
    from taskfit import TaskModule, Trainer
    from taskfit.callbacks import Callback

    class ResNetTask(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(args)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(outputs, targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

        def train_dataloader(self) -> DataLoader:
            return make_loader(args, device)

    class StepClock(Callback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_train_batch_start(self, trainer: Any, task: Any, batch: Any, batch_idx: int) -> None:
            if trainer.state.batch_idx == args.warmup:
                sync(device)
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, task: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.state.global_step == args.warmup + args.steps:
                sync(device)
                self.end = time.perf_counter()

    clock = StepClock()
    dp, chosen = strategy == "dp", "dp" if strategy == "dp" else "auto"
    if strategy == "fsdp":  # one process (a 1-rank mesh), so that the task and callbacks need not be pickled
        from taskfit.strategies.fsdp import FSDPStrategy

        chosen = FSDPStrategy(device.type, 1, auto_wrap_policy={BasicBlock})
    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(max_steps=args.warmup + args.steps, accelerator=device.type, strategy=chosen,
                          devices=torch.cuda.device_count() if dp else "auto", precision=precision,
                          compile=compiled, channels_last=args.channels_last, default_root_dir=root,
                          callbacks=[clock])
        trainer.fit(ResNetTask())
    return clock.end - clock.start


# ---- the table --------------------------------------------------------------------------------------------
def peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset(device: torch.device) -> None:
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def copy_time(args: argparse.Namespace, device: torch.device) -> float | None:
    """Median seconds of one batch's pinned host-to-device copy (what a prefetch to the device could hide)."""
    if device.type != "cuda":
        return None
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size).pin_memory()
    times = []
    for _ in range(10):
        sync(device)
        t = time.perf_counter()
        x.to(device, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, images and step counts: a smoke run "
                        "that also works on the CPU")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage (64: ResNet-18)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=15, help="untimed steps first (compile, cudnn, allocator)")
    parser.add_argument("--channels-last", action="store_true", help="channels_last in both loops")
    parser.add_argument("--configs", default="fp32,bf16,bf16+compile",
                        help="comma-separated subset of fp32, bf16, bf16+compile")
    parser.add_argument("--strategies", default="single,dp,fsdp", help="comma-separated subset of single, dp, fsdp")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is available")
    args = parser.parse_args()
    if args.quick:
        args.batch_size, args.image_size, args.width, args.classes = 8, 32, 8, 10
        args.steps, args.warmup = 3, 1
    for name in ("batch_size", "image_size", "width", "classes", "steps", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    known = {"fp32": ("32", False), "bf16": ("bf16-mixed", False), "bf16+compile": ("bf16-mixed", True)}
    for c in configs:
        if c not in known:
            parser.error(f"unknown config {c!r}: use a subset of {', '.join(known)}")
    for s in strategies:
        if s not in ("single", "dp", "fsdp"):
            parser.error(f"unknown strategy {s!r}: use a subset of single, dp, fsdp")

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    warnings.filterwarnings("ignore")
    notes = []
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    gpus = torch.cuda.device_count() if cuda else 0
    print(f"# taskfit GPU benchmark\n\n{name} x{gpus or 1}, torch {torch.__version__}, python "
          f"{sys.version.split()[0]}; ResNet-18 layout, width {args.width}, {args.image_size}x{args.image_size} "
          f"images, batch {args.batch_size}, {args.warmup} warm-up + {args.steps} timed steps, SGD momentum"
          f"{', channels_last' if args.channels_last else ''}.\n")
    if "dp" in strategies and gpus < 2:
        strategies.remove("dp")
        notes.append(f"dp skipped: it needs 2 or more GPUs, this machine has {gpus}.")
    if not cuda and "bf16+compile" in configs:
        configs.remove("bf16+compile")
        notes.append("bf16+compile skipped on the CPU (compiling takes minutes there; run it on a GPU).")
    if cuda and not torch.cuda.is_bf16_supported():
        configs = [c for c in configs if c == "fp32"]
        notes.append("bf16 rows skipped: this GPU does not support bfloat16.")

    print("| config | strategy | loop | samples/s | step (ms) | peak memory (GiB) | taskfit / hand |")
    print("|---|---|---|---|---|---|---|")
    started = time.perf_counter()
    for strategy in strategies:
        for config in configs:
            precision, compiled = known[config]
            seconds: dict[str, float] = {}
            for loop, fn in (("hand", hand_loop), ("taskfit", trainer_loop)):
                reset(device)
                try:
                    seconds[loop] = fn(args, device, precision, compiled, strategy)
                except Exception as exc:  # one failing setting (e.g. compile + dp) must not hide the others
                    print(f"| {config} | {strategy} | {loop} | failed: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:120]} ||||")
                    continue
                step = seconds[loop] / args.steps
                mem = peak_memory(device)
                ratio = f"{seconds['taskfit'] / seconds['hand']:.3f}" if loop == "taskfit" and "hand" in seconds \
                    else ""
                print(f"| {config} | {strategy} | {loop} | {args.batch_size / step:,.0f} | {step * 1e3:.1f} | "
                      f"{'-' if mem is None else f'{mem:.2f}'} | {ratio} |", flush=True)
    if "fsdp" in strategies:
        notes.append("fsdp runs on one device here (its hand row is the single-device loop): the cost of sharding's "
                     "machinery and its memory, not its scaling; on N GPUs run a script with "
                     "Trainer(strategy=\"fsdp\") under torchrun --nproc-per-node=N (docs/strategies.md, fsdp).")
    copy = copy_time(args, device)
    if copy is not None:
        notes.append(f"one batch's pinned host-to-device copy takes {copy * 1e3:.2f} ms: the most a one-batch "
                     "prefetch to the device on a side stream could save per step.")
    notes.append(f"total time of the benchmark: {time.perf_counter() - started:.0f} s.")
    print()
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
