"""Checkpoints: atomic files that hold everything needed to continue a run exactly, and load without running code.

A checkpoint is a dict that ``torch.load(path, weights_only=True)`` reads: tensors, plain containers and
primitives only (RNG states are stored as tensors and lists, never as pickled objects). What is in it, how
``fit(ckpt_path=...)`` continues from it, and how a preemption signal becomes one: docs/checkpointing.md.
File handling (atomic writes, safe reads, weight checks) is in trainer/serialization.py.
"""
from __future__ import annotations

import array
import os
import random
import re
import signal
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .data import ResumableSampler
from .errors import CheckpointError
from .serialization import (FORMAT, FORMAT_VERSION, IN_MEMORY_BYTES, LAST, CheckpointWriter, atomic_copy,
                            atomic_save, check_plain, check_weights, load_checkpoint, load_file, module_state,
                            remove_files)

__all__ = ["save_checkpoint", "restore", "load_weights", "load_module", "preempt", "resolve", "last_checkpoint",
           "load_checkpoint", "atomic_copy", "remove_files", "CheckpointWriter", "FORMAT_VERSION"]


# ---- writing --------------------------------------------------------------------------------------------
def save_checkpoint(trainer: Any, path: str | os.PathLike, background: bool = False) -> str:
    """Write ``trainer``'s complete state to ``path`` on rank 0; every rank must call it (RNG states are gathered).

    Returns the absolute path. Earlier background saves are finished first. ``background=True`` serialises now
    and leaves the fsync and rename to ``trainer.checkpoint_writer`` (the file is in place when the next save
    starts or fit returns). Under ddp all ranks wait (a barrier) until rank 0 has written, so a rank that exits
    right after a (synchronous) save, as on preemption, cannot bring down rank 0 mid-write.
    """
    if getattr(trainer, "optimizer", None) is None:
        raise CheckpointError(f"Cannot save a checkpoint to {os.fspath(path)}: this Trainer has not run fit, so it "
                              "has no training state to save.",
                              "call trainer.save_checkpoint(path) during or after trainer.fit(task); to save only "
                              "weights, use torch.save(task.state_dict(), path).")
    path = os.path.abspath(os.fspath(path))
    writer = trainer.checkpoint_writer
    writer.wait()  # in order: an older file is never renamed over this one
    strategy = trainer.strategy
    rng = _rng_state()
    ranks = [rng] if strategy.world_size == 1 else \
        [strategy.broadcast(rng if strategy.rank == r else None, src=r) for r in range(strategy.world_size)]
    if trainer.is_main:
        checkpoint = _contents(trainer, ranks)
        size = check_plain(checkpoint, "checkpoint")
        atomic_save(checkpoint, path, writer if background else None, in_memory=size <= IN_MEMORY_BYTES)
    strategy.barrier()
    return path


def _contents(trainer: Any, rng: list[dict[str, Any]]) -> dict[str, Any]:
    from . import __version__

    st, task = trainer.state, trainer.task
    loader = trainer._train_loader
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "versions": {"taskfit": str(__version__), "torch": str(torch.__version__)},
        "module": trainer.strategy.module_state_dict(trainer._wrapped),
        "optimizer": trainer.optimizer.state_dict(),
        "schedulers": [config.scheduler.state_dict() for config in trainer.schedulers],
        "precision": trainer.precision.state_dict(),
        "loop": {"state": st.state_dict(), "fold_mark": list(trainer._fold_mark)},
        "logbook": _book_state(trainer),
        "rng": rng,
        "data": {"seed": int(trainer.data_seed), "epoch": st.epoch, "batches_done": st.batches_done,
                 "batch_size": getattr(loader, "batch_size", None), "world_size": trainer.strategy.world_size,
                 "accumulate_grad_batches": trainer.accumulate_grad_batches,
                 "num_train_batches": _finite(trainer.num_train_batches)},
        "callbacks": {cb.state_key: state for cb in trainer.callbacks if (state := cb.state_dict())},
        "hparams": trainer.hparams,
        "config": trainer.config,
        "task": {"class": f"{type(task).__module__}.{type(task).__qualname__}", "hparams": task.hparams},
    }


