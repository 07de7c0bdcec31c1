"""DistributedDataParallel: the digits CNN in 2 processes, started by torchrun or by the Trainer
itself.

    torchrun --nproc-per-node=2 examples/ddp_torchrun.py     # torchrun starts 2 processes (gloo on
    a CPU) python examples/ddp_torchrun.py                          # the Trainer spawns the 2
    processes itself python examples/ddp_torchrun.py --quick                  # a smoke run (what
    the test suite runs)

    # several machines: the same command on every node, node 0's address as rendezvous endpoint
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=node0:29500
    examples/ddp_torchrun.py

What changes against ``examples/digits.py``: ``strategy="ddp"``, and the batch size, which is per
process: each of the N processes trains on its own shard of every epoch, so 64 // N per process
keeps the effective batch of the single-process job (64) and its number of steps. The seed, the data
order and the validation metrics are the same on every rank; only rank 0 prints, draws the progress
bar and writes logs and checkpoints.
"""
from __future__ import annotations

import argparse
import os

from taskfit import Trainer, seed_everything

try:
    from taskfit.examples.digits import DigitsTask
# run as `python examples/ddp_torchrun.py` from a checkout: examples/ is on sys.path
except ImportError:
    from digits import DigitsTask


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        default=bool(os.environ.get("TASKFIT_QUICK")),
        help="small settings for a smoke run (also: TASKFIT_QUICK=1)",
    )
    parser.add_argument("--devices", type=int, default=2, help="processes to spawn without "
                                                               "torchrun (default 2)")
    parser.add_argument("--accelerator", default="auto", help='"cpu" (gloo), "cuda" (nccl, one GPU '
                                                              'per process)')
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--root", default=None, help="where runs go (default: ./taskfit_logs)")
    args = parser.parse_args(argv)

    # every rank: the same initial weights (DDP also broadcasts rank 0's) and the same data order
    seed_everything(0)
    trainer = Trainer(
        strategy="ddp",
        accelerator=args.accelerator,
        devices=args.devices,
        max_epochs=args.max_epochs or (2 if args.quick else 10),
        default_root_dir=args.root,
    )
    # torchrun's WORLD_SIZE, or --devices when the Trainer spawns
    world_size = trainer.strategy.world_size
    metrics = trainer.fit(DigitsTask(batch_size=64 // world_size))
    if trainer.is_main:  # under torchrun every rank runs this script to the end
        print(f"validation accuracy: {metrics['val/acc']:.4f} with {world_size} processes of batch "
              f"{64 // world_size}  (run directory: {trainer.log_dir})")
    return metrics


if __name__ == "__main__":
    main()
