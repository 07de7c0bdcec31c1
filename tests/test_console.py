"""What a run shows on the console: the progress bar on a real terminal (a pseudo-terminal, as a person's shell
has it) with the current loss from the first steps and its values in a fixed order, read only when the bar redraws;
one line per epoch to a file; a results table after trainer.test() / trainer.validate() from Python."""
from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest
from taskfit import Trainer
from taskfit.callbacks import ProgressBar
from tasks import ClassifierTask

ROOT = Path(__file__).resolve().parents[1]


def on_a_terminal(code: str, cwd: Path) -> list[str]:
    """Run ``python -c code`` with stdout on a 140-column pseudo-terminal; every redraw the terminal received."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))  # tqdm draws nothing 0 columns wide
    paths = [str(ROOT / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    process = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=subprocess.PIPE,
                               cwd=cwd, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert process.wait(timeout=300) == 0, process.stderr.read().decode()[-3000:]
    return [part for part in re.split(r"[\r\n]+", out.decode(errors="replace")) if part.strip()]


SLOW_STEPS = textwrap.dedent("""
    import time
    from tasks import RegressionTask
    from taskfit import Trainer

    class Slow(RegressionTask):  # 20 steps of 40 ms an epoch: tqdm redraws (every 0.25 s) inside the epoch
        def loss(self, outputs, targets):
            time.sleep(0.04)
            return super().loss(outputs, targets)

    Trainer(max_epochs=2, log_every_n_steps=50, enable_model_summary=False).fit(Slow(n=160, val_n=16))
""")


def test_the_bar_shows_the_loss_from_the_first_steps_in_a_fixed_order(tmp_path):
    redraws = on_a_terminal(SLOW_STEPS, tmp_path)
    bars = [(int(m.group(1)), int(m.group(2)), line) for line in redraws
            if (m := re.match(r"Epoch (\d)/1:.*\| *(\d+)/20 \[", line))]
    mid_epoch = [line for epoch, n, line in bars if epoch == 0 and 0 < n < 20]
    assert mid_epoch and all("loss=" in line for line in mid_epoch), redraws  # long before log_every_n_steps=50
    # the values keep the order they first appeared in: the loss, then validation's (from the end of epoch 0 on)
    keys = [re.findall(r"([\w/]+)=", line.split("it/s, ")[-1]) for _, n, line in bars if n]
    assert keys[0] == ["loss"] and ["loss", "val/loss"] in keys and all(k in (["loss"], ["loss", "val/loss"])
                                                                     for k in keys), keys
    assert [line for line in redraws if line.startswith("Epoch 1/1:") and "20/20" in line][-1].count("loss=") == 2


STOPPED_EARLY = textwrap.dedent("""
    from tasks import RegressionTask
    from taskfit import Trainer

    for kwargs in (dict(max_steps=1), dict(max_steps=10), dict(max_epochs=1, limit_train_batches=3),
                   dict(max_steps=3, accumulate_grad_batches=2)):
        print("run", kwargs, flush=True)
        Trainer(**kwargs, enable_model_summary=False, enable_checkpointing=False, logger=False,
                default_root_dir="runs").fit(RegressionTask(n=64))  # 8 batches an epoch
