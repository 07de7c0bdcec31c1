"""CUDA-only checks of the GPU hot path: no host-device sync between logging intervals, pinned memory with
non-blocking copies, ``compile=True`` checkpoints that load anywhere, ``channels_last``. Skipped without CUDA."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from taskfit import TaskModule, Trainer
from taskfit.callbacks import Callback, ProgressBar
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LOG_EVERY = 10


class ConvTask(TaskModule):
    """A small CNN on 3x16x16 inputs; logs a value of its own every step (stays on the device)."""

    def __init__(self, n: int = 512, batch_size: int = 16, sync_in_loss: bool = False) -> None:
        super().__init__()
        self.batch_size, self.sync_in_loss = batch_size, sync_in_loss
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                                 nn.Linear(8 * 16, 4))
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
        self.input_devices: set[str] = set()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.input_devices.add(inputs.device.type)
        return self.net(inputs)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(outputs, targets)
        self.log("acc", (outputs.argmax(-1) == targets).float().mean(), prog_bar=True)
        if self.sync_in_loss:
            print(loss.item())  # the kind of per-step sync the guard must catch
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class GuardOn(Callback):
    """First at batch start: sync debug mode "error" for every step that does not log (and not the first)."""

    order = -10**6

    def __init__(self) -> None:
        self.guarded = 0

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        logs = (trainer.state.global_step + 1) % trainer.log_every_n_steps == 0
        if trainer.state.batch_idx >= 1 and not logs:
            torch.cuda.set_sync_debug_mode("error")
            self.guarded += 1


class GuardOff(Callback):
    """Last at batch end: back to normal before the epoch end (which syncs once, by design)."""

    order = 10**6

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer, task, exception) -> None:
        torch.cuda.set_sync_debug_mode("default")


def guarded_trainer(tmp_path, **kwargs) -> tuple[Trainer, GuardOn]:
    guard = GuardOn()
    trainer = Trainer(max_epochs=1, accelerator="cuda", log_every_n_steps=LOG_EVERY, default_root_dir=str(tmp_path),
                      callbacks=[guard, GuardOff(), ProgressBar(stream=io.StringIO())], **kwargs)
    return trainer, guard


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_no_host_device_sync_between_logging_intervals(tmp_path, precision):
    """Defaults on (progress bar, TensorBoard, checkpoint, throughput): steps between logs never wait for the GPU."""
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    task = ConvTask()
    trainer, guard = guarded_trainer(tmp_path, precision=precision)
    try:
        metrics = trainer.fit(task)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    steps = len(task.data) // task.batch_size
    assert trainer.state.global_step == steps
    assert guard.guarded == steps - 1 - steps // LOG_EVERY  # every step but the first and the logging ones
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert "train/acc" in metrics  # self.log values reached the host at the logging interval


def test_sync_guard_catches_a_per_step_sync(tmp_path):
    """The guard above is not vacuous: a `.item()` in the loss is reported as a synchronizing operation."""
    trainer, _ = guarded_trainer(tmp_path, enable_checkpointing=False, logger=False)
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            trainer.fit(ConvTask(n=64, sync_in_loss=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_batches_are_pinned_and_reach_the_gpu(tmp_path, quiet):
    task = ConvTask(n=64)
    trainer = Trainer(max_epochs=1, accelerator="cuda", default_root_dir=str(tmp_path), **quiet)
    trainer.fit(task)
    assert trainer.train_dataloader.pin_memory  # pinned host memory: the non_blocking copy is really async
    assert task.input_devices == {"cuda"}


def test_compiled_checkpoint_loads_into_a_plain_module_on_cpu(tmp_path):
    torch.manual_seed(0)
    task = ConvTask(n=64)
    trainer = Trainer(max_epochs=1, accelerator="cuda", compile=True, default_root_dir=str(tmp_path),
                      enable_progress_bar=False, enable_model_summary=False, logger=False)
    trainer.fit(task)
    path = trainer.checkpoint_callback.last_model_path
    saved = torch.load(path, map_location="cpu", weights_only=True)["module"]
    assert set(saved) == set(ConvTask().state_dict())  # no "_orig_mod." prefix
    plain = ConvTask.load_from_checkpoint(path)  # on the CPU, not compiled
    trained = {k: v.cpu() for k, v in task.state_dict().items()}
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in trained.items())
    x = task.data.tensors[0][:8]
    with torch.no_grad():
        assert torch.equal(plain(x), task.cpu().eval()(x))
    # ...and training resumes from it without compile, on the CPU
    resumed = Trainer(max_epochs=2, accelerator="cpu", default_root_dir=str(tmp_path), enable_progress_bar=False,
                      enable_model_summary=False, logger=False, enable_checkpointing=False)
    resumed.fit(ConvTask(n=64), ckpt_path=path)
    assert resumed.state.epoch == 2


def test_channels_last_trains_in_channels_last(tmp_path, quiet):
    task = ConvTask(n=64)
    trainer = Trainer(max_epochs=1, accelerator="cuda", channels_last=True, default_root_dir=str(tmp_path), **quiet)
    metrics = trainer.fit(task)
    conv = task.net[0]
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.isfinite(torch.tensor(metrics["train/loss_epoch"]))
