"""MLFlowLogger: each fit is an MLflow run with the hyperparameters as params, every published value
as a metric with its global step, the run's tags and name, and (when asked) the best and last
checkpoints as artifacts.

Needs MLflow: ``pip install "taskfit[mlflow]"`` (the ``mlflow`` package: its client, its default
``sqlite:`` store and ``mlflow ui``). Metrics are buffered and sent with ``log_batch``, at most
every ``flush_secs`` seconds (and at epoch ends, before a checkpoint records the run, when 1000 are
waiting and when the run ends), so a remote tracking server costs one request per flush, not one per
value. Rank 0 only.

The run is named as TensorBoard names the run directory (``lr=0.1/version_0`` in a sweep), its
params are the hyperparameters TensorBoard's HParams tab shows, its tags are MLflow's own (source,
user, git commit: ``resolve_tags``) plus yours, and a fit resumed from a checkpoint continues the
run the checkpoint recorded (values of the steps it redoes are not sent twice; a run left
``RUNNING`` by a killed process says so in a tag).

Where to see it: at the start of the run (rank 0; with the ``taskfit`` command, in its report at the
end instead, once) it prints the ``mlflow ui --backend-store-uri <store>`` command and the URL of
the experiment's runs table, with ``?workflowType=machine_learning``: MLflow 3's UI opens in its
GenAI mode unless the URL (or the browser's last choice) says otherwise, whatever the experiment's
kind. The run's model values (``train/``, ``val/``) are sent before the trainer's own ``vitals/``,
so that the run page, which lists the metrics in the order the store first received them, shows them
first.
"""
from __future__ import annotations

import os
import re
import time
from typing import Any
from urllib.parse import urlparse

from ...arguments import arguments_checked
from ...console import echo
from ...errors import MisconfigurationError
from .logger import PREFIX_SEPARATOR, Logger, display_name

_STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
_BATCH_METRICS, _BATCH_PARAMS = 1000, 100  # MLflow's limits per log_batch request
# MLflow 3's UI opens an experiment of this kind as model training, not GenAI
_KIND = "mlflow.experimentKind"
_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
# the runs table in the UI's model-training
_RUNS_PAGE = "/#/experiments/{id}/runs?workflowType=machine_learning"
# mode (MLflow 3's UI otherwise opens in the mode last chosen in the browser, GenAI at first:
# Traces, no runs) the trainer's own measurements (callbacks/lr_monitor.py's MONITORS): sent after
# the model's
_MONITORS = "vitals/"
_LIGHTNING_ONLY = {
    "checkpoint_path_prefix": "remove it: checkpoints are uploaded under the run's checkpoints/ "
                              "artifacts.",
    "synchronous": "remove it: taskfit sends metrics in batches (flush_secs), never one request "
                   "per value.",
}


def _mlflow() -> Any:
    """The ``mlflow`` module, or a MisconfigurationError that says what to install."""
    try:
        import mlflow
    except ImportError as exc:
        raise MisconfigurationError("MLFlowLogger needs MLflow, which is not installed.",
                                    "`pip install \"taskfit[mlflow]\"` (or `pip install mlflow`), "
                                    "or use another logger.") from exc
    return mlflow


