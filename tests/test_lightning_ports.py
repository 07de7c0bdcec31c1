"""Lightning code as users bring it (issue 28, "Done when"): lightning-hydra-template's MNIST module, data module and
callback configuration run as written; the Trainer's Lightning-only arguments and Lightning's spellings of defaults;
the stand-ins the ported examples import (examples/lightning_stand_ins.py). The ported examples themselves run in
tests/test_examples.py. Lightning 2.6.6's values are written here (observed), so CI needs no Lightning.
"""
from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

import pytest
import torch
import torchmetrics
from taskfit import DataModule, MisconfigurationError, TaskModule, Trainer
from taskfit.callbacks import Callback
from taskfit.compat.lightning.trainer_arguments import TRAINER_ARGUMENTS
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, Dataset, TensorDataset, random_split

pytest.importorskip("sklearn", reason="the template's data is scikit-learn's bundled digits (the MNIST stand-in)")
from taskfit.examples.lightning_stand_ins import MNIST, make_grid, save_image, transforms  # noqa: E402

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)


# ---- lightning-hydra-template: src/models/mnist_module.py and src/data/mnist_datamodule.py, imports changed ------
class SimpleDenseNet(nn.Module):
    def __init__(self, input_size: int = 784, lin1_size: int = 64, lin2_size: int = 128, lin3_size: int = 64,
                 output_size: int = 10) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size), nn.BatchNorm1d(lin1_size), nn.ReLU(),
            nn.Linear(lin1_size, lin2_size), nn.BatchNorm1d(lin2_size), nn.ReLU(),
            nn.Linear(lin2_size, lin3_size), nn.BatchNorm1d(lin3_size), nn.ReLU(),
            nn.Linear(lin3_size, output_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, channels, width, height = x.size()
        return self.model(x.view(batch_size, -1))


class MNISTLitModule(TaskModule):  # was: LightningModule
    def __init__(self, net: nn.Module, optimizer: Any, scheduler: Any, compile: bool) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net
        self.criterion = torch.nn.CrossEntropyLoss()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.train_loss, self.val_loss, self.test_loss = (torchmetrics.MeanMetric() for _ in range(3))
        self.val_acc_best = torchmetrics.MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        # by default lightning executes validation step sanity checks before training starts,
        # so it's worth to make sure validation metrics don't store results from these checks
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def model_step(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        preds = torch.argmax(logits, dim=1)
        return loss, preds, y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def on_train_epoch_end(self) -> None:
        pass

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_acc.compute()  # get current val acc
        self.val_acc_best(acc)  # update best so far val acc
        # log `val_acc_best` as a value through `.compute()` method, instead of as a metric object
        # otherwise metric would be reset by lightning after each epoch
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.test_loss(loss)
        self.test_acc(preds, targets)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_test_epoch_end(self) -> None:
        pass

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net = torch.compile(self.net)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is not None:
            scheduler = self.hparams.scheduler(optimizer=optimizer)
            return {"optimizer": optimizer, "lr_scheduler": {
                "scheduler": scheduler, "monitor": "val/loss", "interval": "epoch", "frequency": 1}}
        return {"optimizer": optimizer}


class MNISTDataModule(DataModule):  # was: LightningDataModule
    def __init__(self, data_dir: str = "data/", train_val_test_split: tuple[int, int, int] = (1_297, 250, 250),
                 batch_size: int = 64, num_workers: int = 0, pin_memory: bool = False) -> None:  # was: 55_000, 5_000, 10_000
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.transforms = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
        self.data_train: Dataset | None = None
        self.data_val: Dataset | None = None
        self.data_test: Dataset | None = None

    @property
    def num_classes(self) -> int:
        return 10

    def prepare_data(self) -> None:
        MNIST(self.hparams.data_dir, train=True, download=True)
        MNIST(self.hparams.data_dir, train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        if not self.data_train and not self.data_val and not self.data_test:
            trainset = MNIST(self.hparams.data_dir, train=True, transform=self.transforms)
            testset = MNIST(self.hparams.data_dir, train=False, transform=self.transforms)
            dataset = ConcatDataset(datasets=[trainset, testset])
            self.data_train, self.data_val, self.data_test = random_split(
                dataset=dataset, lengths=self.hparams.train_val_test_split,
                generator=torch.Generator().manual_seed(42))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset=self.data_train, batch_size=self.hparams.batch_size,
                          num_workers=self.hparams.num_workers, pin_memory=self.hparams.pin_memory, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset=self.data_val, batch_size=self.hparams.batch_size,
                          num_workers=self.hparams.num_workers, pin_memory=self.hparams.pin_memory, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(dataset=self.data_test, batch_size=self.hparams.batch_size,
                          num_workers=self.hparams.num_workers, pin_memory=self.hparams.pin_memory, shuffle=False)

    def teardown(self, stage: str | None = None) -> None:
        pass

    def state_dict(self) -> dict[Any, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


# configs/callbacks/{model_checkpoint,early_stopping,model_summary}.yaml with default.yaml's overrides
CALLBACKS_YAML = """
model_checkpoint:
  _target_: taskfit.callbacks.ModelCheckpoint  # was: lightning.pytorch.callbacks.ModelCheckpoint
  dirpath: {dirpath}
  filename: "epoch_{{epoch:03d}}"
  monitor: "val/acc"
  verbose: False
  save_last: True
  save_top_k: 1
  mode: "max"
  auto_insert_metric_name: False
  save_weights_only: False
  every_n_train_steps: null
  train_time_interval: null
  every_n_epochs: null
  save_on_train_epoch_end: null
early_stopping:
  _target_: taskfit.callbacks.EarlyStopping  # was: lightning.pytorch.callbacks.EarlyStopping
  monitor: "val/acc"
  min_delta: 0.
  patience: 100
  verbose: False
  mode: "max"
  strict: True
  check_finite: True
  stopping_threshold: null
  divergence_threshold: null
  check_on_train_epoch_end: null
model_summary:
  _target_: taskfit.callbacks.ModelSummary  # was: lightning.pytorch.callbacks.RichModelSummary
  max_depth: -1
"""


class Sabotage(Callback):
    """Zeroes the net's weights when the last epoch starts (a dead ReLU net: chance accuracy from then on), so the
    last weights are bad and only the best checkpoint gives a good test; records what each validation published."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.seen = epoch, []

    def on_train_epoch_start(self, trainer: Trainer, pl_module: MNISTLitModule) -> None:
        if trainer.current_epoch == self.epoch:
            with torch.no_grad():
                for p in pl_module.net.parameters():
                    p.zero_()

    def on_validation_end(self, trainer: Trainer, pl_module: MNISTLitModule) -> None:
        metrics = trainer.callback_metrics
        self.seen.append((trainer.current_epoch, float(metrics["val/acc"]), float(metrics["val/acc_best"])))


def test_hydra_template_mnist_module_and_checkpoint_config(tmp_path):
    """The template's train.py: callbacks from its YAML, fit(model=, datamodule=), then test with the best
    checkpoint. val/acc_best is the running maximum of the real validations (not the sanity check's), logged and
    on the bar; the best file is epoch_XXX.ckpt of the best epoch, and test(ckpt_path="best") uses it."""
    import functools

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    torch.manual_seed(0)
    config = OmegaConf.create(CALLBACKS_YAML.format(dirpath=tmp_path / "checkpoints"))
    callbacks = [instantiate(config[name]) for name in ("model_checkpoint", "early_stopping", "model_summary")]
    sabotage = Sabotage(epoch=3)
    model = MNISTLitModule(SimpleDenseNet(), optimizer=functools.partial(torch.optim.Adam, lr=0.001, weight_decay=0.0),
                           scheduler=functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, mode="min",
                                                       factor=0.1, patience=10), compile=False)
    datamodule = MNISTDataModule()
    trainer = Trainer(callbacks=[*callbacks, sabotage], min_epochs=1, max_epochs=4, accelerator="cpu", devices=1,
                      check_val_every_n_epoch=1, deterministic=False, default_root_dir=str(tmp_path),
                      enable_progress_bar=False)
    trainer.fit(model=model, datamodule=datamodule, ckpt_path=None)

    epochs = [epoch for epoch, _, _ in sabotage.seen]
    accs = [acc for _, acc, _ in sabotage.seen]
    assert epochs == [0, 1, 2, 3], sabotage.seen  # the sanity check is no validation here (on_validation_end)
    assert accs[3] < 0.3 < 0.8 < max(accs[:3]), sabotage.seen  # the sabotaged last epoch; chance is 0.1
    for i, (_, _, best) in enumerate(sabotage.seen):  # computed before the reset, reset after the sanity check
        assert best == pytest.approx(max(accs[: i + 1]), abs=1e-6), sabotage.seen
    assert {"val/acc_best", "val/acc", "train/acc"} <= set(trainer.progress_bar_metrics)
    assert float(trainer.logged_metrics["val/acc_best"]) == pytest.approx(max(accs), abs=1e-6)

    best_epoch = accs.index(max(accs))
    checkpoint = trainer.checkpoint_callback
    assert os.path.basename(checkpoint.best_model_path) == f"epoch_{best_epoch:03d}.ckpt"
    assert float(checkpoint.best_model_score) == pytest.approx(max(accs), abs=1e-6)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == sorted([f"epoch_{best_epoch:03d}.ckpt", "last.ckpt"])

    ckpt_path = trainer.checkpoint_callback.best_model_path  # the template's train.py
    best = trainer.test(model=model, datamodule=datamodule, ckpt_path=ckpt_path)[0]
    assert best == trainer.test(model=model, datamodule=datamodule, ckpt_path="best")[0]
    last = trainer.test(model=model, datamodule=datamodule, ckpt_path="last")[0]  # Lightning's last.ckpt: the best
    # here (save_last=True refreshes it with ranked saves only; docs/migrating-lightning.md, "Where taskfit differs")
    assert best["test/acc"] > 0.8 and last["test/acc"] < 0.3, (best, last)
    assert best["test/acc"] == pytest.approx(_accuracy(ckpt_path, datamodule), abs=1e-6)


def _accuracy(ckpt_path: str, datamodule: MNISTDataModule) -> float:
    """Test accuracy of the weights in ``ckpt_path``, computed by hand (the net in eval mode, every test image)."""
    net = SimpleDenseNet()
    state = torch.load(ckpt_path, weights_only=True)["module"]
    net.load_state_dict({k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")})
    net.eval()
    with torch.no_grad():
        pairs = [(net(x).argmax(1), y) for x, y in datamodule.test_dataloader()]
    return float(sum((p == y).sum() for p, y in pairs)) / sum(len(y) for _, y in pairs)


# ---- the Trainer's Lightning arguments -------------------------------------------------------------------------
LIGHTNING_26_TRAINER = (  # inspect.signature(lightning.pytorch.Trainer.__init__), Lightning 2.6.6
    "accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks", "fast_dev_run",
    "max_epochs", "min_epochs", "max_steps", "min_steps", "max_time", "limit_train_batches", "limit_val_batches",
    "limit_test_batches", "limit_predict_batches", "overfit_batches", "val_check_interval",
    "check_val_every_n_epoch", "num_sanity_val_steps", "log_every_n_steps", "enable_checkpointing",
    "enable_progress_bar", "enable_model_summary", "accumulate_grad_batches", "gradient_clip_val",
    "gradient_clip_algorithm", "deterministic", "benchmark", "inference_mode", "use_distributed_sampler",
    "profiler", "detect_anomaly", "barebones", "plugins", "sync_batchnorm", "reload_dataloaders_every_n_epochs",
    "default_root_dir", "enable_autolog_hparams", "model_registry")


def test_every_lightning_trainer_argument_is_taken_or_answered():
    """Each Lightning 2.6 argument is one taskfit's Trainer takes or one its table answers with what to do instead;
    no table row names an argument the Trainer takes (a stale hint)."""
    taken = set(inspect.signature(Trainer.__init__).parameters)
    missing = [a for a in LIGHTNING_26_TRAINER if a not in taken and a not in TRAINER_ARGUMENTS]
    assert not missing, missing
    assert not taken & set(TRAINER_ARGUMENTS), taken & set(TRAINER_ARGUMENTS)


@pytest.mark.parametrize("argument, hint", [
    ("num_nodes", "torchrun --nnodes=N --nproc-per-node=G"),  # docs/troubleshooting.md's example, verbatim
    ("gpus", 'accelerator="cuda", devices=N'),
    ("resume_from_checkpoint", "trainer.fit(task, ckpt_path=...)"),
    ("sync_batchnorm", "torch.nn.SyncBatchNorm.convert_sync_batchnorm"),
])
def test_lightning_only_trainer_argument_says_what_to_use(argument, hint):
    with pytest.raises(MisconfigurationError) as info:
        Trainer(max_epochs=1, **{argument: 2})
    message = str(info.value)
    assert f"Trainer({argument}=...) is an argument of Lightning's Trainer that taskfit's does not take." in message
    assert "HINT: " in message and hint in message, message


def test_lightning_spellings_of_defaults():
    """What Lightning documents as "the default" or "no limit" means the same here."""
    default = Trainer(max_epochs=1, **QUIET)
    lightning = Trainer(max_epochs=1, max_steps=-1, precision=None, limit_train_batches=None, limit_val_batches=None,
                        val_check_interval=None, log_every_n_steps=None, num_sanity_val_steps=None,
                        gradient_clip_algorithm=None, deterministic=None, **QUIET)
    for name in ("max_steps", "precision_name", "limits", "val_check_interval", "log_every_n_steps",
                 "num_sanity_val_steps", "gradient_clip_algorithm", "deterministic"):
        assert getattr(lightning, name) == getattr(default, name), name
    endless_epochs = Trainer(max_epochs=-1, max_steps=3, **QUIET)
    # Lightning's trainer.max_epochs stays -1 (no epoch limit; tests/test_flags.py fits with it)
    assert (endless_epochs.max_epochs, endless_epochs.max_steps) == (-1, 3)
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        with pytest.raises(MisconfigurationError, match=r'accelerator="gpu"\) asks for a GPU, but neither CUDA nor'):
            Trainer(accelerator="gpu", max_epochs=1)


class Squares(TaskModule):
    """x -> x^2 with a tiny MLP; 4 validation batches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
        x = torch.linspace(-1, 1, 32).unsqueeze(1)
        self.data = TensorDataset(x, x ** 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)


class Counter(Callback):
    def __init__(self, stop_after: int | None = None) -> None:
        self.sanity, self.stop_after, self.max_epochs = 0, stop_after, None

    def on_validation_batch_end(self, trainer: Trainer, pl_module: TaskModule, *args: Any) -> None:
        self.sanity += trainer.sanity_checking

    def on_train_batch_end(self, trainer: Trainer, pl_module: TaskModule, *args: Any) -> None:
        self.max_epochs = trainer.max_epochs
        if self.stop_after is not None and trainer.global_step >= self.stop_after:
            trainer.should_stop = True


def test_sanity_check_of_every_batch_and_lightnings_1000_epochs():
    """num_sanity_val_steps=-1: every validation batch (4); a fit without max_epochs or max_steps runs Lightning's
    1000 epochs, with Lightning's warning."""
    counter = Counter()
    Trainer(max_epochs=1, num_sanity_val_steps=-1, callbacks=[counter], **QUIET).fit(Squares())
    assert counter.sanity == 4
    counter = Counter(stop_after=2)
    with pytest.warns(UserWarning, match=r"max_epochs was not set, so fit stops after 1000 epochs \(Lightning's "):
        Trainer(callbacks=[counter], **QUIET).fit(Squares())
    assert counter.max_epochs == 1000


def test_entry_points_take_lightnings_keywords():
    task, trainer = Squares(), Trainer(max_epochs=1, **QUIET)
    trainer.fit(model=task, weights_only=None)
    assert trainer.validate(model=task, weights_only=True)[0].keys() == {"val/loss"}
    with pytest.raises(MisconfigurationError, match=r"Trainer.fit\(\) got both task and model="):
        trainer.fit(task, model=task)
    with pytest.raises(MisconfigurationError, match=r"unknown argument 'train_dataloader'[\s\S]*train_dataloaders"):
        trainer.fit(task, train_dataloader=task.train_dataloader())
    with pytest.raises(MisconfigurationError, match=r"Trainer.fit\(weights_only=...\) is an argument of Lightning"):
        trainer.fit(task, weights_only=False)


class NoValidationStep(Squares):
    """A Lightning-style module (own training_step, no validation_step, no loss) given a data module with val data,
    as the GAN example is."""

    loss = TaskModule.loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


def test_fit_without_validation_step_skips_validation_as_lightning():
    counter = Counter()
    with pytest.warns(UserWarning, match=r"NoValidationStep defines no validation_step \(nor a loss for the default "
                                         r"one\), so fit does not validate[\s\S]*Skipping val loop"):
        Trainer(max_epochs=1, callbacks=[counter], **QUIET).fit(NoValidationStep())
    assert counter.sanity == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a task with a loss keeps taskfit's default validation step, silently
        Trainer(max_epochs=1, **QUIET).fit(Squares())


# ---- the ports' stand-ins --------------------------------------------------------------------------------------
def test_stand_ins_match_torchvision_and_mnist(tmp_path):
    train, test = MNIST(".", train=True), MNIST(".", train=False, transform=transforms.ToTensor())
    assert (len(train), len(test)) == (1500, 297) and train.data.dtype == torch.uint8
    image, label = test[0]
    assert image.shape == (1, 28, 28) and 0 <= image.min() and image.max() <= 1 and 0 <= label <= 9
    # torchvision's make_grid: three 1x28x28 images in one row, 2 px padding, one channel repeated to three
    grid = make_grid(torch.stack([test[i][0] for i in range(3)]), nrow=8, padding=2, normalize=True)
    assert grid.shape == (3, 32, 92) and torch.equal(grid[0], grid[2]) and grid.max() == 1
    assert torch.equal(grid[:, :2], torch.zeros(3, 2, 92))  # pad_value 0
    save_image(grid, str(tmp_path / "g.png"))
    from PIL import Image

    with Image.open(tmp_path / "g.png") as png:
        assert (png.mode, png.size) == ("RGB", (92, 32))
