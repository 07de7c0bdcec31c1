"""The documented MLflow path, exactly: `taskfit logger=mlflow` with no tracking URI set (MLflow's default store, what
`pip install "taskfit[mlflow]"` installs), then `mlflow ui` started in the same folder serves the run: named as its
TensorBoard run, with HParams' params, MLflow's own tags and the model's metrics (read through the UI's REST API)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from tb_server import free_port

pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install -e '.[mlflow]')")

TINY = ["trainer.max_epochs=2", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "trainer.num_sanity_val_steps=0", "trainer.enable_model_summary=false",
        "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]


def clean_env() -> dict[str, str]:
    """The environment of a newcomer's shell: no MLflow settings, one thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k not in ("TASKFIT_SEED", "RANK")}
    env.update(OMP_NUM_THREADS="1")
    return env


def ask(url: str, body: dict | None = None) -> dict:
    """A request to the UI's REST API; generous timeout: its first answers can be slow on a busy machine."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def stop_group(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left of it after 30 s."""
    os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:  # the whole group is gone
            break
        server.poll()
        time.sleep(0.2)
    else:
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)


def test_taskfit_logger_mlflow_then_mlflow_ui_shows_the_run(tmp_path):
    result = subprocess.run([sys.executable, "-m", "taskfit", "logger=[tensorboard,mlflow]", *TINY], cwd=tmp_path,
                            env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "mlflow.db").is_file()  # MLflow's default store, in the folder taskfit ran in
    (run_dir,) = (tmp_path / "logs" / "digits" / "runs").iterdir()

    port = free_port()
    # A session of its own: mlflow ui starts job consumers (huey) that outlive it unless its whole group is stopped.
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}/api/2.0/mlflow"
    try:
        experiment, deadline = None, time.monotonic() + 120  # a deadline against a hang, not a speed check
        while experiment is None and time.monotonic() < deadline and server.poll() is None:
            try:
                experiment = ask(f"{base}/experiments/get-by-name?experiment_name=digits")["experiment"]
            except OSError:  # not listening yet
                time.sleep(0.5)
        assert experiment is not None, f"mlflow ui did not answer: {server.stderr.read()[-2000:]}"
        tags = {t["key"]: t["value"] for t in experiment.get("tags", [])}
        assert tags["mlflow.experimentKind"] == "custom_model_development"  # opens as model training, not GenAI
        (run,) = ask(f"{base}/runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
    finally:
        stop_group(server)

    info, data = run["info"], run["data"]
    assert info["status"] == "FINISHED" and info["run_name"] == f"{run_dir.name}/version_0"  # as TensorBoard names it
    tags = {t["key"]: t["value"] for t in data["tags"]}
    assert tags["taskfit.log_dir"] == str(run_dir / "version_0") and tags["mlflow.user"]
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.source.name"]  # MLflow's resolve_tags
    params = {p["key"]: p["value"] for p in data["params"]}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    events = EventAccumulator(str(run_dir / "version_0"))
    events.Reload()
    start = HParamsPluginData.FromString(events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    assert set(params) == set(start.session_start_info.hparams)  # the same readable params as the HParams tab
    assert params["task.optimizer"] == "AdamW" and float(params["task.optimizer.lr"]) == 0.003
    assert not [key for key in params if "_target_" in key or key.startswith(("callbacks.", "paths."))]
    metrics = {m["key"] for m in data["metrics"]}
    assert {"train/loss", "val/loss", "val/acc", "test/loss", "test/acc", "vitals/samples_per_sec"} <= metrics
    assert not [key for key in metrics if key.startswith(("lr/", "perf/"))]  # the monitors sort after the model
    assert urllib.parse.quote(info["run_id"]) in result.stdout  # the report names the run
    # ... and says how to see it: the exact command (this server's store) and the runs table in model-training mode
    # (MLflow 3's UI opens in the GenAI mode otherwise, whatever the experiment's kind)
    assert f"see it: mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}\n" in result.stdout
    assert (f"then open http://127.0.0.1:5000/#/experiments/{experiment['experiment_id']}/runs"
            "?workflowType=machine_learning\n") in result.stdout
    groups = [m["key"].split("/")[0] for m in data["metrics"]]  # the run page's order: the model's values first
    assert groups[0] == "train" and groups.index("vitals") > max(
        i for i, group in enumerate(groups) if group in ("train", "val")), groups
