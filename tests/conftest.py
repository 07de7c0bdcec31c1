"""Shared test setup: one torch thread (the machine has 2 cores and tests run subprocesses too)."""
from __future__ import annotations

import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout (tests import the installed taskfit)
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_test(monkeypatch, tmp_path):
    """Each test starts unseeded, outside any SLURM job, in its own working directory (so ./taskfit_logs never lands in the checkout)."""
    monkeypatch.delenv("TASKFIT_SEED", raising=False)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:  # pytest inside a SLURM job: no run is a task
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def quiet():
    """Trainer kwargs for tests that do not look at progress, summary, checkpoints or TensorBoard."""
    return dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)
