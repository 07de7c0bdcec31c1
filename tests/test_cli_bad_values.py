"""Bad values and paths on the `taskfit` command line (issue 39), through the real command in a subprocess: each is
one error naming the key (no traceback), exit 1, no run folder left, nothing written outside ``paths.log_dir``.
All of them fail before training."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from test_cli import taskfit

TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1", "trainer.num_sanity_val_steps=0", "trainer.enable_model_summary=false"]


def _prepare(root: Path) -> Path:
    """A working directory two levels down (so that ``../../x`` stays inside the test's folder), with the bad
    files the cases point at."""
    cwd = root / "work" / "here"
    cwd.mkdir(parents=True)
    (cwd / "garbage.ckpt").write_bytes(bytes(range(256)) * 4)
    (cwd / "text.ckpt").write_text("this is not a checkpoint\n")
    (cwd / "empty.ckpt").write_bytes(b"")
    (cwd / "a_folder").mkdir()
    (cwd / "my_configs" / "task").mkdir(parents=True)
    (cwd / "my_configs" / "task" / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64))
    (cwd / "my_configs" / "task" / "nul.yaml").write_bytes(b"_target_: x\x00\x01\x02\n")
    # (issue 47, row 8: a task written as a YAML list; before: a TaskModuleError naming no file,
    # after a run directory was made)
    (cwd / "my_configs" / "task" / "listed.yaml").write_text("- _target_: my.Task\n- hidden: 8\n")
    return cwd


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# (the arguments, the error class, a pattern the error's first line must match: the key and its value)
CASES = {
    "negative lr": (["task.optimizer.lr=-1"], "MisconfigurationError",
                    r"Config value task\.optimizer\.lr=-1 is not valid: ValueError: Invalid learning rate"),
    "negative num_workers": (["task.num_workers=-1"], "MisconfigurationError",
                             r"Config value task\.num_workers=-1 is not valid: .*num_workers"),
    "log_dir under a file": (["paths.log_dir=/dev/null/x"], "MisconfigurationError",
                             r"paths\.log_dir=/dev/null/x: the run directory /dev/null/x/.* cannot be created"),
    "binary yaml": (["--config-dir=my_configs", "task=binary"], "MisconfigurationError",
                    r"task=binary: the config file .*binary\.yaml is not text"),
    "yaml with NULs": (["--config-dir=my_configs", "task=nul"], "MisconfigurationError",
                       r"The config file .*nul\.yaml is not valid YAML: unacceptable character"),
    "task file a yaml list": (["--config-dir=my_configs", "task=listed"],
                              "MisconfigurationError",
                              r"The config file .*my_configs/task/listed\.yaml \(task=listed\) "
                              r"is a YAML list, not a mapping of keys"),
    "missing config dir": (["--config-dir=no_such_configs"], "MisconfigurationError",
                           r"--config-dir /.*/work/here/no_such_configs: that path does not exist"),
    "config dir is a file": (["--config-dir=text.ckpt"], "MisconfigurationError",
                             r"--config-dir /.*/text\.ckpt: that path is a file, not a folder"),
    "garbage ckpt": (["ckpt_path=garbage.ckpt"], "CheckpointError",
                     r"ckpt_path=.*garbage\.ckpt cannot be resumed from: "),
    "text ckpt": (["ckpt_path=text.ckpt"], "CheckpointError", r"ckpt_path=.*text\.ckpt cannot be resumed from: "),
    "empty ckpt": (["ckpt_path=empty.ckpt"], "CheckpointError", r"ckpt_path=.*empty\.ckpt cannot be resumed from: "),
    "folder ckpt": (["ckpt_path=a_folder"], "CheckpointError",
                    r"ckpt_path=.*a_folder cannot be resumed from: .*is a directory"),
    "missing ckpt": (["ckpt_path=nowhere.ckpt"], "CheckpointError", r"ckpt_path=.*nowhere\.ckpt: there is no"),
    "name escaping": (["name=../../escaped"], "MisconfigurationError",
                      r"name='\.\./\.\./escaped' is not a valid run name: .*outside paths\.log_dir"),
    "absolute name": (["name=/tmp/taskfit_escaped_run"], "MisconfigurationError",
                      r"name='/tmp/taskfit_escaped_run' is not a valid run name"),
    "unclosed list": (["trainer.max_epochs=[1,"], "MisconfigurationError",
                      r"Config value trainer\.max_epochs='\[1,' cannot be parsed"),
    "unclosed filename field": (['callbacks.model_checkpoint.filename="{epoch"'], "MisconfigurationError",
                                r"Config callbacks\.model_checkpoint is not valid: ModelCheckpoint\(filename="
                                r"'\{epoch'\) is not a valid file name template"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_value_is_one_error_naming_the_key_and_leaves_nothing(tmp_path, case):
    args, cls, pattern = CASES[case]
    cwd = _prepare(tmp_path)
    before = _files(tmp_path)
    result = taskfit(*args, *TINY, cwd=cwd, expect=1, timeout=180)  # flags (--config-dir) first
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and len(lines) <= 3, result.stderr[-3000:]
    assert lines[0].startswith(f"{cls}: ") and re.search(pattern, lines[0]), result.stderr
    assert lines[1].startswith("  HINT: "), result.stderr
    assert _files(tmp_path) == before  # no run folder (nor logs/), nothing beside or above it
    assert not os.path.exists("/tmp/taskfit_escaped_run")


def test_a_malformed_filename_template_is_refused_before_training(tmp_path):
    from taskfit import MisconfigurationError
    from taskfit.callbacks import ModelCheckpoint

    for template, problem in (("{epoch", "a '{' that is not part"), ("epoch}-{step}", "a '}' that is not part"),
                              ("{}", "a '{' that is not part"), ("{epoch:q}", "the format of '{epoch:q}'")):
        with pytest.raises(MisconfigurationError, match=re.escape(problem)):
            ModelCheckpoint(dirpath=str(tmp_path), filename=template)
    ModelCheckpoint(dirpath=str(tmp_path), filename="{epoch:03d}-{val/acc:.3f}")  # still fine
    assert not list(tmp_path.iterdir())
