"""TaskModules with their own steps, for tests/test_steps.py (under ddp spawn they are pickled by reference, so
they live in a module)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from taskfit.callbacks import Callback
from tasks import ClassifierTask, grouped


class StepClassifier(ClassifierTask):
    """ClassifierTask written as Lightning users write it: training_step and validation_step of its own."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self(inputs)  # through DDP: the whole step runs inside the wrapper's forward
        self.log(grouped(self, "acc_batch"), (logits.argmax(-1) == targets).float().mean())
        return {"loss": F.cross_entropy(logits, targets), "logits": logits}

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self(inputs)
        self.stage_metrics["acc"].update(logits, targets)
        self.log(grouped(self, "acc_batch"), (logits.argmax(-1) == targets).float().mean())
        return F.cross_entropy(logits, targets)

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return {"index": batch_idx, "classes": self(batch[0]).argmax(-1)}


class ManualClassifier(ClassifierTask):
    """Manual optimization with two optimizers: the first layer's SGD and the second layer's Adam, each with its
    scheduler, stepping in turn on their own losses (as a GAN's two players do)."""

    automatic_optimization = False

    def configure_optimizers(self):
        first = torch.optim.SGD(self.net[0].parameters(), lr=self.lr, momentum=0.9)
        second = torch.optim.Adam(self.net[2].parameters(), lr=0.01)
        return [first, second], [torch.optim.lr_scheduler.StepLR(first, 2, 0.8),
                                 torch.optim.lr_scheduler.StepLR(second, 3, 0.5)]

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        first, second = self.optimizers()
        loss = F.cross_entropy(self(inputs), targets)
        first.zero_grad()
        self.manual_backward(loss)
        first.step()
        hidden = self.net[1](self.net[0](inputs)).detach()  # the second player sees the first one's output
        second_loss = F.cross_entropy(self.net[2](hidden), targets)
        second.zero_grad()
        self.manual_backward(second_loss)
        self.clip_gradients(second, gradient_clip_val=0.5)
        second.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("train/second_loss", second_loss.detach())
        return loss


class OutputsProbe(Callback):
    """Keeps what on_train_batch_end received (the step's outputs) and the batch sizes."""

    def __init__(self) -> None:
        self.outputs, self.sizes = [], []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        self.outputs.append(outputs)
        self.sizes.append(len(batch[0]))


class DtypeProbe(ClassifierTask):
    """Records the dtype of the logits inside its own training_step (autocast must cover the step)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[torch.dtype] = []

    def training_step(self, batch, batch_idx):
        logits = self(batch[0])
        self.seen.append(logits.dtype)
        return F.cross_entropy(logits.float(), batch[1])
