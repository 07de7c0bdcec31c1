"""BatchNormDigits: taskfit's digits CNN with BatchNorm after each convolution.

It takes the same arguments as taskfit.examples.digits.DigitsTask, so the built-in digits config
trains it as is:

    taskfit task=digits task._target_=mypkg.digits.BatchNormDigits
"""
from __future__ import annotations

from taskfit.examples.digits import DigitsTask
from torch import nn


class BatchNormDigits(DigitsTask):
    def __init__(
        self,
        channels: int = 32,
        hidden: int = 128,
        dropout: float = 0.1,
        batch_size: int = 64,
        lr: float = 3e-3,
        optimizer=None,
        scheduler=None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            channels=channels,
            hidden=hidden,
            dropout=dropout,
            batch_size=batch_size,
            lr=lr,
            optimizer=optimizer,
            scheduler=scheduler,
            num_workers=num_workers,
        )
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
