"""Checkpoints: atomic files that hold everything needed to continue a run exactly, and load without running code.

A checkpoint is a dict that ``torch.load(path, weights_only=True)`` reads: tensors, plain containers and
primitives only (RNG states are stored as tensors and lists, never as pickled objects). What is in it, how
``fit(ckpt_path=...)`` continues from it, and how a preemption signal becomes one: docs/checkpointing.md.
File handling (atomic writes, safe reads, weight checks) is in trainer/serialization.py; under fsdp a checkpoint is
a directory of per-rank shards with the same contents (trainer/sharded_checkpoint.py).
"""
from __future__ import annotations

import inspect
import math
import os
import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..callbacks import callback_states, is_task_hook, load_callback_states
from ..data.loaders import ResumableSampler, data_position, finite, restore_position, stateful
from ..errors import CheckpointError, NonFiniteLossError
from ..init_args import plain_hparams
from ..logs.logger import next_version_dir  # the run-directory logic lives with the loggers (CONTRACTS §4)
from ..optim import check_optimizer_state, lr_course
from ..strategies.base import unwrap
from ..version import __version__
from .files import (
    FORMAT,
    FORMAT_VERSION,
    LAST,
    CheckpointWriter,
    atomic_copy,
    atomic_save,
    check_plain,
    check_weights,
    load_checkpoint,
    load_file,
    module_state,
    remove_files,
)
from .rng import gather_rng_states, set_rng_state
from .sharded import MARKER, checkpoint_exists, is_sharded, meta_entries, read_index, read_shards, save_sharded

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["save_checkpoint", "open_checkpoint", "restore", "load_weights", "load_module", "resolve", "last_checkpoint",
           "next_version_dir", "load_checkpoint", "atomic_copy",
           "remove_files", "CheckpointWriter", "FORMAT_VERSION"]


# ---- writing --------------------------------------------------------------------------------------------
def save_checkpoint(trainer: Trainer, path: str | os.PathLike, background: bool = False,
                    weights_only: bool = False) -> str:
    """Write ``trainer``'s complete state to ``path`` on rank 0; every rank must call it (RNG states are gathered).
    ``weights_only``: the module's weights, counters and what describes the run; no optimizer, RNG or data state.

    Returns the absolute path. Earlier background saves are finished first. ``background=True`` copies the state
    into reused host buffers now and leaves serialising, writing, fsync and rename to ``trainer.checkpoint_writer``
    (the file is in place when the next save starts or fit returns; under fsdp through DCP's ``async_save``).
    Under ddp all ranks wait (a barrier) until rank 0 has written, so a rank that exits right after a
    (synchronous) save, as on preemption, cannot bring down rank 0 mid-write.
    """
    if getattr(trainer, "optimizer", None) is None:
        raise CheckpointError(f"Cannot save a checkpoint to {os.fspath(path)}: this Trainer has not run fit, so it "
                              "has no training state to save.",
                              "call trainer.save_checkpoint(path) during or after trainer.fit(task); to save only "
                              "weights, use torch.save(task.state_dict(), path).")
    path = os.path.abspath(os.fspath(path))
    _check_losses(trainer, path)
    writer = trainer.checkpoint_writer
    writer.wait()  # in order: an older file is never renamed over this one
    if weights_only:
        state = {"module": trainer.strategy.module_state_dict(trainer.model),
                 "loop": {"state": trainer.state.state_dict()}}
    else:
        state = trainer.state_dict()  # on every rank: the RNG states are gathered
    checkpoint = _contents(trainer, state)
    for fn in trainer.hooks["on_save_checkpoint"]:  # Lightning's hook: callbacks (not for weights only), the task
        if not weights_only or is_task_hook(fn):
            fn(trainer, trainer.task, checkpoint)
    if trainer.strategy.sharded_checkpoints:  # fsdp: a directory, each rank writing its shards
        save_sharded(trainer.strategy, checkpoint, path, writer if background else None)
    elif trainer.is_main:
        check_plain(checkpoint, "checkpoint")
        atomic_save(checkpoint, path, writer if background else None)
    trainer.strategy.barrier()
    return path


def _check_losses(trainer: Trainer, path: str) -> None:
    """No checkpoint from a state whose losses since the last check were NaN/Inf: it would rotate good files out."""
    try:
        trainer.logs.check_pending(trainer.state.epoch)
    except NonFiniteLossError as exc:
        cb = trainer.checkpoint_callback
        good = [p for p in ((cb.last_model_path, cb.best_model_path) if cb else ()) if p and checkpoint_exists(p)]
        raise NonFiniteLossError(
            f"{exc.what} Nothing was saved to {path}; the last good checkpoint is {good[0] if good else 'none yet'}.",
            f"resume from it with fit(ckpt_path={good[0]!r}) after the fix: {exc.hint}" if good else exc.hint) from None


