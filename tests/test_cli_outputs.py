"""What a real `taskfit` run leaves behind, in a subprocess: taskfit.log holds what the terminal showed (once, without
a prefix), mode=test/predict evaluate a checkpoint (and refuse a missing one before building anything), and a
joblib sweep names its jobs by their values, keeps its summary and shows the swept key in a real TensorBoard."""
from __future__ import annotations

import importlib.util
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import yaml
from tb_server import hparams_view, serve
from test_cli import TINY, load_ckpt, run_dirs, taskfit

PROBE = '''
import os, signal, warnings
from taskfit.callbacks import Callback


class Probe(Callback):
    """Warns at fit start; sends this process SIGTERM once global step `kill_at_step` is done."""

    def __init__(self, kill_at_step: int = 0):
        self.kill_at_step = kill_at_step

    def on_fit_start(self, trainer, task):
        warnings.warn("probe: a warning at fit start", UserWarning)

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if self.kill_at_step and trainer.state.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGTERM)


class Boom:
    def __init__(self, **kwargs):
        raise RuntimeError("the task was built")
'''
COMMON = ["debug=limit", "trainer.limit_train_batches=3", "task.channels=4", "task.hidden=8", "task.scheduler=null",
          "+callbacks.probe._target_=probe.Probe"]
_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[([\w.]+)\]\[(\w+)\] - ", re.M)


def log_records(path: Path) -> list[tuple[str, str, str]]:
    """(logger, level, message) of each record of a Hydra job log (a message may span lines)."""
    text = path.read_text()
    starts = list(_PREFIX.finditer(text))
    return [(m.group(1), m.group(2), text[m.end():(starts[i + 1].start() if i + 1 < len(starts) else len(text))]
             .rstrip("\n")) for i, m in enumerate(starts)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, object]:
    """One real run: 1 epoch of 3 batches, a model summary, a warning, a test pass."""
    root = tmp_path_factory.mktemp("trained")
    (root / "probe.py").write_text(PROBE)
    result = taskfit(*COMMON, "trainer.max_epochs=1", cwd=root)
    (run,) = run_dirs(root, "debug_digits")
    return root, run, result


# ---- taskfit.log: the terminal's lines, time-stamped -------------------------------------------------------
def test_taskfit_log_holds_what_the_run_printed_and_the_terminal_shows_it_once(trained):
    root, run, result = trained
    records = log_records(run / "taskfit.log")
    by_logger = {}
    for name, level, message in records:
        by_logger.setdefault(name, []).append((level, message))
    summary = by_logger["taskfit.summary"][0][1]
    assert "Name" in summary.splitlines()[0] and "trainable params" in summary  # the whole table, one record
    (epoch,) = [m for _, m in by_logger["taskfit.progress"]]
    assert epoch.startswith("Epoch 0/0: 100%|") and "3/3" in epoch and "val/loss=" in epoch
    assert by_logger["taskfit.throughput"][0][1].startswith("Throughput: ")
    (warning,) = [m for level, m in by_logger["taskfit.warnings"] if "probe:" in m]
    assert "UserWarning: probe: a warning at fit start" in warning
    (report,) = [m for _, m in by_logger["taskfit.cli"]]
    assert report.startswith("taskfit: done in ") and f"run directory:   {run}" in report and "test:" in report

    # The terminal: each of these lines exactly once, as printed (no Hydra prefix on any of taskfit's lines).
    out, err = result.stdout, result.stderr
    for text in (summary, epoch, report):
        assert out.count(text) == 1, text
    assert err.count("UserWarning: probe: a warning at fit start") == 1 and "probe:" not in out
    assert "][taskfit" not in out + err


