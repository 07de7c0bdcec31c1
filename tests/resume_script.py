"""Driver of tests/test_resume.py: train, get killed by a real signal, resume, and train once uninterrupted.

    python tests/resume_script.py ROOT [SCENARIO ...]      # default: every scenario

One interpreter for all scenarios: torch is imported once, then every training run is a forked child process (a
real process, killed by a real SIGKILL/SIGTERM; nothing in memory survives to the resumed run except what a
fresh start would have). Writes ROOT/SCENARIO/result.json (each run's exit status and output) and, for the final
resumed run and the uninterrupted reference run, their start step and logged values (*_log.json) and final
parameters (*_params.pt).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(1)

from taskfit import Trainer  # noqa: E402
from taskfit.callbacks import Callback, ModelCheckpoint  # noqa: E402
from tasks import RegressionTask  # noqa: E402


class ScheduledTask(RegressionTask):
    """RegressionTask with momentum (optimizer state) and a step-interval scheduler; ``ballast`` MB of buffer."""

    def __init__(self, ballast_mb: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        if ballast_mb:  # makes every checkpoint write take long enough to be killed in the middle of it
            self.register_buffer("ballast", torch.zeros(ballast_mb * 2**18))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ManualTask(ScheduledTask):
    """Manual optimization: two optimizers (the linear layer's SGD with momentum, a second head's Adam), each with
    its scheduler, stepping in turn; dropout draws random numbers in the step."""

    automatic_optimization = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.head = torch.nn.Linear(4, 1)

    def configure_optimizers(self):
        first = torch.optim.SGD(self.net.parameters(), lr=self.lr, momentum=0.9)
        second = torch.optim.Adam(self.head.parameters(), lr=0.01)
        return [first, second], [torch.optim.lr_scheduler.StepLR(first, 2, 0.8),
                                 torch.optim.lr_scheduler.StepLR(second, 3, 0.5)]

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        first, second = self.optimizers()
        loss = torch.nn.functional.mse_loss(self(inputs), targets)
        first.zero_grad()
        self.manual_backward(loss)
        first.step()
        head_loss = torch.nn.functional.mse_loss(self.head(self.net[0](inputs)).squeeze(-1), targets)
        second.zero_grad()
        self.manual_backward(head_loss)
        self.clip_gradients(second, gradient_clip_val=0.5)
        second.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("head_loss", head_loss.detach())
        return loss


TASK = dict(n=48, batch_size=4, lr=0.02, shuffle=True, dropout=0.3, val_n=16)
# name: (task kwargs, Trainer kwargs, ModelCheckpoint kwargs, runs). A run: ("kill"/"term", epoch, batch_idx)
# signals the process at the start of that batch (SIGKILL) / the end of it (SIGTERM); ("write",) SIGKILLs it
# while it writes its second checkpoint; ("finish",) resumes and trains to the end.
SCENARIOS = {
    # every_n_train_steps checkpoints, accumulation 2, killed twice (the first time mid accumulation group)
    "steps": (dict(TASK), dict(max_epochs=3, accumulate_grad_batches=2, val_check_interval=4, log_every_n_steps=3),
              dict(every_n_train_steps=4, every_n_epochs=None, monitor="val/loss", save_top_k=2,
                   filename="{epoch}-{step}-{val/loss:.4f}"),
              [("kill", 0, 9), ("kill", 1, 7), ("finish",)]),
    # epoch-end checkpoints only (every epoch: min_epoch_interval=0), 2 DataLoader worker processes, killed mid-epoch
    "epochs": (dict(TASK, num_workers=2), dict(max_epochs=3, accumulate_grad_batches=2, log_every_n_steps=2),
               dict(min_epoch_interval=0), [("kill", 1, 7), ("finish",)]),
    # SIGKILL while a checkpoint is being written
    "write": (dict(TASK, ballast_mb=24), dict(max_steps=9, log_every_n_steps=2),
              dict(every_n_train_steps=3, every_n_epochs=None), [("write",), ("finish",)]),
    # SIGTERM to the process group (2 DataLoader workers included) mid-epoch: a checkpoint at that step boundary,
    # exit status 143; the resume is mid-epoch with workers
    "sigterm": (dict(TASK, num_workers=2), dict(max_epochs=2, log_every_n_steps=4),
                dict(every_n_epochs=0), [("term", 0, 5), ("finish",)]),
    # manual optimization, two optimizers and schedulers (global_step: 2 per batch), SIGKILLed mid-epoch
    "manual": (dict(TASK), dict(max_epochs=3, log_every_n_steps=3, val_check_interval=5),
               dict(every_n_train_steps=4, every_n_epochs=None), [("kill", 1, 7), ("finish",)]),
}


class Recorder(Callback):
    """Writes the values of every on_log call, and the step the run started at, to a JSON file."""

    def __init__(self, path: str) -> None:
        self.path, self.records, self.start = path, [], None

    def on_fit_start(self, trainer, task) -> None:
        st = trainer.state
        self.start = {"epoch": st.epoch, "batches_done": st.batches_done, "global_step": st.global_step}

    def on_log(self, trainer, task, metrics) -> None:
        self.records.append([trainer.state.global_step, metrics])

    def on_fit_end(self, trainer, task) -> None:
        with open(self.path, "w") as f:
            json.dump({"start": self.start, "records": self.records}, f)


class Signal(Callback):
    """Sends this process ``signum`` at batch ``batch_idx`` of ``epoch`` (at its start for SIGKILL, else its end);
    with ``rank``, only that ddp rank's process; with ``group``, its whole process group."""

    order = 2000  # after ModelCheckpoint

    def __init__(self, signum: int, epoch: int, batch_idx: int, rank: int | None = None, group: bool = False) -> None:
        self.signum, self.epoch, self.batch_idx, self.rank, self.group = signum, epoch, batch_idx, rank, group

    def _maybe(self, trainer) -> None:
        if (trainer.state.epoch, trainer.state.batch_idx) == (self.epoch, self.batch_idx) and \
                self.rank in (None, trainer.strategy.rank):
            # ModelCheckpoint renames its files on a background thread: kill after the last one is in place, so the
            # resume point is known (a kill in the middle of a write is the "write" scenario).
            trainer.checkpoint_writer.wait()
            if self.group:  # as `kill -TERM -<pgid>` or a scheduler does: DataLoader workers get it too
                os.killpg(os.getpgrp(), self.signum)
            else:
                os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, task, batch, batch_idx) -> None:
        if self.signum == signal.SIGKILL:
            self._maybe(trainer)

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        if self.signum != signal.SIGKILL:
            self._maybe(trainer)


