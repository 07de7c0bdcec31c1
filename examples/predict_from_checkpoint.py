"""Inference from a checkpoint: rebuild the trained task from its file and predict, two ways.

    python examples/predict_from_checkpoint.py                      # trains the digits CNN briefly
    first (~10 s) python examples/predict_from_checkpoint.py --ckpt path/to.ckpt  # or use a
    checkpoint you have

1. ``DigitsTask.load_from_checkpoint(path)`` builds the task with the hyperparameters the checkpoint
   recorded (channels, hidden size...: no need to repeat them) and loads the weights, in eval mode.
   Use it like any ``nn.Module``.
2. ``trainer.predict(task, ckpt_path=path)`` loads the weights into a task and runs its
   ``predict_dataloader`` batch by batch (on the Trainer's device and precision, under any
   strategy).

Both read the file with ``torch.load(weights_only=True)`` only: a checkpoint cannot run code
(docs/checkpointing.md).
"""
from __future__ import annotations

import argparse
import os

import torch
from taskfit import Trainer, seed_everything
from taskfit.examples.digits import DigitsTask
from torch.utils.data import DataLoader


class DigitsPredictor(DigitsTask):
    """The digits task plus the data to predict on: the validation images, without their labels."""

    def predict_dataloader(self) -> DataLoader:
        images, _ = self.val_set.tensors
        return DataLoader(images, batch_size=128)


def train(root: str) -> str:
    """A short training run; returns the path of its best checkpoint (ranked by validation
    accuracy)."""
    from taskfit.callbacks import ModelCheckpoint

    seed_everything(0)
    checkpoint = ModelCheckpoint(monitor="val/acc", mode="max", filename="{epoch}-{val/acc:.3f}")
    trainer = Trainer(
        max_epochs=3,
        default_root_dir=root,
        callbacks=[checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(DigitsPredictor(channels=16, hidden=64))
    print(f"trained: best val/acc {checkpoint.best_model_score:.4f} in "
          f"{checkpoint.best_model_path} (run directory: {trainer.log_dir})")
    return checkpoint.best_model_path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", help="a checkpoint of DigitsTask (default: train one first)")
    parser.add_argument(
        "--root", default="taskfit_logs", help="where the short training run writes"
    )
    args = parser.parse_args()
    path = args.ckpt or train(args.root)

    # 1. The module itself: built from the recorded hyperparameters, weights loaded, eval mode.
    task = DigitsPredictor.load_from_checkpoint(path)
    sizes = {k: task.hparams[k] for k in ("channels", "hidden")}
    print(f"loaded {os.path.basename(path)}: {type(task).__name__}(channels={sizes['channels']}, "
          f"hidden={sizes['hidden']}), training={task.training}")
    images, targets = task.val_set.tensors
    with torch.no_grad():
        direct = task(images).argmax(-1)
    print(f"direct forward:  accuracy {(direct == targets).float().mean():.4f} on {len(targets)} "
          "images")

    # 2. The Trainer: loads the weights into a fresh task and predicts batch by batch.
    trainer = Trainer(enable_progress_bar=False, enable_model_summary=False, logger=False)
    batches = trainer.predict(DigitsPredictor(**sizes), ckpt_path=path)
    predicted = torch.cat(batches).argmax(-1)
    print(f"trainer.predict: accuracy {(predicted == targets).float().mean():.4f} ({len(batches)} "
          f"batches; same predictions as the direct forward: {torch.equal(predicted, direct)})")


if __name__ == "__main__":
    main()