def test_resume_early_stopping_and_preemption_messages_reach_the_log(trained):
    """Resumed, EarlyStopping stops at the epoch's validation, and a SIGTERM right after saves and exits 143."""
    root, first, _ = trained
    result = taskfit(*COMMON, "trainer.max_epochs=3", "ckpt_path=last", "+callbacks.probe.kill_at_step=6",
                     "callbacks.early_stopping.stopping_threshold=1000", cwd=root, expect=128 + signal.SIGTERM)
    (run,) = [d for d in run_dirs(root, "debug_digits") if d != first]
    records = log_records(run / "taskfit.log")
    (resumed,) = [m for name, _, m in records if m.startswith("Resumed from ")]
    assert resumed.startswith(f"Resumed from {first}/version_0/checkpoints/last.ckpt: epoch 1, batch 0, global step 3")
    (stop,) = [m for name, _, m in records if name == "taskfit.early_stopping"]
    assert stop.startswith("EarlyStopping: stopping at epoch 1 (global step 6): Stopping threshold reached: "
                           "val/loss = ")
    (preempted,) = [(level, m) for name, level, m in records if name == "taskfit.preemption"]
    assert preempted[0] == "WARNING" and preempted[1].startswith("taskfit: SIGTERM received; saved a checkpoint at ")
    assert "global step 6 to " in preempted[1]
    assert "with ckpt_path=last" in preempted[1]
    assert result.stdout.count(resumed) == 1 and result.stdout.count(stop) == 1
    assert result.stderr.count(preempted[1]) == 1


def test_outside_the_command_the_output_is_printed_once_and_the_logger_gets_it(capsys, tmp_path):
    import logging

    from taskfit import Trainer
    from taskfit.callbacks import EarlyStopping
    from tasks import RegressionTask

    root_handler = logging.StreamHandler()  # a script that configured logging (basicConfig) gets no second copy
    logging.getLogger().addHandler(root_handler)
    kept = []
    collector = logging.Handler()
    collector.emit = kept.append
    logging.getLogger("taskfit").addHandler(collector)
    try:
        Trainer(max_epochs=2, enable_checkpointing=False, logger=False, default_root_dir=str(tmp_path),
                callbacks=[EarlyStopping(stopping_threshold=1e9)]).fit(RegressionTask(n=32, val_n=8))
    finally:
        logging.getLogger().removeHandler(root_handler)
        logging.getLogger("taskfit").removeHandler(collector)
    out, err = capsys.readouterr()
    messages = [r.getMessage() for r in kept]
    # EarlyStopping decides after the other callbacks (order 990), so its line follows the epoch's
    assert [r.name for r in kept] == ["taskfit.summary", "taskfit.progress", "taskfit.early_stopping"]
    for message in messages:
        assert out.count(message) == 1, message  # printed to stdout as before
        assert message not in err  # the root handler did not print it again
    assert messages[2].startswith("EarlyStopping: stopping at epoch 0") and messages[1].startswith("Epoch 0/1: 100%|")


def test_on_a_terminal_the_bar_stays_there_and_the_log_gets_one_line_per_epoch(tmp_path):
    import io
    import logging

    from taskfit import Trainer
    from taskfit.callbacks import ProgressBar
    from tasks import RegressionTask

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen, kept = Terminal(), []
    collector = logging.Handler()
    collector.emit = kept.append
    logging.getLogger("taskfit").addHandler(collector)
    try:
        Trainer(max_epochs=2, enable_checkpointing=False, enable_model_summary=False, logger=False,
                default_root_dir=str(tmp_path), callbacks=[ProgressBar(stream=screen)]).fit(RegressionTask(n=32))
    finally:
        logging.getLogger("taskfit").removeHandler(collector)
    assert [r.getMessage()[:17] for r in kept] == ["Epoch 0/1: 100%|█", "Epoch 1/1: 100%|█"]
    shown = screen.getvalue()
    assert "\r" in shown and shown.count("\n") == 2  # the two bars (left on screen), no extra line per epoch


def test_ckpt_path_last_with_nothing_to_resume_warns_without_a_source_line(tmp_path):
    """The command has no line of the user's to show: the warning is its message, not one of
    taskfit's source lines under a taskfit file name (nor Python's `sys:1:`)."""
    result = taskfit(*TINY, "test=false", "ckpt_path=last", cwd=tmp_path)
    lines = result.stderr.splitlines()
    warned = "no earlier run named 'digits' has a last.ckpt"
    (i,) = [i for i, line in enumerate(lines) if warned in line]
    assert lines[i].startswith("UserWarning: ckpt_path=last: "), lines[i]
    assert ".py:" not in result.stderr and "sys:1" not in result.stderr, result.stderr
    assert "find_last_checkpoint" not in result.stderr  # (the source line under the warning before)


