"""DataParallel: the digits CNN on every visible GPU with ``torch.nn.DataParallel``, in one process.

    python examples/dp.py            # all visible GPUs; on a machine without CUDA: a warning, then
    one device python examples/dp.py --quick    # a smoke run with small settings (what the test
    suite runs)

What it shows: multi-GPU is one argument (``strategy="dp"``, ``devices=[0, 1]`` to choose GPUs);
``batch_size`` is the batch of the whole step, which DataParallel splits over the GPUs; the
checkpoint holds the plain module's weights (no ``module.`` prefix), so it loads into a model that
was never wrapped. When you outgrow one process, ``examples/ddp_torchrun.py`` is the same job under
DistributedDataParallel (docs/strategies.md).
"""
from __future__ import annotations

import argparse
import os

from taskfit import Trainer, seed_everything

try:
    from taskfit.examples.digits import DigitsTask
# run as `python examples/dp.py` from a checkout: the examples folder is on sys.path
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
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--root", default=None, help="where runs go (default: ./taskfit_logs)")
    args = parser.parse_args(argv)

    seed_everything(0)
    trainer = Trainer(strategy="dp", max_epochs=args.max_epochs or (2 if args.quick else 10),
                      default_root_dir=args.root)
    trainer.fit(DigitsTask(batch_size=64))  # 64 per step in total: 32 per GPU on two GPUs
    accuracy = trainer.state.metrics["val/acc"]

    # The checkpoint has no DataParallel prefix: it loads into a plain, never-wrapped module.
    path = trainer.checkpoint_callback.last_model_path
    plain = DigitsTask.load_from_checkpoint(path)
    check = Trainer(
        strategy="single",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (reloaded,) = check.validate(plain)
    print(f"validation accuracy: {accuracy:.4f}, reloaded from {os.path.basename(path)} into a "
          f"plain module: {reloaded['val/acc']:.4f}  (run directory: {trainer.log_dir})")
    return reloaded


if __name__ == "__main__":
    main()
