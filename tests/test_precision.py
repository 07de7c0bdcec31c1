"""Precision (trainer/precision.py): the names, what ``trainer.precision`` reports, and
Lightning's true half modes ("bf16-true", "16-true") against a hand-written loop doing the same,
bit for bit, on the CPU."""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from taskfit import MisconfigurationError, TaskModule, Trainer
from taskfit.callbacks import Callback
from taskfit.precision import Precision, normalize_precision
from tasks import checkpointing_trainer, classification_data
from torch import nn
from torch.utils.data import DataLoader

# on the CPU, where the hand-written loops run, even on a machine with a GPU
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
             logger=False, accelerator="cpu")
TRUE_MODES = [("bf16-true", torch.bfloat16), ("16-true", torch.float16)]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Mlp(TaskModule):
    """A classifier with Adam and a fixed batch order; records the default dtype in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.data = classification_data(64)
        self.default_dtypes: list[torch.dtype] = []

    def forward(self, inputs):
        self.default_dtypes.append(torch.get_default_dtype())
        return self.net(inputs)

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets)

    def configure_optimizers(self):
        # eps=1e-3: Adam's default 1e-8 is 0 in float16, and its first steps would divide by 0
        return torch.optim.Adam(self.parameters(), lr=0.01, eps=1e-3)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=32)

    predict_dataloader = val_dataloader


def _seeded() -> Mlp:
    torch.manual_seed(0)
    return Mlp()


def _by_hand(task: Mlp, dtype: torch.dtype, steps: int, device: str = "cpu") -> None:
    """What Lightning's HalfPrecision does, by hand: module and floating inputs in ``dtype``."""
    task.to(device=device, dtype=dtype)
    optimizer = task.configure_optimizers()
    batches = [batch for _ in range(steps) for batch in task.train_dataloader()][:steps]
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        outputs = task(inputs.to(device=device, dtype=dtype))
        loss = F.cross_entropy(outputs, targets.to(device))
        loss.backward()
        optimizer.step()


# ---- names ------------------------------------------------------------------------------------
def test_an_unknown_precision_is_one_error_naming_every_valid_value():
    with pytest.raises(MisconfigurationError) as info:
        Trainer(precision="fp8", max_epochs=1)
    message = str(info.value)
    assert "Unknown precision 'fp8'" in message and "HINT: use one of" in message
    for name in ("32", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "32-true", "bf16"):
        assert f'"{name}"' in message, name


@pytest.mark.parametrize("given, name", [
    (32, "32"), ("32-true", "32"), ("bf16", "bf16-mixed"), (16, "16-mixed"), ("16", "16-mixed"),
    ("bf16-true", "bf16-true"), ("16-true", "16-true"), (None, "32")])
def test_trainer_precision_is_the_name_before_any_run(given, name):
    trainer = Trainer(precision=given, max_epochs=1)
    assert trainer.precision == name == normalize_precision(name)
    # the run's Precision (its GradScaler...) comes with a run
    assert trainer.precision_plugin is None


def test_the_gradscaler_is_read_only_in_the_precision_module():
    """One owner: no other library module reaches for ``.scaler``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    owner, readers = os.path.join(root, "trainer", "precision.py"), []
    for folder in ("trainer", "callbacks"):
        for path, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                full = os.path.join(path, name)
                if not name.endswith(".py") or full == owner:
                    continue
                with open(full, encoding="utf-8") as source:
                    if re.search(r"\.scaler\b", source.read()):
                        readers.append(os.path.relpath(full, root))
    assert readers == []


def test_a_true_mode_builds_layers_in_its_dtype_and_restores_the_default():
    trainer = Trainer(precision="bf16-true", max_epochs=1)
    with trainer.init_module(empty_init=False):
        layer = nn.Linear(2, 2)
        assert torch.get_default_dtype() == torch.bfloat16
    assert layer.weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32
    with Trainer(precision="bf16-mixed", max_epochs=1).init_module():
        assert nn.Linear(2, 2).weight.dtype == torch.float32


def test_a_true_mode_converts_floating_inputs_only():
    precision = Precision("bf16-true", torch.device("cpu"))
    pair = (torch.zeros(1, dtype=torch.float64), torch.arange(2))
    batch = {"x": torch.ones(2), "pair": pair, "n": 3}
    out = precision.convert_input(batch)
    assert (out["x"].dtype, out["pair"][0].dtype, out["pair"][1].dtype, out["n"]) == (
        torch.bfloat16, torch.bfloat16, torch.int64, 3)
    assert Precision("32", torch.device("cpu")).convert_input(batch) is batch


# ---- the true modes against a hand-written loop -----------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("precision, dtype", TRUE_MODES)
def test_a_true_mode_trains_as_a_hand_written_loop_to_the_bit(precision, dtype, device):
    expected = _seeded()
    _by_hand(expected, dtype, steps=6, device=device)
    task = _seeded()
    trainer = Trainer(precision=precision, max_steps=6, limit_val_batches=0,
                      **{**QUIET, "accelerator": device})
    trainer.fit(task)
    assert trainer.precision_plugin.scaler is None
    # tensors made in the forward are made in the dtype
    assert set(task.default_dtypes) == {dtype}
    for (name, want), got in zip(expected.state_dict().items(), task.state_dict().values()):
        assert got.dtype == dtype and torch.equal(got, want), name
    states = [v for state in trainer.optimizer.state.values()
              for k, v in state.items() if k != "step"]
    assert states and all(v.dtype == dtype for v in states)


class BatchDtypes(Callback):
    """The inputs' dtype each batch hook sees."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.dtype]] = []

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        self.seen.append(("train", batch[0].dtype))

    def on_validation_batch_start(self, trainer, task, batch, batch_idx, dataloader_idx=0):
        self.seen.append(("val", batch[0].dtype))

    def on_predict_batch_start(self, trainer, task, batch, batch_idx, dataloader_idx=0):
        self.seen.append(("predict", batch[0].dtype))