def _contents(trainer: Trainer, state: dict[str, Any]) -> dict[str, Any]:
    """The file: a format header, the run's state, and what describes the run (hparams, config, task class)."""
    task = trainer.task
    return {"format": FORMAT, "format_version": FORMAT_VERSION,
            "versions": {"taskfit": __version__, "torch": str(torch.__version__)}, **state,
            "hparams": trainer.hparams, "config": trainer.config,
            "task": {"class": f"{type(task).__module__}.{type(task).__qualname__}", "hparams": plain_hparams(task)}}


# ---- run folders; resolving "last" / "best" -----------------------------------------------------------------
def last_checkpoint(root: str | os.PathLike, warn: bool = True) -> str | None:
    """The newest complete checkpoint to continue from under ``root``: ``root/last.ckpt``, else the ``last.ckpt``
    of the highest ``version_N/checkpoints`` that has one; None when there is none.

    A sharded ``last.ckpt`` without its COMPLETE marker (a copy or a write that stopped half-way) is skipped for
    the newest complete checkpoint of its folder (an ``epoch=...-step=...`` one), else of the next older version,
    and ``warn`` says which one was skipped for which."""
    root = os.fspath(root)
    versions = sorted(((int(m.group(1)), d) for d in (os.listdir(root) if os.path.isdir(root) else [])
                       if (m := re.fullmatch(r"version_(\d+)", d))), reverse=True)
    skipped, found = [], None
    for folder in [root] + [os.path.join(root, d, "checkpoints") for _, d in versions]:
        last = os.path.join(folder, LAST)
        if checkpoint_exists(last):
            found = last
        elif is_sharded(last):  # a directory of that name, without its marker
            skipped.append(os.path.abspath(last))
            found = _newest_complete(folder)
        if found:
            break
    if skipped and warn:
        instead = f"resuming from {os.path.abspath(found)}, the newest complete checkpoint" if found else \
            "there is no complete checkpoint to resume from"
        warnings.warn(f"Skipped {', '.join(skipped)}: incomplete (no COMPLETE marker; its write or copy stopped "
                      f"half-way); {instead}. HINT: delete the incomplete directory, or copy it again whole.",
                      UserWarning, stacklevel=3)
    return os.path.abspath(found) if found else None


def _newest_complete(folder: str) -> str | None:
    """The most recently written complete checkpoint in ``folder`` (a sharded one dates from its marker)."""
    dated = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if name.endswith(".ckpt") and not name.startswith(".") and checkpoint_exists(path):
            dated.append((os.path.getmtime(os.path.join(path, MARKER) if os.path.isdir(path) else path), path))
    return max(dated)[1] if dated else None


def resolve(trainer: Trainer, ckpt_path: Any, fresh: bool = False) -> str | None:
    """A path for ``ckpt_path``: "last", "best" (see docs/checkpointing.md) or a file path. With ``fresh`` (fit),
    "last" with nothing to resume is None (a fresh start), with one warning, as in Lightning: the first start of a
    job and its restarts run the same command."""
    if ckpt_path not in ("last", "best"):
        if not isinstance(ckpt_path, (str, os.PathLike)):
            raise CheckpointError(f"ckpt_path={ckpt_path!r} is not a path.",
                                  'pass "last", "best" or the path of a .ckpt file.')
        return os.path.abspath(os.path.expanduser(os.fspath(ckpt_path)))
    cb = trainer.checkpoint_callback
    looked = []
    if cb is not None and cb.last_model_path and checkpoint_exists(cb.last_model_path):
        last = cb.last_model_path  # written by this Trainer
    else:
        roots = ([cb.dirpath_arg] if cb is not None and cb.dirpath_arg else []) + [os.path.dirname(trainer.log_dir)]
        last = None
        for root in roots:
            looked.append(root)
            last = last_checkpoint(root, warn=trainer.is_main)
            if last:
                break
    if ckpt_path == "last":
        where = f"looked for {LAST} in {' and '.join(looked)} and its version_*/checkpoints folders"
        if last is None and fresh:
            if trainer.is_main:
                warnings.warn(f'fit(ckpt_path="last"): there is no checkpoint to resume yet ({where}), so this fit '
                              "starts fresh. HINT: expected on a job's first start; otherwise check default_root_dir "
                              "(or ModelCheckpoint(dirpath=...)) is the folder of the run to resume.", UserWarning,
                              stacklevel=7)  # the line that called fit
            return None
        if last is None:
            raise CheckpointError(
                f"ckpt_path=\"last\" but no checkpoint has been saved yet ({where}).",
                "pass the path of a .ckpt file, or set Trainer(default_root_dir=...) to the folder of the run whose "
                "checkpoint to evaluate.")
        return last
    best = cb.best_model_path if cb is not None and cb.best_model_path else None
    if best is None and last is not None:  # the newest run's bookkeeping names its best file
        states = load_checkpoint(last).get("callbacks", {})
        best = next((s.get("best_model_path") for s in states.values()
                     if isinstance(s, Mapping) and s.get("best_model_path")), None)
    if not best or not checkpoint_exists(best):
        raise CheckpointError(
            f"ckpt_path=\"best\" but no best checkpoint is known (last: {last}, best: {best}).",
            "train first with a ModelCheckpoint that saves top-k files (save_top_k >= 1, monitor=\"val/loss\" to "
            "rank them), or pass the path of a .ckpt file.")
    return best


