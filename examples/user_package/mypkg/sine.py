"""SineTask: an MLP regressing y = sin(3x) from noisy samples. Synthetic data, no download, seconds
on a CPU."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from taskfit import TaskModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def sine_data(n: int, noise: float, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * 4 - 2
    return TensorDataset(x, torch.sin(3 * x).squeeze(1) + noise * torch.randn(n, generator=g))


class SineTask(TaskModule):
    """``layers`` hidden layers of ``hidden`` units; MSE loss, mean absolute error as the metric.

    ``optimizer``/``scheduler`` are factories, as Hydra builds them with ``_partial_: true``.
    """

    def __init__(self, hidden: int = 64, layers: int = 2, n_train: int = 2048, noise: float = 0.05,
                 batch_size: int = 64, optimizer=None, scheduler=None) -> None:
        super().__init__(
            optimizer=optimizer or functools.partial(torch.optim.Adam, lr=1e-2), scheduler=scheduler
        )
        self.batch_size = batch_size
        sizes = [1] + [hidden] * layers
        blocks = [m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.Tanh())]
        self.net = nn.Sequential(*blocks, nn.Linear(sizes[-1], 1))
        self.train_set = sine_data(n_train, noise, seed=0)
        self.val_set, self.test_set = sine_data(512, noise, seed=1), sine_data(512, noise, seed=2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs).squeeze(1)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def configure_metrics(self):
        import torchmetrics

        return {"mae": torchmetrics.MeanAbsoluteError()}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256)
