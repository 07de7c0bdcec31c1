"""Smoke runs of benchmarks/: they still run and compare the same work (timings are printed, never asserted).
Each is kept small (seconds on an idle 2-core machine): on a busy one they must still end well within pytest's
300 s timeout."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIGHTNING = importlib.util.find_spec("lightning") is not None


def _run(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TASKFIT_SEED", None)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _main(name: str, *args: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """benchmarks/<name>.py's main() in this process, with ``args`` as its command line: what it prints."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    assert module.main() == 0
    return capsys.readouterr().out


def test_overhead_benchmark_trains_exactly_what_the_hand_written_loop_trains():
    out = _run("benchmarks/overhead.py", "--quick", "--epochs", "2", "--workload", "tiny MLP", "--no-lightning",
               "--no-memory", "--no-import")
    rows = [line for line in out.splitlines() if line.startswith("| tiny MLP |")]
    variants = [row.split("|")[2].strip() for row in rows]
    # separate processes: hand, defaults, all off; alternating: hand, taskfit; interleaved: taskfit and the
    # harness check (hand in the Trainer's place)
    assert variants == ["hand", "taskfit, defaults", "taskfit, all off", "hand", "taskfit", "taskfit",
                        "hand in the Trainer's place (harness check)"], out
    diffs = [row.rstrip(" |").rsplit("|", 1)[-1].strip() for row in rows]
    assert diffs == ["0.0e+00"] * 7, out  # same data order, same arithmetic: bit-for-bit equal parameters
    for row in rows[:3] + rows[5:]:
        ratios = re.findall(r"\| (\d+\.\d{3}) \[(\d+\.\d{3})-(\d+\.\d{3})\] \|", row)
        assert ratios and float(ratios[0][1]) <= float(ratios[0][0]) <= float(ratios[0][2]), row


def test_hook_costs_lists_every_default_callback_s_epoch_costs():
    out = _run("benchmarks/hook_costs.py", "--epochs", "3")
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    for name in ("ModelCheckpoint.on_train_epoch_end", "TensorBoardLogger.on_log", "ProgressBar.on_train_epoch_end",
                 "LearningRateMonitor.on_log_interval", "ThroughputMonitor.on_log_interval"):
        assert any(f"`{name}`" in row for row in rows), out
    assert not any("fit_start" in row for row in rows), out  # once per fit, not an epoch's cost
    share = re.search(r"All hooks but fit start: ([\d.]+) ms per epoch, ([\d.]+)% of an epoch", out)
    assert share and 0 < float(share.group(2)) < 100, out


def test_gpu_benchmark_quick_runs_on_the_cpu():
    out = _run("benchmarks/gpu.py", "--quick", "--strategies", "single,dp")  # fsdp: 2 more processes, minutes when busy
    rows = {tuple(cell.strip() for cell in line.split("|")[1:4]) for line in out.splitlines()
            if line.startswith("| fp32") or line.startswith("| bf16")}
    assert {("fp32", "single", "hand"), ("fp32", "single", "taskfit"), ("bf16", "single", "hand"),
            ("bf16", "single", "taskfit")} <= rows, out
    assert "dp skipped" in out  # says why a row is missing instead of leaving it out silently


@pytest.mark.skipif(LIGHTNING, reason="Lightning is installed: the comparison below runs instead")
def test_lightning_parity_says_how_to_install_lightning(monkeypatch, capsys):
    out = _main("lightning_parity", "--only", "val_check_interval", monkeypatch=monkeypatch, capsys=capsys)
    assert "not installed" in out and "pip install lightning" in out  # CI: no Lightning


def test_lightning_parity_rows_agree_where_lightning_is_installed(tmp_path):
    pytest.importorskip("lightning")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "lightning_parity.py"), "--only",
                           "val_check_interval"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| val_check_interval |")]
    assert len(rows) == 5 and all(row.rstrip(" |").endswith("yes") for row in rows), proc.stdout


@pytest.mark.skipif(LIGHTNING, reason="Lightning is installed: the comparison below runs instead")
def test_lightning_ports_say_how_to_install_lightning(monkeypatch, capsys):
    out = _main("lightning_ports", "--only", "autoencoder", "--quick", monkeypatch=monkeypatch, capsys=capsys)
    assert "not installed" in out and "pip install lightning" in out  # CI: no Lightning


