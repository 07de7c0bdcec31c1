"""Lightning's Trainer arguments that taskfit's Trainer does not take, each with what to use
instead, and Lightning's spellings of default values read as taskfit's.

``TRAINER_ARGUMENTS`` is the table of Lightning-only arguments the Trainer's metaclass answers
(trainer.py here): ``Trainer(num_nodes=2)`` is one catalogued error whose HINT says what to do. It
holds every argument of Lightning 2.6's ``Trainer`` that taskfit's lacks, and the 1.x arguments that
ported code still passes (``gpus``, ``resume_from_checkpoint``...). tests/test_lightning_ports.py
holds Lightning 2.6.6's argument list and checks that each is taken or in this table.

:func:`lightning_values` lets the Trainer take the values Lightning documents as "the default" or
"no limit": ``None`` for the arguments that have a default here, ``max_steps=-1``,
``num_sanity_val_steps=-1`` (every validation batch) and ``accelerator="gpu"``.
trainer.py in this folder applies both (the Trainer's metaclass) and the entry points' Lightning
keywords.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

from ...errors import MisconfigurationError

_TORCHRUN = "torchrun --nnodes=N --nproc-per-node=G"
_ACCELERATOR = (
    'accelerator="cuda", devices=N (Lightning 2\'s spelling, which taskfit takes; docs/trainer.md)'
)

TRAINER_ARGUMENTS: dict[str, str] = {
    # Lightning 2.6
    "num_nodes": f"start one process per GPU on every node with {_TORCHRUN} (docs/strategies.md).",
    "max_time": "stop on max_epochs or max_steps; to end a run at a wall-clock limit, send it "
                "SIGTERM (e.g. `timeout -s TERM 4h python train.py`): taskfit saves a checkpoint "
                "and exits, and fit(task, ckpt_path='last') continues it exactly "
                "(docs/checkpointing.md).",
    "benchmark": "set torch.backends.cudnn.benchmark = True yourself before fit (taskfit leaves "
                 "cuDNN's setting as you set it).",
    "inference_mode": "validation, test and predict run under torch.no_grad(); wrap code that "
                      "needs gradients there in torch.enable_grad().",
    "use_distributed_sampler": "taskfit shards a plain DataLoader itself (a resumable sampler) and "
                               "keeps a loader with a sampler of your own as it is; nothing to set "
                               "(docs/strategies.md).",
    "detect_anomaly": "nonfinite_loss='raise' (the default) stops at the first NaN/Inf loss with "
                      "its epoch, batch and step; for autograd's anomaly mode call "
                      "torch.autograd.set_detect_anomaly(True) yourself.",
    "barebones": "turn the extras off one by one: enable_progress_bar=False, "
                 "enable_model_summary=False, enable_checkpointing=False, logger=False (the "
                 "default path already costs no sync per step).",
    "plugins": "precision plugins: precision='16-mixed' or 'bf16-mixed'; "
               "SLURMEnvironment(auto_requeue=True): requeue=True (the default in a SLURM batch "
               "job), preempt_signals, preempt_exit_code; cluster environments: torchrun's or "
               "SLURM's variables are read (docs/clusters.md).",
    "sync_batchnorm": "convert the model yourself for ddp: self.net = "
                      "torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.net) in your "
                      "TaskModule's __init__ or configure_model.",
    "enable_autolog_hparams": "taskfit's loggers always record the task's hyperparameters "
                              "(docs/logging.md); leave the argument out.",
    "model_registry": "not available: copy trainer.checkpoint_callback.best_model_path to your "
                      "registry after fit.",
    # Lightning 1.x, removed in 2.0
    "gpus": f"use {_ACCELERATOR}.",
    "num_processes": "devices=N; on CPUs strategy='ddp', devices=N starts N processes.",
    "auto_select_gpus": "devices=N takes the first N visible GPUs; choose others with "
                        "CUDA_VISIBLE_DEVICES or devices=[i, j].",
    "tpu_cores": "TPUs are not supported: accelerator='cpu', 'cuda' or 'mps'.",
    "ipus": "IPUs are not supported: accelerator='cpu', 'cuda' or 'mps'.",
    "resume_from_checkpoint": "trainer.fit(task, ckpt_path=...) ('last', 'best' or a path), as in "
                              "Lightning 2.",
    "track_grad_norm": "log it in on_before_optimizer_step: self.log('grad_norm', "
                       "torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad "
                       "is not None])).",
    "replace_sampler_ddp": "taskfit shards a plain DataLoader itself and keeps a sampler of your "
                           "own; nothing to set.",
    "auto_lr_find": "call taskfit.tune.lr_find(trainer, task) before fit (Lightning 2's "
                    "Tuner.lr_find; docs/tuning.md).",
    "auto_scale_batch_size": "not available: try batch sizes with short fits (e.g. fast_dev_run=5) "
                             "and keep the largest that fits in memory.",
    "amp_backend": "precision='16-mixed' or 'bf16-mixed' (torch.autocast; apex is not supported).",
    "amp_level": "precision='16-mixed' or 'bf16-mixed' (torch.autocast; apex is not supported).",
    "move_metrics_to_cpu": "logged values stay on the device and are converted once per log "
                           "interval; leave it out.",
    "multiple_trainloader_mode": "taskfit trains on one loader per fit: combine data sets in one "
                                 "Dataset (torch.utils.data.ConcatDataset, or one that returns a "
                                 "dict per sample).",
    "checkpoint_callback": "enable_checkpointing=True/False, or callbacks=[ModelCheckpoint(...)].",
    "progress_bar_refresh_rate": "enable_progress_bar=True/False (the bar refreshes a few times a "
                                 "second).",
    "weights_summary": "enable_model_summary=True/False, or "
                       "callbacks=[ModelSummary(max_depth=...)].",
    "terminate_on_nan": "nonfinite_loss='raise' (the default).",
    "stochastic_weight_avg": "callbacks=[StochasticWeightAveraging(swa_lrs=...)] from "
                             "taskfit.callbacks (docs/tuning.md).",
    "flush_logs_every_n_steps": "the loggers flush their files themselves every few seconds; leave "
                                "it out.",
    "weights_save_path": "ModelCheckpoint(dirpath=...), or default_root_dir=...",
    "prepare_data_per_node": "prepare_data runs once per machine (local rank 0), Lightning's "
                             "default.",
    "truncated_bptt_steps": "split the sequence in your own training_step (Lightning 2 removed it "
                            "too).",
    "distributed_backend": "strategy='ddp', 'dp' or 'fsdp'.",
    "reload_dataloaders_every_epoch": "reload_dataloaders_every_n_epochs=1, as in Lightning 2.",
}

# Lightning's value for "the default" or "no limit" -> taskfit's: the arguments whose default is not
# None here
_NONE_MEANS_DEFAULT = (
    "precision",
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "val_check_interval",
    "num_sanity_val_steps",
    "log_every_n_steps",
    "enable_checkpointing",
    "enable_progress_bar",
    "enable_model_summary",
    "gradient_clip_algorithm",
    "deterministic",
)


def lightning_values(init: Callable[..., None], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of ``Trainer(...)`` with Lightning's spellings of a default read as taskfit's."""
    defaults = {
        k: p.default
        for k, p in inspect.signature(init).parameters.items()
        if k in _NONE_MEANS_DEFAULT
    }
    kwargs = dict(kwargs)
    for name in _NONE_MEANS_DEFAULT:
        if name in kwargs and kwargs[name] is None:
            kwargs[name] = defaults[name]
    if kwargs.get("max_steps") == -1:  # Lightning's default: no step limit
        kwargs["max_steps"] = None
    if kwargs.get("num_sanity_val_steps") == -1:  # Lightning: every validation batch
        kwargs["num_sanity_val_steps"] = sys.maxsize
    if kwargs.get("accelerator") == "gpu":  # Lightning: CUDA, or Apple's MPS
        kwargs["accelerator"] = _gpu()
    return kwargs


