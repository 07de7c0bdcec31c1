"""Small TaskModules shared by the tests (fast on one CPU thread)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from taskfit import DataModule, TaskModule
from taskfit.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def regression_data(n: int = 64, features: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.arange(1, features + 1, dtype=torch.float32)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, generator=g))


def classification_data(n: int = 96, features: int = 8, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, features, generator=g) + F.one_hot(y, features).float() * 2.0
    return TensorDataset(x, y)


class RegressionTask(TaskModule):
    """A linear model with MSE; ``dropout`` and ``shuffle`` exercise RNG and data order."""

    def __init__(self, features: int = 4, n: int = 64, batch_size: int = 8, lr: float = 0.05,
                 shuffle: bool = False, dropout: float = 0.0, num_workers: int = 0, val_n: int = 0) -> None:
        super().__init__()
        self.batch_size, self.lr, self.shuffle, self.num_workers = batch_size, lr, shuffle, num_workers
        self.net = nn.Sequential(nn.Dropout(dropout), nn.Linear(features, 1))
        self.data = regression_data(n, features)
        self.val_data = regression_data(val_n, features, seed=1) if val_n else None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs).squeeze(-1)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=self.shuffle, num_workers=self.num_workers)

    def val_dataloader(self):
        return None if self.val_data is None else DataLoader(self.val_data, batch_size=self.batch_size)


def grouped(task, name: str) -> str:
    """``<stage>/<name>`` (train/, val/, test/): taskfit's tests group their keys as its examples do (self.log
    publishes a name as given)."""
    stage = task.trainer.state.stage
    return f"{'val' if stage == 'sanity' else stage}/{name}"


class ClassifierTask(TaskModule):
    """An MLP classifier with a torchmetrics accuracy and a logged value."""

    def __init__(self, n: int = 96, val_n: int = 45, batch_size: int = 16, lr: float = 0.1, hidden: int = 16) -> None:
        super().__init__()
        self.batch_size, self.lr = batch_size, lr
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        self.data, self.val_data = classification_data(n), classification_data(val_n, seed=1)

    def forward(self, inputs):
        return self.net(inputs)

    def loss(self, outputs, targets):
        self.log(grouped(self, "acc_batch"), (outputs.argmax(-1) == targets).float().mean(),
                 on_epoch=self.epoch_acc or None)
        return F.cross_entropy(outputs, targets)

    epoch_acc = False  # EpochAccClassifierTask: also the epoch's mean in training (train/acc_batch_step, _epoch)

    def configure_metrics(self):
        import torchmetrics

        return {"acc": torchmetrics.Accuracy(task="multiclass", num_classes=3)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_data, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.val_data, batch_size=self.batch_size)


def one_process_of_ddp(cls: type) -> type:
    """``cls`` training in one process on the order a ddp run sees (``DistributedSampler``'s
    ``randperm(n, seed + epoch)``, whole): the reference of the tests that compare 1 process x batch
    16 with 2 ranks x batch 8. (One process otherwise draws its order as Lightning's
    ``RandomSampler``; ddp's is Lightning's DistributedSampler's.)"""

    def train_dataloader(self):
        loader = super(subclass, self).train_dataloader()
        seed = int(os.environ.get("TASKFIT_SEED", 0))
        sampler = DistributedSampler(loader.dataset, num_replicas=1, rank=0, seed=seed)
        return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)

    body = {"train_dataloader": train_dataloader, "__module__": cls.__module__}
    subclass = type(cls.__name__, (cls,), body)
    return subclass


# ---- for tests/test_ddp.py: under ddp spawn these are pickled by reference, so they live in a module ----------
class RaiseAtStep(Callback):
    """Raise ``ValueError`` on rank ``rank`` when global step ``step`` starts (the other ranks carry on)."""

    def __init__(self, step: int = 3, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        if trainer.strategy.rank == self.rank and trainer.state.global_step == self.step:
            raise ValueError(f"boom at step {self.step} on rank {self.rank}")


class RankProbe(Callback):
    """Counts DDP's gradient all-reduces and writes what each rank saw to ``<out>/rank<r>.pt`` at fit end."""

    def __init__(self, out: str) -> None:
        self.out, self.allreduces = out, 0

    def on_fit_start(self, trainer, task) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(state, bucket):
            self.allreduces += 1
            return allreduce_hook(state, bucket)

        if isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel):
            trainer.model.register_comm_hook(None, counting_hook)

    def on_fit_end(self, trainer, task) -> None:
        s = trainer.strategy
        torch.save({"rank": s.rank, "world_size": s.world_size, "is_main": trainer.is_main, "log_dir": trainer.log_dir,
                    "data_seed": trainer.data_seed, "allreduces": self.allreduces,
                    "global_step": trainer.state.global_step, "saved": s.module_state_dict(trainer.model),
                    "wrapper": trainer.model.state_dict()}, f"{self.out}/rank{s.rank}.pt")