def test_a_true_mode_converts_the_batch_before_the_batch_hooks_as_lightning():
    hooks = BatchDtypes()
    trainer = Trainer(precision="bf16-true", max_steps=1, callbacks=[hooks], **QUIET)
    trainer.fit(_seeded())
    trainer.predict(trainer.task)
    assert {stage for stage, _ in hooks.seen} == {"train", "val", "predict"}
    assert {dtype for _, dtype in hooks.seen} == {torch.bfloat16}


def test_bf16_true_validates_and_predicts_in_bfloat16():
    task = _seeded()
    trainer = Trainer(precision="bf16-true", max_steps=2, **QUIET)
    trainer.fit(task)
    assert torch.isfinite(torch.tensor(trainer.validate(task, verbose=False)[0]["val/loss"]))
    predictions = trainer.predict(task)
    assert predictions and all(p.dtype == torch.bfloat16 for p in predictions)


def test_bf16_true_configure_model_builds_in_bfloat16():
    class Built(Mlp):
        def configure_model(self):
            self.head = nn.Linear(3, 3)  # built when the run sets the task up

        def forward(self, inputs):
            return self.head(self.net(inputs))

    torch.manual_seed(0)
    task = Built()
    Trainer(precision="bf16-true", max_steps=1, **QUIET).fit(task)
    assert task.head.weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32


class Batches(Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_start(self, trainer, task, batch, batch_idx):
        self.count += 1


def test_bf16_true_resumes_from_a_checkpoint_to_the_bit(tmp_path):
    reference = _seeded()
    checkpointing_trainer(tmp_path / "ref", precision="bf16-true", max_steps=8,
                          enable_checkpointing=False).fit(reference)
    short = checkpointing_trainer(tmp_path / "run", precision="bf16-true", max_steps=3)
    short.fit(_seeded())
    task, batches = _seeded(), Batches()
    resumed = checkpointing_trainer(tmp_path / "run", precision="bf16-true", max_steps=8,
                                    callbacks=[batches])
    resumed.fit(task, ckpt_path="last")
    assert batches.count == 5  # steps 4 to 8: it went on from the checkpoint of step 3
    for (name, want), got in zip(reference.state_dict().items(), task.state_dict().values()):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name


def test_bf16_true_under_fsdp_shards_bfloat16_parameters_and_trains_as_one_device():
    from taskfit.strategies.fsdp import FSDPStrategy

    single = _seeded()
    Trainer(precision="bf16-true", max_steps=4, limit_val_batches=0, **QUIET).fit(single)
    task = _seeded()
    strategy = FSDPStrategy("cpu", 1, auto_wrap_policy={nn.Linear})
    Trainer(strategy=strategy, precision="bf16-true", max_steps=4, limit_val_batches=0,
            **QUIET).fit(task)
    # the shards themselves are bfloat16
    assert all(p.dtype == torch.bfloat16 for p in task.parameters())
    for (name, want), got in zip(single.state_dict().items(), task.state_dict().values()):
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert torch.equal(got, want), name
