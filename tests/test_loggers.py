"""Loggers: the Logger interface, Trainer(logger=...), CSVLogger and MLFlowLogger read back from
their files and store (csv module, MlflowClient), errors at fit start, rank 0 only under ddp, and
the `taskfit logger=...` groups.
"""
from __future__ import annotations

import csv
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from taskfit import MisconfigurationError, Trainer
from taskfit.callbacks import (
    Callback,
    CSVLogger,
    EarlyStopping,
    LearningRateMonitor,
    Logger,
    MLFlowLogger,
    TensorBoardLogger,
    ThroughputMonitor,
)
from tasks import ClassifierTask, KillAt, RaiseAtStep, RegressionTask

ROOT = Path(__file__).resolve().parents[1]
MLFLOW = importlib.util.find_spec("mlflow")
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


class Recorder(Callback):
    """Every ``on_log`` call as (the step loggers record it at, values): what a logger must have
    written."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def on_log(self, trainer, task, metrics):
        self.calls.append((trainer.state.log_step, dict(metrics)))


class RankCSV(CSVLogger):
    """A CSVLogger that leaves a file per rank whose hook or setup ran (for the ddp test; pickled by
    reference)."""

    def __init__(self, probe_dir: str) -> None:
        super().__init__()
        self.probe_dir = probe_dir

    def on_log(self, trainer, task, metrics):
        Path(self.probe_dir, f"on_log-rank{trainer.strategy.rank}").touch()
        super().on_log(trainer, task, metrics)

    def setup(self, trainer):
        Path(self.probe_dir, f"setup-rank{trainer.strategy.rank}").touch()
        super().setup(trainer)


def read_csv(path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def kinds(trainer) -> list[type]:
    return [type(cb) for cb in trainer.callbacks]


# ---- Trainer(logger=...) -------------------------------------------------------------------------
def test_logger_argument_takes_one_a_list_true_or_false():
    csv_logger, tb = CSVLogger(), TensorBoardLogger()
    one = Trainer(max_epochs=1, logger=csv_logger, **QUIET)
    assert csv_logger in one.callbacks and TensorBoardLogger not in kinds(one)
    # any logger brings the monitors
    assert {LearningRateMonitor, ThroughputMonitor} <= set(kinds(one))
    both = Trainer(max_epochs=1, logger=[tb, CSVLogger()], **QUIET)
    assert kinds(both).count(TensorBoardLogger) == 1 and CSVLogger in kinds(both)
    assert TensorBoardLogger in kinds(Trainer(max_epochs=1, **QUIET))  # True: the default
    assert not [
        cb
        for cb in Trainer(max_epochs=1, logger=False, **QUIET).callbacks
        if isinstance(cb, Logger)
    ]
    assert not [
        cb for cb in Trainer(max_epochs=1, logger=[], **QUIET).callbacks if isinstance(cb, Logger)
    ]
    # a Logger among the callbacks replaces TB
    mine = Trainer(max_epochs=1, callbacks=[csv_logger], **QUIET)
    assert kinds(mine).count(CSVLogger) == 1 and TensorBoardLogger not in kinds(mine)
    same = Trainer(max_epochs=1, callbacks=[csv_logger], logger=csv_logger, **QUIET)
    assert [cb for cb in same.callbacks if cb is csv_logger] == [csv_logger]  # not twice
    from taskfit import callbacks

    assert (
        callbacks.Logger is Logger and isinstance(tb, Logger) and issubclass(MLFlowLogger, Logger)
    )


def test_logger_argument_of_a_wrong_type_is_explained():
    with pytest.raises(MisconfigurationError, match=r"Trainer\(logger='csv'\) is not valid: "
                                                    r"expected True, False, a Logger or a list of "
                                                    r"Loggers[\s\S]*HINT: .*logger=csv"):
        Trainer(max_epochs=1, logger="csv")
    with pytest.raises(MisconfigurationError, match=r"logger=<class .*CSVLogger'>\) is not valid"):
        Trainer(max_epochs=1, logger=CSVLogger)  # the class, not an instance
    with pytest.raises(MisconfigurationError, match=r"got an object of type EarlyStopping, not a "
                                                    r"Logger instance[\s\S]*callbacks=\[\.\.\.\]"):
        Trainer(max_epochs=1, logger=[CSVLogger(), EarlyStopping()])
    with pytest.raises(MisconfigurationError, match=r"got the class CSVLogger, not a Logger "
                                                    r"instance"):
        Trainer(max_epochs=1, logger=[CSVLogger])


# ---- CSVLogger -----------------------------------------------------------------------------------
def test_csv_has_a_column_per_key_a_row_per_step_and_the_hparams(tmp_path):
    recorder, logger = Recorder(), CSVLogger()
    task = ClassifierTask()  # 6 steps per epoch; validation at 6 and 12
    trainer = Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        default_root_dir=str(tmp_path),
        logger=logger,
        callbacks=[recorder],
        **QUIET,
    )
    trainer.fit(task)
    path = tmp_path / "version_0" / "metrics.csv"
    assert logger.metrics_path == str(path) and logger.log_dir == trainer.log_dir
    # Lightning's ExperimentWriter: the file, and no row left unwritten after the fit
    assert logger.experiment.metrics_file_path == str(path) and logger.experiment.metrics == []
    header, rows = read_csv(path)
    expected: dict[int, dict[str, float]] = {}
    for step, values in recorder.calls:
        expected.setdefault(step, {}).update(values)
    assert header[:2] == ["step", "epoch"] and set(header[2:]) == {
        k for v in expected.values() for k in v
    }
    # one row per step, at Lightning's steps (a value logged after optimizer step k is at k - 1)
    assert [int(r["step"]) for r in rows] == sorted(expected) == [1, 3, 5, 7, 9, 11]
    # as Lightning's metrics.csv has it
    assert [int(r["epoch"]) for r in rows] == [0, 0, 0, 1, 1, 1]
    for row in rows:
        values = expected[int(row["step"])]
        assert {k for k, v in row.items() if v != "" and k not in ("step", "epoch")} == set(values)
        assert all(float(row[k]) == v for k, v in values.items())  # repr of a float: exact
    assert yaml.safe_load((path.parent / "hparams.yaml").read_text()) == task.hparams

    trainer.test(task)  # into the same run: the header grows, the rows before stay as they were
    header2, rows2 = read_csv(path)
    assert header2[:len(header)] == header and "test/loss" in header2 and rows2[:-1] == [
        {**r, **{k: "" for k in header2[len(header):]}} for r in rows]
    assert (
        rows2[-1]["step"] == "12"
        and float(rows2[-1]["test/loss"]) == trainer.state.metrics["test/loss"]
    )

    (validated,) = Trainer(default_root_dir=str(tmp_path), logger=CSVLogger(), **QUIET).validate(
        task
    )
    # a validate on its own: a run of its own
    _, rows3 = read_csv(tmp_path / "version_1" / "metrics.csv")
    assert len(rows3) == 1 and float(rows3[0]["val/loss"]) == validated["val/loss"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_csv_is_valid_after_the_process_is_killed(tmp_path):
    """SIGKILL mid-fit (in a forked child), after the first validation widened the header: every row
    is whole."""
    trainer = Trainer(max_epochs=3, log_every_n_steps=1, logger=CSVLogger(), callbacks=[KillAt(9)],
                      default_root_dir=str(tmp_path), **QUIET)
    pid = os.fork()
    if pid == 0:  # the child trains until it kills itself; it never returns into pytest
        try:
            trainer.fit(ClassifierTask())
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    header, rows = read_csv(tmp_path / "version_0" / "metrics.csv")
    assert "val/loss" in header and "train/loss_epoch" in header
    # (Lightning's steps) step 8's row was not complete yet
    assert [int(r["step"]) for r in rows] == list(range(8))
    # every row as wide as the header
    assert all(None not in r and None not in r.values() for r in rows)
    assert all(r["train/loss"] for r in rows) and rows[5]["val/loss"] and not rows[4]["val/loss"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:Skipped .*last.ckpt")
@pytest.mark.parametrize("kill, every", [(7, 6), (8, 3), (12, 4), (13, 2), (18, 6)])
def test_csv_of_a_fit_resumed_at_an_epochs_last_step_has_each_step_once(tmp_path, kill, every):
    """5 trials: a fit killed (SIGKILL, in a forked child) at step ``kill``, its last checkpoint at
    an epoch's last step (6, 12 or 18; 6 steps an epoch), then resumed. The resumed fit logs that
    step's epoch means again: they merge into the step's row (it had a second row holding only
    train/loss_epoch), so every step has one row."""
    from taskfit.callbacks import ModelCheckpoint

    def trainer(*extra):
        return Trainer(
            max_epochs=3,
            log_every_n_steps=1,
            logger=CSVLogger(),
            default_root_dir=str(tmp_path),
            callbacks=[
                ModelCheckpoint(every_n_train_steps=every, every_n_epochs=None, save_top_k=-1),
                *extra,
            ],
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    killed = trainer(KillAt(kill, settled=True))  # the checkpoint of step 6 is on disk
    pid = os.fork()
    if pid == 0:  # the child trains until it kills itself; it never returns into pytest
        try:
            killed.fit(ClassifierTask())
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    resumed = trainer()
    resumed.fit(ClassifierTask(), ckpt_path="last")
    assert resumed.state.resumed and resumed.log_dir == str(tmp_path / "version_0")
    header, rows = read_csv(tmp_path / "version_0" / "metrics.csv")
    # each step once, in order (Lightning's: from 0)
    assert [int(r["step"]) for r in rows] == list(range(18))
    assert all(None not in r and None not in r.values() and r["train/loss"] for r in rows)
    ends = {int(r["step"]): r for r in rows if r["train/loss_epoch"]}
    assert sorted(ends) == [5, 11, 17] and all(r["val/loss"] for r in ends.values())
    assert [r["epoch"] for r in rows] == [str(e) for e in range(3) for _ in range(6)]


def _not_utf8(data: bytes) -> bytes:
    """Two bytes that are not UTF-8 in the middle of the row of step 3."""
    at = data.index(b"\n3,") + 4
    return data[:at] + b"\xff\xfe" + data[at:]


def _header_lost(data: bytes) -> bytes:
    return data[data.index(b"\n") + 1:]


def _last_row_torn(data: bytes) -> bytes:
    """The last row cut in its middle (a copy cut short, a disk that filled)."""
    start = data.rindex(b"\n", 0, len(data) - 1) + 1
    return data[:start + (len(data) - start) // 2]


@pytest.mark.parametrize("damage, kept_steps", [
    # Lightning's steps
    (_not_utf8, [0, 1]), (_header_lost, []), (_last_row_torn, [0, 1, 2, 3, 4])])
def test_a_resume_over_a_damaged_metrics_csv_keeps_it_aside_and_goes_on(tmp_path, damage,
                                                                        kept_steps):
    """Issue 47, row 5: a metrics.csv that is not UTF-8, lost its header or has a torn last row
    (before: a raw UnicodeDecodeError that blocked every resume, or rows garbled silently). The
    resume goes on; the damaged file is kept aside byte for byte, a warning names both files, and
    metrics.csv continues from its intact beginning: every row as wide as the header."""
    from taskfit.callbacks import ModelCheckpoint

    def fit(max_epochs, ckpt_path=None):
        trainer = Trainer(max_epochs=max_epochs, log_every_n_steps=1, logger=CSVLogger(),
                          default_root_dir=str(tmp_path), callbacks=[ModelCheckpoint()],
                          **{**QUIET, "enable_checkpointing": True})
        trainer.fit(ClassifierTask(), ckpt_path=ckpt_path)
        return trainer

    path = Path(fit(1).log_dir) / "metrics.csv"
    damaged = damage(path.read_bytes())
    path.write_bytes(damaged)
    with pytest.warns(UserWarning, match=rf"{path} is damaged \(.*\): it is kept as "
                                         rf"{path}\.damaged, and {path} (continues|starts)"):
        resumed = fit(2, ckpt_path="last")
    assert resumed.state.resumed and resumed.state.global_step == 12
    assert (tmp_path / path.parent / "metrics.csv.damaged").read_bytes() == damaged
    header, rows = read_csv(path)
    assert header[:2] == ["step", "epoch"] and "train/loss" in header
    assert all(None not in r and None not in r.values() for r in rows)
    steps = [int(r["step"]) for r in rows]
    assert steps[:len(kept_steps)] == kept_steps and steps[-6:] == list(range(6, 12))
    assert steps == sorted(set(steps))


def test_an_unwritable_directory_fails_at_fit_start_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    recorder = Recorder()
    trainer = Trainer(
        max_epochs=1,
        default_root_dir=str(blocker / "runs"),
        logger=CSVLogger(),
        callbacks=[recorder],
        **QUIET,
    )
    with pytest.raises(MisconfigurationError, match=r"CSVLogger cannot write to "
                                                    r".*a_file.*NotADirectoryError"):
        trainer.fit(RegressionTask())
    assert trainer.state.global_step == 0 and recorder.calls == []


def test_a_custom_logger_gets_rank0_calls_in_order(tmp_path):
    calls = []

    class Memory(Logger):
        def setup(self, trainer):
            calls.append(("setup", trainer.log_dir))

        def log_hyperparams(self, params):
            calls.append(("hparams", params))

        def log_metrics(self, metrics, step):
            calls.append(("metrics", step, sorted(metrics)))

        def save(self):
            calls.append(("save",))

        def finalize(self, status):
            calls.append(("finalize", status))

    task = RegressionTask(n=16, lr=0.1)  # 2 steps
    trainer = Trainer(max_epochs=1, logger=Memory(), default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(task)
    assert (
        calls[:2] == [("setup", trainer.log_dir), ("hparams", task.hparams)]
        and task.hparams["lr"] == 0.1
    )
    assert ("save",) in calls and calls[-1] == ("finalize", "success")
    # the last step's, as Lightning
    assert any(c[:2] == ("metrics", 1) and "train/loss_epoch" in c[2] for c in calls)
    calls.clear()
    with pytest.raises(ValueError, match="boom"):
        Trainer(max_epochs=2, logger=Memory(), callbacks=[RaiseAtStep(1, 0)], **QUIET).fit(
            RegressionTask(n=16)
        )
    assert calls[-1] == ("finalize", "failed")


def test_ddp_writes_from_rank_0_only(tmp_path):
    probes = tmp_path / "probes"
    probes.mkdir()
    trainer = Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        log_every_n_steps=1,
        logger=RankCSV(str(probes)),
        default_root_dir=str(tmp_path / "runs"),
        **QUIET,
    )
    trainer.fit(ClassifierTask(batch_size=8))  # 96 samples, 2 ranks x 8: 6 steps per epoch
    assert sorted(p.name for p in probes.iterdir()) == [
        "on_log-rank0",
        "on_log-rank1",
        "setup-rank0",
    ]
    header, rows = read_csv(Path(trainer.log_dir) / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(12))  # each step once: rank 1 wrote nothing
    assert "val/acc" in header and float(rows[-1]["val/loss"]) == pytest.approx(
        trainer.state.metrics["val/loss"]
    )
    assert sorted(os.listdir(trainer.log_dir)) == ["hparams.yaml", "metrics.csv"]


# ---- MLFlowLogger --------------------------------------------------------------------------------
@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A local file store in tmp_path (MLflow 3 keeps file stores behind
    MLFLOW_ALLOW_FILE_STORE)."""
    pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (pip install -e "
                                         "'.[mlflow]')")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file:{tmp_path / 'mlruns'}"