class KillAt(Callback):
    """SIGKILL this process when global step ``step`` ends (nothing can close files, runs or threads). ``settled``:
    first wait until the background checkpoint writes already started are on disk (a test of what a resume does
    with them, not of a kill during a write: on a busy machine the write of the step before could still run)."""

    def __init__(self, step: int, settled: bool = False) -> None:
        self.step, self.settled = step, settled

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.state.global_step == self.step:
            import os
            import signal

            if self.settled:
                trainer.checkpoint_writer.wait()

            os.kill(os.getpid(), signal.SIGKILL)


class SignalAt(Callback):
    """Rank 0 sends ``signum`` to process ``pid`` when global step ``step`` ends (a scheduler's preemption)."""

    def __init__(self, step: int, pid: int, signum: int) -> None:
        self.step, self.pid, self.signum, self.sent = step, pid, signum, False

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.is_main and not self.sent and trainer.state.global_step == self.step:
            import os

            self.sent = True
            os.kill(self.pid, self.signum)


class RecordPeriod(Callback):
    """Rank 0 writes the ddp flag-exchange period it uses at global step ``step`` to ``<out>/period``."""

    def __init__(self, out: str, step: int) -> None:
        self.out, self.step = out, step

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if trainer.is_main and trainer.state.global_step == self.step:
            with open(f"{self.out}/period", "w") as fh:
                fh.write(str(trainer.preemption.period))


class SlowSteps(Callback):
    """Every training step takes ``seconds`` more (a big model's step), on every rank."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        import time

        time.sleep(self.seconds)


# ---- for the checkpoint and resume tests: checkpoints on, everything else that prints or logs off ----------
CHECKPOINTING = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)


def checkpointing_trainer(root, **kwargs):
    from taskfit import Trainer

    return Trainer(default_root_dir=str(root), seed=0, **{**CHECKPOINTING, **kwargs})


def seeded_task(cls=RegressionTask, **kwargs):
    torch.manual_seed(0)
    return cls(**kwargs)


def same_state(a, b) -> bool:
    """Nested state (tensors, dicts, lists) equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


class EpochAccClassifierTask(ClassifierTask):
    """ClassifierTask whose acc_batch is also averaged per training epoch (self.log(..., on_epoch=True))."""

    epoch_acc = True


class RankLogs(RegressionTask):
    """Logs ``rank * 10 + batch_idx`` with each reduction, and a torchmetrics mean of it (test_lightning_api)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(n=16, batch_size=4, val_n=8, **kwargs)  # 2 ranks: 2 training batches each per epoch
        import torchmetrics

        self.mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        v = torch.tensor(float(self.global_rank * 10 + batch_idx))
        for fx in ("mean", "sum", "max", "min"):
            self.log(f"train/{fx}", v, on_step=False, on_epoch=True, reduce_fx=fx)
        self.log("train/mine", v, on_step=False, on_epoch=True, rank_zero_only=True)
        self.mean.update(v)
        self.log("train/metric", self.mean, on_step=False, on_epoch=True)
        return self.loss(self(batch[0]), batch[1])


class MetricsProbe(Callback):
    """Writes each rank's ``state.metrics`` at fit end to ``<out>/metrics<r>.pt``."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer, task) -> None:
        torch.save(dict(trainer.state.metrics), f"{self.out}/metrics{trainer.strategy.rank}.pt")


class Line(TaskModule):
    """y = w * x with w starting at 0; the loss is the mean squared error to y = x (x = 0..n-1 in batches of
    ``batch_size`` for training, 100..103 in batches of 2 for validation): test_lightning_semantics/_api."""

    def __init__(self, n: int = 18, batch_size: int = 2, lr: float = 1e-4, scheduler: dict | None = None) -> None:
        super().__init__()
        self.n, self.batch_size, self.lr, self.scheduler_args = n, batch_size, lr, scheduler
        self.net = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(self.net.weight)

    def forward(self, x):
        return self.net(x)

    def loss(self, outputs, targets):
        return ((outputs - targets) ** 2).mean()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.scheduler_args is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, **self.scheduler_args}}

    def _data(self, start: int, n: int) -> TensorDataset:
        x = torch.arange(start, start + n, dtype=torch.float32).unsqueeze(1)
        return TensorDataset(x, x)

    def train_dataloader(self):
        return DataLoader(self._data(0, self.n), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self._data(100, 4), batch_size=2)


class RecordingData(DataModule):
    """RankLogs' data as a DataModule that leaves a file ``call-<hook>[-<stage>]-<rank>`` per hook call."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def _mark(self, *what: str) -> None:
        open(f"{self.out}/call-{'-'.join(what)}-{self.trainer.global_rank}", "w").close()

    def prepare_data(self):
        self._mark("prepare_data")

    def setup(self, stage):
        self._mark("setup", stage)

    def teardown(self, stage):
        self._mark("teardown", stage)

    def train_dataloader(self):
        return DataLoader(regression_data(16, 4), batch_size=4)