class MLFlowLogger(Logger):
    """Logs each fit as an MLflow run (rank 0).

    Args:
        experiment_name: the MLflow experiment the runs go into (created if missing).
        run_name: the run's name (None: the run directory as TensorBoard names it, e.g.
            ``lr=0.1/version_0``).
        tracking_uri: where runs are stored: ``http://host:5000`` (a tracking server),
            ``sqlite:///mlflow.db``, ``file:/path/mlruns``... None: ``$MLFLOW_TRACKING_URI``, else
            ``save_dir``'s, else MLflow's default (``sqlite:///mlflow.db`` in the working directory:
            what ``mlflow ui`` started there shows).
        tags: tags of every run, added to MLflow's own (``resolve_tags``: source, user, git commit)
            and ``taskfit.log_dir`` (the run directory).
        save_dir: a local folder for the runs when no tracking URI is given:
            ``sqlite:///<save_dir>/mlflow.db``.
        log_model: at fit end, upload ModelCheckpoint's best and last files as artifacts under
            ``checkpoints/``.
        prefix: put ``<prefix>-`` before every metric name.
        artifact_location: where a new experiment keeps its artifacts (MLflow's default otherwise).
        run_id: continue this existing run instead of starting one.
        flush_secs: send buffered metrics when the last send is this old (also at epoch ends and the
            run's end).
    """

    # after ModelCheckpoint (1000): at fit end its last file is saved before the upload
    order = 1100

    @arguments_checked(lightning=_LIGHTNING_ONLY, docs="docs/logging.md")
    def __init__(
        self,
        experiment_name: str = "taskfit",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, str] | None = None,
        save_dir: str | None = None,
        log_model: bool = False,
        *,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        flush_secs: float = 10.0,
    ) -> None:
        _mlflow()  # a missing package is an error here, not at fit start
        if log_model not in (True, False):
            raise MisconfigurationError(f"MLFlowLogger(log_model={log_model!r}) is not supported.",
                                        "pass True (the best and last checkpoints, uploaded at fit "
                                        "end) or False; "
                                        'Lightning\'s "all" (every checkpoint as it is saved) is '
                                        'not supported.')
        self._where(save_dir, None, None, prefix)
        self.experiment_name, self.run_name, self.tracking_uri = (
            experiment_name,
            run_name,
            tracking_uri,
        )
        self.tags, self.log_model, self.artifact_location = (
            dict(tags or {}),
            log_model,
            artifact_location,
        )
        self.flush_secs = flush_secs
        # the params (None: trainer.hparams; the taskfit command: HParams')
        self.hparams: dict[str, Any] | None = None
        self._run_id: str | None = run_id
        self._client: Any = None
        self._uri: str | None = None  # the tracking URI in use
        self._for_run: str | None = None  # the trainer.log_dir its run belongs to
        self._pending: list[Any] = []
        self._sent = 0.0  # time.monotonic() of the last send
        # a resumed run: the last step of each metric the killed run sent
        self._sent_until: dict[str, int] = {}
        self._experiment: str | None = None  # the id of the run's experiment
        # a new run: timed sends hold vitals/ back until the model's val/ values went
        self._monitors_wait = False

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
        """None: MLflow's runs live in the tracking store (the run directory it belongs to is its
        tag ``taskfit.log_dir``)."""
        return None

    @property
    def has_directory(self) -> bool:
        # its runs live in the tracking store: the run directory is another logger's or the
        # Trainer's
        return False

    @property
    def save_dir(self) -> str | None:
        """The local folder of a ``file:`` or ``sqlite:`` store (``save_dir`` as given), else
        None."""
        if self._save_dir is not None:
            return os.path.abspath(self._save_dir)
        uri = self.tracking_uri or self._uri or ""
        if uri.startswith("sqlite:///"):  # sqlite:///relative.db, sqlite:////absolute.db
            return os.path.dirname(os.path.abspath(uri[len("sqlite:///"):]))
        parsed = urlparse(uri)
        return parsed.path if parsed.scheme == "file" else None

    def run_state(self) -> dict[str, Any]:
        return {"run_id": self._run_id, "tracking_uri": self._uri}

    # ---- the Logger interface --------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        if (
            self._client is not None
            and self._run_id is not None
            and self._for_run == trainer.log_dir
        ):
            # more values for the same run (a test)
            self._client.update_run(self._run_id, status="RUNNING")
            return
        mlflow = _mlflow()
        recorded = self._recorded if self.resuming else None
        uri = self._uri = (
            (recorded or {}).get("tracking_uri") or self.tracking_uri or self._default_uri(mlflow)
        )
        try:
            from mlflow.tracking import MlflowClient
            from mlflow.tracking.context.registry import resolve_tags

            _connect(uri)  # a server that is down: seconds, not MLflow's minutes of retries
            self._client = MlflowClient(tracking_uri=uri)
            run_id = (recorded or {}).get("run_id") or self._run_id
            if run_id is not None:
                self._continue(run_id, trainer.state.log_step if recorded else None)
                self._monitors_wait = False
            else:
                tags = resolve_tags({**self.tags, "taskfit.log_dir": str(self._run_dir)})
                self._experiment = self._experiment_id()
                run = self._client.create_run(
                    self._experiment,
                    tags=tags,
                    run_name=self.run_name or display_name(trainer, self._run_dir),
                )
                self._run_id, self._monitors_wait = run.info.run_id, True
        except Exception as exc:  # noqa: BLE001 - any failure of the store: one explained error
            reason = " ".join(str(exc).split())[:500]
            raise MisconfigurationError(
                f"MLFlowLogger cannot start a run in the tracking store {uri!r}: "
                f"{type(exc).__name__}: {reason}",
                "check MLFlowLogger(tracking_uri=...) or $MLFLOW_TRACKING_URI: a running server "
                "(http://host:5000), sqlite:///mlflow.db (pip install \"taskfit[mlflow]\" installs "
                "what it needs), or a writable file: folder (MLflow 3 asks for "
                "MLFLOW_ALLOW_FILE_STORE=true).") from exc
        self._for_run, self._pending, self._sent = trainer.log_dir, [], time.monotonic()
        if trainer.config is None:  # (the taskfit command's report shows these lines, once)
            first = f"MLFlowLogger: run {self._run_id} in experiment '{self.experiment_name}'."
            echo("\n".join(self.ui_lines(first)), name="taskfit.mlflow")

    def ui_lines(self, first: str) -> list[str]:
        """``first``, then how to see the run: ``mlflow ui --backend-store-uri <store>`` and the URL
        of the runs table (a tracking server: its own URL). Also the ``taskfit`` command's
        report."""
        uri = self._uri or self.tracking_uri or ""
        if self._experiment is None or not uri:
            return [first]
        page = _RUNS_PAGE.format(id=self._experiment)
        scheme = urlparse(uri).scheme
        if scheme in ("http", "https"):
            return [first, f"  see it at {uri.rstrip('/')}{page}"]
        if (
            scheme == "sqlite"
            or scheme == "file"
            or scheme.split("+")[0] in ("postgresql", "mysql", "mssql")
        ):
            store = _shown_uri(uri)
            env = "MLFLOW_ALLOW_FILE_STORE=true " if scheme == "file" else ""
            return [
                first,
                f"  see it: {env}mlflow ui --backend-store-uri {store}",
                f"  then open {_UI}{page}",
            ]
        return [first]  # databricks, ...: that service's own UI

    def _default_uri(self, mlflow: Any) -> str:
        if self._save_dir is None or os.environ.get("MLFLOW_TRACKING_URI"):
            return mlflow.get_tracking_uri()
        os.makedirs(self._save_dir, exist_ok=True)
        return f"sqlite:///{os.path.abspath(os.path.join(self._save_dir, 'mlflow.db'))}"

    def _experiment_id(self) -> str:
        experiment = self._client.get_experiment_by_name(self.experiment_name)
        if experiment is None:
            return self._client.create_experiment(
                self.experiment_name,
                artifact_location=self.artifact_location,
                tags={_KIND: "custom_model_development"},
            )
        if _KIND not in experiment.tags:
            self._client.set_experiment_tag(
                experiment.experiment_id, _KIND, "custom_model_development"
            )
        return experiment.experiment_id

    def _continue(self, run_id: str, resumed_at: int | None) -> None:
        """Write into the existing run ``run_id`` (a resumed fit's, or
        ``MLFlowLogger(run_id=...)``). A run still ``RUNNING`` was left so by a process that died
        without closing it (SIGKILL, out of memory): say so."""
        run = self._client.get_run(run_id)
        self._run_id, self._experiment = run_id, run.info.experiment_id
        if resumed_at is None:
            self._client.update_run(run_id, status="RUNNING")
            return
        history = {key: self._client.get_metric_history(run_id, key) for key in run.data.metrics}
        self._sent_until = {
            key: max(m.step for m in points) for key, points in history.items() if points
        }
        last = max(self._sent_until.values(), default=resumed_at)
        if run.info.status == "RUNNING":
            # if this resumed fit never gets going, it stays so
            self._client.set_terminated(run_id, "KILLED")
            self._client.set_tag(run_id, "taskfit.killed", "the process died without closing the "
                                 f"run (last step sent: {last}); found "
                                 f"{time.strftime('%Y-%m-%d %H:%M:%S')} "
                                 "by a resume")
        resumes = run.data.tags.get("taskfit.resumed_at", "")
        self._client.set_tag(run_id, "taskfit.resumed_at", f"{resumes},{resumed_at}".strip(","))
        self._client.update_run(run_id, status="RUNNING")

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Params (the ``hparams`` the taskfit command chose, else ``params``), as text cut to
        MLflow's length limits; a resumed run has them already (MLflow refuses to change a
        param)."""
        from mlflow.entities import Param

        if self._client.get_run(self._run_id).data.params:
            return
        key_limit, value_limit = _limits()
        chosen = self.hparams if self.hparams is not None else params
        items = [Param(_name(k)[:key_limit], str(v)[:value_limit]) for k, v in chosen.items()]
        for i in range(0, len(items), _BATCH_PARAMS):
            self._client.log_batch(self._run_id, params=items[i:i + _BATCH_PARAMS])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # a resumed run: the killed run sent these steps already (the same values: exact resume)
        if self._sent_until:
            metrics = {
                k: v for k, v in metrics.items() if step > self._sent_until.get(_name(k), -1)
            }
            if step > max(self._sent_until.values()):
                self._sent_until = {}
        self._pending += [Metric(_name(k), float(v), now, int(step)) for k, v in metrics.items()]
        if len(self._pending) >= _BATCH_METRICS:
            self.save()
        elif time.monotonic() - self._sent >= self.flush_secs:
            self._send(hold_monitors=self._monitors_wait)

    def save(self) -> None:
        self._send(hold_monitors=False)

    def on_train_epoch_end(self, trainer: Any, task: Any) -> None:
        # the first epoch's values, validation's included, are all there
        self._monitors_wait = False
        super().on_train_epoch_end(trainer, task)

    def _send(self, hold_monitors: bool) -> None:
        """Send what is buffered, the model's values first (the run page lists metrics in the order
        the store first got them). ``hold_monitors``: a timed send of a new run before its first
        val/ values keeps vitals/ back."""
        pending, self._pending = self._pending, []
        if hold_monitors:
            self._pending = [m for m in pending if self._rank(m.key) == 3]
            pending = [m for m in pending if self._rank(m.key) < 3]
        # stable: in the order logged within each group
        pending.sort(key=lambda m: self._rank(m.key))
        if any(self._rank(m.key) == 1 for m in pending):
            self._monitors_wait = False
        for i in range(0, len(pending), _BATCH_METRICS):
            self._client.log_batch(self._run_id, metrics=pending[i:i + _BATCH_METRICS])
        self._sent = time.monotonic()

    def _rank(self, key: str) -> int:
        """The order of a metric's group on the run page: train/ 0, val/ 1, the model's others 2,
        vitals/ 3."""
        if self.prefix and key.startswith(f"{self.prefix}{PREFIX_SEPARATOR}"):
            key = key[len(self.prefix) + len(PREFIX_SEPARATOR):]
        return next(
            (rank for rank, group in enumerate(("train/", "val/")) if key.startswith(group)),
            3 if key.startswith(_MONITORS) else 2,
        )

    def finalize(self, status: str) -> None:
        self.save()
        self._client.set_terminated(self._run_id, _STATUS.get(status, "FINISHED"))

    def on_fit_end(self, trainer: Any, task: Any) -> None:
        if self._active and self.log_model:
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


def _shown_uri(uri: str) -> str:
    """``uri`` as ``mlflow ui --backend-store-uri`` takes it from any folder: a relative sqlite/file
    path made absolute, a password replaced by ``***``."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])
    parsed = urlparse(uri)
    if parsed.scheme == "file" and not os.path.isabs(parsed.path or "/"):
        return "file:" + os.path.abspath(parsed.path)
    if parsed.password:
        return uri.replace(f":{parsed.password}@", ":***@", 1)
    return uri


def _connect(uri: str) -> None:
    """Open (and close) a TCP connection to an ``http(s)://`` tracking server that is reached
    directly (no proxy); raise OSError when it cannot be opened within 5 s."""
    import socket
    import urllib.request

    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    if urllib.request.getproxies().get(parsed.scheme) and not urllib.request.proxy_bypass(
        parsed.hostname
    ):
        return  # MLflow's requests go through the proxy: let them
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    socket.create_connection((parsed.hostname, port), timeout=5).close()


def _name(key: str) -> str:
    """A metric/param name MLflow accepts: alphanumerics, ``_ - . / `` and spaces; anything else
    becomes ``_``."""
    return re.sub(r"[^/\w.\- ]", "_", str(key)).strip("/") or "_"


def _limits() -> tuple[int, int]:
    try:
        from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH
    except ImportError:  # older MLflow: its documented limits then
        return 250, 500
    return MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH
