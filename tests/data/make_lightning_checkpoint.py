"""Writes tests/data/lightning-2.6.6.ckpt with PyTorch Lightning itself (run where Lightning is installed:
``python tests/data/make_lightning_checkpoint.py``); tests/test_lightning_checkpoints.py loads it with taskfit.

The module is ``tests/test_lightning_checkpoints.py``'s ``Blob`` with Lightning's base class: the same attributes, the
same ``__init__`` arguments, recorded by ``save_hyperparameters()``.
"""
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Blob(L.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    out = Path(__file__).with_name("lightning-2.6.6.ckpt")
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir="/tmp/lightning-ckpt")
    trainer.fit(Blob(hidden=5, lr=0.05), DataLoader(data, batch_size=8))
    trainer.save_checkpoint(out)
    print(out, sorted(torch.load(out, weights_only=True)))
