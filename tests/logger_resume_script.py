"""Driver of tests/test_logger_runs.py's resume test: one fit with TensorBoard, CSV and MLflow loggers, in a process
of its own (a fork of pytest's process, with its threads, is not safe to kill and continue from).

    python tests/logger_resume_script.py ROOT MLFLOW_URI KILL_STEP     # killed by SIGKILL when step KILL_STEP ends
    python tests/logger_resume_script.py ROOT MLFLOW_URI resume        # fit(ckpt_path="last"); prints the run dir
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import taskfit.callbacks.loggers.tensorboard as tb  # noqa: E402
from taskfit import Trainer  # noqa: E402
from taskfit.callbacks import CSVLogger, MLFlowLogger, ModelCheckpoint, TensorBoardLogger  # noqa: E402
from tasks import ClassifierTask, KillAt  # noqa: E402


def main(root: str, uri: str, what: str) -> None:
    resume = what == "resume"
    if not resume:
        tb.SEND_SECS = 0.0  # every finished step reaches the event file: the killed run writes past its checkpoint
    loggers = [TensorBoardLogger(), CSVLogger(), MLFlowLogger(tracking_uri=uri, flush_secs=0)]
    checkpoint = ModelCheckpoint(every_n_train_steps=4, every_n_epochs=None, save_top_k=-1)
    trainer = Trainer(max_epochs=3, log_every_n_steps=1, default_root_dir=root, logger=loggers,
                      callbacks=[checkpoint] + ([] if resume else [KillAt(int(what))]),
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ClassifierTask(), ckpt_path="last" if resume else None)  # 6 steps per epoch
    print(f"log_dir={trainer.log_dir}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
