"""A user-written callback: sample predictions in TensorBoard, as images and as a text table.

    python examples/custom_callback.py            # digits, 3 epochs, then: tensorboard --logdir
    taskfit_logs python examples/custom_callback.py --quick    # 1 short epoch (what the test suite
    runs)

After every validation, ``PredictionSamples`` runs the model on the same few validation images and
writes

- ``samples/images``: the images, one grid per validation (IMAGES tab; the slider moves through the
  steps);
- ``samples/predictions``: a table of label, prediction and confidence, misses in bold (TEXT tab).

It shows what a callback uses: a hook (``on_validation_end``), ``trainer.state`` (the stage, the
global step), the TensorBoard writer (``summary_writer(trainer)``: None on ranks other than 0 and
with ``logger=False``), and how to keep off the hot path: the work happens once per validation, on
16 images, under ``torch.no_grad``.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from taskfit import Trainer, seed_everything
from taskfit.callbacks import Callback
from taskfit.callbacks.loggers.tensorboard import summary_writer
from taskfit.examples.digits import DigitsTask


class PredictionSamples(Callback):
    """After each validation: the first ``count`` validation images with their predictions, to
    TensorBoard."""

    def __init__(self, count: int = 16, zoom: int = 4) -> None:
        self.count, self.zoom = count, zoom

    def on_validation_end(self, trainer: Trainer, task: DigitsTask) -> None:
        writer = summary_writer(trainer)
        if writer is None:  # another ddp rank, or Trainer(logger=False)
            return
        # a TensorDataset slice: (images, labels)
        images, labels = task.val_dataloader().dataset[: self.count]
        was_training = task.training
        task.eval()
        with torch.no_grad():
            probs = task(trainer.strategy.batch_to_device(images)).softmax(-1).cpu()
        task.train(was_training)
        confidence, predicted = probs.max(-1)
        step = trainer.state.global_step  # the x-axis every taskfit tag uses
        writer.add_images("samples/images", F.interpolate(images, scale_factor=self.zoom), step)
        rows = ["| # | label | prediction | confidence |", "|---|---|---|---|"]
        for i, (y, p, c) in enumerate(
            zip(labels.tolist(), predicted.tolist(), confidence.tolist())
        ):
            mark = "" if y == p else "**"
            rows.append(f"| {i} | {y} | {mark}{p}{mark} | {c:.2f} |")
        writer.add_text("samples/predictions", "\n".join(rows), step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short epoch (a smoke run)")
    parser.add_argument("--root", default=None, help="where runs go (default ./taskfit_logs)")
    args = parser.parse_args()
    quick = args.quick or os.environ.get("TASKFIT_QUICK") == "1"
    seed_everything(0)
    trainer = Trainer(max_epochs=1 if quick else 3, limit_train_batches=8 if quick else 1.0,
                      val_check_interval=4 if quick else 1.0, callbacks=[PredictionSamples()],
                      default_root_dir=args.root)
    trainer.fit(DigitsTask(channels=8 if quick else 32))
    print(f"validation accuracy: {trainer.state.metrics['val/acc']:.4f}  (run directory: "
          f"{trainer.log_dir})")
    print(f"see the samples: tensorboard --logdir {os.path.dirname(trainer.log_dir)}  (IMAGES and "
          "TEXT tabs)")


if __name__ == "__main__":
    main()
