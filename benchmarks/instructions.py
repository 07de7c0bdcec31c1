"""Instructions per epoch: the Trainer against the hand-written loop, counted by valgrind (immune to machine load).

    python benchmarks/instructions.py          # needs valgrind; ~10 minutes (valgrind runs ~50x slower)
    python benchmarks/instructions.py --variants hand taskfit   # two of them: ~4 minutes

Wall-clock differences of 1% drown in the noise of a shared machine; instruction counts do not. This runs the
tiny MLP of benchmarks/workloads.py under callgrind, counts the instructions of one epoch (the second: the first
warms up) of the hand-written loop and of the Trainer with its defaults switched on one at a time, and prints
each against the hand-written loop, for all threads and for the training thread alone (the per-step work;
background threads such as the checkpoint writer's run the previous save during the counted epoch). Instructions
are not time: they miss the disk (fsync) and cache misses, and Python-level work costs more per instruction than
compiled kernels, so wall-clock shares are larger.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

VARIANTS = ["hand", "taskfit, all off", "taskfit, + progress bar", "taskfit, + logger", "taskfit"]


def child() -> None:
    """Under callgrind: run every variant; count only its second epoch (callgrind_control toggles and dumps)."""
    import overhead as ob
    import torch
    import torch.nn.functional as F
    import workloads as wl
    from taskfit import Trainer
    from taskfit.callbacks import Callback

    torch.set_num_threads(1)
    spec = wl.WORKLOADS["tiny MLP"]
    data = wl.make_data(spec)

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(os.getpid())], capture_output=True, check=False)

    def measure(name: str, epoch: int) -> None:  # called at the start of every epoch
        if epoch == 1:
            control("--instr=on")
        elif epoch == 2:
            control("--instr=off")
            control(f"--dump={name}")

    model, optimizer, loader = wl.make_hand(spec, data)
    for epoch in range(3):
        measure("hand", epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    class Toggle(Callback):
        order = -10**6

        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_epoch_start(self, trainer: Trainer, task: object) -> None:
            measure(self.name, trainer.state.epoch)

    for name in [v for v in VARIANTS[1:] if v in sys.argv[2:]]:
        with tempfile.TemporaryDirectory() as root, ob.quiet_run():
            Trainer(max_epochs=3, accelerator="cpu", default_root_dir=root, callbacks=[Toggle(name)],
                    **ob.BREAKDOWN.get(name, {})).fit(wl.make_task(spec, data))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Instructions per epoch of the tiny MLP, under callgrind.")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS, metavar="NAME",
                        help=f"which to count (default: all of {VARIANTS}); the hand-written loop always runs")
    variants = ["hand"] + [v for v in parser.parse_args().variants if v != "hand"]
    if shutil.which("valgrind") is None:
        sys.exit("benchmarks/instructions.py needs valgrind (e.g. `apt-get install valgrind`).")
    with tempfile.TemporaryDirectory() as out:
        base = os.path.join(out, "callgrind.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                        f"--callgrind-out-file={base}",
                        sys.executable, os.path.abspath(__file__), "--child", *variants], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        counts: dict[str, int] = {}  # every thread: the training thread, the checkpoint writer, the loggers'...
        training: dict[str, int] = {}  # the training thread alone (thread 1: the per-step work)
        for path in glob.glob(base + ".*"):
            with open(path) as f:
                text = f.read()
            name = re.search(r"^desc: Trigger: dump (.*)$", text, re.M)
            total = re.search(r"^totals: (\d+)", text, re.M)
            thread = re.search(r"^thread: (\d+)", text, re.M)
            if name and total:
                key = name.group(1).strip()
                counts[key] = counts.get(key, 0) + int(total.group(1))
                if thread is None or thread.group(1) == "1":
                    training[key] = training.get(key, 0) + int(total.group(1))
    missing = [v for v in variants if v not in counts]
    if missing:
        sys.exit(f"no count for {missing}: is callgrind_control on the PATH?")
    print("| variant | instructions in one epoch of the tiny MLP | ratio to hand | training thread alone | ratio "
          "to hand |\n|---|---|---|---|---|")
    for name in variants:
        print(f"| {name} | {counts[name]:,} | {counts[name] / counts['hand']:.4f} | {training[name]:,} | "
              f"{training[name] / training['hand']:.4f} |")


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