# ---- mode=test and mode=predict ----------------------------------------------------------------------------
def test_mode_test_and_predict_evaluate_a_checkpoint(trained, tmp_path):
    root, run, _ = trained
    (best,) = [p for p in (run / "version_0" / "checkpoints").glob("epoch=*.ckpt")]
    out = taskfit(*COMMON, "mode=test", f'ckpt_path="{best}"', cwd=root).stdout
    tested = next(d for d in run_dirs(root, "debug_digits") if yaml.safe_load((d / "config.yaml").read_text())
                  .get("mode") == "test")
    assert f"checkpoint:      {best}" in out and "taskfit: test in " in out
    loss = float(re.search(r"test/loss=([\d.e+-]+)", out).group(1))
    from test_cli import read_events

    events = read_events(tested / "version_0").Scalars("~test/loss")  # TensorBoard's tag: after the curves
    assert [e.step for e in events] == [0] and events[0].value == pytest.approx(loss, rel=1e-3)  # a run of its own
    assert "taskfit: test in " in (tested / "taskfit.log").read_text()

    preds = tmp_path / "preds"
    out = taskfit(*COMMON, "mode=predict", f'ckpt_path="{best}"', f"predict.output_dir={preds}", cwd=root).stdout
    files = sorted(preds.glob("predictions_rank0_batch*.pt"))
    assert [f.name for f in files] == ["predictions_rank0_batch000000.pt", "predictions_rank0_batch000001.pt"]
    assert f"predictions:     {preds}  (2 file(s), from DigitsTask.test_dataloader())" in out
    first = torch.load(files[0], weights_only=True)
    assert first["indices"] == list(range(256)) and first["predictions"].shape == (256, 10)

    from taskfit.examples.digits import DigitsTask

    task = DigitsTask(channels=4, hidden=8).eval()  # the same weights, in this process
    task.load_state_dict(load_ckpt(best)["module"])
    inputs = task.test_set.tensors[0][:256]
    with torch.no_grad():
        assert torch.allclose(first["predictions"], task(inputs), atol=1e-5)


def test_evaluating_without_a_usable_checkpoint_fails_before_anything_is_built(trained):
    root, _, _ = trained
    before = run_dirs(root, "debug_digits")
    err = taskfit(*COMMON, "mode=predict", "ckpt_path=missing.ckpt", "task._target_=probe.Boom", cwd=root,
                  expect=1).stderr
    assert f"CheckpointError: Checkpoint {root / 'missing.ckpt'} does not exist." in err
    assert "the task was built" not in err  # the checkpoint was checked before the task
    assert run_dirs(root, "debug_digits") == before  # and the run directory is removed


def test_check_checkpoint_reads_headers_and_explains(tmp_path):
    from taskfit.cli.modes import check_checkpoint, check_checkpoint_arg, check_mode
    from taskfit.errors import CheckpointError, MisconfigurationError

    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a PyTorch checkpoint of tensors"):
        check_checkpoint(str(tmp_path / "text.ckpt"))
    torch.save({"epoch": 3}, tmp_path / "empty.ckpt")
    with pytest.raises(CheckpointError, match="holds no model weights"):
        check_checkpoint(str(tmp_path / "empty.ckpt"))
    torch.save({"w": torch.zeros(2)}, tmp_path / "weights.pt")
    check_checkpoint(str(tmp_path / "weights.pt"))  # weights only: fine for evaluation
    with pytest.raises(MisconfigurationError, match=r"mode=test needs a checkpoint, but ckpt_path is null"):
        check_checkpoint_arg("test", None, "digits")
    with pytest.raises(MisconfigurationError, match=r"mode=predict with ckpt_path=best"):
        check_checkpoint_arg("predict", "best", "digits")
    with pytest.raises(MisconfigurationError, match=r"mode='tset' is not a mode"):
        check_mode({"mode": "tset"})
    with pytest.raises(MisconfigurationError, match=r"predict.dataloader='train' is not valid"):
        check_mode({"mode": "predict", "predict": {"dataloader": "train"}})


