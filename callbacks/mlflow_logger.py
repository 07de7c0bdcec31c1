"""MLFlowLogger: each fit is an MLflow run with the hyperparameters as params, every published value as a metric
with its global step, the run's tags and name, and (when asked) the best and last checkpoints as artifacts.

Needs MLflow's client: ``pip install "taskfit[mlflow]"`` (``mlflow-skinny``; the full ``mlflow`` package works
too and adds local ``sqlite:`` stores). Metrics are buffered and sent with ``log_batch``, at most every
``flush_secs`` seconds (and at epoch ends, when 1000 are waiting and when the run ends), so a remote tracking
server costs one request per flush, not one per value. Rank 0 only.
"""
from __future__ import annotations

import os
import re
import time
from typing import Any
from urllib.parse import urlparse

from ..errors import MisconfigurationError
from .logger import Logger

_STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
_BATCH_METRICS, _BATCH_PARAMS = 1000, 100  # MLflow's limits per log_batch request


def _mlflow() -> Any:
    """The ``mlflow`` module, or a MisconfigurationError that says what to install."""
    try:
        import mlflow
    except ImportError as exc:
        raise MisconfigurationError("MLFlowLogger needs MLflow's client, which is not installed.",
                                    "`pip install \"taskfit[mlflow]\"` (or `pip install mlflow-skinny`), or use "
                                    "another logger.") from exc
    return mlflow


