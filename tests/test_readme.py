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


def test_readme_and_quickstart_say_one_thing():
    """The main job's sample output, its timings and the TensorBoard commands: the same in both."""
    with open(os.path.join(ROOT, "docs", "quickstart.md"), encoding="utf-8") as f:
        quickstart = f.read()
    readme = _readme()

    def results(text: str) -> str:  # the sample's last lines: the test results and the summary line
        return re.search(r"^Test results\n.*?^validation accuracy: [\d.]+, test accuracy: [\d.]+",
                         text, re.S | re.M).group(0)

    def commands(text: str) -> set[str]:
        return set(re.findall(r"^tensorboard --logdir \S+", text, re.M))

    assert results(readme) == results(quickstart)
    assert commands(readme) == commands(quickstart) == {"tensorboard --logdir taskfit_logs",
                                                        "tensorboard --logdir logs/digits"}
    for text in (readme, quickstart):  # the main job's time: quiet, then busy
        assert re.search(r"8 s on (2|two) quiet CPU cores", text)
        assert re.search(r"50 to\s+360 s", text), "the busy machine's range"
        assert "test/loss 0.06857" in text  # what another CPU printed