# ---- a sweep with the joblib launcher, seen in a real TensorBoard -------------------------------------------
JOBLIB = importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is not None


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, str]:
    """`taskfit -m task.optimizer.lr=0.1,0.01`, tiny, with Hydra's joblib launcher when it is installed."""
    root = tmp_path_factory.mktemp("sweep")
    launcher = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"] if JOBLIB else []
    out = taskfit("-m", *launcher, "task.optimizer.lr=0.1,0.01", *TINY, "test=false", cwd=root).stdout
    (sweep_dir,) = (root / "logs" / "digits" / "multiruns").iterdir()
    return sweep_dir, out


@pytest.mark.skipif(not JOBLIB, reason="hydra-joblib-launcher is not installed (pip install hydra-joblib-launcher)")
def test_a_joblib_sweep_keeps_its_summary_and_job_names(sweep):
    sweep_dir, out = sweep
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0_lr=0.1", "1_lr=0.01"]
    summary = yaml.safe_load((sweep_dir / "sweep_summary.yaml").read_text())
    assert [(j["job"], j["overrides"][0], j["status"]) for j in summary["jobs"]] == [
        (0, "task.optimizer.lr=0.1", "ok"), (1, "task.optimizer.lr=0.01", "ok")]
    assert [Path(j["run_dir"]).name for j in summary["jobs"]] == ["0_lr=0.1", "1_lr=0.01"]
    assert all(j["monitor"] == "val/loss" and j["score"] > 0 for j in summary["jobs"])
    assert summary["best_job"] == min(summary["jobs"], key=lambda j: j["score"])["job"]
    assert "Sweep summary: 2 job(s)" in out and "Best (*): job" in out
    assert f"Compare the runs: tensorboard --logdir {sweep_dir}" in out  # runs then named 0_lr=0.1/version_0...
    assert not (sweep_dir / ".taskfit_jobs").exists()  # the rows the jobs wrote are in the summary now
    for job in ("0_lr=0.1", "1_lr=0.01"):  # each worker's lines went to its own job's log
        assert "taskfit: done in" in (sweep_dir / job / "taskfit.log").read_text()


def test_tensorboard_lists_the_swept_key_with_both_values_and_the_metrics(sweep):
    sweep_dir, _ = sweep
    with serve(sweep_dir) as base:
        view = hparams_view(base)
    assert view["runs"] == ["0_lr=0.1/version_0", "1_lr=0.01/version_0"]  # the legend tells the runs apart
    names = view["hparams"]  # a sweep's columns: what it varies, ticked as opened (its constants would be ticked too)
    assert names == ["task.optimizer.lr"] and view["differs"] == ["task.optimizer.lr"]
    assert view["metrics"][:4] == ["val/loss", "~best/val/loss", "val/acc", "~best/val/acc"]
    assert view["shown"][:2] == ["val/loss", "best val/loss"]
    by_lr = {values["task.optimizer.lr"]: metrics for values, metrics in view["sessions"]}
    assert set(by_lr) == {0.1, 0.01}
    for metrics in by_lr.values():
        assert {"val/loss", "~best/val/loss", "val/acc", "~best/val/acc", "train/loss_epoch"} <= set(metrics)
        assert metrics["~best/val/loss"] <= metrics["val/loss"] + 1e-6
    tags = view["scalar_tags"]
    assert sorted(tags)[-1].startswith("~best/") and sorted(tags)[0] == "train/loss"  # the curves first, best/* last
    assert view["text_tags"] == ["config"]


@pytest.mark.slow
def test_screenshot_of_the_hparams_tab(sweep, tmp_path):
    """A look as a person has it: headless Chromium renders the HParams tab of the sweep (skipped without it)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no headless Chromium on this machine")
    from tb_server import screenshot

    sweep_dir, _ = sweep
    with serve(sweep_dir) as base:
        png = screenshot(browser, f"{base}/#hparams", tmp_path / "hparams.png")
    if png is None:
        pytest.skip("Chromium could not take a screenshot here")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") == 1400
    assert len(data) > 20_000  # a rendered page, not a blank one (a blank 1400x1000 PNG is a few KB)
