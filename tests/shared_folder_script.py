"""Driver of tests/test_checkpoint_folders.py's row-2 test: two runs started at once on one
checkpoint folder.

python tests/shared_folder_script.py ROOT TRIALS

Each trial forks two real processes that are released at the same instant and fit with the same
``ModelCheckpoint(dirpath=ROOT/trialN/ckpts)`` (a resubmitted job beside the still-running one; a
sweep without per-trial folders), then, while those that train are still training, a third that fits
with ``ckpt_path="last"``. Long jobs overlap: a run that has saved waits (at a batch end) until
every run of the trial has saved once or ended, then finishes. Every process writes what it did to a
JSON file; one line of JSON per trial goes to ROOT/trials.jsonl: each run's pid, status (``trained``
or ``refused`` with the message), whether it resumed, and the files its bookkeeping names."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)

from taskfit import CheckpointError, Trainer  # noqa: E402
from taskfit.callbacks import Callback, ModelCheckpoint  # noqa: E402
from tasks import RegressionTask  # noqa: E402


class Gate(Callback):
    """After the run's first save: say so (``<name>.saved``), then wait for ``release`` before going
    on, so that the runs of a trial overlap as long-running jobs do."""

    order = 2000

    def __init__(self, base: str, name: str) -> None:
        self.base, self.name = base, name

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        if trainer.state.global_step != 2:
            return
        open(os.path.join(self.base, f"{self.name}.saved"), "w").close()
        while not os.path.exists(os.path.join(self.base, "release")):
            time.sleep(0.005)


def _fit(folder: str, base: str, name: str, lr: float, ckpt_path: str | None) -> dict:
    cb = ModelCheckpoint(
        dirpath=folder, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2
    )
    trainer = Trainer(
        default_root_dir=os.path.join(base, name),
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb, Gate(base, name)],
        seed=0,
    )
    torch.manual_seed(0)
    try:
        trainer.fit(RegressionTask(lr=lr), ckpt_path=ckpt_path)
    except CheckpointError as exc:
        return {"status": "refused", "message": str(exc)}
    files = sorted({*cb.best_k_models, cb.last_model_path} - {""})
    return {"status": "trained", "resumed": trainer.state.resumed, "files": files}


def _child(go: int, out: str, *args) -> None:
    """In a forked process: wait for the start signal, fit, write the outcome, exit."""
    try:
        os.read(go, 1)
        result = {"pid": os.getpid(), **_fit(*args)}
    except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
        result = {"pid": os.getpid(), "status": "crashed", "message": traceback.format_exc()}
    with open(out, "w") as fh:
        json.dump(result, fh)
    os._exit(0)


def _fork(go: int, out: str, *args) -> int:
    pid = os.fork()
    if pid == 0:
        _child(go, out, *args)
    return pid


def _wait_for(base: str, names: list[str]) -> None:
    """Until each of ``names`` has saved once (and waits) or ended."""

    def done(name: str) -> bool:
        return any(os.path.exists(os.path.join(base, name + end)) for end in (".saved", ".json"))

    while not all(done(name) for name in names):
        time.sleep(0.005)


def trial(base: str) -> dict:
    folder = os.path.join(base, "ckpts")
    os.makedirs(base)
    read, write = os.pipe()
    runs = {
        name: _fork(read, os.path.join(base, f"{name}.json"), folder, base, name, lr, None)
        for name, lr in (("a", 0.05), ("b", 0.07))
    }
    os.write(write, b"go")
    _wait_for(base, ["a", "b"])
    runs["resume"] = _fork(
        read, os.path.join(base, "resume.json"), folder, base, "resume", 0.09, "last"
    )
    os.write(write, b"g")
    _wait_for(base, ["resume"])
    open(os.path.join(base, "release"), "w").close()
    for pid in runs.values():
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    os.close(read)
    os.close(write)
    results = {}
    for name in runs:
        with open(os.path.join(base, f"{name}.json")) as fh:
            results[name] = json.load(fh)
    return results


def main() -> None:
    root, trials = sys.argv[1], int(sys.argv[2])
    # One fit before the trials: what is set up lazily on a first fit is inherited by every forked
    # run
    open(os.path.join(root, "release"), "w").close()
    _fit(os.path.join(root, "warm", "ckpts"), root, "warm", 0.05, None)
    with open(os.path.join(root, "trials.jsonl"), "w") as out:
        for n in range(trials):
            out.write(json.dumps(trial(os.path.join(root, f"trial{n}"))) + "\n")


if __name__ == "__main__":
    main()
