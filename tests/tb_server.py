"""A real ``tensorboard`` process on a free localhost port, read through its HTTP API (what the browser reads), and
a headless Chromium screenshot of it. Tests skip cleanly where tensorboard's server cannot start."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

STATUSES = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def serve(logdir: Path, runs: int | None = None, timeout: float = 90) -> Iterator[str]:
    """``tensorboard --logdir logdir`` on a free port until every run (``runs``: how many, default: as many as hold
    event files) is loaded; yields its base URL. Skips the test if the server cannot start at all."""
    expected = runs if runs is not None else len({p.parent for p in Path(logdir).rglob("events.out.tfevents.*")})
    port = free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--port", str(port),
               "--host", "127.0.0.1", "--load_fast", "false", "--reload_interval", "1"]
    try:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        pytest.skip(f"tensorboard cannot start: {exc}")
    base = f"http://127.0.0.1:{port}"
    try:
        listening, deadline = False, time.monotonic() + timeout
        while time.monotonic() < deadline and server.poll() is None:
            try:
                tags = get(f"{base}/data/plugin/scalars/tags")
                listening = True
                if len(tags) >= expected:
                    break
            except OSError:  # not listening yet
                pass
            time.sleep(0.5)
        if not listening:
            detail = server.stderr.read()[-2000:] if server.poll() is not None else "no answer"
            pytest.skip(f"tensorboard's server did not start: {detail}")
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)


def hparams_view(base: str) -> dict:
    """What the HParams tab reads as it opens: the hyperparameter names in its order (``differs`` first), the
    metric columns (tags and shown names), each session's values; plus the runs, scalar and text tags."""
    experiment = get(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
    hparams = [h["name"] for h in experiment["hparamInfos"]]
    metrics = [m["name"]["tag"] for m in experiment["metricInfos"]]
    request = {"experimentName": "", "startIndex": 0, "sliceSize": 100, "allowedStatuses": STATUSES,
               "colParams": [{"hparam": h} for h in hparams] +
                            [{"metric": {"tag": t, "group": ""}} for t in metrics]}
    groups = get(f"{base}/data/plugin/hparams/session_groups", request)["sessionGroups"]
    scalar_tags = get(f"{base}/data/plugin/scalars/tags")
    text_tags = get(f"{base}/data/plugin/text/tags")
    return {"runs": sorted(get(f"{base}/data/runs")), "hparams": hparams,
            "differs": [h["name"] for h in experiment["hparamInfos"] if h.get("differs")],
            "metrics": metrics, "shown": [m.get("displayName") or m["name"]["tag"] for m in experiment["metricInfos"]],
            "sessions": [(g["hparams"], {m["name"]["tag"]: m["value"] for m in g["metricValues"]}) for g in groups],
            "scalar_tags": sorted({t for run in scalar_tags.values() for t in run}),
            "text_tags": sorted({t.split("/")[0] for run in text_tags.values() for t in run})}


def screenshot(browser: str, url: str, out: Path, size: str = "1400,1000") -> Path | None:
    """A headless Chromium screenshot of ``url`` (None if Chromium produced none)."""
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={size}",
               "--virtual-time-budget=15000", f"--screenshot={out}", url]
    try:
        subprocess.run(command, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out if out.is_file() and out.stat().st_size else None