def test_lightning_ports_run_the_same_numbers_where_lightning_is_installed(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("jsonargparse", reason="the autoencoder's LightningCLI needs jsonargparse")
    pytest.importorskip("sklearn", reason="the ported examples use scikit-learn's bundled digits")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "lightning_ports.py"), "--only",
                           "autoencoder", "--quick"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [row] = [line for line in proc.stdout.splitlines() if line.startswith("| autoencoder")]
    assert "(0.0e+00 relative)" in row and "max difference 0.0e+00" in row and "the same" in row, row
    assert "image grids: 4 of 4 byte-identical" in row, row


def test_step_budget_prices_each_piece_of_the_step_on_the_same_work():
    out = _run("benchmarks/step_budget.py", "--reps", "1", "--epochs", "2")
    rows = [line for line in out.splitlines() if line.startswith("| the ") or line.startswith("| reduced")
            or line.startswith("| harness")]
    assert len(rows) == 8, out  # the Trainer, the reduced step, three pieces back, two loop cuts, the harness check
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and cells[-1] == "0.0e+00", row  # every variant did the hand loop's exact work
    assert all(re.fullmatch(r"[+-]\d+\.\d\d", row.split("|")[4].strip()) for row in rows[:-1]), out


def test_revisions_times_this_checkout_against_a_git_revision_in_its_own_package():
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("benchmarks/revisions.py reads revisions from git: not a git checkout")
    out = _run("benchmarks/revisions.py", "HEAD", "--procs", "1", "--runs", "1", "--epochs", "2")
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")
            and not line.startswith("| revision")}
    assert set(rows) == {"this checkout", "HEAD"}, out  # each timed from its own copy (the child checks which)
    for row in rows.values():
        ratio, trainer_ms, hand_ms = (float(row.split("|")[i]) for i in (2, 4, 5))
        assert ratio > 0 and trainer_ms > 0 and hand_ms > 0, row


def test_revisions_names_a_revision_git_cannot_read_before_any_run():
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("benchmarks/revisions.py reads revisions from git: not a git checkout")
    proc = subprocess.run([sys.executable, "benchmarks/revisions.py", "no-such-revision"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "git cannot read revision 'no-such-revision'" in proc.stderr and "HINT:" in proc.stderr, proc.stderr


def test_tuning_benchmark_prices_averaging_and_the_profiler():
    out = _run("benchmarks/tuning.py", "--reps", "1", "--epochs", "1")
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for name in ("plain", "EMAWeightAveraging (every step)", "StochasticWeightAveraging (per epoch)", "SimpleProfiler"):
        assert name in rows, out
    assert re.search(r"\d+\.\d us per update", rows["EMAWeightAveraging (every step)"]), out
    accounted = re.search(r"table accounts for ([\d.]+)% of trainer.fit's wall time", out)
    assert accounted and 0 < float(accounted.group(1)) <= 100.5, out


def test_checkpoint_stall_prints_one_row_per_variant_and_the_resume_table():
    out = _run("benchmarks/checkpoint_stall.py", "--quick")
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    variants = ["torch.save", "dcp async_save", "dcp async_save, reused stager", "taskfit"]
    assert rows[:5] == ["variant", *variants], out
    table = [line for line in out.splitlines() if line.startswith("| taskfit |")][0]
    cells = [cell.strip() for cell in table.strip("|").split("|")]
    assert len(cells) == 9 and all(float(c) == float(c) for c in cells[1:5]), table  # numbers, not NaN
    assert ("| lightning |" in out) != ("Lightning is not installed" in out), out  # a row, or why there is none
    assert "| taskfit | " in out.split("resume of the taskfit checkpoint")[1] and "| torch.load |" in out, out


# Each table on its own, its variants in one process (--quick): the work of each test is two tiny fits,
# or three tiny fsdp fits of 2 gloo processes, so that a machine shared with other work does not push it
# past the suite's per-test limit (the whole benchmark, 6 interpreters and 6 ranks, did: 300 s under load).
def test_model_memory_compares_activation_checkpointing_on_the_same_weights():
    out = _run("benchmarks/model_memory.py", "--quick", "--part=checkpointing")
    ac = [line for line in out.splitlines() if line.startswith(("| None |", "| {Block} |"))]
    assert len(ac) == 2 and "init_module" not in out, out
    # checkpointing trains the same weights
    assert float(ac[1].rstrip(" |").rsplit("|", 1)[-1]) <= 1e-6, out


def test_model_memory_compares_the_empty_init_under_fsdp_on_the_same_weights():
    out = _run("benchmarks/model_memory.py", "--quick", "--part=fsdp")
    meta = [line for line in out.splitlines() if line.startswith(("| eager |", "| init_module"))]
    assert len(meta) == 2 and "activation_checkpointing" not in out, out
    # so does the empty build under fsdp
    assert float(meta[1].rstrip(" |").rsplit("|", 1)[-1]) <= 1e-6, out
