"""Inference at scale: predictions under ddp in dataset order, and PredictionWriter writing them to disk as they
are made (docs/callbacks.md, docs/strategies.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from taskfit import Trainer, seed_everything
from taskfit.callbacks import Callback, PredictionWriter
from taskfit.errors import MisconfigurationError
from tasks import ClassifierTask

HERE = os.path.dirname(os.path.abspath(__file__))
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False)


class Predicting(ClassifierTask):
    """Predicts the 45 validation samples (an odd number: 23 + 22 on two ranks)."""

    def predict_dataloader(self):
        return self.val_dataloader()


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TASKFIT_SEED"):
        env.pop(key, None)
    return env


class Calls(Callback):
    def __init__(self):
        self.calls = []

    def on_predict_start(self, trainer, task):
        self.calls.append("start")

    def on_predict_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self.calls.append((batch_idx, tuple(outputs.shape)))

    def on_predict_end(self, trainer, task):
        self.calls.append("end")


def test_predict_hooks_fire_and_return_predictions_false_keeps_nothing():
    calls = Calls()
    task = Predicting(batch_size=16)
    assert Trainer(callbacks=[calls], **QUIET).predict(task, return_predictions=False) is None
    assert calls.calls == ["start", (0, (16, 3)), (1, (16, 3)), (2, (13, 3)), "end"]


def test_ddp_predict_returns_every_ranks_predictions_in_dataset_order(tmp_path):
    seed_everything(0)
    task = Predicting(batch_size=8)
    single = Trainer(**QUIET).predict(task)
    writer = PredictionWriter(tmp_path / "written", write_interval="epoch")
    ddp = Trainer(strategy="ddp", accelerator="cpu", devices=2, callbacks=[writer], **QUIET).predict(task)
    assert [p.shape for p in ddp] == [p.shape for p in single] == [(8, 3)] * 5 + [(5, 3)]
    for got, expected in zip(ddp, single):
        assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    files = sorted(os.listdir(tmp_path / "written"))
    assert files == ["predictions_rank0.pt", "predictions_rank1.pt"]
    saved = [torch.load(tmp_path / "written" / name, weights_only=True) for name in files]
    assert saved[0]["indices"] == list(range(0, 45, 2)) and saved[1]["indices"] == list(range(1, 45, 2))
    everything = torch.cat([torch.cat(s["predictions"]) for s in saved])
    order = torch.tensor(saved[0]["indices"] + saved[1]["indices"]).argsort()
    assert torch.allclose(everything[order], torch.cat(single), atol=1e-6, rtol=0)


def test_prediction_writer_streams_a_predict_set_larger_than_memory_holds_in_one_list(tmp_path):
    """300 batches of 1 MiB predictions (300 MiB): written one file per batch, the process grows by a few MiB."""
    script = tmp_path / "stream.py"
    script.write_text(textwrap.dedent(f"""
        import json, resource, torch
        from torch.utils.data import DataLoader, TensorDataset
        from taskfit import TaskModule, Trainer
        from taskfit.callbacks import PredictionWriter

        class Wide(TaskModule):
            def __init__(self):
                super().__init__()
                self.scale = torch.nn.Parameter(torch.ones(4096))
            def forward(self, x):
                return x[:, :1] * self.scale  # (64, 4096) floats: 1 MiB per batch
            def predict_dataloader(self):
                return DataLoader(TensorDataset(torch.randn(300 * 64, 1)), batch_size=64)

        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        writer = PredictionWriter({str(tmp_path / "out")!r})
        result = Trainer(callbacks=[writer], enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False).predict(Wide(), return_predictions=False)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"grew_mib": (after - before) / 1024, "result": result}}))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    files = sorted(os.listdir(tmp_path / "out"))
    assert report["result"] is None and len(files) == 300 and files[0] == "predictions_rank0_batch000000.pt"
    assert report["grew_mib"] < 60, report  # 300 MiB of predictions were made; they never sat in memory together
    last = torch.load(tmp_path / "out" / files[-1], weights_only=True)
    assert last["indices"] == list(range(299 * 64, 300 * 64)) and last["predictions"].shape == (64, 4096)


def test_prediction_writer_rejects_an_unknown_interval():
    with pytest.raises(MisconfigurationError) as info:
        PredictionWriter("out", write_interval="step")
    assert info.value.what == "PredictionWriter(write_interval='step') is not valid."
