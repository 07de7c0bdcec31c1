"""BaseFinetuning / BackboneFinetuning (callbacks/finetuning.py): Lightning 2.6's callbacks for
transfer learning.

The expected values were observed by running the same program with Lightning 2.6.6
(``lightning.pytorch``'s LightningModule, Trainer and BackboneFinetuning in place of taskfit's): the
learning rates of each epoch and the trained weights.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from taskfit import MisconfigurationError, TaskModule, Trainer, seed_everything
from taskfit.callbacks import BackboneFinetuning, BaseFinetuning, Callback, ModelCheckpoint

# Lightning 2.6.6, the program below: the optimizer's learning rates at each epoch's end, the
# head's weight sum and how far the backbone's first layer moved (it trains from epoch 1 on)
LIGHTNING_LRS = [[0.1], [0.1, 0.01], [0.1, 0.02], [0.1, 0.04]]
LIGHTNING_HEAD_SUM, LIGHTNING_BACKBONE_MOVED = -0.430029, 0.538546


class Transfer(TaskModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)


class Lrs(Callback):
    def __init__(self) -> None:
        self.seen: list[list[float]] = []

    def on_train_epoch_end(self, trainer, task):
        self.seen.append([round(g["lr"], 6) for g in trainer.optimizers[0].param_groups])


def _data() -> DataLoader:
    x = torch.randn(32, 4)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _trainer(tmp_path, max_epochs: int, *callbacks: Callback, **kwargs) -> Trainer:
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    return Trainer(max_epochs=max_epochs, callbacks=[finetuning, *callbacks],
                   default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, **kwargs)


@pytest.mark.filterwarnings("ignore:The provided params")  # its batch norm: Lightning warns too
def test_backbone_finetuning_trains_the_head_then_the_backbone_as_lightning(tmp_path):
    seed_everything(0)
    data, task = _data(), Transfer()
    start = task.backbone[0].weight.detach().clone()
    lrs = Lrs()
    _trainer(tmp_path, 4, lrs, enable_checkpointing=False).fit(task, data)
    assert lrs.seen == LIGHTNING_LRS
    assert float(task.head.weight.detach().sum()) == pytest.approx(LIGHTNING_HEAD_SUM, abs=1e-5)
    moved = float((task.backbone[0].weight.detach() - start).abs().sum())
    assert moved == pytest.approx(LIGHTNING_BACKBONE_MOVED, abs=1e-5)
    assert task.backbone[0].weight.requires_grad and task.backbone[1].track_running_stats


@pytest.mark.filterwarnings("ignore:The provided params")
def test_backbone_finetuning_resumes_exactly(tmp_path):
    seed_everything(0)
    data, straight = _data(), Transfer()
    resumed = Transfer()
    resumed.load_state_dict(straight.state_dict())
    _trainer(tmp_path / "a", 4, enable_checkpointing=False).fit(straight, data)
    last = ModelCheckpoint(dirpath=tmp_path / "b", save_last=True)
    _trainer(tmp_path / "b", 2, last).fit(resumed, data)
    lrs = Lrs()
    # a fresh callback: its parameter group is rebuilt from the checkpoint before the optimizer's
    # state loads
    _trainer(tmp_path / "b", 4, lrs).fit(resumed, data, ckpt_path=last.last_model_path)
    assert lrs.seen == LIGHTNING_LRS[2:]
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_freeze_and_unfreeze_helpers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    BaseFinetuning.freeze(model, train_bn=True)
    assert not model[0].weight.requires_grad
    assert model[1].weight.requires_grad and model[1].track_running_stats
    BaseFinetuning.freeze(model, train_bn=False)
    assert not model[1].weight.requires_grad and not model[1].track_running_stats
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.5)
    BaseFinetuning.make_trainable(model[2])
    # model[2]'s parameters are already in it
    with pytest.warns(UserWarning, match="Did you init your optimizer in"):
        BaseFinetuning.unfreeze_and_add_param_group(model, optimizer)
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 4]
    assert optimizer.param_groups[1]["lr"] == 0.05  # the first group's / initial_denom_lr
    assert len(BaseFinetuning.flatten_modules(model)) == 3


def test_backbone_finetuning_without_a_backbone_is_one_clear_error(tmp_path):
    class NoBackbone(Transfer):
        def __init__(self) -> None:
            super().__init__()
            del self.backbone
            self.body = nn.Linear(4, 8)

    lightnings = "should have a nn.Module `backbone` attribute"
    with pytest.raises(MisconfigurationError, match=lightnings) as error:
        _trainer(tmp_path, 1, enable_checkpointing=False).fit(NoBackbone(), _data())
    assert "HINT" in str(error.value)
