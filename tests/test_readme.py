"""The README's example runs as printed, and .ci/run runs exactly the README's test command."""
from __future__ import annotations

import os
import re

from conftest import ROOT


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_readme_taskmodule_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = re.search(r"## A TaskModule in 25 lines\n\n```python\n(.*?)```", _readme(), re.S).group(1)
    assert len(block.strip().splitlines()) <= 32
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(block, "README.md", "exec"), namespace)
    assert (tmp_path / "taskfit_logs" / "version_0").is_dir()


def test_ci_runs_the_readme_test_command():
    command = re.search(r"## Run the tests\n\n```bash\n(.*?)\n```", _readme(), re.S).group(1).strip()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert lines[-1] == command
    install = re.search(r"## Install\n\n```bash\n(.*?)\n```", _readme(), re.S).group(1).strip().splitlines()[-1]
    assert install.replace("pip install", "").split() == lines[-2].replace("python -m pip install --quiet", "").split()