class MLFlowLogger(Logger):
    """Logs each fit as an MLflow run (rank 0).

    Args:
        experiment_name: the MLflow experiment the runs go into (created if missing).
        run_name: the run's name (None: MLflow picks one).
        tracking_uri: where runs are stored: ``http://host:5000`` (a tracking server), ``file:/path/mlruns``,
            ``sqlite:///mlflow.db`` (full ``mlflow`` package only)... None: ``$MLFLOW_TRACKING_URI``, else MLflow's
            default.
        tags: tags of every run (``taskfit.log_dir``, the run directory, is added).
        log_model_checkpoints: at fit end, upload ModelCheckpoint's best and last files as artifacts under
            ``checkpoints/``.
        flush_secs: send buffered metrics when the last send is this old (also at epoch ends and the run's end).
    """

    order = 1100  # after ModelCheckpoint (1000): at fit end its last file is saved before the upload

    def __init__(self, *, experiment_name: str = "taskfit", run_name: str | None = None,
                 tracking_uri: str | None = None, tags: dict[str, str] | None = None,
                 log_model_checkpoints: bool = False, flush_secs: float = 10.0) -> None:
        _mlflow()  # a missing package is an error here, not at fit start
        self.experiment_name, self.run_name, self.tracking_uri = experiment_name, run_name, tracking_uri
        self.tags = dict(tags or {})
        self.log_model_checkpoints, self.flush_secs = log_model_checkpoints, flush_secs
        self._client: Any = None
        self._uri: str | None = None  # the tracking URI in use (tracking_uri, or MLflow's resolution of None)
        self._run_id: str | None = None
        self._run_for: str | None = None  # the trainer.log_dir the MLflow run belongs to
        self._pending: list[Any] = []
        self._sent = 0.0  # time.monotonic() of the last send

    @property
    def experiment(self) -> Any:
        """The ``mlflow.tracking.MlflowClient`` (rank 0, once a run started)."""
        return self._client

    @property
    def run_id(self) -> str | None:
        """The MLflow run id of the current (or last) run."""
        return self._run_id

    @property
    def log_dir(self) -> str | None:
        """None: MLflow's runs live in the tracking store, not in the run directory."""
        return None

    @property
    def save_dir(self) -> str | None:
        """The local folder of a ``file:`` tracking URI, else None."""
        uri = self.tracking_uri or self._uri
        parsed = urlparse(uri) if uri else None
        return parsed.path if parsed is not None and parsed.scheme == "file" else None

    # ---- the Logger interface ---------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        if self._run_id is not None and self._run_for == trainer.log_dir:
            return  # more values for the same run (a test after fit)
        mlflow = _mlflow()
        uri = self._uri = self.tracking_uri or mlflow.get_tracking_uri()
        try:
            from mlflow.tracking import MlflowClient

            _connect(uri)  # a server that is down: seconds, not MLflow's minutes of retries
            self._client = MlflowClient(tracking_uri=uri)
            experiment = self._client.get_experiment_by_name(self.experiment_name)
            experiment_id = experiment.experiment_id if experiment is not None else \
                self._client.create_experiment(self.experiment_name)
            tags = {**self.tags, "taskfit.log_dir": str(trainer.log_dir)}
            run = self._client.create_run(experiment_id, tags=tags, run_name=self.run_name)
        except Exception as exc:  # noqa: BLE001 - any failure of the store: one explained error
            reason = " ".join(str(exc).split())[:500]
            raise MisconfigurationError(
                f"MLFlowLogger cannot start a run in the tracking store {uri!r}: {type(exc).__name__}: {reason}",
                "check MLFlowLogger(tracking_uri=...) or $MLFLOW_TRACKING_URI: a running server (http://host:5000), "
                "a writable file: folder (MLflow 3 asks for MLFLOW_ALLOW_FILE_STORE=true), or sqlite:///mlflow.db "
                "with the full mlflow package (`pip install mlflow`).") from exc
        self._run_id, self._run_for, self._pending = run.info.run_id, trainer.log_dir, []
        self._sent = time.monotonic()

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Params, as text cut to MLflow's length limits (keys 250, values 6000 or what the installed MLflow allows)."""
        from mlflow.entities import Param

        key_limit, value_limit = _limits()
        items = [Param(_name(k)[:key_limit], str(v)[:value_limit]) for k, v in params.items()]
        for i in range(0, len(items), _BATCH_PARAMS):
            self._client.log_batch(self._run_id, params=items[i:i + _BATCH_PARAMS])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending += [Metric(_name(k), float(v), now, int(step)) for k, v in metrics.items()]
        if len(self._pending) >= _BATCH_METRICS or time.monotonic() - self._sent >= self.flush_secs:
            self.save()

    def save(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), _BATCH_METRICS):
            self._client.log_batch(self._run_id, metrics=pending[i:i + _BATCH_METRICS])
        self._sent = time.monotonic()

    def finalize(self, status: str) -> None:
        self.save()
        self._client.set_terminated(self._run_id, _STATUS.get(status, "FINISHED"))

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        if self._active and self.log_model_checkpoints:
            self._upload_checkpoints(trainer)
        super().on_fit_end(trainer, task)

    def _upload_checkpoints(self, trainer: Any) -> None:
        """ModelCheckpoint's best and last files, under the run's ``checkpoints/`` artifacts."""
        callback = trainer.checkpoint_callback
        if callback is None:
            return
        trainer.checkpoint_writer.wait()  # the files written on the background thread are in place
        paths = (callback.best_model_path, callback.last_model_path)
        for path in dict.fromkeys(p for p in paths if p and os.path.isfile(p)):
            self._client.log_artifact(self._run_id, path, artifact_path="checkpoints")


def _connect(uri: str) -> None:
    """Open (and close) a TCP connection to an ``http(s)://`` tracking server that is reached directly (no proxy);
    raise OSError when it cannot be opened within 5 s."""
    import socket
    import urllib.request

    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    if urllib.request.getproxies().get(parsed.scheme) and not urllib.request.proxy_bypass(parsed.hostname):
        return  # MLflow's requests go through the proxy: let them
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    socket.create_connection((parsed.hostname, port), timeout=5).close()


def _name(key: str) -> str:
    """A metric/param name MLflow accepts: alphanumerics, ``_ - . / `` and spaces; anything else becomes ``_``."""
    return re.sub(r"[^/\w.\- ]", "_", str(key)).strip("/") or "_"


def _limits() -> tuple[int, int]:
    try:
        from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH
    except ImportError:  # older MLflow: its documented limits then
        return 250, 500
    return MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH
