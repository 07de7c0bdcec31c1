"""TensorBoardLogger: what the Trainer publishes is in the event files, read back with TensorBoard's own reader
(EventAccumulator) and served by a real ``tensorboard`` process; HParams carry hyperparameters and metric values.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from taskfit import MisconfigurationError, Trainer, seed_everything
from taskfit.callbacks import Callback, EarlyStopping, TensorBoardLogger
from tasks import ClassifierTask, RegressionTask
from tb_server import free_port, get

ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def read_run(path) -> "EventAccumulator":  # noqa: F821
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0})
    run.Reload()
    return run


def scalars(run, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in run.Scalars(tag)]


def hparams_data(run) -> dict:
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    content = run.PluginTagToContent("hparams")
    return {tag.split("/")[-1]: HParamsPluginData.FromString(raw) for tag, raw in content.items()}


def event_files(root) -> list[Path]:
    return sorted(Path(root).rglob("events.out.tfevents.*"))


class Recorder(Callback):
    """Keeps every ``on_log`` call: (the step loggers record it at, values), to compare with the event files."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def on_log(self, trainer, task, metrics):
        self.calls.append((trainer.state.log_step, dict(metrics)))


# ---- scalars ----------------------------------------------------------------------------------------------
def test_scalars_in_event_files_are_what_was_logged(tmp_path):
    recorder = Recorder()
    task = ClassifierTask()  # 96 samples, batch 16: 6 steps per epoch; logs acc_batch with self.log
    trainer = Trainer(max_epochs=2, log_every_n_steps=2, default_root_dir=str(tmp_path), callbacks=[recorder],
                      **QUIET)
    trainer.fit(task)
    assert Path(trainer.log_dir) == tmp_path / "version_0"
    run = read_run(trainer.log_dir)

    expected = defaultdict(list)
    for step, metrics in recorder.calls:
        for key, value in metrics.items():
            expected[key].append((step, value))
    tags = set(run.Tags()["scalars"])
    assert tags - set(expected) == {"~best/val/loss", "~best/val/acc", "~best/val/acc_batch", "~best/train/loss_epoch"}
    assert set(expected) <= tags and not any(tag.startswith(("lr/", "perf/", "test/")) for tag in tags)
    for key, points in expected.items():  # event files store float32
        assert scalars(run, key) == [(s, pytest.approx(v, rel=1e-6, abs=1e-9)) for s, v in points], key

    assert [s for s, _ in scalars(run, "train/loss")] == [1, 3, 5, 7, 9, 11]  # Lightning's steps
    assert [s for s, _ in scalars(run, "train/acc_batch")] == [1, 3, 5, 7, 9, 11]  # self.log in loss()
    for tag in ("val/loss", "val/acc", "train/loss_epoch", "vitals/epoch_time_s"):  # acc_batch: per step only
        assert [s for s, _ in scalars(run, tag)] == [5, 11], tag
    assert scalars(run, "vitals/lr/SGD/pg0") == [(s, pytest.approx(0.1)) for s in (1, 3, 5, 7, 9, 11)]
    assert all(v > 0 for _, v in scalars(run, "vitals/samples_per_sec"))
    assert scalars(run, "~best/val/loss")[0][1] == pytest.approx(min(v for _, v in scalars(run, "val/loss")))

    # The logged val/loss is what trainer.validate returns for the same weights; validate and test write
    # into the same run directory, at the run's count of stepped batches (12, as Lightning's).
    final_val = scalars(run, "val/loss")[-1][1]
    validated = trainer.validate(task)[0]
    tested = trainer.test(task)[0]
    assert validated["val/loss"] == pytest.approx(final_val, rel=1e-6)
    run = read_run(trainer.log_dir)
    assert scalars(run, "val/loss")[-1] == (12, pytest.approx(validated["val/loss"], rel=1e-6))
    assert scalars(run, "~test/loss") == [(12, pytest.approx(tested["test/loss"], rel=1e-6))]  # sorts last
    assert scalars(run, "~test/acc") == [(12, pytest.approx(tested["test/acc"], rel=1e-6))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0"]
    logger = next(cb for cb in trainer.callbacks if isinstance(cb, TensorBoardLogger))
    assert logger.experiment is None  # closed after fit, validate and test


def test_tensorboard_opens_on_the_model_curves(tmp_path):
    """TensorBoard's Scalars and Time Series tabs group tags by their first part, in name order, and open the first
    two groups only: those are train and val, also after a test pass; the learning rate and throughput come next
    (vitals), the one-point groups (best values, test results) last. The groups as they open: docs/logging.md."""
    task = ClassifierTask()
    trainer = Trainer(max_epochs=2, log_every_n_steps=2, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(task)
    trainer.test(task)
    tags = read_run(trainer.log_dir).Tags()["scalars"]
    groups = list(dict.fromkeys(tag.split("/")[0] for tag in sorted(tags)))  # no digits to sort: plain name order
    assert groups == ["train", "val", "vitals", "~best", "~test"], groups
    assert {"train/loss", "train/loss_epoch", "train/acc_batch", "val/loss", "val/acc"} <= set(tags)
    assert {"vitals/lr/SGD/pg0", "vitals/samples_per_sec", "vitals/epoch_time_s", "~test/acc", "~test/loss"} <= set(
        tags)


def test_one_event_per_step_and_a_key_logged_twice_keeps_both_values(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    class Twice(Callback):  # the same key twice at one step: both values must reach the file
        def on_train_epoch_end(self, trainer, task):
            trainer.log_metrics({"custom/x": 1.0})
            trainer.log_metrics({"custom/x": 2.0})

    trainer = Trainer(max_epochs=2, log_every_n_steps=2, default_root_dir=str(tmp_path), callbacks=[Twice()],
                      **QUIET)
    trainer.fit(ClassifierTask())  # 6 steps per epoch
    # at the epoch's last step (Lightning's: 5 and 11 after 6 and 12 optimizer steps)
    assert scalars(read_run(trainer.log_dir), "custom/x") == [(5, 1.0), (5, 2.0), (11, 1.0), (11, 2.0)]
    steps = [e.step for path in event_files(tmp_path) for e in LegacyEventFileLoader(str(path)).Load()
             if e.summary.value and all(v.HasField("simple_value") for v in e.summary.value)]
    # The loss, learning rate and throughput of an interval arrive in three on_log calls: one event. At 5 and
    # 11 the epoch's values and validation join it; custom/x's second value starts one more event there.
    assert steps == [1, 3, 5, 5, 7, 9, 11, 11, 11], steps


@pytest.mark.parametrize("send_secs", [3600.0, 0.0])
def test_scalars_reach_the_writer_in_one_batch_every_send_secs(tmp_path, monkeypatch, send_secs):
    """Each event handed to SummaryWriter wakes its thread, which takes the GIL from the loop (one wake-up per log
    interval cost a 0.14 s epoch ~4%): the events are kept and handed over together every SEND_SECS, and at the end
    nothing is missing. With SEND_SECS=0 every completed step's event goes over at the next log call."""
    import taskfit.callbacks.loggers.tensorboard as tb
    from torch.utils.tensorboard.writer import FileWriter

    monkeypatch.setattr(tb, "SEND_SECS", send_secs)
    handed: list[tuple[str, int]] = []  # (what happened, global step), in order
    add_summary = FileWriter.add_summary

    def spy(self, summary, global_step=None, *args, **kwargs):
        if summary.value and all(v.HasField("simple_value") for v in summary.value):
            handed.append(("scalars", global_step))
        return add_summary(self, summary, global_step, *args, **kwargs)

    monkeypatch.setattr(FileWriter, "add_summary", spy)

    class Mark(Callback):
        def on_train_epoch_end(self, trainer, task):
            handed.append(("epoch end", trainer.state.global_step))

    trainer = Trainer(max_epochs=3, log_every_n_steps=1, default_root_dir=str(tmp_path), callbacks=[Mark()], **QUIET)
    trainer.fit(ClassifierTask())  # 6 steps per epoch
    during = [step for what, step in handed[:handed.index(("epoch end", 18))] if what == "scalars"]
    if send_secs:  # nothing handed over while training: all of it at the end
        assert during == []
    else:  # each step's event as soon as the next one starts
        assert during == list(range(17)), during  # (Lightning's steps: from 0)
    assert [s for s, _ in scalars(read_run(trainer.log_dir), "train/loss")] == list(range(18))


def test_each_fit_gets_its_own_version_directory(tmp_path):
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(RegressionTask(n=16))
    first = trainer.log_dir
    trainer.max_epochs = 2  # this Trainer's next fit continues at epoch 1 (Lightning's counters), in a new run
    trainer.fit(RegressionTask(n=16))
    assert (Path(first).name, Path(trainer.log_dir).name) == ("version_0", "version_1")
    assert all(len(event_files(d)) == 1 for d in (first, trainer.log_dir))


# ---- hyperparameters ------------------------------------------------------------------------------------
def test_hparams_plugin_has_hyperparameters_and_metric_values(tmp_path):
    task = ClassifierTask(lr=0.05, hidden=8)
    stopper = EarlyStopping(monitor="val/acc", mode="max", patience=10)
    trainer = Trainer(max_epochs=3, default_root_dir=str(tmp_path), callbacks=[stopper], **QUIET)
    trainer.fit(task)
    run = read_run(trainer.log_dir)
    data = hparams_data(run)
    assert set(data) == {"session_start_info", "experiment", "session_end_info"}

    start = data["session_start_info"].session_start_info.hparams
    assert {k: start[k].number_value for k in start} == {"n": 96, "val_n": 45, "batch_size": 16, "lr": 0.05,
                                                         "hidden": 8}
    experiment = data["experiment"].experiment
    assert {h.name for h in experiment.hparam_infos} == set(task.hparams)
    metric_names = [m.name.tag for m in experiment.metric_infos]
    for key in ("val/loss", "val/acc", "train/loss_epoch", "~test/loss", "~test/acc"):
        assert key in metric_names and (key.startswith("~test/") or f"~best/{key}" in metric_names), key

    from tensorboard.plugins.hparams import api_pb2

    assert data["session_end_info"].session_end_info.status == api_pb2.STATUS_SUCCESS
    acc, loss = [v for _, v in scalars(run, "val/acc")], [v for _, v in scalars(run, "val/loss")]
    assert len(acc) == 3
    assert scalars(run, "~best/val/acc")[-1][1] == pytest.approx(max(acc))  # mode from EarlyStopping
    assert scalars(run, "~best/val/loss")[-1][1] == pytest.approx(min(loss))  # mode guessed from the name


def test_hparams_are_the_flattened_config_when_given(tmp_path):
    config = {"model": {"lr": 0.01, "layers": [4, 4], "act": None}, "trainer": {"max_epochs": 1}, "seed": 3}
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), config=config, **QUIET)
    trainer.fit(RegressionTask(n=16, val_n=8))
    start = hparams_data(read_run(trainer.log_dir))["session_start_info"].session_start_info.hparams
    assert set(start) == {"model.lr", "model.layers", "model.act", "trainer.max_epochs", "seed"}
    assert start["model.lr"].number_value == 0.01 and start["seed"].number_value == 3
    assert start["model.layers"].string_value == "[4, 4]" and start["model.act"].string_value == "None"


# ---- the writer closes whatever ends the fit -------------------------------------------------------------
class FailingTask(RegressionTask):
    """Trains normally, then ends the fit at step 3 with an error, a real SIGINT or a real SIGTERM."""

    def __init__(self, how: str = "error") -> None:
        super().__init__(n=64, batch_size=8)
        self.how, self.calls = how, 0

    def loss(self, outputs, targets):
        self.calls += 1
        if self.calls == 3:
            if self.how == "error":
                raise RuntimeError("boom at step 3")
            os.kill(os.getpid(), signal.SIGINT if self.how == "sigint" else signal.SIGTERM)
        return super().loss(outputs, targets)


@pytest.mark.parametrize("how, raised, status", [("error", RuntimeError, "STATUS_FAILURE"),
                                                 ("sigint", SystemExit, "STATUS_UNKNOWN"),
                                                 ("sigterm", SystemExit, "STATUS_UNKNOWN")])
def test_event_file_is_closed_when_fit_ends_abnormally(tmp_path, how, raised, status):
    logger = TensorBoardLogger()
    trainer = Trainer(max_epochs=2, log_every_n_steps=1, default_root_dir=str(tmp_path), callbacks=[logger],
                      **QUIET)
    # A job started in the background by a non-interactive shell inherits SIGINT ignored: Ctrl-C's default here.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(raised):
            trainer.fit(FailingTask(how))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert logger.experiment is None
    run = read_run(trainer.log_dir)
    steps = [s for s, _ in scalars(run, "train/loss")]
    # error: step 3 never finishes; a signal is handled at the step boundary (sigint: KeyboardInterrupt at once)
    assert steps[:2] == [0, 1] and steps[-1] <= 2  # (Lightning's steps: from 0)
    from tensorboard.plugins.hparams import api_pb2

    assert hparams_data(run)["session_end_info"].session_end_info.status == api_pb2.Status.Value(status)


# ---- optional: histograms and the graph ---------------------------------------------------------------------
class GraphTask(RegressionTask):
    def __init__(self) -> None:
        super().__init__(n=32, batch_size=8, dropout=0.5)  # dropout: the run depends on train mode and the RNG
        self.example_input_array = torch.zeros(2, 4)


def test_histograms_and_graph_when_asked(tmp_path):
    logger = TensorBoardLogger(histogram_every_n_steps=2, log_graph=True)
    assert isinstance(logger, TensorBoardLogger)
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), callbacks=[logger], seed=0, **QUIET)
    seed_everything(0)
    task = GraphTask()
    trainer.fit(task)
    run = read_run(trainer.log_dir)
    tags = run.Tags()
    assert tags["graph"] is True
    assert {"params/net.1.weight", "params/net.1.bias", "grads/net.1.weight", "grads/net.1.bias"} <= set(
        tags["histograms"])
    assert [e.step for e in run.Histograms("grads/net.1.weight")] == [0, 2, 4, 6]
    assert run.Histograms("params/net.1.weight")[0].histogram_value.num == 4  # a 1x4 weight

    # Tracing the graph does not disturb the run: same seed without the graph/histograms, same weights.
    seed_everything(0)
    plain = GraphTask()
    Trainer(max_epochs=2, logger=False, seed=0, **QUIET).fit(plain)
    assert all(torch.equal(a, b) for a, b in zip(task.state_dict().values(), plain.state_dict().values()))


def test_default_logger_costs_nothing_per_step():
    """Only a logger with histograms overrides on_before_optimizer_step (which the Trainer would call per step)."""
    from taskfit.callback import Callback as Base

    assert type(TensorBoardLogger()) is TensorBoardLogger
    assert TensorBoardLogger.on_before_optimizer_step is Base.on_before_optimizer_step
    assert type(TensorBoardLogger(histogram_every_n_steps=5)).on_before_optimizer_step \
        is not Base.on_before_optimizer_step


def test_bad_logger_arguments_are_explained(tmp_path):
    with pytest.raises(MisconfigurationError, match=r"histogram_every_n_steps=0\) is not valid"):
        TensorBoardLogger(histogram_every_n_steps=0)
    with pytest.raises(MisconfigurationError, match=r"invalid modes \{'val/acc': 'up'\}"):
        TensorBoardLogger(hparam_metrics={"val/acc": "up"})
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), callbacks=[TensorBoardLogger(log_graph=True)],
                      **QUIET)
    with pytest.raises(MisconfigurationError, match=r"log_graph=True\) needs RegressionTask.example_input_array"):
        trainer.fit(RegressionTask(n=16))


def test_importing_and_building_a_trainer_does_not_load_tensorboard():
    code = ("import sys, taskfit, taskfit.callbacks\nfrom taskfit import Trainer\nTrainer(max_epochs=1, "
            "enable_checkpointing=False)\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorboard' or "
            "m.startswith('torch.utils.tensorboard')))")
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- ddp: only rank 0 writes ----------------------------------------------------------------------------
def test_only_rank_zero_writes_event_files_under_ddp(tmp_path):
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, log_every_n_steps=2,
                      default_root_dir=str(tmp_path), **QUIET)
    metrics = trainer.fit(RegressionTask(n=64, batch_size=8, val_n=16))
    files = event_files(tmp_path)
    assert len(files) == 1, files  # rank 1 created no writer and no file
    assert files[0].parent == Path(trainer.log_dir) == tmp_path / "version_0"
    assert files[0].name.split(".")[4] != str(os.getpid())  # written by a worker, not by this process
    run = read_run(trainer.log_dir)
    # 32 samples per rank: 4 steps per epoch, logged at Lightning's steps 1, 3, 5, 7
    assert [s for s, _ in scalars(run, "train/loss")] == [1, 3, 5, 7]
    assert scalars(run, "val/loss")[-1] == (7, pytest.approx(metrics["val/loss"], rel=1e-6))