def train(scenario: str, root: str, name: str, resume: bool, extra: list, reference: bool = False) -> None:
    task_kwargs, trainer_kwargs, ckpt_kwargs, _ = SCENARIOS[scenario]
    torch.manual_seed(0)
    task = (ManualTask if scenario == "manual" else ScheduledTask)(**task_kwargs)
    callbacks = [Recorder(os.path.join(root, f"{name}_log.json")), *extra]
    if not reference:
        callbacks.append(ModelCheckpoint(**ckpt_kwargs))
    trainer = Trainer(seed=0, deterministic=True, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=not reference, num_sanity_val_steps=0 if resume else 2,
                      default_root_dir=os.path.join(root, "ref" if reference else "runs"), callbacks=callbacks,
                      **trainer_kwargs)
    trainer.fit(task, ckpt_path="last" if resume else None)
    torch.save({k: v.detach().clone() for k, v in task.state_dict().items()}, os.path.join(root, f"{name}_params.pt"))


def start_child(fn, log: str) -> int:
    """Fork a child that runs ``fn`` in a process group of its own (with its DataLoader workers, as a job under a
    scheduler), its output in ``log``; it exits with fn's SystemExit code, 0, or 1 on an error. Returns its pid.

    ``code`` is 0 only once ``fn`` has returned: torch's SIGCHLD handler raises again for each worker that dies, and
    a second such error while the first is being printed skips the ``except`` clause (status 0, nothing printed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgrp()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            fn()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def fork(fn, log: str, write_watch: str | None = None) -> dict:
    """Run ``fn`` in a child process; with ``write_watch``, SIGKILL it while it writes a checkpoint there."""
    start = time.monotonic()
    pid = start_child(fn, log)
    killed_tmp = None
    if write_watch is not None:
        killed_tmp = watch_writes(pid, write_watch)
    _, status = os.waitpid(pid, 0)
    with open(log) as f:
        output = f.read()
    return {"status": os.waitstatus_to_exitcode(status), "output": output, "killed_tmp": killed_tmp,
            "seconds": round(time.monotonic() - start, 2)}


def watch_writes(pid: int, directory: str) -> str | None:
    """Poll ``directory``: once a first ``last.ckpt`` exists, SIGKILL ``pid`` in the middle of writing the next file."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            raise RuntimeError("the run ended before a checkpoint write could be interrupted")
        names = os.listdir(directory) if os.path.isdir(directory) else []
        if "last.ckpt" in names:
            for name in (n for n in names if n.endswith(".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    if os.path.getsize(os.path.join(directory, name)) > 2**20:  # bytes written, not all of them
                        os.kill(pid, signal.SIGKILL)
                        return os.path.join(directory, name)
        time.sleep(0.0005)
    os.kill(pid, signal.SIGKILL)
    raise RuntimeError("no checkpoint write was seen")


def run_scenario(scenario: str, root: str) -> None:
    os.makedirs(root, exist_ok=True)
    runs = []
    for i, run in enumerate(SCENARIOS[scenario][3]):
        resume, log = i > 0, os.path.join(root, f"run{i}.out")
        if run[0] == "finish":
            result = fork(lambda: train(scenario, root, "final", resume, []), log)
        elif run[0] == "write":
            watch = os.path.join(root, "runs", "version_0", "checkpoints")
            result = fork(lambda: train(scenario, root, f"run{i}", resume, []), log, write_watch=watch)
            result["left_tmp"] = os.path.exists(result["killed_tmp"])
        else:
            signum = signal.SIGKILL if run[0] == "kill" else signal.SIGTERM
            sender = Signal(signum, run[1], run[2], group=signum == signal.SIGTERM)
            result = fork(lambda: train(scenario, root, f"run{i}", resume, [sender]), log)
        if run[0] != "finish":
            # The folder as this run left it (the next run continues in it: issue 47 row 1)
            shutil.copytree(os.path.join(root, "runs", "version_0", "checkpoints"),
                            os.path.join(root, f"after_run{i}"))
        runs.append(result)
    reference = fork(lambda: train(scenario, root, "reference", False, [], reference=True),
                     os.path.join(root, "reference.out"))
    with open(os.path.join(root, "result.json"), "w") as f:
        json.dump({"runs": runs, "reference": reference}, f, indent=1)


if __name__ == "__main__":
    # Trainer(deterministic=True) calls this; its first call imports torch._inductor (seconds): do it once,
    # before forking, instead of in every child.
    torch.use_deterministic_algorithms(True)
    for name in sys.argv[2:] or SCENARIOS:
        run_scenario(name, os.path.join(sys.argv[1], name))
