"""The examples gallery runs: each example is started as a user would (``python examples/x.py``), in a fresh
working directory, and must reach its stated quality and leave a run directory with TensorBoard event files.

Each example takes ``--quick`` (or ``TASKFIT_QUICK=1``) for small settings. The main job's >= 95% claim at full
settings is checked in-process by tests/test_core.py; here digits runs its quick mode (3 epochs).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("sklearn", reason="the examples use scikit-learn's bundled data sets (pip install -e '.[examples]')")


def run_example(script: str, tmp_path: Path, *args: str, timeout: float = 120) -> str:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TASKFIT_SEED", None)
    env.pop("TASKFIT_QUICK", None)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def run_directory(stdout: str, tmp_path: Path) -> Path:
    """The run directory the example printed: under the working directory, with TensorBoard event files."""
    match = re.search(r"run directory: ([^);]+)\)", stdout)
    assert match, f"the example did not print its run directory:\n{stdout[-2000:]}"
    path = Path(match.group(1).strip())
    assert path.is_dir() and tmp_path in path.parents, path
    assert list(path.rglob("events.out.tfevents.*")), f"no TensorBoard event files under {path}"
    return path


def test_digits_main_job(tmp_path):
    out = run_example("digits.py", tmp_path, "--quick")
    accuracy = float(re.search(r"validation accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.9, out[-2000:]  # 3 epochs; chance is 0.1
    run_directory(out, tmp_path)
    # stdout is not a terminal here: the progress bar writes a line per epoch, not one per step
    assert 1 <= len([line for line in out.splitlines() if line.startswith("Epoch ")]) <= 3, out


def test_diabetes_regression(tmp_path):
    out = run_example("diabetes.py", tmp_path, "--quick", "--root", str(tmp_path / "runs"))
    r2, mae = map(float, re.search(r"test R\^2: ([-0-9.]+)\s+test MAE: ([0-9.]+)", out).groups())
    # Predicting the training mean gives R^2 <= 0 and MAE ~ 65; least squares gives R^2 0.43 on this split.
    assert r2 > 0.25 and mae < 55, out[-2000:]
    assert (tmp_path / "runs") in run_directory(out, tmp_path).parents


def test_sequence_model_needs_memory(tmp_path):
    out = run_example("sequence.py", tmp_path, "--quick")
    accuracy = float(re.search(r"validation accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.9, out[-2000:]  # chance is 1/8
    run_directory(out, tmp_path)


def test_recall_task_cannot_be_solved_without_memory():
    """The synthetic task really needs memory: the label is not a function of the token counts."""
    import torch

    from taskfit.examples.sequence import MARKER, VOCAB, RecallDataset

    data = RecallDataset(2048, length=16, seed=0)
    rows = torch.arange(len(data))
    marker_at = (data.tokens == MARKER).int().argmax(1)
    assert torch.equal(data.tokens[rows, marker_at + 1] - 1, data.labels)
    # A bag-of-tokens baseline: the most frequent symbol of each sequence is right ~27% of the time (chance 1/8).
    counts = torch.stack([(data.tokens == t).sum(1) for t in range(1, VOCAB + 1)], 1)
    bag_accuracy = (counts.argmax(1) == data.labels).float().mean().item()
    assert bag_accuracy < 0.35, bag_accuracy