# ---- restoring a run ------------------------------------------------------------------------------------
def open_checkpoint(trainer: Trainer, ckpt_path: Any) -> tuple[str, dict[str, Any]] | None:
    """``fit(ckpt_path=...)``'s checkpoint, read before the loaders are built: the task's ``on_load_checkpoint`` and
    the data module's state come first, as in Lightning (the loaders may depend on that state). None:
    ``ckpt_path="last"`` found nothing to resume, and the fit starts fresh (with a warning)."""
    path = resolve(trainer, ckpt_path, fresh=True)
    if path is None:
        return None
    ckpt = dict(load_checkpoint(path))
    if is_sharded(path):
        read_index(path)  # a damaged or hostile shard directory is refused before anything else is said or done
    if "optimizer" not in ckpt:
        raise CheckpointError(f"{path} holds only weights (ModelCheckpoint(save_weights_only=True)), not a training "
                              "state to resume.", "resume from a full checkpoint (the last.ckpt a preemption signal "
                              "writes is one), or start a new fit from these weights with "
                              "TaskModule.load_from_checkpoint(path).")
    _task_loads(trainer, ckpt)
    return path, ckpt


def _task_loads(trainer: Trainer, ckpt: Mapping[str, Any]) -> None:
    """The task's own ``on_load_checkpoint`` (Lightning calls it for every entry point), then the data module's
    ``load_state_dict``."""
    for fn in trainer.hooks["on_load_checkpoint"]:
        if is_task_hook(fn):
            fn(trainer, trainer.task, ckpt)
    if trainer.datamodule is not None and ckpt.get("datamodule"):
        trainer.datamodule.load_state_dict(ckpt["datamodule"])


def restore(trainer: Trainer, path: str, ckpt: dict[str, Any]) -> None:
    """Continue ``trainer`` exactly where the checkpoint (:func:`open_checkpoint`) left it (called by fit after the
    loaders are built, before on_fit_start)."""
    ckpt["module"] = check_weights(unwrap(trainer.model), module_state(ckpt, path), path)
    if len(ckpt["schedulers"]) != len(trainer.schedulers):
        raise CheckpointError(
            f"{path} has {len(ckpt['schedulers'])} learning-rate scheduler(s), configure_optimizers returned "
            f"{len(trainer.schedulers)}.",
            "resume with the optimizer and scheduler setup of the original run.")
    saved = ckpt["optimizer"] if isinstance(ckpt["optimizer"], list) else [ckpt["optimizer"]]
    if len(saved) != len(trainer.optimizers):
        raise CheckpointError(f"{path} has the state of {len(saved)} optimizer(s), configure_optimizers returned "
                              f"{len(trainer.optimizers)}.", "resume with the optimizers of the original run.")
    for optimizer, state in zip(trainer.optimizers, saved):
        check_optimizer_state(optimizer, state, path)
    _warn_changes(trainer, ckpt, path)
    if is_sharded(path):  # each rank reads its part of every tensor (any number of ranks may have written them)
        templates = trainer.strategy.checkpoint_templates(trainer.model, trainer.optimizers, meta_entries(ckpt))
        ckpt = read_shards(path, ckpt, templates)
    for fn in trainer.hooks["on_load_checkpoint"]:  # the callbacks' (the task's came first: open_checkpoint)
        if not is_task_hook(fn):
            fn(trainer, trainer.task, ckpt)
    trainer.load_state_dict(ckpt)
    _warn_schedule(trainer, ckpt["data"], path)
    if trainer.is_main:
        st = trainer.state
        from ..console import echo  # printed, and logged to `taskfit` (the taskfit command's taskfit.log)
        echo(f"Resumed from {path}: epoch {st.epoch}, batch {st.batches_done}, global step {st.global_step}.")


