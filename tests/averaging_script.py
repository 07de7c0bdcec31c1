"""Driver of tests/test_weight_averaging.py's kill-and-resume test: tests/resume_script.py's scenarios machinery
(real forked processes, a real SIGKILL mid-epoch, a resume from last.ckpt, an uninterrupted reference run) with an
EMA or SWA callback in every run.

    python tests/averaging_script.py ROOT [SCENARIO ...]

Writes what resume_script.py writes (ROOT/SCENARIO/result.json, *_log.json, *_params.pt: the task's weights, which
hold the average after fit) and *_averaging.pt: the callback's state at the end (the training weights, the update
count) and the optimizer's learning rate.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import resume_script  # noqa: E402
from taskfit.callbacks import Callback, EMAWeightAveraging, StochasticWeightAveraging  # noqa: E402

TASK = dict(n=48, batch_size=4, lr=0.02, shuffle=True, dropout=0.3, val_n=16)
AVERAGING = {  # name: the callback, then resume_script's scenario (task, Trainer, ModelCheckpoint kwargs, runs)
    # EMA every 2nd step with a warm-up, accumulation 2, validation every 4 batches (on the average), step checkpoints
    "ema": (lambda: EMAWeightAveraging(decay=0.8, update_every_n_steps=2, warmup_steps=3),
            (TASK, dict(max_epochs=3, accumulate_grad_batches=2, val_check_interval=4, log_every_n_steps=3),
             dict(every_n_train_steps=4, every_n_epochs=None, monitor="val/loss", save_top_k=2),
             [("kill", 1, 9), ("finish",)])),
    # SWA from epoch 2 (of 4), lr annealed over 2 epochs; killed in epoch 3, after the average has begun
    "swa": (lambda: StochasticWeightAveraging(swa_lrs=0.005, swa_epoch_start=2, annealing_epochs=2),
            (TASK, dict(max_epochs=4, log_every_n_steps=4), dict(every_n_train_steps=5, every_n_epochs=None),
             [("kill", 2, 7), ("finish",)])),
}


class Keep(Callback):
    """At fit end, after everything else: the averaging callback's state and the lr, to ``<root>/<name>_averaging.pt``."""

    order = 3000

    def __init__(self, path: str, averaging: Callback) -> None:
        self.path, self.averaging = path, averaging

    def on_fit_end(self, trainer, task) -> None:
        state = self.averaging.state_dict()
        torch.save({"training": state["weights"], "count": state["count"],
                    "lr": trainer.optimizer.param_groups[0]["lr"]}, self.path)


def train(scenario: str, root: str, name: str, resume: bool, extra: list, reference: bool = False) -> None:
    averaging = AVERAGING[scenario][0]()
    keep = Keep(os.path.join(root, f"{name}_averaging.pt"), averaging)
    plain_train(scenario, root, name, resume, [averaging, keep, *extra], reference)


plain_train, resume_script.train = resume_script.train, train  # run_scenario's runs get the callback
resume_script.SCENARIOS.update({name: scenario for name, (_, scenario) in AVERAGING.items()})

if __name__ == "__main__":
    torch.use_deterministic_algorithms(True)  # imported once, before forking (see resume_script.py)
    for name in sys.argv[2:] or AVERAGING:
        resume_script.run_scenario(name, os.path.join(sys.argv[1], name))
