"""A run's checkpoints: what one holds (:func:`run_state`), saving it (also on a preemption signal:
:func:`preempt`), and restoring a run from one (:func:`open_checkpoint`, :func:`restore`,
:func:`load_weights`).

A checkpoint is a dict that ``torch.load(path, weights_only=True)`` reads: tensors, plain containers
and primitives only (RNG states are stored as tensors and lists, never as pickled objects). What is
in it, how ``fit(ckpt_path=...)`` continues from it, and how a preemption signal becomes one:
docs/checkpointing.md. File handling (atomic writes, safe reads, weight checks) is in
checkpoint/files.py; under fsdp a checkpoint is a directory of per-rank shards with the same
contents (checkpoint/sharded.py).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..callback import callback_states, load_callback_states
from ..checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    atomic_save,
    check_plain,
    check_weights,
    load_checkpoint,
    load_file,
    module_state,
)
from ..checkpoint.lookup import warn_skipped
from ..console import user_stacklevel
from ..checkpoint.rng import gather_rng_states, set_rng_state
from ..checkpoint.sharded import (
    is_sharded,
    meta_entries,
    read_index,
    read_shards,
    save_sharded,
)
from ..cluster import requeue_job, slurm_job_id
from ..console import echo
from ..data.loaders import ResumableSampler, data_position, finite, restore_position, stateful
from ..errors import CheckpointError, MisconfigurationError
from ..init_args import plain_hparams, run_hparams
from ..optim import check_optimizer_state, lr_course
from ..strategies.base import unwrap
from ..version import __version__
from .cadence import steps_per_epoch
from .hooks import is_task_hook
from .run import Run

__all__ = ["save_checkpoint", "preempt", "open_checkpoint", "restore", "load_weights", "run_state",
           "load_run_state", "load_first", "no_training_state"]


# ---- writing -------------------------------------------------------------------------------------
def save_checkpoint(run: Run, path: str | os.PathLike, background: bool = False,
                    weights_only: bool = False) -> str:
    """Write ``trainer``'s complete state to ``path`` on rank 0; every rank must call it (RNG states
    are gathered). ``weights_only``: the module's weights, counters and what describes the run; no
    optimizer, RNG or data state.

    Returns the absolute path. Earlier background saves are finished first. ``background=True``
    copies the state into reused host buffers now and leaves serialising, writing, fsync and rename
    to ``run.checkpoint_writer`` (the file is in place when the next save starts or fit returns;
    under fsdp through DCP's ``async_save``). Under ddp all ranks wait (a barrier) until rank 0 has
    written, so a rank that exits right after a (synchronous) save, as on preemption, cannot bring
    down rank 0 mid-write.
    """
    if run is None or run.optimizer is None:
        raise no_training_state(path)
    path = os.path.abspath(os.fspath(path))
    writer = run.checkpoint_writer
    writer.wait()  # in order: an older file is never renamed over this one
    if weights_only:
        state = {"module": run.strategy.module_state_dict(run.model),
                 "loop": {"state": run.state.state_dict()}}
    else:
        state = run_state(run)  # on every rank: the RNG states are gathered
    checkpoint = _contents(run, state, alias_weights=not run.strategy.sharded_checkpoints)
    # Lightning's hook: callbacks (not for weights only), the task
    for fn in run.hooks["on_save_checkpoint"]:
        if not weights_only or is_task_hook(fn):
            fn(run.trainer, run.task, checkpoint)
    if run.strategy.sharded_checkpoints:  # fsdp: a directory, each rank writing its shards
        save_sharded(run.strategy, checkpoint, path, writer if background else None)
    elif run.strategy.is_main:
        check_plain(checkpoint, "checkpoint")
        atomic_save(checkpoint, path, writer if background else None)
    run.strategy.barrier()
    return path


def no_training_state(path: str | os.PathLike) -> CheckpointError:
    """The error for a save before any fit: there is no training state."""
    return CheckpointError(
        f"Cannot save a checkpoint to {os.fspath(path)}: this Trainer has not run fit, so it has "
        "no training state to save.",
        "call trainer.save_checkpoint(path) during or after trainer.fit(task); to save only "
        "weights, use torch.save(task.state_dict(), path).")


def _contents(run: Run, state: dict[str, Any], alias_weights: bool = True) -> dict[str, Any]:
    """The file: a format header, the run's state, what describes the run (hparams, config, task
    class), and Lightning's top-level keys, so that scripts and ``on_load_checkpoint`` written for
    Lightning's files read taskfit's: ``epoch``, ``global_step``, ``hyper_parameters`` and
    ``state_dict``, the same dict as ``module`` (pickled once: no second copy of the weights in the
    file; not in a sharded directory)."""
    task = run.task
    hparams = plain_hparams(task)
    lightning = {
        "epoch": run.state.checkpoint_epoch,
        "global_step": run.state.global_step,
        "hyper_parameters": hparams,
        **({"state_dict": state["module"]} if alias_weights else {}),
    }
    contents = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": {"taskfit": __version__, "torch": str(torch.__version__)},
        **state,
        "hparams": run_hparams(run.config.command_config, task),
        "config": run.config.command_config,
        "task": {"class": f"{type(task).__module__}.{type(task).__qualname__}", "hparams": hparams},
        **lightning,
    }
    if state.get("datamodule"):
        # Lightning's key of a non-empty data module state: the class's __qualname__ (the same
        # dict, pickled once); never in place of one of the file's own keys
        contents.setdefault(type(run.data.datamodule).__qualname__, state["datamodule"])
    return contents


# ---- reading the checkpoint to resume ("last" and "best": the manager, loop/checkpointer.py) ---
def load_first(run: Run, ckpt_path: Any, candidates: list[str], skipped: list[tuple[str, str]],
                load: Any, warn: bool = True) -> tuple[str, Any]:
    """``(path, load(path))`` of the first candidate that loads. Under "last" a candidate that
    cannot be read or fails its checksums is skipped for the next (one warning names what was
    skipped, why, and what is resumed instead); if none loads, the first one's error. Any other
    ``ckpt_path`` is loaded or refused as it is."""
    first: CheckpointError | None = None
    for path in candidates:
        try:
            ckpt = load(path)
        except CheckpointError as exc:
            if ckpt_path != "last":
                raise
            first = first or exc
            skipped.append((path, exc.what))
            continue
        if warn and run.strategy.is_main:
            # the line that called fit / validate
            warn_skipped(skipped, path, stacklevel=user_stacklevel())
        return path, ckpt
    assert first is not None
    raise first


# ---- restoring a run -----------------------------------------------------------------------------
def open_checkpoint(run: Run, ckpt_path: Any) -> tuple[str, dict[str, Any]] | None:
    """``fit(ckpt_path=...)``'s checkpoint, read before the loaders are built: the task's
    ``on_load_checkpoint`` and the data module's state come first, as in Lightning (the loaders may
    depend on that state). None: ``ckpt_path="last"`` found nothing to resume, and the fit starts
    fresh (with a warning)."""
    candidates, skipped = run.checkpointer.resolve(ckpt_path, fresh=True)
    if not candidates:
        return None
    path, ckpt = load_first(run, ckpt_path, candidates, skipped, load_resumable)
    if "optimizer" not in ckpt:
        raise CheckpointError(
            f"{path} holds only weights "
            "(ModelCheckpoint(save_weights_only=True)), not a training state to "
            "resume.",
            "resume from a full checkpoint (the last.ckpt a preemption signal "
            "writes is one), or start a new fit from these weights with "
            "TaskModule.load_from_checkpoint(path).",
        )
    _check_max_epochs(run, ckpt, path)
    task_loads(run, ckpt)
    return path, ckpt


def _check_max_epochs(run: Run, ckpt: Mapping[str, Any], path: str) -> None:
    """Refuse a resume past ``max_epochs``: such a fit would train nothing (Lightning refuses it
    too, in its checkpoint connector's restore_training_state, with the words kept here)."""
    max_epochs, epoch = run.config.max_epochs, ckpt.get("epoch")
    if max_epochs in (None, -1) or not isinstance(epoch, int) or epoch <= max_epochs:
        return
    raise MisconfigurationError(
        f"You restored a checkpoint with current_epoch={epoch}, but you have set "
        f"Trainer(max_epochs={max_epochs}): {path} is past the end of this fit, which would train "
        "nothing.",
        "resume with a max_epochs larger than that of the run that wrote it, or load only its "
        "weights with "
        "TaskModule.load_from_checkpoint(path) to start a new fit from them.")


def load_resumable(path: str) -> dict[str, Any]:
    """A checkpoint to resume, read and verified (its checksums; a sharded one's index against its
    files)."""
    ckpt = dict(load_checkpoint(path))
    if is_sharded(path):
        # a damaged or hostile shard directory is refused before anything else is said or done
        read_index(path)
    return ckpt


def task_loads(run: Run, ckpt: Mapping[str, Any]) -> None:
    """The task's own ``on_load_checkpoint`` (Lightning calls it for every entry point), then the
    data module's ``load_state_dict``."""
    for fn in run.hooks["on_load_checkpoint"]:
        if is_task_hook(fn):
            fn(run.trainer, run.task, ckpt)
    datamodule = run.data.datamodule
    if datamodule is not None:
        # taskfit's key, else Lightning's (a Lightning .ckpt): the class's __qualname__
        state = ckpt.get("datamodule") or ckpt.get(type(datamodule).__qualname__)
        if state:
            datamodule.load_state_dict(state)


def restore(run: Run, path: str, ckpt: dict[str, Any]) -> None:
    """Continue ``trainer`` exactly where the checkpoint (:func:`open_checkpoint`) left it (called
    by fit after the loaders are built, before on_fit_start)."""
    ckpt["module"] = check_weights(unwrap(run.model), module_state(ckpt, path), path)
    if len(ckpt["schedulers"]) != len(run.schedulers):
        raise CheckpointError(
            f"{path} has {len(ckpt['schedulers'])} learning-rate scheduler(s), "
            f"configure_optimizers returned {len(run.schedulers)}.",
            "resume with the optimizer and scheduler setup of the original run.")
    saved = ckpt["optimizer"] if isinstance(ckpt["optimizer"], list) else [ckpt["optimizer"]]
    if len(saved) != len(run.optimizers):
        raise CheckpointError(
            f"{path} has the state of {len(saved)} optimizer(s), "
            "configure_optimizers returned "
            f"{len(run.optimizers)}.",
            "resume with the optimizers of the original run.",
        )
    _warn_changes(run, ckpt, path)
    # each rank reads its part of every tensor (any number of ranks may have written them)
    if is_sharded(path):
        templates = run.strategy.checkpoint_templates(run.model, run.optimizers, meta_entries(ckpt))
        ckpt = read_shards(path, ckpt, templates)
    # the callbacks' (the task's came first: open_checkpoint)
    for fn in run.hooks["on_load_checkpoint"]:
        if not is_task_hook(fn):
            fn(run.trainer, run.task, ckpt)
    # after the callbacks' hooks: one may rebuild the parameter groups it added (BaseFinetuning)
    for optimizer, state in zip(run.optimizers, saved):
        check_optimizer_state(optimizer, state, path)
    load_run_state(run, ckpt)
    _warn_schedule(run, ckpt["data"], path)
    if run.strategy.is_main:
        st = run.state
        # printed, and logged to `taskfit` (the taskfit command's taskfit.log)
        from ..console import echo
        echo(f"Resumed from {path}: epoch {st.epoch}, batch {st.batches_done}, global step "
             f"{st.global_step}.")


def _warn_schedule(run: Run, data: Mapping[str, Any], path: str) -> None:
    """A longer (or shorter) run resumed with schedulers sized for the original one: say what the lr
    will do."""
    config = run.config
    old = (data.get("max_epochs", config.max_epochs), data.get("max_steps", config.max_steps))
    if not len(run.schedulers) or old == (config.max_epochs, config.max_steps):
        return
    st, n = run.state, run.num_train_batches
    per_epoch = steps_per_epoch(n, config.accumulate_grad_batches) if n != float("inf") else 0
    ends = [config.max_steps] if config.max_steps is not None else []
    if config.max_epochs not in (None, -1) and per_epoch:
        ends.append(config.max_epochs * per_epoch)
    steps = max(0, min(ends, default=st.global_step) - st.global_step)
    epochs = max(0, (config.max_epochs or st.epoch) - st.epoch)
    course = "; ".join(lr_course(run.schedulers, steps, epochs))
    warnings.warn(
        f"Resuming from {path} with max_epochs {old[0]} -> {config.max_epochs} and max_steps "
        f"{old[1]} -> {config.max_steps}: the learning-rate schedulers continue from the "
        f"checkpoint's state, which was sized for the original run. {course}. HINT: to train "
        "longer with a schedule of its own, start a new fit from the checkpoint's weights "
        "(TaskModule.load_from_checkpoint) with a scheduler sized for the new length "
        "(docs/checkpointing.md, 'Extending a run').", UserWarning, stacklevel=4)


def _warn_changes(run: Run, ckpt: Mapping[str, Any], path: str) -> None:
    data = ckpt["data"]
    now = {"batch size": getattr(run.train_dataloader, "batch_size", None),
           "world size": run.strategy.world_size,
           "accumulate_grad_batches": run.config.accumulate_grad_batches,
           "batches per epoch": finite(run.num_train_batches)}
    saved = {"batch size": data.get("batch_size"), "world size": data.get("world_size"),
             "accumulate_grad_batches": data.get("accumulate_grad_batches"),
             "batches per epoch": data.get("num_train_batches")}
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in now if saved[k] != now[k]]
    old, new = ckpt.get("task", {}).get("hparams", {}), plain_hparams(run.task)
    changed += [
        f"{k} {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and k != "batch_size" and " at 0x" not in str(old.get(k))
    ]
    state = ckpt["loop"]["state"]
    mid_epoch = data["batches_done"] and not state.get("epoch_done")
    resumable = isinstance(getattr(run.train_dataloader, "sampler", None), ResumableSampler) or (
        stateful(run.train_dataloader) and data.get("loader") is not None)
    if mid_epoch and not resumable:
        warnings.warn(f"Resuming mid-epoch (batch {data['batches_done']}) from {path}, but the "
                      "training data is not a plain DataLoader over a map-style dataset (custom "
                      "sampler, IterableDataset or DataLoader subclass), so taskfit cannot "
                      "fast-forward it: the rest of this epoch starts from the loader's first "
                      "batch. HINT: use a plain DataLoader (shuffle=True/False) for an exact "
                      "mid-epoch resume, a loader with state_dict/load_state_dict (torchdata's "
                      "StatefulDataLoader), or save only at epoch ends "
                      "(ModelCheckpoint(every_n_epochs=1)).", UserWarning, stacklevel=4)
    if changed:
        where = (
            "mid-epoch (batch %d)" % data["batches_done"] if mid_epoch else "at an epoch boundary"
        )
        warnings.warn(f"Resuming from {path} ({where}) with a changed setup: {'; '.join(changed)}. "
                      "The run continues, but not exactly as the original would have (the data "
                      "position counts batches of the new size per rank). HINT: resume with the "
                      "original settings for an exact continuation.", UserWarning, stacklevel=4)


