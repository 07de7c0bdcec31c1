"""Preemption and exact resume, the way a cluster does it: the job is stopped by SIGTERM and started
again.

    python examples/preemption.py        # ~20 s on a CPU: start, preempt, requeue, compare

This script plays the scheduler (SLURM, Kubernetes, a spot-instance reclaim). It starts the training
job ``python examples/preemption.py --job`` as a child process, sends it SIGTERM in the middle of an
epoch, sees it exit with status 143 after writing a checkpoint, and starts the very same command
again. The job is ordinary code: it passes ``ckpt_path="last"``, which starts fresh the first time
(nothing to resume yet) and continues where the first start stopped the second time. Finally the
same job runs uninterrupted (in this process) for comparison: the final weights are bitwise
identical.

On a real cluster only ``job()`` is yours; docs/clusters.md shows the SLURM, torchrun and Kubernetes
settings.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job(root: str, epochs: int, heartbeat: bool = True) -> str:
    """The training job. Run it again after a preemption and it resumes: nothing else to do."""
    from taskfit import Trainer, seed_everything
    from taskfit.callbacks import Callback
    from taskfit.examples.digits import DigitsTask

    # lets the "scheduler" above see progress (and pick a moment to preempt)
    class Heartbeat(Callback):
        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
            print(f"step {trainer.state.global_step}", flush=True)

    seed_everything(0)
    task = DigitsTask(channels=8, hidden=32, dropout=0.1)
    trainer = Trainer(max_epochs=epochs, seed=0, deterministic=True, default_root_dir=root,
                      callbacks=[Heartbeat()] if heartbeat else [], enable_progress_bar=False,
                      enable_model_summary=False)
    # the first start has nothing to resume: a fresh run (with a warning)
    trainer.fit(task, ckpt_path="last")
    digest = hashlib.sha256(
        b"".join(t.numpy().tobytes() for t in task.state_dict().values())
    ).hexdigest()[:16]
    line = (f"finished: epoch {trainer.state.epoch}, step {trainer.state.global_step}, val/acc "
            f"{trainer.state.metrics['val/acc']:.4f}, weights {digest} (run directory: "
            f"{trainer.log_dir})")
    print(line, flush=True)
    return line


def start(root: str, epochs: int) -> subprocess.Popen:
    """Start the job (what a scheduler does), its output piped here."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--job",
            "--root",
            root,
            "--epochs",
            str(epochs),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def wait(proc: subprocess.Popen, preempt_at: int | None = None) -> tuple[int, str]:
    """Wait for the job; with ``preempt_at``, send it SIGTERM once it reports that step. Returns
    (status, output)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if preempt_at is not None and line.strip() == f"step {preempt_at}":
            # what `scancel`, a node drain or `kubectl delete pod` sends
            proc.send_signal(signal.SIGTERM)
            preempt_at = None
    return proc.wait(), "".join(lines)


def finished_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("finished:"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--job", action="store_true", help="run the training job itself (what a "
                                                           "cluster starts)")
    parser.add_argument("--root", default=os.path.join("taskfit_logs", "preemption"),
                        help="the job's run directory (the demo uses a new demo_N folder under it)")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    if args.job:
        job(args.root, args.epochs)
        return

    demo = next(
        path
        for i in range(10**6)
        if not os.path.exists(path := os.path.join(args.root, f"demo_{i}"))
    )
    # 23 steps/epoch
    status, output = wait(start(os.path.join(demo, "job"), args.epochs), preempt_at=30)
    notice = next(line for line in output.splitlines() if "received" in line)
    print(f"1st start: exit status {status} (128 + SIGTERM)\n  {notice}")
    assert status == 128 + signal.SIGTERM, output

    # requeued: the same command resumes
    status, output = wait(start(os.path.join(demo, "job"), args.epochs))
    resumed = next(line for line in output.splitlines() if line.startswith("Resumed from"))
    print(f"2nd start: exit status {status}\n  {resumed}\n  {finished_line(output)}")
    assert status == 0, output

    print("the same job uninterrupted, in this process, for comparison:")
    uninterrupted = job(os.path.join(demo, "uninterrupted"), args.epochs, heartbeat=False)
    same = (
        finished_line(output).split("weights ")[1][:16] == uninterrupted.split("weights ")[1][:16]
    )
    print(f"preempted + resumed run bitwise equal to the uninterrupted one: {same}")

if __name__ == "__main__":
    main()
