"""One seeded Lightning program, run by Lightning 2.6.6 or, renamed as docs/migrating-lightning.md
says, by taskfit: what it ends with (the weights, ``torch.rand(1)`` after ``fit``, ``validate`` and
``test``) must be the same.

    python tests/rng_program.py lightning shuffled-workers   # prints the JSON of what it observed
    python tests/rng_program.py taskfit stream               # SETTINGS names the others
    python tests/rng_program.py record tests/data/lightning_rng.json  # Lightning's, every setting

A small MLP with dropout (so every draw from the global RNG moves the masks), a training loader that
is shuffled or not, with 2 workers or none, whose dataset adds noise in ``__getitem__`` (drawn in
the workers when there are some), a validation loader, 3 epochs with a sanity check, then
``validate`` and ``test``. Lightning's values for each setting are recorded in
tests/data/lightning_rng.json (tests/test_lightning_rng.py).
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
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

# name -> (shuffle, num_workers, seed_everything(workers=), data drawn in *_dataloader(),
#          persistent workers)
SETTINGS = {
    "shuffled": (True, 0, False, False, False),
    "shuffled-workers": (True, 2, False, False, False),
    "unshuffled": (False, 0, False, False, False),
    "unshuffled-workers": (False, 2, False, False, False),
    "seeded-workers": (True, 2, True, False, False),
    "persistent-workers": (True, 2, False, False, True),
    "data-in-loaders": (True, 0, False, True, False),
}


class Noisy(Dataset):
    """Fixed inputs and labels; ``__getitem__`` adds noise from the global torch RNG (a worker's,
    with workers)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


class Stream(IterableDataset):
    """An IterableDataset that records, as its side effect, how many samples were drawn so far."""

    def __init__(self, n: int) -> None:
        self.n, self.drawn = n, 0

    def __iter__(self):
        g = torch.Generator().manual_seed(2)
        for _ in range(self.n):
            self.drawn += 1
            yield torch.randn(8, generator=g), torch.randint(0, 3, (), generator=g)


def framework(name: str) -> tuple[Any, Any, Any]:
    """``(Trainer, LightningModule, seed_everything)`` of ``"lightning"`` or ``"taskfit"`` (the
    guide's rename)."""
    if name == "lightning":
        pl = importlib.import_module("lightning.pytorch")
        return pl.Trainer, pl.LightningModule, pl.seed_everything
    tf = importlib.import_module("taskfit")
    return tf.Trainer, tf.TaskModule, tf.seed_everything


def make_module(base: type, setting: str) -> Any:
    shuffle, workers, _, in_loaders, persistent = SETTINGS[setting]

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

        def loader(self, **kwargs: Any) -> DataLoader:
            # as Lightning's BoringModel: data drawn from the global RNG when asked for a loader
            data = self.data
            if in_loaders:
                data = TensorDataset(torch.randn(40, 8), torch.randint(0, 3, (40,)))
            return DataLoader(data, **kwargs)

        def train_dataloader(self) -> DataLoader:
            return self.loader(batch_size=8, shuffle=shuffle, num_workers=workers,
                               persistent_workers=persistent)

        def val_dataloader(self) -> DataLoader:
            return self.loader(batch_size=16)

        def test_dataloader(self) -> DataLoader:
            return self.loader(batch_size=16)

    return Net()


def run(name: str, setting: str, root: str) -> dict[str, Any]:
    """What the program observes under framework ``name``: the final weights and the RNG after
    each entry point."""
    Trainer, LightningModule, seed_everything = framework(name)
    seed_everything(7, workers=SETTINGS[setting][2])
    model = make_module(LightningModule, setting)
    trainer = Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root)
    out: dict[str, Any] = {}
    trainer.fit(model)
    out["rand_after_fit"] = torch.rand(1).item()
    trainer.validate(model, verbose=False)
    out["rand_after_validate"] = torch.rand(1).item()
    trainer.test(model, verbose=False)
    out["rand_after_test"] = torch.rand(1).item()
    out["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    return out


def stream(name: str, root: str) -> dict[str, Any]:
    """An RL template's shape: training on an IterableDataset (no length) whose iteration has a
    side effect; what each training step sees of it (samples drawn so far,
    ``trainer.is_last_batch``) and the epoch's logged mean."""
    Trainer, LightningModule, seed_everything = framework(name)
    seed_everything(7)
    seen: list[list[Any]] = []

    class Agent(LightningModule):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net, self.data = nn.Linear(8, 3), Stream(20)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append([self.data.drawn, self.trainer.is_last_batch])
            self.log("drawn", float(self.data.drawn), on_step=False, on_epoch=True)
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=4)

    trainer = Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root)
    trainer.fit(Agent())
    return {"seen": seen, "drawn_epoch_mean": float(trainer.callback_metrics["drawn"])}


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def record(path: str) -> None:
    """Write Lightning's values of every setting to ``path`` (tests/data/lightning_rng.json)."""
    with tempfile.TemporaryDirectory() as tmp:
        values = {setting: run("lightning", setting, tmp) for setting in SETTINGS}
        values["stream"] = stream("lightning", tmp)
    with open(path, "w") as f:
        versions = {"lightning": importlib.import_module("lightning").__version__,
                    "torch": torch.__version__}
        json.dump({**versions, **values}, f, indent=0)


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2])
        sys.exit()
    with tempfile.TemporaryDirectory() as tmp:
        if sys.argv[2] == "stream":
            print(json.dumps(stream(sys.argv[1], tmp)))
        else:
            print(json.dumps(run(sys.argv[1], sys.argv[2], tmp)))