def _book_state(trainer: Any) -> dict[str, Any] | None:
    """The values logged so far this epoch, exactly; None after a completed epoch (a resume starts the next)."""
    if trainer.state.epoch_done:
        return None
    book = trainer._train_book.state_dict()
    for series in book["series"].values():
        pending = series["pending"]
        alike = pending and all(isinstance(v, torch.Tensor) for v in pending) \
            and len({(v.dtype, v.shape, v.device) for v in pending}) == 1
        if alike:
            # One tensor in the file instead of one per value (each costs the pickler ~20 objects); bits unchanged.
            series["pending"] = torch.stack([v.detach() for v in pending])
        else:  # logged tensors may be views of large tensors: save only their own values
            series["pending"] = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in pending]
        if isinstance(series["total"], torch.Tensor):
            series["total"] = series["total"].detach().clone()
    return book


def _finite(n: float) -> int | None:
    return None if n == float("inf") else int(n)


# ---- RNG states as tensors and lists ----------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    # array packs the 625 ints in C; torch.tensor(tuple) inspects each one (about twice as slow, every save).
    out: dict[str, Any] = {"python": {"version": version,
                                      "state": torch.frombuffer(array.array("q", state), dtype=torch.int64),
                                      "gauss": gauss},
                           "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                        "has_gauss": int(has_gauss), "gauss": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return out


def _set_rng_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    saved_np = state.get("numpy")
    if saved_np is not None:
        import numpy as np

        np.random.set_state((saved_np["name"], saved_np["keys"].numpy().astype(np.uint32), saved_np["pos"],
                             saved_np["has_gauss"], saved_np["gauss"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(f"The checkpoint has CUDA RNG states of {len(cuda)} devices, this machine has "
                          f"{torch.cuda.device_count()}: CUDA random numbers (dropout on the GPU) will differ from "
                          "the original run. HINT: resume on as many GPUs for a bitwise-equal result.", stacklevel=3)


# ---- resolving "last" / "best" ------------------------------------------------------------------------------
def last_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest ``last.ckpt`` under ``root``: of ``root`` itself, else of the highest ``version_N/checkpoints``."""
    root = os.fspath(root)
    direct = os.path.join(root, LAST)
    if os.path.isfile(direct):
        return os.path.abspath(direct)
    versions = sorted(((int(m.group(1)), d) for d in (os.listdir(root) if os.path.isdir(root) else [])
                       if (m := re.fullmatch(r"version_(\d+)", d))), reverse=True)
    for _, d in versions:
        candidate = os.path.join(root, d, "checkpoints", LAST)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return None


def resolve(trainer: Any, ckpt_path: Any) -> str:
    """A path for ``ckpt_path``: "last", "best" (see docs/checkpointing.md) or a file path."""
    if ckpt_path not in ("last", "best"):
        if not isinstance(ckpt_path, (str, os.PathLike)):
            raise CheckpointError(f"ckpt_path={ckpt_path!r} is not a path.",
                                  'pass "last", "best" or the path of a .ckpt file.')
        return os.path.abspath(os.path.expanduser(os.fspath(ckpt_path)))
    cb = trainer.checkpoint_callback
    looked = []
    if cb is not None and cb.last_model_path and os.path.isfile(cb.last_model_path):
        last = cb.last_model_path  # written by this Trainer
    else:
        roots = ([cb.dirpath_arg] if cb is not None and cb.dirpath_arg else []) + [os.path.dirname(trainer.log_dir)]
        last = None
        for root in roots:
            looked.append(root)
            last = last_checkpoint(root)
            if last:
                break
    if ckpt_path == "last":
        if last is None:
            raise CheckpointError(
                f"ckpt_path=\"last\" but no checkpoint has been saved yet (looked for {LAST} in "
                f"{' and '.join(looked)} and its version_*/checkpoints folders).",
                "start without ckpt_path for a fresh run, pass the path of a .ckpt file, or set "
                "Trainer(default_root_dir=...) to the folder of the run to resume.")
        return last
    best = cb.best_model_path if cb is not None and cb.best_model_path else None
    if best is None and last is not None:  # the newest run's bookkeeping names its best file
        states = load_checkpoint(last).get("callbacks", {})
        best = next((s.get("best_model_path") for s in states.values()
                     if isinstance(s, Mapping) and s.get("best_model_path")), None)
    if not best or not os.path.isfile(best):
        raise CheckpointError(
            f"ckpt_path=\"best\" but no best checkpoint is known (last: {last}, best: {best}).",
            "train first with a ModelCheckpoint that saves top-k files (save_top_k >= 1, monitor=\"val/loss\" to "
            "rank them), or pass the path of a .ckpt file.")
    return best


# ---- restoring a run ------------------------------------------------------------------------------------
def restore(trainer: Any, ckpt_path: Any) -> None:
    """Continue ``trainer`` exactly where the checkpoint left it (called by fit after setup, before on_fit_start)."""
    from .strategies import unwrap

    path = resolve(trainer, ckpt_path)
    ckpt = load_checkpoint(path)
    module = unwrap(trainer._wrapped)
    weights = module_state(ckpt, path)
    weights = check_weights(module, weights, path)
    if len(ckpt["schedulers"]) != len(trainer.schedulers):
        raise CheckpointError(
            f"{path} has {len(ckpt['schedulers'])} learning-rate scheduler(s), configure_optimizers returned "
            f"{len(trainer.schedulers)}.",
            "resume with the optimizer and scheduler setup of the original run.")
    _warn_changes(trainer, ckpt, path)
    module.load_state_dict(weights)
    try:
        trainer.optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"The optimizer state in {path} does not fit this optimizer ({exc}).",
                              "resume with the optimizer of the original run (same parameter groups).") from None
    for config, state in zip(trainer.schedulers, ckpt["schedulers"]):
        config.scheduler.load_state_dict(state)
    trainer.precision.load_state_dict(ckpt["precision"])
    _restore_loop(trainer, ckpt)
    states = ckpt.get("callbacks", {})
    for cb in trainer.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
    rng = ckpt["rng"]
    rank = trainer.strategy.rank
    _set_rng_state(rng[rank] if rank < len(rng) else rng[0])  # last: nothing after this may draw random numbers
    if trainer.is_main:
        st = trainer.state
        print(f"Resumed from {path}: epoch {st.epoch}, batch {st.batches_done}, global step {st.global_step}.",
              flush=True)


def _restore_loop(trainer: Any, ckpt: Mapping[str, Any]) -> None:
    st, data = trainer.state, ckpt["data"]
    st.load_state_dict(ckpt["loop"]["state"])
    st.stage = "idle"
    book = trainer._train_book
    if st.epoch_done:  # written at the end of a completed epoch: continue with the next one
        st.epoch, st.batches_done, st.epoch_done = st.epoch + 1, 0, False
        book.reset()
        trainer._fold_mark = (st.global_step, 0)
    else:
        device = trainer.strategy.device
        logbook = ckpt["logbook"]
        for series in logbook["series"].values():  # logged tensors go back to the device they were logged on
            pending = series["pending"]
            series["pending"] = list(pending.to(device).unbind()) if isinstance(pending, torch.Tensor) else \
                [v.to(device) if isinstance(v, torch.Tensor) else v for v in pending]
            if isinstance(series["total"], torch.Tensor):
                series["total"] = series["total"].to(device)
        book.load_state_dict(logbook)
        trainer._fold_mark = tuple(ckpt["loop"].get("fold_mark", (st.global_step, st.batches_done)))
    trainer._track_loss()
    trainer.data_seed = int(data["seed"])  # the run's data order, whatever this process was seeded with
    for loader in (trainer._train_loader, trainer._val_loader):
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "seed"):
            sampler.seed = trainer.data_seed


def _warn_changes(trainer: Any, ckpt: Mapping[str, Any], path: str) -> None:
    data = ckpt["data"]
    now = {"batch size": getattr(trainer._train_loader, "batch_size", None),
           "world size": trainer.strategy.world_size,
           "accumulate_grad_batches": trainer.accumulate_grad_batches,
           "batches per epoch": _finite(trainer.num_train_batches)}
    saved = {"batch size": data.get("batch_size"), "world size": data.get("world_size"),
             "accumulate_grad_batches": data.get("accumulate_grad_batches"),
             "batches per epoch": data.get("num_train_batches")}
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in now if saved[k] != now[k]]
    old, new = ckpt.get("task", {}).get("hparams", {}), trainer.task.hparams
    changed += [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k) and k != "batch_size" and " at 0x" not in str(old.get(k))]
    state = ckpt["loop"]["state"]
    mid_epoch = data["batches_done"] and not state.get("epoch_done")
    if mid_epoch and not isinstance(getattr(trainer._train_loader, "sampler", None), ResumableSampler):
        warnings.warn(f"Resuming mid-epoch (batch {data['batches_done']}) from {path}, but the training data is not a "
                      "plain DataLoader over a map-style dataset (custom sampler, IterableDataset or DataLoader "
                      "subclass), so taskfit cannot fast-forward it: the rest of this epoch starts from the loader's "
                      "first batch. HINT: use a plain DataLoader (shuffle=True/False) for an exact mid-epoch resume, "
                      "or save only at epoch ends (ModelCheckpoint(every_n_epochs=1)).", UserWarning, stacklevel=4)
    if changed:
        where = "mid-epoch (batch %d)" % data["batches_done"] if mid_epoch else "at an epoch boundary"
        warnings.warn(f"Resuming from {path} ({where}) with a changed setup: {'; '.join(changed)}. The run "
                      "continues, but not exactly as the original would have (the data position counts batches "
                      "of the new size per rank). HINT: resume with the original settings for an exact "
                      "continuation.", UserWarning, stacklevel=4)


def load_weights(trainer: Any, ckpt_path: Any) -> str:
    """Load only the module weights (validate/test/predict with ``ckpt_path``)."""
    from .strategies import unwrap

    path = resolve(trainer, ckpt_path)
    module = unwrap(trainer._wrapped)
    weights = module_state(load_file(path), path)
    weights = check_weights(module, weights, path)
    module.load_state_dict(weights)
    return path


def load_module(cls: type, path: str | os.PathLike, map_location: Any = "cpu", **kwargs: Any) -> Any:
    """Build ``cls`` with the init arguments the checkpoint records (``kwargs`` win) and load its weights."""
    import inspect

    path = os.path.abspath(os.fspath(path))
    ckpt = load_file(path)
    weights = module_state(ckpt, path)
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


# ---- preemption -------------------------------------------------------------------------------------------
def preempt(trainer: Any) -> None:
    """A preemption signal was seen at a step boundary: save to the ``last`` checkpoint, report it, exit."""
    signum = trainer._signal
    cb = trainer.checkpoint_callback
    if cb is not None:
        path = cb.prepare_last(trainer)  # its bookkeeping names the file it is about to be saved in
    else:
        path = os.path.join(trainer.log_dir, "checkpoints", LAST)
    save_checkpoint(trainer, path)
    code = trainer.preempt_exit_code if trainer.preempt_exit_code is not None else 128 + signum
    if trainer.is_main:
        st, name = trainer.state, signal.Signals(signum).name
        print(f"taskfit: {name} received; saved a checkpoint at epoch {st.epoch}, batch {st.batches_done}, global "
              f"step {st.global_step} to {path}. Exiting with status {code}. Resume with "
              f"trainer.fit(task, ckpt_path=\"last\") (or ckpt_path=\"{path}\").", file=sys.stderr, flush=True)
    raise SystemExit(code)