def test_mlflow_run_has_params_metrics_tags_and_checkpoints(tmp_path, mlflow_store, monkeypatch):
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    batches = []
    real = MlflowClient.log_batch
    monkeypatch.setattr(MlflowClient, "log_batch", lambda self, run_id, metrics=(), **kw: (
        batches.append(len(metrics)), real(self, run_id, metrics=metrics, **kw))[1])
    recorder = Recorder()
    logger = MLFlowLogger(
        experiment_name="exp",
        run_name="first",
        tracking_uri=mlflow_store,
        tags={"team": "vision"},
        log_model=True,
        flush_secs=3600,
    )
    config = {
        "task": {"lr": 0.1, "note": "x" * (MAX_PARAM_VAL_LENGTH + 10), "layers": [1, 2]},
        "seed": None,
    }
    trainer = Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        logger=logger,
        callbacks=[recorder],
        config=config,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ClassifierTask())
    client = MlflowClient(tracking_uri=mlflow_store)
    run = client.get_run(logger.run_id)
    assert (
        logger.experiment is not None
        and logger.save_dir == str(tmp_path / "mlruns")
        and logger.log_dir is None
    )
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    assert run.data.tags["team"] == "vision" and run.data.tags["taskfit.log_dir"] == trainer.log_dir
    from mlflow.tracking.context.registry import resolve_tags

    assert {
        k: v for k, v in resolve_tags().items() if k != "mlflow.source.name"
    }.items() <= run.data.tags.items()
    params = run.data.params
    assert (
        params["task.lr"] == "0.1"
        and params["seed"] == "None"
        and len(params["task.note"]) == MAX_PARAM_VAL_LENGTH
    )
    history = [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "val/loss")]
    assert history == [
        (s, pytest.approx(v["val/loss"])) for s, v in recorder.calls if "val/loss" in v
    ]
    logged = sum(len(v) for _, v in recorder.calls)
    # 2 epoch ends and the end, not per step
    assert sum(batches) == logged and len([b for b in batches if b]) == 3
    artifacts = sorted(a.path for a in client.list_artifacts(logger.run_id, "checkpoints"))
    assert artifacts == sorted(
        f"checkpoints/{Path(p).name}"
        for p in {
            trainer.checkpoint_callback.best_model_path,
            trainer.checkpoint_callback.last_model_path,
        }
    )


