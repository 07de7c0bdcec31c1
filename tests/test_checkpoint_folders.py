"""Checkpoint folders across runs (issue 47, rows 1 and 2): a resumed fit continues in the folder of the run it
resumes, and two live runs given the same folder never write the same file nor resume each other's weights.

Row 1 runs in this process; row 2 starts two real processes on one folder, again and again (a race).
"""
from __future__ import annotations

import os
import re

from taskfit.callbacks import ModelCheckpoint
from tasks import checkpointing_trainer as _trainer
from tasks import seeded_task as _task


def _files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))


# ---- row 1: a resume continues in its run's folder ------------------------------------------------------------
def test_a_resume_without_a_logger_continues_in_the_folder_it_resumes(tmp_path):
    _trainer(tmp_path, max_epochs=2).fit(_task())
    folder = tmp_path / "version_0" / "checkpoints"
    assert _files(folder) == ["epoch=1-step=16.ckpt", "last.ckpt"]
    trainer = _trainer(tmp_path, max_epochs=4)
    trainer.fit(_task(), ckpt_path="last")
    # No second run directory: save_top_k=1 held across the resume (the epoch=1 file was rotated out)
    assert sorted(os.listdir(tmp_path)) == ["version_0"]
    assert _files(folder) == ["epoch=3-step=32.ckpt", "last.ckpt"]
    assert trainer.log_dir == str(tmp_path / "version_0")
    assert trainer.checkpoint_callback.best_model_path == str(folder / "epoch=3-step=32.ckpt")


def test_resumed_saves_rotate_the_top_k_of_the_earlier_fits(tmp_path):
    ranked = dict(monitor="step", mode="max", save_top_k=2)
    _trainer(tmp_path, max_epochs=2, callbacks=[ModelCheckpoint(**ranked)]).fit(_task())
    for epochs in (3, 4):
        cb = ModelCheckpoint(**ranked)
        _trainer(tmp_path, max_epochs=epochs, callbacks=[cb]).fit(_task(), ckpt_path="last")
    folder = tmp_path / "version_0" / "checkpoints"
    assert _files(folder) == ["epoch=2-step=24.ckpt", "epoch=3-step=32.ckpt", "last.ckpt"]
    assert sorted(os.path.basename(p) for p in cb.best_k_models) == _files(folder)[:2]


def test_a_fresh_fit_without_a_logger_still_starts_a_new_version(tmp_path):
    _trainer(tmp_path, max_epochs=1).fit(_task())
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(_task())
    assert trainer.log_dir == str(tmp_path / "version_1")
    assert re.fullmatch(r"epoch=0-step=\d+\.ckpt", _files(tmp_path / "version_0" / "checkpoints")[0])
