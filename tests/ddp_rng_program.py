"""One seeded Lightning program trained with 2 CPU processes (gloo), run by Lightning 2.6.6
(``strategy="ddp"``) or, renamed as docs/migrating-lightning.md says, by taskfit: what it ends with
must be the same (issue 45 under ddp).

    python tests/ddp_rng_program.py lightning shuffled ROOT   # prints the JSON of what it observed
    python tests/ddp_rng_program.py taskfit unshuffled ROOT
    python tests/ddp_rng_program.py record tests/data/lightning_ddp.json  # Lightning's

A small MLP with dropout (each rank's global RNG moves its masks), a training loader of 21 samples
in batches of 4 (11 per rank after DistributedSampler's padding: batches of 4, 4, 3) whose dataset
adds noise from the global RNG in ``__getitem__`` and returns each sample's index, a validation
loader of 16, 2 epochs with the sanity check. Observed: rank 0's weights and ``torch.rand(1)`` after
``fit`` in the launching script, ``callback_metrics``, and from each rank the sample indices of
each epoch and a draw from a copy of its global RNG at ``on_fit_end``. benchmarks/
lightning_ddp_parity.py prints both side by side; tests/test_lightning_rng.py checks taskfit's
against Lightning's values recorded in tests/data/lightning_ddp.json.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from taskfit import TaskModule

# name -> shuffle of the training DataLoader
SETTINGS = {"shuffled": True, "unshuffled": False}


class Noisy(Dataset):
    """Fixed inputs and labels; ``__getitem__`` adds noise from the global torch RNG and returns the
    sample's index."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i], i


class Body:
    """The program's module, a mixin before LightningModule or TaskModule (the same code in
    both)."""

    def __init__(self, shuffle: bool = True, root: str = "") -> None:
        super().__init__()
        self.shuffle, self.root = shuffle, root
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, i = batch
        self.seen[-1].extend(i.tolist())
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Noisy(21), batch_size=4, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Noisy(16), batch_size=4)

    def on_fit_end(self) -> None:
        # a draw from a copy of this rank's global RNG (the run's own stays as it is)
        copy = torch.Generator().set_state(torch.get_rng_state())
        rank = {"seen": self.seen, "rand": torch.rand(1, generator=copy).item()}
        path = os.path.join(self.root, f"rank{self.global_rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rank, f)
        os.replace(path + ".tmp", path)


class TaskfitNet(Body, TaskModule):
    """taskfit's module (at the top level: its ddp workers unpickle it by reference)."""


def module_class(name: str) -> type:
    """The program's module class for ``"lightning"`` or ``"taskfit"``."""
    if name == "taskfit":
        return TaskfitNet
    pl = importlib.import_module("lightning.pytorch")
    return type("LightningNet", (Body, pl.LightningModule), {})


def run(name: str, setting: str, root: str) -> dict[str, Any] | None:
    """What the program observes under framework ``name`` (None on Lightning's other ranks)."""
    pl = importlib.import_module("lightning.pytorch" if name == "lightning" else "taskfit")
    pl.seed_everything(7)
    model = module_class(name)(shuffle=SETTINGS[setting], root=root)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    trainer.fit(model)
    # Lightning's "ddp" runs this script again for rank 1: only rank 0 (the launcher) reports
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    out: dict[str, Any] = {"rand_after_fit": torch.rand(1).item()}
    out["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    out["callback_metrics"] = {k: float(v) for k, v in sorted(trainer.callback_metrics.items())}
    for rank in (0, 1):
        out[f"rank{rank}"] = read_when_written(os.path.join(root, f"rank{rank}.json"))
    return out


def read_when_written(path: str) -> Any:
    """The JSON a rank writes at ``on_fit_end`` (Lightning's rank 0 may return from fit first)."""
    for _ in range(600):
        try:
            with open(path) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.1)
    raise TimeoutError(f"{path} was never written")


def run_in_subprocess(name: str, setting: str) -> dict[str, Any]:
    """:func:`run` in a fresh ``python`` (Lightning's ddp launcher runs the script again)."""
    with tempfile.TemporaryDirectory() as root:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "PL_GLOBAL_SEED", "TASKFIT_SEED"):
            env.pop(key, None)
        result = subprocess.run([sys.executable, os.path.abspath(__file__), name, setting, root],
                                env=env, capture_output=True, text=True, check=False)
        if result.returncode:
            raise RuntimeError(f"{name} {setting} failed:\n{result.stderr[-4000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])


def record(path: str) -> None:
    """Write Lightning's values of every setting to ``path`` (tests/data/lightning_ddp.json)."""
    values = {setting: run_in_subprocess("lightning", setting) for setting in SETTINGS}
    with open(path, "w") as f:
        versions = {"lightning": importlib.import_module("lightning").__version__,
                    "torch": torch.__version__}
        json.dump({**versions, **values}, f, indent=0)


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2])
        sys.exit()
    # imported by name, so that taskfit's workers find TaskfitNet where the test finds it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    observed = importlib.import_module("ddp_rng_program").run(sys.argv[1], sys.argv[2], sys.argv[3])
    if observed is not None:
        print(json.dumps(observed))