def load_weights(run: Run, ckpt_path: Any) -> str:
    """Load only the module weights (validate/test/predict with ``ckpt_path``)."""
    path, ckpt = load_first(run, ckpt_path, *run.checkpointer.resolve(ckpt_path), load_file)
    weights = check_weights(unwrap(run.model), module_state(ckpt, path), path)
    task_loads(run, ckpt)
    if is_sharded(path):
        templates = run.strategy.checkpoint_templates(
            run.model, [], meta_entries({"module": weights})
        )
        weights = read_shards(path, {"module": weights}, templates, parts=("module",))["module"]
    run.strategy.load_module_state_dict(run.model, weights)
    return path


# ---- the run's state, as checkpoints hold it (Trainer.state_dict / load_state_dict) --------------
def run_state(run: Run) -> dict[str, Any]:
    """``run_state(run)``: everything needed to continue a fit exactly, each part asked for its own
    state."""
    if run.optimizer is None:
        raise CheckpointError("This Trainer has no training state: it has not run fit.",
                              "call state_dict()/save_checkpoint(path) during or after "
                              "trainer.fit(task).")
    st, logs = run.state, run.logs.state_dict()
    strategy = run.strategy
    optimizers = [strategy.optimizer_state_dict(run.model, o) for o in run.optimizers]
    book = None if st.epoch_done else logs["book"]  # this epoch's values (none once complete)
    return {
        "module": strategy.module_state_dict(run.model),
        "optimizer": optimizers[0] if len(optimizers) == 1 else optimizers,
        "schedulers": run.schedulers.state_dict(),
        "precision": run.precision.state_dict(),
        "loop": {"state": st.state_dict(), "fold_mark": logs["fold_mark"]},
        # rank 0's; under ddp/fsdp every rank's too, so that epoch means resume exactly
        "logbook": book,
        "logbooks": None
        if book is None or strategy.world_size == 1
        else strategy.all_gather_object(_cpu(book)),
        "rng": gather_rng_states(run.strategy),
        "data": data_position(
            run.train_dataloader,
            run.num_train_batches,
            st,
            run.data_seed,
            strategy.world_size,
            run.config,
        ),
        "callbacks": callback_states(run.callbacks),
        "datamodule": run.data.datamodule.state_dict() if run.data.datamodule is not None else None,
    }