def _gpu() -> str:
    """Lightning's accelerator="gpu": CUDA where it is, else Apple's MPS."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    raise MisconfigurationError('Trainer(accelerator="gpu") asks for a GPU, but neither CUDA nor '
                                'MPS is available '
                                "on this machine.", 'use accelerator="cpu" or "auto" (a GPU where '
                                                    'there is one).')


# Lightning's keywords of fit/validate/test/predict/save_checkpoint taskfit does not take
ENTRY_POINT_ARGUMENTS = {
    "weights_only": "fit/validate/test/predict load every checkpoint with "
                    "torch.load(weights_only=True) (checkpoints hold tensors and plain containers "
                    "only); for save_checkpoint, a weights-only file comes from "
                    "ModelCheckpoint(save_weights_only=True) (docs/checkpointing.md).",
    "storage_options": "checkpoints are written to local or mounted paths; copy them elsewhere "
                       "after saving.",
}


_LIMIT_NOTES = ("limit_train_batches", "limit_val_batches", "limit_test_batches",
                "limit_predict_batches", "overfit_batches", "val_check_interval")


def batch_limit_notes(given: dict[str, Any]) -> list[str]:
    """Lightning's informational line for each ``limit_*_batches``, ``overfit_batches`` and
    ``val_check_interval`` passed as ``1`` or ``1.0`` (``given``: the arguments as passed; a
    default left out says nothing), since an int and a float of the same value mean different
    things there. ``fast_dev_run`` sets the limits itself: only ``overfit_batches`` speaks then, as
    in Lightning."""
    notes = []
    for name in _LIMIT_NOTES:
        value = given.get(name)
        if given.get("fast_dev_run") and name != "overfit_batches":
            continue
        if type(value) is int and value == 1:
            what = {"limit_train_batches": "1 batch per epoch will be used.",
                    "val_check_interval": "validation will run after every batch."}
            notes.append(f"`Trainer({name}=1)` was configured so "
                         f"{what.get(name, '1 batch will be used.')}")
        elif type(value) is float and value == 1.0:
            what = {"limit_train_batches": "100% of the batches per epoch will be used",
                    "val_check_interval": "validation will run at the end of the training epoch"}
            notes.append(f"`Trainer({name}=1.0)` was configured so "
                         f"{what.get(name, '100% of the batches will be used')}.")
    return notes

