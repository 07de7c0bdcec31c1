"""One seeded Lightning program, run by Lightning 2.6.6 or, renamed as docs/migrating-lightning.md says, by taskfit:
what it ends with (the weights, ``torch.rand(1)`` after ``fit``, ``validate`` and ``test``) must be the same.

    python tests/rng_program.py lightning shuffle workers   # prints the JSON of what it observed
    python tests/rng_program.py taskfit noshuffle noworkers

A small MLP with dropout (so every draw from the global RNG moves the masks), a training loader that is shuffled or
not, with 2 workers or none, whose dataset adds noise in ``__getitem__`` (drawn in the workers when there are some),
a validation loader, 3 epochs with a sanity check, then ``validate`` and ``test``. Lightning's values for each
setting are recorded in tests/data/lightning_rng.json (tests/test_lightning_rng.py).
"""
from __future__ import annotations

import importlib
import json
import sys
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

SETTINGS = [(shuffle, workers) for shuffle in (True, False) for workers in (0, 2)]


class Noisy(Dataset):
    """Fixed inputs and labels; ``__getitem__`` adds noise from the global torch RNG (a worker's, with workers)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


class Stream(IterableDataset):
    """An IterableDataset that records, as its side effect, how many samples were drawn from it so far."""

    def __init__(self, n: int) -> None:
        self.n, self.drawn = n, 0

    def __iter__(self):
        g = torch.Generator().manual_seed(2)
        for _ in range(self.n):
            self.drawn += 1
            yield torch.randn(8, generator=g), torch.randint(0, 3, (), generator=g)


def framework(name: str) -> tuple[Any, Any, Any]:
    """``(Trainer, LightningModule, seed_everything)`` of ``"lightning"`` or ``"taskfit"`` (the guide's rename)."""
    if name == "lightning":
        pl = importlib.import_module("lightning.pytorch")
        return pl.Trainer, pl.LightningModule, pl.seed_everything
    tf = importlib.import_module("taskfit")
    return tf.Trainer, tf.TaskModule, tf.seed_everything


def make_module(base: type, shuffle: bool, workers: int) -> Any:
    class Net(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
            self.data = Noisy(40)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("test_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=8, shuffle=shuffle, num_workers=workers)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=16)

        def test_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=16)

    return Net()


def run(name: str, shuffle: bool, workers: int, root: str) -> dict[str, Any]:
    """What the program observes under framework ``name``: the final weights and the RNG after each entry point."""
    Trainer, LightningModule, seed_everything = framework(name)
    seed_everything(7)
    model = make_module(LightningModule, shuffle, workers)
    trainer = Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    out: dict[str, Any] = {}
    trainer.fit(model)
    out["rand_after_fit"] = torch.rand(1).item()
    trainer.validate(model, verbose=False)
    out["rand_after_validate"] = torch.rand(1).item()
    trainer.test(model, verbose=False)
    out["rand_after_test"] = torch.rand(1).item()
    out["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    return out


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


if __name__ == "__main__":
    name, shuffle, workers = sys.argv[1], sys.argv[2] == "shuffle", 2 if sys.argv[3] == "workers" else 0
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(name, shuffle, workers, tmp)))