def test_mlflow_run_of_a_failed_fit_is_failed_and_keeps_its_metrics(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    logger = MLFlowLogger(tracking_uri=mlflow_store, flush_secs=3600)
    with pytest.raises(ValueError, match="boom at step 9"):
        Trainer(max_epochs=3, log_every_n_steps=1, logger=logger, callbacks=[RaiseAtStep(9, 0)],
                default_root_dir=str(tmp_path), **QUIET).fit(ClassifierTask())
    client = MlflowClient(tracking_uri=mlflow_store)
    assert client.get_run(logger.run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(logger.run_id, "train/loss")] == list(
        range(9)
    )


def test_mlflow_bad_uri_fails_at_fit_start_before_training(tmp_path, mlflow_store, monkeypatch):
    import socket as sockets

    import urllib3.util.connection

    # every TCP connection opened by taskfit's probe or by MLflow's HTTP client (urllib3), by port
    attempts = []

    def counted(real):
        def connect(address, *args, **kwargs):
            attempts.append(address[1])
            return real(address, *args, **kwargs)
        return connect

    monkeypatch.setattr(sockets, "create_connection", counted(sockets.create_connection))
    monkeypatch.setattr(urllib3.util.connection, "create_connection",
                        counted(urllib3.util.connection.create_connection))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with socket.socket() as sock:  # a port nobody listens on: connections are refused
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for uri in ("nosuchscheme://nowhere", f"file:{blocker}/mlruns", down):
        recorder = Recorder()
        trainer = Trainer(max_epochs=1, logger=MLFlowLogger(tracking_uri=uri), callbacks=[recorder],
                          default_root_dir=str(tmp_path), **QUIET)
        with pytest.raises(MisconfigurationError, match=r"MLFlowLogger cannot start a run in the "
                                                        rf"tracking store '{uri}'[\s\S]*HINT: "
                                                        r"check MLFlowLogger\(tracking_uri"):
            trainer.fit(RegressionTask())
        assert trainer.state.global_step == 0 and recorder.calls == []
    # A server that is down fails at the first refused connection, not after MLflow's retries (7
    # with backoff: minutes per URI): counted in connections, not seconds, so a busy machine cannot
    # fail it.
    assert attempts.count(int(down.rsplit(":", 1)[1])) == 1, attempts


@pytest.mark.parametrize("flush_secs", [3600.0, 0.0])
def test_mlflow_says_how_to_see_the_run_and_sends_the_model_values_first(
    tmp_path, monkeypatch, capsys, flush_secs
):
    """Issue 38: the run's start prints the exact `mlflow ui --backend-store-uri` command and the
    runs table's URL (in the UI's model-training mode); the run page lists metrics in the order the
    store first got them, so train/ and val/ go before vitals/, also when timed sends (flush_secs=0:
    every log call) come before the first validation."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger, recorder = MLFlowLogger(experiment_name="digits", save_dir=str(tmp_path / "store"),
                                    flush_secs=flush_secs), Recorder()
    Trainer(max_epochs=2, log_every_n_steps=1, logger=logger,
            callbacks=[LearningRateMonitor(), ThroughputMonitor(), recorder],
            default_root_dir=str(tmp_path), **QUIET).fit(ClassifierTask())
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("digits").experiment_id
    out = capsys.readouterr().out
    assert (
        f"MLFlowLogger: run {logger.run_id} in experiment 'digits'.\n  see it: mlflow ui "
        f"--backend-store-uri {uri}\n  then open "
        f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?workflowType=machine_learning\n"
    ) in out
    keys = list(client.get_run(logger.run_id).data.metrics)
    groups = [key.split("/")[0] for key in keys]
    assert {"train", "val", "vitals"} <= set(groups), keys
    # the store's order (the run page's): the task's and the user's LearningRateMonitor's values
    # (lr-SGD: logged before the batch's step, as Lightning's) before taskfit's vitals/
    assert groups[0] != "vitals" and groups.index("vitals") > max(
        i for i, group in enumerate(groups) if group in ("train", "val")), keys
    lr = "vitals/lr/SGD/pg0"  # values held back by timed sends are sent later, not lost
    assert sorted(m.step for m in client.get_metric_history(logger.run_id, lr)) == \
        [step for step, values in recorder.calls if lr in values]


def test_mlflow_ui_lines_for_each_kind_of_store(tmp_path, monkeypatch):
    from taskfit.callbacks.loggers.mlflow_logger import _shown_uri

    monkeypatch.chdir(tmp_path)
    # from any folder
    assert _shown_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert _shown_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert _shown_uri("file:mlruns") == f"file:{tmp_path / 'mlruns'}"
    assert (
        _shown_uri("postgresql://me:secret@db:5432/mlflow") == "postgresql://me:***@db:5432/mlflow"
    )
    logger = MLFlowLogger()
    assert logger.ui_lines("first") == ["first"]  # no run yet
    logger._experiment = "7"
    page = "/#/experiments/7/runs?workflowType=machine_learning"
    logger._uri = "http://tracking.example:5000/"
    assert logger.ui_lines("first") == ["first", f"  see it at http://tracking.example:5000{page}"]
    logger._uri = f"file:{tmp_path}/mlruns"
    assert (
        logger.ui_lines("first")[1]
        == f"  see it: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri "
        f"file:{tmp_path}/mlruns"
    )
    logger._uri = "databricks"
    assert logger.ui_lines("first") == ["first"]


def test_mlflow_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    with pytest.raises(MisconfigurationError, match=r"MLFlowLogger needs MLflow, which is not "
                                                    r"installed[\s\S]*pip install "
                                                    r"\"taskfit\[mlflow\]\""):
        MLFlowLogger()


# ---- the command line ----------------------------------------------------------------------------
TINY = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "test=false",
]


def taskfit(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("TASKFIT_SEED", "HYDRA_FULL_ERROR", "RANK")
    }
    full_env.update(OMP_NUM_THREADS="1", **env)
    result = subprocess.run([sys.executable, "-m", "taskfit", *args, *TINY], cwd=cwd, env=full_env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_cli_logger_groups(tmp_path, monkeypatch):
    """`taskfit logger=csv` and `logger=mlflow` compose to their callbacks (in this process); one
    real `taskfit` run with a list of groups writes TensorBoard, CSV and (if installed) MLflow."""
    from taskfit.cli import build_callbacks, compose_config

    for group, cls in (("csv", CSVLogger), ("mlflow", MLFlowLogger)):
        config = compose_config([f"logger={group}"], run_dir=str(tmp_path))
        if cls is MLFlowLogger and MLFLOW is None:
            continue
        built = build_callbacks(config)
        assert [type(cb) for cb in built if isinstance(cb, Logger)] == [cls], group
        # replaces the default
        assert TensorBoardLogger not in kinds(Trainer(callbacks=built, max_epochs=1))
    assert (
        compose_config(["logger=mlflow"], run_dir=str(tmp_path))["logger"]["mlflow"][
            "experiment_name"
        ]
        == "digits"
    )

    groups, uri = ["tensorboard", "csv"], f"file:{tmp_path / 'mlruns'}"
    if MLFLOW is not None:
        groups.append("mlflow")
        # MLflow 3 keeps file stores behind it
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    extra = [f"logger.mlflow.tracking_uri={uri}", "logger.mlflow.run_name=cli"] if MLFLOW else []
    result = taskfit(f"logger=[{','.join(groups)}]", *extra, cwd=tmp_path)
    (run,) = (tmp_path / "logs" / "digits" / "runs").iterdir()
    version = run / "version_0"
    assert list(version.glob("events.out.tfevents.*")), sorted(os.listdir(version))
    header, rows = read_csv(version / "metrics.csv")
    # 2 steps, at Lightning's steps 0 and 1; step 0 also holds the learning rate the first epoch
    # starts with (the digits task's cosine steps per epoch), the last the epoch's values
    assert [r["step"] for r in rows] == ["0", "1"] and "val/loss" in header and rows[-1]["val/loss"]
    assert yaml.safe_load((version / "hparams.yaml").read_text())["trainer.max_epochs"] == 1
    assert f"CSV:             {version / 'metrics.csv'}" in result.stdout
    if MLFLOW is None:
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert (
        found.info.status == "FINISHED"
        and found.info.run_name == "cli"
        and found.info.run_id in result.stdout
    )
    # the report: how to see it
    assert (
        f"  MLflow:          experiment 'digits', run {found.info.run_id}\n                   "
        f"see it: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri}\n           "
        "        then open "
        f"http://127.0.0.1:5000/#/experiments/{found.info.experiment_id}/runs?workflowType=machine_learning\n"
    ) in result.stdout
    # the report's, not the start's too
    assert result.stdout.count("mlflow ui --backend-store-uri") == 1
    assert (
        found.data.params["trainer.max_epochs"] == "1" and "task.optimizer.lr" in found.data.params
    )
    history = [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "val/loss")]
    assert history == [(1, pytest.approx(float(rows[-1]["val/loss"])))]


def test_loggers_work_outside_a_run_as_lightnings(tmp_path):
    """Lightning's loggers are usable without a Trainer: version and log_dir are known before the
    first write, log_hyperparams takes a Namespace, log_metrics a step, TensorBoardLogger.log_graph
    a model and an input."""
    import argparse

    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # an earlier run: the next one is version_1
    (tmp_path / "csv" / "version_0").mkdir(parents=True)
    table = CSVLogger(tmp_path / "csv")
    assert (table.version, table.log_dir) == (1, str(tmp_path / "csv" / "version_1"))
    table.log_hyperparams(argparse.Namespace(lr=0.1, layers=2))
    table.log_metrics({"a": 1.0}, step=0)
    table.log_metrics({"a": 2.0, "b": 5.0}, step=1)
    table.save()
    with open(tmp_path / "csv" / "version_1" / "metrics.csv", newline="") as fh:
        assert [(r["step"], r["a"], r["b"]) for r in csv.DictReader(fh)] == [
            ("0", "1.0", ""),
            ("1", "2.0", "5.0"),
        ]
    assert yaml.safe_load((tmp_path / "csv" / "version_1" / "hparams.yaml").read_text()) == {
        "lr": 0.1,
        "layers": 2,
    }

    board = TensorBoardLogger(tmp_path / "tb", name="exp")
    assert (
        board.log_dir == str(tmp_path / "tb" / "exp" / "version_0") and board.experiment is not None
    )
    board.log_hyperparams({"lr": 0.2})
    # as Lightning's
    assert yaml.safe_load((Path(board.log_dir) / "hparams.yaml").read_text()) == {"lr": 0.2}
    board.log_metrics({"x": 3.0}, step=5)
    board.log_graph(torch.nn.Linear(2, 1), torch.zeros(1, 2))
    board.finalize("success")
    events = EventAccumulator(board.log_dir)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [
        (5, 3.0)
    ] and events.Graph() is not None
    with pytest.warns(UserWarning, match=r"Could not log computational graph to TensorBoard: The "
                                         r"`model.example_input_array` attribute is not set"):
        board.log_graph(torch.nn.Linear(2, 1))
    # no save_dir: the Trainer's default_root_dir decides, at fit
    assert CSVLogger().log_dir is None


def test_csv_logger_outside_a_run_flushes_every_n_steps_as_lightnings(tmp_path):
    """Lightning 2.6.6's CSVLogger without a Trainer (its tests/loggers/test_csv.py): rows wait in
    ``experiment.metrics`` until a step s with (s + 1) % flush_logs_every_n_steps == 0; header step + keys (no
    epoch column), tensors written as numbers, ``log_hyperparams()`` without params writes hparams.yaml."""
    import torch
    from taskfit.callbacks import ExperimentWriter

    table = CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    path = Path(table.log_dir) / ExperimentWriter.NAME_METRICS_FILE
    table.log_metrics({"a": torch.tensor(0.5), "n": torch.tensor(1)}, step=0)
    assert table.experiment.metrics == [{"a": 0.5, "n": 1, "step": 0}] and not path.exists()
    table.log_metrics({"a": 1}, step=1)  # (1 + 1) % 2 == 0: written
    assert table.experiment.metrics == [] and table.experiment.metrics_file_path == str(path)
    with open(path, newline="") as fh:
        assert [dict(r) for r in csv.DictReader(fh)] == [{"step": "0", "a": "0.5", "n": "1"},
                                                         {"step": "1", "a": "1", "n": ""}]
    table.experiment.log_metrics({"c": 3.0})  # Lightning's writer: the next row, written at save()
    table.save()
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["step", "a", "n", "c"] and rows[-1] == {
        "step": "2",
        "a": "",
        "n": "",
        "c": "3.0",
    }
    table.log_hyperparams()
    assert yaml.safe_load((path.parent / ExperimentWriter.NAME_HPARAMS_FILE).read_text()) == {}

    with pytest.raises(MisconfigurationError, match=r"CSVLogger\(flush_logs_every_n_steps=0\) is "
                                                    r"not valid"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)
    # in a run each step's row is written when the step is complete, whatever the setting
    logger = CSVLogger(tmp_path / "run", flush_logs_every_n_steps=1000)
    Trainer(max_epochs=1, log_every_n_steps=1, logger=logger, **QUIET).fit(
        RegressionTask(n=16, val_n=8)
    )
    with open(logger.metrics_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[:2] == ["step", "epoch"] and [r["step"] for r in rows] == ["0", "1"]


def test_tensorboard_default_hp_metric_is_off_and_lightnings_minus_one_when_asked(tmp_path):
    """taskfit writes no hp_metric placeholder by default (issue 48); default_hp_metric=True writes
    Lightning's -1 at the hyperparameters' step, as an HParams column; log_hyperparams(params,
    metrics) logs the given metrics."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    def read(logger):
        events = EventAccumulator(logger.log_dir)
        events.Reload()
        columns = []
        for content in events.PluginTagToContent("hparams").values():
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.HasField("experiment"):
                columns += [m.name.tag for m in data.experiment.metric_infos]
        scalars = {
            tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]
        }
        return scalars, columns

    off = TensorBoardLogger(tmp_path, name="off")
    Trainer(max_epochs=1, logger=off, **QUIET).fit(RegressionTask(n=16, val_n=8))
    scalars, columns = read(off)
    assert "hp_metric" not in scalars and "hp_metric" not in columns and "val/loss" in columns

    on = TensorBoardLogger(tmp_path, name="on", default_hp_metric=True)
    Trainer(max_epochs=1, logger=on, **QUIET).fit(RegressionTask(n=16, val_n=8))
    scalars, columns = read(on)
    # Lightning 2.6.6: hp_metric -1.0 at step 0, and an HParams metric column hp_metric
    assert scalars["hp_metric"] == [(0, -1.0)] and "hp_metric" in columns and "val/loss" in columns

    alone = TensorBoardLogger(tmp_path, name="alone")
    alone.log_hyperparams({"lr": 0.1}, {"abc": 0.5})  # positional, as Lightning's tests call it
    alone.finalize("success")
    assert read(alone)[0]["abc"] == [(0, 0.5)]
    with pytest.raises(MisconfigurationError, match=r"TensorBoardLogger\(default_hp_metric='yes'\) "
                                                    r"is not valid"):
        TensorBoardLogger(tmp_path, default_hp_metric="yes")


