"""Tasks of tests/test_model_memory.py (activation checkpointing, meta-device initialisation). Spawned fsdp workers
unpickle them by reference, so they live in an importable module. Tiny: process start-up dominates a run."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from taskfit import TaskModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    """A residual MLP block with dropout (its recomputation must draw the same masks); counts its forwards."""

    forwards = 0

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.forwards += 1
        return x + self.down(self.dropout(F.gelu(self.up(self.norm(x)))))


class BlocksTask(TaskModule):
    """An embedding, ``depth`` Blocks and a head over random tokens; AdamW. The data is made in ``__init__`` (it
    must stay real under ``init_module(empty_init=True)``)."""

    def __init__(self, depth: int = 3, width: int = 16, batch_size: int = 8, lr: float = 0.01) -> None:
        super().__init__()
        self.batch_size, self.lr = batch_size, lr
        self.embed = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(self.block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 32, (64, 5), generator=g)
        self.data = TensorDataset(tokens, tokens[:, 0] % 4)

    def block(self, width: int) -> nn.Module:
        return Block(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


class AttentionTask(BlocksTask):
    """Blocks of torch's own ``nn.TransformerEncoderLayer`` (MultiheadAttention, LayerNorm, Linear), each built
    on its own (``nn.TransformerEncoder`` would deep-copy one layer: see docs/strategies.md)."""

    def block(self, width: int) -> nn.Module:
        return nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width, dropout=0.1, batch_first=True)


class Scaled(nn.Module):
    """A layer with a parameter and no ``reset_parameters()``: it cannot be built empty."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class ScaledTask(BlocksTask):
    def __init__(self) -> None:
        super().__init__(depth=1, width=4)
        self.scaled = Scaled()


class ConfiguredTask(BlocksTask):
    """Lightning's ``configure_model``: the blocks are built when the run sets the task up, empty when asked to."""

    def __init__(self, empty: bool = False) -> None:
        super().__init__(depth=0)
        self.empty = empty

    def configure_model(self) -> None:
        if len(self.blocks):
            return
        with self.trainer.init_module(empty_init=self.empty):
            self.blocks.extend(Block(16) for _ in range(3))