# ---- a real TensorBoard serves the runs of a sweep ------------------------------------------------------------
def test_tensorboard_serves_runs_tags_and_hparams(tmp_path):
    results = {}
    for lr in (0.05, 0.2):  # a two-run "sweep"
        trainer = Trainer(max_epochs=2, log_every_n_steps=2, default_root_dir=str(tmp_path), **QUIET)
        results[lr] = trainer.fit(ClassifierTask(lr=lr))
    port = free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path), "--port", str(port),
               "--host", "127.0.0.1", "--load_fast", "false", "--reload_interval", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        tags, deadline = {}, time.monotonic() + 90
        while time.monotonic() < deadline and server.poll() is None:
            try:
                tags = get(f"{base}/data/plugin/scalars/tags")
                if {"version_0", "version_1"} <= set(tags):
                    break
            except OSError:  # not listening yet
                pass
            time.sleep(0.5)
        assert server.poll() is None, f"tensorboard exited: {server.stderr.read()[-2000:]}"
        assert {"version_0", "version_1"} <= set(tags), f"runs not listed within 90 s: {tags}"
        for run in ("version_0", "version_1"):
            assert {"train/loss", "val/loss", "val/acc", "vitals/lr/SGD/pg0", "~best/val/loss"} <= set(tags[run])

        request = {"experimentName": "", "startIndex": 0, "sliceSize": 10,
                   "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
                   "colParams": [{"hparam": "lr"}, {"metric": {"tag": "val/loss", "group": ""}}]}
        groups = get(f"{base}/data/plugin/hparams/session_groups", request)["sessionGroups"]
        by_lr = {g["hparams"]["lr"]: {m["name"]["tag"]: m["value"] for m in g["metricValues"]} for g in groups}
        assert set(by_lr) == {0.05, 0.2}
        for lr, metrics in results.items():
            assert by_lr[lr]["val/loss"] == pytest.approx(metrics["val/loss"], rel=1e-6)
            assert by_lr[lr]["val/acc"] == pytest.approx(metrics["val/acc"], rel=1e-6)
            assert "~best/val/loss" in by_lr[lr] and "train/loss_epoch" in by_lr[lr]
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)