def test_log_graph_of_a_task_outside_a_run_and_lightnings_warnings(tmp_path):
    """Lightning's TensorBoardLogger.log_graph(model, input_array) works on a LightningModule
    outside a run (torch.jit reads every attribute: taskfit's stage_metrics must not raise then); a
    dict input is not traced, with Lightning's warning."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = TensorBoardLogger(tmp_path, log_graph=True)
    task = RegressionTask()
    board.log_graph(task, torch.zeros(2, 4))
    with pytest.warns(UserWarning, match=r"Could not log computational graph to TensorBoard: .* "
                                         r"can't be traced"):
        board.log_graph(task, {"x": 1})
    board.finalize("success")
    events = EventAccumulator(board.log_dir)
    events.Reload()
    assert events.Graph() is not None


def test_loggers_get_log_metrics_with_lightnings_keywords(tmp_path):
    """Lightning calls ``logger.log_metrics(metrics=..., step=...)``: a logger written for it with
    keyword-only parameters works."""
    calls = []

    class KeywordsOnly(Logger):
        def log_metrics(self, *, metrics, step):
            calls.append((step, dict(metrics)))

    Trainer(
        max_epochs=1,
        log_every_n_steps=1,
        logger=KeywordsOnly(),
        default_root_dir=str(tmp_path),
        **QUIET,
    ).fit(RegressionTask(n=16, val_n=8))
    assert calls and all(isinstance(step, int) for step, _ in calls)


@pytest.mark.parametrize("cls", [CSVLogger, TensorBoardLogger])
def test_a_url_save_dir_is_refused_not_made_a_local_folder(tmp_path, monkeypatch, cls):
    """Lightning's loggers write through fsspec ("memory://", "s3://"); taskfit's write local
    folders: a URL is one clear error, not a folder named "memory:" in the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MisconfigurationError, match=rf"{cls.__name__}\(save_dir='memory://logs'\) "
                                                    r"is a URL"):
        cls(save_dir="memory://logs")
    assert list(tmp_path.iterdir()) == []