""")


def test_the_bar_total_respects_max_steps_and_limit_train_batches(tmp_path):
    """As Lightning's: the batches the epoch runs, not the loader's (max_steps=1 reads 1/1)."""
    redraws = on_a_terminal(STOPPED_EARLY, tmp_path)
    finals, run = {}, None
    for line in redraws:
        if line.startswith("run "):
            run = line[4:]
        elif m := re.match(r"(Epoch \d+)\S*: .*\| *(\d+/\d+) \[", line):
            finals.setdefault(run, {})[m.group(1)] = m.group(2)  # each epoch's last redraw
    assert finals == {"{'max_steps': 1}": {"Epoch 0": "1/1"},
                      "{'max_steps': 10}": {"Epoch 0": "8/8", "Epoch 1": "2/2"},
                      "{'max_epochs': 1, 'limit_train_batches': 3}": {"Epoch 0": "3/3"},
                      "{'max_steps': 3, 'accumulate_grad_batches': 2}": {"Epoch 0": "6/6"}}, redraws
    out = io.StringIO()  # a log file's line per epoch says the same
    trainer = Trainer(max_steps=1, enable_model_summary=False, enable_checkpointing=False,
                      logger=False, default_root_dir=str(tmp_path),
                      callbacks=[ProgressBar(stream=out)])
    trainer.fit(ClassifierTask())
    assert "| 1/1 [" in out.getvalue(), out.getvalue()


def test_the_values_are_read_when_the_bar_redraws_not_at_every_step(tmp_path, monkeypatch):
    """Converting the loss is a host-device sync: the bar reads it when tqdm redraws, never per step."""
    import taskfit.callbacks.progress as progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(progress, "REFRESH_S", 3600.0)  # no redraw between an epoch's first and last
    reads = []
    values = progress.ProgressBar.values
    monkeypatch.setattr(progress.ProgressBar, "values", lambda self, trainer: reads.append(1) or values(self, trainer))
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[ProgressBar(stream=Terminal())])
    trainer.fit(ClassifierTask(n=480))  # 30 steps an epoch
    assert trainer.state.global_step == 60 and len(reads) <= 2 * 3  # per epoch: its first draws and its last


def test_test_and_validate_from_python_print_a_results_table(tmp_path, capsys):
    task = ClassifierTask()
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_model_summary=False,
                      enable_checkpointing=False)
    trainer.fit(task)
    capsys.readouterr()
    (tested,) = trainer.test(task)
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "Test results" and len(table) == 1 + len(tested)
    assert {line.split()[0]: float(line.split()[1]) for line in table[1:]} == pytest.approx(tested, rel=1e-3)
    (validated,) = trainer.validate(task)
    out = capsys.readouterr().out
    assert out.startswith("Validation results\n") and f"{validated['val/loss']:.4g}" in out
    trainer.max_epochs = 2  # (this Trainer's epoch 0 is done: its next fit trains epoch 1, as Lightning's)
    trainer.fit(task)  # a validation inside fit prints no table, on a file one line per epoch
    assert "results" not in (out := capsys.readouterr().out) and out.count("Epoch 1/1: 100%") == 1


def test_long_evaluation_passes_get_a_bar_of_their_own(tmp_path, monkeypatch):
    """A validation, test or predict pass shows a bar once it has run EVAL_DELAY_S (counted by Lightning's batch
    hooks); a short one shows none."""
    import taskfit.callbacks.progress as progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    task = ClassifierTask(val_n=90)  # 6 batches of 16
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[ProgressBar(stream=(screen := Terminal()))])
    trainer.fit(task)
    trainer.test(task)  # passes of a few milliseconds: no bar (the test's results table only)
    assert not re.search(r"(Validation|Test): ", screen.getvalue())
    monkeypatch.setattr(progress, "EVAL_DELAY_S", 0.0)  # every pass counts as long...
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)  # ...and every batch redraws
    trainer.max_epochs = 2  # (this Trainer's epoch 0 is done: its next fit trains epoch 1, as Lightning's)
    trainer.fit(task)
    trainer.validate(task)
    trainer.test(task)
    trainer.predict(task, dataloaders=task.test_dataloader())
    shown = re.split(r"[\r\n]+", screen.getvalue())
    for title in ("Validation", "Test", "Predict"):
        counts = [int(m.group(1)) for line in shown if (m := re.match(rf"{title}: .*?(\d+)(?:/6|it) ", line))]
        assert counts and max(counts) == 6, (title, shown[-40:])
    assert any(re.match(r"Validation: +\d+%\|.*\| 6/6 ", line) for line in shown)  # in fit: the total is known


class BarValues(ClassifierTask):
    def loss(self, outputs, targets):
        self.log("bar_acc", (outputs.argmax(-1) == targets).float().mean(), prog_bar=True)
        return super().loss(outputs, targets)


def test_prog_bar_values_join_the_line_in_the_order_they_first_appeared(tmp_path, capsys):
    Trainer(max_epochs=2, log_every_n_steps=2, default_root_dir=str(tmp_path), enable_model_summary=False,
            enable_checkpointing=False).fit(BarValues())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch ")]
    keys = [re.findall(r"([\w/]+)=", line.split("it/s, ")[-1]) for line in lines]
    assert keys[0][:2] == ["loss", "bar_acc"] and keys[1] == keys[0]  # ...and keep their places
    assert {"val/loss", "val/acc"} <= set(keys[0]) and "acc_batch" not in keys[0]  # not a prog_bar value