def _cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, Mapping):
        return {k: _cpu(v) for k, v in tree.items()}
    return type(tree)(_cpu(v) for v in tree) if isinstance(tree, (list, tuple)) else tree


def load_run_state(run: Run, state: Mapping[str, Any]) -> None:
    """``trainer.load_state_dict(state)``: every part continues where :func:`run_state` left it."""
    strategy, saved = run.strategy, state["optimizer"]
    strategy.load_module_state_dict(run.model, state["module"])
    for optimizer, optimizer_state in zip(
        run.optimizers, saved if isinstance(saved, list) else [saved]
    ):
        strategy.load_optimizer_state_dict(run.model, optimizer, optimizer_state)
    run.schedulers.load_state_dict(state["schedulers"])
    run.precision.load_state_dict(state["precision"])
    run.state.load_state_dict(state["loop"]["state"])
    fold_mark = state["loop"].get("fold_mark", (run.state.global_step, run.state.batches_done))
    books, book = state.get("logbooks"), state["logbook"]
    if books and len(books) == strategy.world_size:  # the same ranks: each continues its own values
        book = books[strategy.rank]
    run.logs.load_state_dict({"book": book, "fold_mark": fold_mark})
    # the run's data order, whatever this process was seeded with
    run.data_seed = int(state["data"]["seed"])
    restore_position(run.train_dataloader, run.val_loader, state["data"])
    # (a data module's state: open_checkpoint)
    load_callback_states(run.callbacks, state.get("callbacks", {}))
    rng, rank = state["rng"], run.strategy.rank
    # last: nothing after it may draw random numbers
    set_rng_state(rng[rank] if rank < len(rng) else rng[0])