def test_trainer_log_dir_before_fit_is_where_the_run_goes_and_save_dir_expands_home_and_variables(
        tmp_path, monkeypatch):
    """Lightning's trainer.log_dir before fit is the first logger's log_dir; "~" and "$VAR" in
    save_dir expand."""
    logger = TensorBoardLogger(tmp_path)
    trainer = Trainer(max_epochs=1, logger=logger, **QUIET)
    # Lightning 2.6.6: the same
    assert trainer.log_dir == logger.log_dir == str(tmp_path / "version_0")
    assert not (tmp_path / "version_0").exists()  # nothing written before the run
    trainer.fit(RegressionTask(n=16))
    assert trainer.log_dir == str(tmp_path / "version_0")
    assert Trainer(logger=False, default_root_dir=str(tmp_path / "r"), **QUIET).log_dir == str(
        tmp_path / "r" / "version_0"
    )

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LOGS_ROOT", str(tmp_path / "var"))
    assert CSVLogger("~/logs").log_dir == str(tmp_path / "home" / "logs" / "version_0")
    assert TensorBoardLogger("$LOGS_ROOT/tb").log_dir == str(tmp_path / "var" / "tb" / "version_0")


@pytest.mark.parametrize("cls", [CSVLogger, TensorBoardLogger])
def test_a_run_opened_before_fit_is_the_one_fit_continues(tmp_path, cls):
    """Lightning's logger.experiment (or log_hyperparams) before fit fixes the version: fit writes
    there too."""
    logger = cls(tmp_path)
    assert logger.experiment is not None and (tmp_path / "version_0").is_dir()
    trainer = Trainer(max_epochs=1, logger=logger, **QUIET)
    assert trainer.log_dir == str(tmp_path / "version_0")
    trainer.fit(RegressionTask(n=16))
    assert trainer.log_dir == logger.log_dir == str(tmp_path / "version_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["version_0"]