# ---- the gallery example: a user-written callback ------------------------------------------------------------
def test_custom_callback_example_writes_images_and_text(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TASKFIT_QUICK", None)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_callback.py"), "--quick", "--root",
                          str(tmp_path / "runs")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    run = read_run(tmp_path / "runs" / "version_0")
    assert [e.step for e in run.Images("samples/images")] == [4, 8]  # after each validation (every 4 batches)
    image = run.Images("samples/images")[-1]
    assert (image.width, image.height) == (8 * 32, 2 * 32)  # a grid of 16 zoomed 8x8 digits (8 per row)
    texts = run.Tensors("samples/predictions/text_summary")
    assert [t.step for t in texts] == [4, 8]
    table = texts[-1].tensor_proto.string_val[0].decode()
    assert table.startswith("| # | label | prediction | confidence |") and table.count("\n") == 17


# ---- HParams as the tab opens: chosen hyperparameters, the varied ones first, metrics in order, the config ----
def test_hparams_varying_keys_metric_order_and_the_config_text(tmp_path):
    config = {"task": {"lr": 0.05, "hidden": 8}, "trainer": {"max_epochs": 2}, "paths": {"log_dir": "logs"}}
    logger = TensorBoardLogger(hparams={"task.lr": 0.05, "task.hidden": 8, "trainer.max_epochs": 2, "act": None},
                               varying=["task.lr"])
    stopper = EarlyStopping(monitor="val/acc", mode="max", patience=10)
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), callbacks=[logger, stopper], config=config,
                      **QUIET)
    trainer.fit(ClassifierTask(lr=0.05, hidden=8))
    run = read_run(trainer.log_dir)
    data = hparams_data(run)
    start = data["session_start_info"].session_start_info.hparams
    assert set(start) == {"task.lr", "task.hidden", "trainer.max_epochs", "act"}  # not the whole config
    assert start["act"].string_value == "None"
    infos = {h.name: h for h in data["experiment"].experiment.hparam_infos}
    # A sweep's HParams columns are the keys it varies, ticked: TensorBoard ticks the first five columns it lists,
    # so listing the constants too would tick them and push the metrics off-screen (they stay in session_start).
    assert list(infos) == ["task.lr"] and infos["task.lr"].differs
    from tensorboard.plugins.hparams import api_pb2

    assert infos["task.lr"].type == api_pb2.DATA_TYPE_FLOAT64
    columns = [(m.name.tag, m.display_name) for m in data["experiment"].experiment.metric_infos]
    # The monitored key first, then val/loss; each followed by its best value, a tag that sorts after val/.
    assert columns[:4] == [("val/acc", "val/acc"), ("~best/val/acc", "best val/acc"), ("val/loss", "val/loss"),
                           ("~best/val/loss", "best val/loss")]
    assert max(run.Tags()["scalars"]).startswith("~best/")
    texts = run.Tensors("config/text_summary")
    assert [t.step for t in texts] == [0]
    shown = texts[0].tensor_proto.string_val[0].decode()
    assert "    task:\n      lr: 0.05" in shown and "log_dir: logs" in shown  # the whole config, as a code block

    # A single run: every key listed, the tuned ones marked (listed first, ticked).
    tuned = TensorBoardLogger(hparams={"task.lr": 0.05, "task.hidden": 8, "act": None}, tuned=["task.hidden"])
    single = Trainer(max_epochs=1, default_root_dir=str(tmp_path), callbacks=[tuned], **QUIET)
    single.fit(ClassifierTask(lr=0.05, hidden=8))
    infos = {h.name: h for h in hparams_data(read_run(single.log_dir))["experiment"].experiment.hparam_infos}
    assert sorted(infos) == ["act", "task.hidden", "task.lr"] and [n for n, h in infos.items() if h.differs] == [
        "task.hidden"] and infos["act"].type == api_pb2.DATA_TYPE_STRING

    with pytest.raises(MisconfigurationError, match=r"TensorBoardLogger\(hparams=\['lr'\]\) is not valid"):
        TensorBoardLogger(hparams=["lr"])
    with pytest.raises(MisconfigurationError, match=r"TensorBoardLogger\(varying='lr'\) is not valid"):
        TensorBoardLogger(varying="lr")


def test_hparams_columns_put_validation_values_named_as_logged_before_training_ones():
    from taskfit.callbacks.loggers.tensorboard_hparams import metric_order

    keys = ["train/loss_epoch", "val_acc", "val/loss", "lr", "val_loss", "val/acc"]
    assert metric_order(keys, ["val_loss"], {"val_acc", "val_loss", "val/loss", "val/acc"}) == [
        "val_loss", "val/loss", "val/acc", "val_acc", "train/loss_epoch", "lr"]