def preempt(run: Run) -> None:
    """A preemption signal was seen at a step boundary: save to the ``last`` checkpoint, report it,
    exit."""
    config, signum = run.config, run.preemption.signum
    # The manager names the file (its policy's last.ckpt) and writes it
    path = run.checkpointer.preempt()
    code = config.preempt_exit_code if config.preempt_exit_code is not None else 128 + signum
    requeue = config.requeue and signum == signal.SIGUSR1 and run.strategy.is_main
    job = slurm_job_id() if requeue else None
    # rank 0, once the checkpoint is in place
    requeued = f" Then {requeue_job(job)}." if job is not None else ""
    if run.strategy.is_main:
        st, name = run.state, signal.Signals(signum).name
        # A run of the `taskfit` command carries its config: say how to resume it there.
        how = "the same `taskfit` command with ckpt_path=last" \
            if config.command_config is not None else 'trainer.fit(task, ckpt_path="last")'
        echo(
            f"taskfit: {name} received; saved a checkpoint at epoch {st.epoch}, batch "
            f"{st.batches_done}, global step {st.global_step} to {path}.{requeued} Exiting with "
            f"status {code}. Resume with {how} (or "
            f'ckpt_path="{path}").',
            stream=sys.stderr,
            level=logging.WARNING,
            name="taskfit.preemption",
        )
    # under a launcher a late or second signal is ignored from here to the exit
    run.preemption.exit_code = code
    raise SystemExit(code)
