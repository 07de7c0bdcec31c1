"""Checkpoint files across the two frameworks: a file PyTorch Lightning 2.6.6 wrote (tests/data, made by
tests/data/make_lightning_checkpoint.py) loads into the same module written as a TaskModule, and taskfit's files
carry Lightning's top-level keys, so that scripts and ``on_load_checkpoint`` written for Lightning read them."""
from __future__ import annotations

import random
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from taskfit import CheckpointError, TaskModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

LIGHTNING_CKPT = Path(__file__).with_name("data") / "lightning-2.6.6.ckpt"
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)


class Blob(TaskModule):
    """tests/data/make_lightning_checkpoint.py's module, with taskfit's base class."""

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

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                          batch_size=8)


def test_a_checkpoint_lightning_wrote_loads_with_its_weights_and_hyperparameters():
    saved = torch.load(LIGHTNING_CKPT, weights_only=True)
    task = Blob.load_from_checkpoint(LIGHTNING_CKPT)
    assert (task.hparams.hidden, task.hparams.lr) == (5, 0.05)  # from "hyper_parameters", not the defaults
    assert not task.training  # eval mode, as Lightning's load_from_checkpoint
    for name, value in task.state_dict().items():  # BatchNorm's running statistics too
        assert torch.equal(value, saved["state_dict"][name]), name
    assert Blob.load_from_checkpoint(LIGHTNING_CKPT, lr=0.5).hparams.lr == 0.5  # keyword arguments win


def test_taskfit_checkpoints_carry_lightnings_keys(tmp_path):
    seen = []

    class Reads(Blob):
        def on_load_checkpoint(self, checkpoint):  # Lightning code reads these keys
            seen.append((checkpoint["epoch"], checkpoint["global_step"], dict(checkpoint["hyper_parameters"])))

    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), **QUIET)
    task = Reads(hidden=3)
    trainer.fit(task)
    path = trainer.checkpoint_callback.last_model_path
    ckpt = torch.load(path, weights_only=True)
    assert (ckpt["epoch"], ckpt["global_step"]) == (1, 8)  # the epoch it completed, as Lightning's epoch-end files
    assert ckpt["hyper_parameters"] == {"hidden": 3, "lr": 0.1}
    assert ckpt["state_dict"].keys() == task.state_dict().keys()
    assert all(torch.equal(ckpt["state_dict"][k], v) for k, v in task.state_dict().items())
    assert ckpt["state_dict"]["net.0.weight"].untyped_storage().data_ptr() == \
        ckpt["module"]["net.0.weight"].untyped_storage().data_ptr()  # one copy of the weights in the file
    Trainer(max_epochs=3, default_root_dir=str(tmp_path), **QUIET).fit(Reads(hidden=3), ckpt_path=path)
    assert seen == [(1, 8, {"hidden": 3, "lr": 0.1})]


def test_a_lightning_checkpoint_is_not_a_training_state_to_resume(tmp_path):
    from taskfit import CheckpointError

    with pytest.raises(CheckpointError, match=r"holds a Lightning 2\.6\.6 checkpoint, not a taskfit training "
                                              r"checkpoint(?s:.*)MyTask\.load_from_checkpoint\(path\)"):
        Trainer(max_epochs=3, default_root_dir=str(tmp_path), **QUIET).fit(Blob(hidden=5), ckpt_path=LIGHTNING_CKPT)


def test_a_background_save_keeps_state_dict_and_module_one_object(tmp_path):
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    task = Blob()
    trainer.fit(task)
    path = tmp_path / "bg.ckpt"
    trainer.save_checkpoint(path, background=True)
    trainer.checkpoint_writer.wait()
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["state_dict"] is ckpt["module"]  # staged once, pickled once


def _flip_bit_in(path: Path, member: str, seed: int) -> None:
    """Flip one random bit of the zip member ``member`` of ``path`` (still a valid zip)."""
    info = zipfile.ZipFile(path).getinfo(member)
    rng = random.Random(seed)
    with open(path, "r+b") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
        at = info.header_offset + 30 + name_len + extra_len + rng.randrange(info.file_size)
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ (1 << rng.randrange(8))]))


LIGHTNING_TENSORS = [f"archive/data/{i}" for i in range(9)]


class Validated(Blob):
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.cross_entropy(self(batch[0]), batch[1]))

    def val_dataloader(self):
        return self.train_dataloader()


def _validate(root: Path, ckpt_path: Path) -> None:
    Trainer(default_root_dir=str(root), **QUIET).validate(Validated(hidden=5), ckpt_path=ckpt_path)


@pytest.mark.parametrize("member", LIGHTNING_TENSORS)
def test_a_flipped_bit_in_a_lightning_checkpoint_is_refused_by_its_zip_crc(tmp_path, member):
    """Issue 47, row 4: a file without taskfit's checksums (here one Lightning 2.6.6 wrote)
    with one bit flipped in a tensor is refused by the CRC-32 its zip archive records for each
    member, by every loading path (before: loaded silently, 4 of 4; Lightning too)."""
    damaged = tmp_path / "lightning.ckpt"
    shutil.copy(LIGHTNING_CKPT, damaged)
    _flip_bit_in(damaged, member, seed=LIGHTNING_TENSORS.index(member))
    message = (rf"Checkpoint {damaged} is damaged: the bytes of a tensor storage \({member}\) "
               "did not match the CRC-32 its zip archive recorded")
    with pytest.raises(CheckpointError, match=message):
        Blob.load_from_checkpoint(damaged)
    with pytest.raises(CheckpointError, match=message):
        _validate(tmp_path, damaged)


def test_a_plain_state_dict_with_a_flipped_bit_is_refused_and_an_intact_one_loads(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(Blob(hidden=5).state_dict(), path)
    _validate(tmp_path, path)
    _flip_bit_in(path, "weights/data/0", seed=0)
    with pytest.raises(CheckpointError, match=r"weights\.pt is damaged: the bytes of a tensor"):
        _validate(tmp_path, path)
