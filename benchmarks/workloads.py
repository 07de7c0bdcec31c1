"""The benchmarks' shared workloads: the same model, data, optimizer and loader for every variant, the
hand-written loop's module and the equivalent TaskModule (used by overhead.py, interleaved.py, instructions.py)."""
from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

SEED = 0


# ---- the same model, data and optimizer for every variant --------------------------------
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


WORKLOADS: dict[str, dict[str, Any]] = {
    # 16,384 samples / 32 = 512 steps per epoch: the framework's per-step cost is what is measured
    "tiny MLP": dict(net=mlp, shape=(64,), samples=16384, batch_size=32, lr=0.05, epochs=6),
    # 2,048 samples / 64 = 32 steps per epoch of real compute
    "small CNN": dict(net=cnn, shape=(3, 32, 32), samples=2048, batch_size=64, lr=0.02, epochs=4),
}


def make_data(spec: dict[str, Any]) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(spec["samples"], *spec["shape"], generator=g),
                         torch.randint(0, 10, (spec["samples"],), generator=g))


def make_net(spec: dict[str, Any]) -> nn.Module:
    torch.manual_seed(SEED)  # identical initial weights in every variant
    return spec["net"]()


def make_optimizer(params: Any, spec: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=spec["lr"], momentum=0.9)


def make_loader(data: TensorDataset, spec: dict[str, Any]) -> DataLoader:
    """The task's loader: ``shuffle`` off unless the spec says so (separate-process runs with ``--shuffle``)."""
    return DataLoader(data, batch_size=spec["batch_size"], shuffle=spec.get("shuffle", False))


def make_hand_loader(data: TensorDataset, spec: dict[str, Any]) -> DataLoader:
    """The hand-written loop's loader: the task's. Shuffled, the Trainer draws its order from the
    global RNG as a plain loop over ``DataLoader(shuffle=True)`` does, at the same points, so the
    weights still match bit for bit."""
    return make_loader(data, spec)


class Model(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_hand(spec: dict[str, Any], data: TensorDataset) -> tuple[Model, torch.optim.Optimizer, DataLoader]:
    """What the hand-written loop starts from: its model (in train mode), optimizer and loader."""
    model = Model(make_net(spec))
    optimizer = make_optimizer(model.parameters(), spec)
    model.train()
    return model, optimizer, make_hand_loader(data, spec)


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between two models' parameters and buffers (0: the same work was done)."""
    return max(float((p - q).abs().max()) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def make_task(spec: dict[str, Any], data: TensorDataset) -> Any:
    from taskfit import TaskModule

    class Task(TaskModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(spec)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(outputs, targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters(), spec)

        def train_dataloader(self) -> DataLoader:
            return make_loader(data, spec)

    return Task()