def _warn_schedule(trainer: Trainer, data: Mapping[str, Any], path: str) -> None:
    """A longer (or shorter) run resumed with schedulers sized for the original one: say what the lr will do."""
    old = (data.get("max_epochs", trainer.max_epochs), data.get("max_steps", trainer.max_steps))
    if not len(trainer.schedulers) or old == (trainer.max_epochs, trainer.max_steps):
        return
    st, n = trainer.state, trainer.num_train_batches
    per_epoch = math.ceil(n / trainer.accumulate_grad_batches) if n != float("inf") else 0
    ends = [trainer.max_steps] if trainer.max_steps is not None else []
    if trainer.max_epochs is not None and per_epoch:
        ends.append(trainer.max_epochs * per_epoch)
    steps = max(0, min(ends, default=st.global_step) - st.global_step)
    epochs = max(0, (trainer.max_epochs or st.epoch) - st.epoch)
    course = "; ".join(lr_course(trainer.schedulers, steps, epochs))
    warnings.warn(
        f"Resuming from {path} with max_epochs {old[0]} -> {trainer.max_epochs} and max_steps {old[1]} -> "
        f"{trainer.max_steps}: the learning-rate schedulers continue from the checkpoint's state, which was sized "
        f"for the original run. {course}. HINT: to train longer with a schedule of its own, start a new fit from the "
        "checkpoint's weights (TaskModule.load_from_checkpoint) with a scheduler sized for the new length "
        "(docs/checkpointing.md, 'Extending a run').", UserWarning, stacklevel=4)


def _warn_changes(trainer: Trainer, ckpt: Mapping[str, Any], path: str) -> None:
    data = ckpt["data"]
    now = {"batch size": getattr(trainer.train_dataloader, "batch_size", None),
           "world size": trainer.strategy.world_size,
           "accumulate_grad_batches": trainer.accumulate_grad_batches,
           "batches per epoch": finite(trainer.num_train_batches)}
    saved = {"batch size": data.get("batch_size"), "world size": data.get("world_size"),
             "accumulate_grad_batches": data.get("accumulate_grad_batches"),
             "batches per epoch": data.get("num_train_batches")}
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in now if saved[k] != now[k]]
    old, new = ckpt.get("task", {}).get("hparams", {}), plain_hparams(trainer.task)
    changed += [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k) and k != "batch_size" and " at 0x" not in str(old.get(k))]
    state = ckpt["loop"]["state"]
    mid_epoch = data["batches_done"] and not state.get("epoch_done")
    resumable = isinstance(getattr(trainer.train_dataloader, "sampler", None), ResumableSampler) or (
        stateful(trainer.train_dataloader) and data.get("loader") is not None)
    if mid_epoch and not resumable:
        warnings.warn(f"Resuming mid-epoch (batch {data['batches_done']}) from {path}, but the training data is not a "
                      "plain DataLoader over a map-style dataset (custom sampler, IterableDataset or DataLoader "
                      "subclass), so taskfit cannot fast-forward it: the rest of this epoch starts from the loader's "
                      "first batch. HINT: use a plain DataLoader (shuffle=True/False) for an exact mid-epoch resume, "
                      "a loader with state_dict/load_state_dict (torchdata's StatefulDataLoader), or save only at "
                      "epoch ends (ModelCheckpoint(every_n_epochs=1)).", UserWarning, stacklevel=4)
    if changed:
        where = "mid-epoch (batch %d)" % data["batches_done"] if mid_epoch else "at an epoch boundary"
        warnings.warn(f"Resuming from {path} ({where}) with a changed setup: {'; '.join(changed)}. The run "
                      "continues, but not exactly as the original would have (the data position counts batches "
                      "of the new size per rank). HINT: resume with the original settings for an exact "
                      "continuation.", UserWarning, stacklevel=4)


def load_weights(trainer: Trainer, ckpt_path: Any) -> str:
    """Load only the module weights (validate/test/predict with ``ckpt_path``)."""
    path = resolve(trainer, ckpt_path)
    ckpt = load_file(path)
    weights = check_weights(unwrap(trainer.model), module_state(ckpt, path), path)
    _task_loads(trainer, ckpt)
    if is_sharded(path):
        templates = trainer.strategy.checkpoint_templates(trainer.model, [], meta_entries({"module": weights}))
        weights = read_shards(path, {"module": weights}, templates, parts=("module",))["module"]
    trainer.strategy.load_module_state_dict(trainer.model, weights)
    return path


