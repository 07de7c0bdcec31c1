"""Tasks and callbacks of tests/test_fsdp.py. Spawned fsdp workers unpickle them by reference, so they live in an
importable module. Every model is tiny (a run is dominated by process start-up, not by compute)."""
from __future__ import annotations

import os
import signal

import torch
import torch.nn.functional as F
from taskfit import TaskModule
from taskfit.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def sequences(n: int, seed: int, length: int = 6, features: int = 8) -> TensorDataset:
    """Sequences whose class is the position of the largest mean feature (3 classes, learnable in a few steps)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, features, generator=g)
    return TensorDataset(x, x.mean(1)[:, :3].argmax(-1))


def blobs(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    return TensorDataset(torch.randn(n, 8, generator=g) + F.one_hot(y, 8).float() * 2.0, y)


class MLPTask(TaskModule):
    """An MLP classifier: 96 training samples, 45 validation samples (23 + 22 per rank), SGD with momentum."""

    def __init__(self, batch_size: int = 16, hidden: int = 32, lr: float = 0.1) -> None:
        super().__init__()
        self.batch_size, self.lr = batch_size, lr
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 3))
        self.data, self.val_data = blobs(96, 0), blobs(45, 1)

    def forward(self, inputs):
        return self.net(inputs)

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets)

    def configure_metrics(self):
        import torchmetrics

        return {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=3)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):  # 11: under 2 ranks, 23 samples are 3 batches on rank 0 and 22 are 2 on rank 1
        return DataLoader(self.val_data, batch_size=11)

    def predict_dataloader(self):
        return DataLoader(TensorDataset(self.val_data.tensors[0]), batch_size=self.batch_size)


class TransformerTask(MLPTask):
    """A 2-layer nn.TransformerEncoder over sequences of 6 steps (d_model 16): AdamW, no dropout."""

    def __init__(self, batch_size: int = 16, lr: float = 0.01) -> None:
        super().__init__(batch_size=batch_size, lr=lr)
        del self.net
        self.embed = nn.Linear(8, 16)
        layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)
        self.data, self.val_data = sequences(96, 0), sequences(45, 1)

    def forward(self, inputs):
        return self.head(self.encoder(self.embed(inputs)).mean(1))

    def configure_optimizers(self):
        # eps 1e-4: the attention's key bias has an exactly zero true gradient (softmax ignores a shift of every
        # score), so its gradient is rounding noise (~1e-9) that Adam's default eps (1e-8) would normalise into
        # full-size steps: 3e-4 apart between any two summation orders (single vs ddp too), not an fsdp effect.
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01, eps=1e-4)


class BatchNormTask(MLPTask):
    """An MLP with BatchNorm: under bf16-mixed its running statistics stay float32, so its weights must too."""

    def __init__(self, batch_size: int = 16) -> None:
        super().__init__(batch_size=batch_size)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))


class ManualTwoOptimizers(MLPTask):
    """Manual optimization with two optimizers (the body's SGD, the head's Adam), each stepping on its own loss;
    the step calls only ``self(...)``, as FSDP requires."""

    automatic_optimization = False

    def __init__(self, batch_size: int = 16) -> None:
        super().__init__(batch_size=batch_size)
        self.head = nn.Linear(3, 3)

    def forward(self, inputs):
        body = self.net(inputs)
        return body, self.head(body.detach())

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(self.head.parameters(), lr=0.01)]

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        body_opt, head_opt = self.optimizers()
        body, head = self(inputs)
        loss = F.cross_entropy(body, targets)
        body_opt.zero_grad()
        self.manual_backward(loss)
        body_opt.step()
        head_opt.zero_grad()
        self.manual_backward(F.cross_entropy(head, targets))
        self.clip_gradients(head_opt, gradient_clip_val=0.05)
        head_opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        body, _ = self(inputs)
        return F.cross_entropy(body, targets)

    def configure_metrics(self):  # its own validation_step logs the loss only
        return {}


class HeadOutsideForward(ManualTwoOptimizers):
    """Calls a submodule of the root's own unit directly, outside the task's forward: refused under fsdp."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return F.cross_entropy(self.head(self.net(inputs)), targets)


class ShardProbe(Callback):
    """At fit end, writes what this rank holds: the local (sharded) and global element counts of the parameters and
    of the optimizer states, the wrapped units, the module class and the number of evaluation forwards it ran, to
    ``<out>/shards_rank<r>.pt``."""

    def __init__(self, out: str) -> None:
        self.out, self.eval_forwards = out, 0

    def on_fit_start(self, trainer, task) -> None:
        def count(module, args, output):
            self.eval_forwards += not module.training

        task.register_forward_hook(count)

    def on_fit_end(self, trainer, task) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        def local(t):
            return t.to_local().numel() if isinstance(t, DTensor) else t.numel()

        params = list(task.parameters())
        # the policy the strategy applies for the run's precision (precision.py decides it)
        policy = trainer.strategy._mp_policy(trainer.precision_plugin)
        states = [v for o in trainer.optimizers for s in o.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        torch.save({"param_local": sum(map(local, params)), "param_global": sum(p.numel() for p in params),
                    "state_local": sum(map(local, states)), "state_global": sum(v.numel() for v in states),
                    "units": sorted(n or "<root>" for n, m in task.named_modules() if isinstance(m, FSDPModule)),
                    "class": type(task).__name__, "sharded": all(isinstance(p, DTensor) for p in params),
                    "eval_forwards": self.eval_forwards,
                    "gather_dtype": str(policy.param_dtype)},
                   os.path.join(self.out, f"shards_rank{trainer.strategy.rank}.pt"))


class KillAt(Callback):
    """SIGKILLs rank ``rank`` at the start of batch ``batch_idx`` of ``epoch`` (after the last checkpoint is in
    place): the out-of-memory killer, mid-epoch."""

    order = 2000

    def __init__(self, epoch: int, batch_idx: int, rank: int = 1) -> None:
        self.epoch, self.batch_idx, self.rank = epoch, batch_idx, rank

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        st = trainer.state
        if (st.epoch, batch_idx, trainer.strategy.rank) == (self.epoch, self.batch_idx, self.rank):
            trainer.checkpoint_writer.wait()
            os.kill(os.getpid(), signal.SIGKILL)