def load_module(cls: type, path: str | os.PathLike, map_location: Any = "cpu", **kwargs: Any) -> Any:
    """Build ``cls`` with the init arguments the checkpoint records (``kwargs`` win) and load its weights."""
    path = os.path.abspath(os.fspath(path))
    ckpt = load_file(path)
    weights = module_state(ckpt, path)
    if is_sharded(path):  # read whole, in this process
        weights = read_shards(path, {"module": weights}, parts=("module",))["module"]
    recorded = ckpt.get("task", {}).get("hparams", {}) if isinstance(ckpt, Mapping) else {}
    params = inspect.signature(cls.__init__).parameters
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    args = {k: v for k, v in recorded.items()
            if (k in params or open_kwargs) and not (isinstance(v, Mapping) and "_target_" in v)}
    args.update(kwargs)  # factories (optimizer=...) were recorded as descriptions: defaults are used for them
    try:
        module = cls(**args)
    except Exception as exc:
        raise CheckpointError(
            f"Could not build {cls.__name__} from the arguments recorded in {path} ({sorted(args)}): "
            f"{type(exc).__name__}: {exc}",
            f"pass the missing or changed arguments: {cls.__name__}.load_from_checkpoint(path, name=value).") from None
    weights = check_weights(module, weights, path)
    module.load_state_dict(weights)
    return module.to(map_location).eval()


# ---- the run's state, as checkpoints hold it (Trainer.state_dict / load_state_dict) --------------------------
def run_state(trainer: Trainer) -> dict[str, Any]:
    """``trainer.state_dict()``: everything needed to continue a fit exactly, each part asked for its own state."""
    if trainer.optimizer is None:
        raise CheckpointError("This Trainer has no training state: it has not run fit.",
                              "call state_dict()/save_checkpoint(path) during or after trainer.fit(task).")
    st, logs = trainer.state, trainer.logs.state_dict()
    strategy = trainer.strategy
    optimizers = [strategy.optimizer_state_dict(trainer.model, o) for o in trainer.optimizers]
    book = None if st.epoch_done else logs["book"]  # this epoch's values (none once complete)
    return {"module": strategy.module_state_dict(trainer.model),
            "optimizer": optimizers[0] if len(optimizers) == 1 else optimizers,
            "schedulers": trainer.schedulers.state_dict(),
            "precision": trainer.precision.state_dict(),
            "loop": {"state": st.state_dict(), "fold_mark": logs["fold_mark"]},
            "logbook": book,  # rank 0's; under ddp/fsdp every rank's too, so that epoch means resume exactly
            "logbooks": None if book is None or strategy.world_size == 1 else strategy.all_gather_object(_cpu(book)),
            "rng": gather_rng_states(trainer.strategy),
            "data": data_position(trainer.train_dataloader, trainer.num_train_batches, st, trainer.data_seed, trainer),
            "callbacks": callback_states(trainer.callbacks),
            "datamodule": trainer.datamodule.state_dict() if trainer.datamodule is not None else None}


def _cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, Mapping):
        return {k: _cpu(v) for k, v in tree.items()}
    return type(tree)(_cpu(v) for v in tree) if isinstance(tree, (list, tuple)) else tree


def load_run_state(trainer: Trainer, state: Mapping[str, Any]) -> None:
    """``trainer.load_state_dict(state)``: every part continues where :func:`run_state` left it."""
    strategy, saved = trainer.strategy, state["optimizer"]
    strategy.load_module_state_dict(trainer.model, state["module"])
    for optimizer, optimizer_state in zip(trainer.optimizers, saved if isinstance(saved, list) else [saved]):
        strategy.load_optimizer_state_dict(trainer.model, optimizer, optimizer_state)
    trainer.schedulers.load_state_dict(state["schedulers"])
    trainer.precision.load_state_dict(state["precision"])
    trainer.state.load_state_dict(state["loop"]["state"])
    fold_mark = state["loop"].get("fold_mark", (trainer.state.global_step, trainer.state.batches_done))
    books, book = state.get("logbooks"), state["logbook"]
    if books and len(books) == strategy.world_size:  # the same ranks: each continues its own values
        book = books[strategy.rank]
    trainer.logs.load_state_dict({"book": book, "fold_mark": fold_mark})
    trainer.data_seed = int(state["data"]["seed"])  # the run's data order, whatever this process was seeded with
    restore_position(trainer.train_dataloader, trainer.val_loader, state["data"])
    load_callback_states(trainer.callbacks, state.get("callbacks", {}))  # (a data module's state: open_checkpoint)
    rng, rank = state["rng"], trainer.strategy.rank
    set_rng_state(rng[rank] if rank < len(rng) else rng[0])  # last: nothing after it may draw random numbers
