"""The ``taskfit`` command (also ``python -m taskfit``): one Hydra app over ``conf/``. See
docs/configuration.md.

A run: compose the config (Hydra), resolve it, check every ``_target_`` and argument
(trainer/config.py), save the resolved config as ``<run dir>/config.yaml``, build the task, the
callbacks and the Trainer, fit, test when the task has test data, and print where the run directory,
TensorBoard logs and best checkpoint are. The command line maps onto ``Trainer(**cfg.trainer,
callbacks=[...cfg.callbacks, ...cfg.logger], config=<resolved cfg>)`` and
``trainer.fit(instantiate(cfg.task), ckpt_path=cfg.ckpt_path)``; ``mode=test`` (``validate``,
``predict``) evaluates ``ckpt_path`` instead (trainer/modes.py). What the run prints also goes to
``<run dir>/taskfit.log`` (trainer/console.py); sweeps' job names and summary are in
trainer/sweep.py.
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .. import callbacks as cbs
from .. import console
from ..callbacks import TensorBoardLogger
from ..checkpoint.dirs import checkpoint_exists
from ..checkpoint.lookup import last_checkpoint
from ..cluster import global_rank
from ..errors import CheckpointError, MisconfigurationError, TaskfitError, find_in_chain
from ..seed import seed_everything, seeds_workers
from ..tools import lr_finder, tuner
from . import config_errors, modes, sweep
from .config import check_targets, explain, locate

# Callbacks that a Trainer switch turns off: a configured one is dropped too, as the Trainer's
# default is.
_SWITCHES = (("enable_progress_bar", "ProgressBar"), ("enable_model_summary", "ModelSummary"),
             ("enable_checkpointing", "ModelCheckpoint"), ("logger", "Logger"),
             ("logger", "LearningRateMonitor"), ("logger", "ThroughputMonitor"))


def _config_path() -> str:
    """The configs shipped as the package ``taskfit.conf`` (installed, editable or not), else a
    checkout's conf/."""
    if importlib.util.find_spec("taskfit.conf") is not None:
        return "pkg://taskfit.conf"
    return os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf"
    )


def _is_leader() -> bool:
    """Rank 0 of a torchrun or SLURM job, or a process started on its own (spawned ddp workers never
    get here)."""
    return global_rank() == 0


# ---- building the pieces -------------------------------------------------------------------------
def build_callbacks(config: dict[str, Any]) -> list[Any]:
    """The ``callbacks`` and ``logger`` groups' callbacks (a null entry is skipped), minus those the
    Trainer's switches turn off (``trainer.enable_checkpointing=false`` drops
    ``callbacks.model_checkpoint``...)."""
    from hydra.utils import instantiate

    switches = config["trainer"]
    off = tuple(getattr(cbs, name) for flag, name in _SWITCHES if not switches.get(flag, True))
    if switches.get("fast_dev_run"):  # nothing is written in a fast_dev_run
        off += (cbs.ModelCheckpoint, cbs.Logger)
    built = []
    for group in ("callbacks", "logger"):
        for name, node in (config.get(group) or {}).items():
            if node is None:
                continue
            if not isinstance(node, dict) or "_target_" not in node:
                raise MisconfigurationError(
                    f"{group}.{name} has no _target_, so it cannot become a callback (it is "
                    f"{node!r}).",
                    "give it `_target_: package.module.MyCallback` and its arguments, or remove "
                    f"it with {group}.{name}=null.")
            cls = locate(node["_target_"], f"{group}.{name}")
            if isinstance(cls, type) and off and issubclass(cls, off):
                continue
            try:
                built.append(instantiate(node, _convert_="all"))
            # the callback refused an argument: name the config node that holds it
            except Exception as exc:
                cause = find_in_chain(exc, MisconfigurationError)
                if cause is None:
                    raise
                raise MisconfigurationError(f"Config {group}.{name} is not valid: {cause.what}",
                                            cause.hint) from exc
    return built


def build_trainer(config: dict[str, Any], callbacks: list[Any]) -> Any:
    """``Trainer(**config["trainer"], callbacks=callbacks, config=config)``; a nested ``_target_``
    (the ddp strategy) is built first."""
    from hydra.utils import instantiate

    factory = instantiate(config["trainer"], _partial_=True, _convert_="all")
    return factory(callbacks=callbacks, config=config)


def find_last_checkpoint(
    log_dir: str, name: str, exclude: str | None = None, required: bool = True
) -> str | None:
    """The newest ``last.ckpt`` (by modification time) of the runs named ``name``: the run
    directories ``<log_dir>/<name>/runs/*`` and ``<log_dir>/<name>/multiruns/*/*``, each searched as
    :func:`trainer.checkpoint.last_checkpoint` does (its ``last.ckpt``, else the highest
    ``version_N``'s; an incomplete sharded one skipped, with a warning). None when there is none and
    not ``required``."""
    base = os.path.abspath(os.path.join(log_dir, name))
    runs = glob.glob(os.path.join(glob.escape(base), "runs", "*")) + \
        glob.glob(os.path.join(glob.escape(base), "multiruns", "*", "*"))
    found = [path for run in runs if os.path.isdir(run) and os.path.abspath(run) != exclude
             if (path := last_checkpoint(run, warn=_is_leader())) is not None]
    where = f"looked in {base}/runs/* and {base}/multiruns/*/*"
    if found:
        return max(found, key=os.path.getmtime)
    if required:
        raise CheckpointError(
            f"ckpt_path=last found no last.ckpt in the runs named '{name}' ({where}).",
            "run once without ckpt_path first, use the same name (experiment, or name=...) and "
            "paths.log_dir as that run, or pass the file: ckpt_path=/path/to/last.ckpt.")
    if _is_leader():
        warnings.warn(f"ckpt_path=last: no earlier run named '{name}' has a last.ckpt yet "
                      f"({where}), so this run starts fresh. HINT: expected on a job's first "
                      "start; otherwise use the name (experiment, or name=...) and paths.log_dir "
                      "of the run to resume.", UserWarning,
                      stacklevel=console.user_stacklevel())  # no user line: none shown
    return None


def _ckpt_path(config: dict[str, Any], run_dir: str, mode: str) -> str | None:
    value = config.get("ckpt_path")
    # fit: nothing to resume yet is a fresh start (a job's first start and its restarts)
    if value == "last":
        return find_last_checkpoint(
            config["paths"]["log_dir"],
            str(config["name"]),
            exclude=run_dir,
            required=mode in modes.EVALUATING,
        )
    if isinstance(value, str) and value != "best":
        return os.path.abspath(os.path.expanduser(value))
    return value


def compose_config(overrides: Sequence[str] = (), run_dir: str | None = None) -> dict[str, Any]:
    """The resolved config that ``taskfit <overrides>`` would run, from Python (a notebook, a test).

    Uses Hydra's compose API on the same configs; ``run_dir`` (default: the working directory)
    stands for the run directory Hydra would create. Add your own config folder with
    ``"hydra.searchpath=[file:///abs/dir]"``. Sets Hydra's global HydraConfig, as a running job has
    it.
    """
    from hydra import compose, initialize_config_dir, initialize_config_module
    from omegaconf import open_dict, read_write

    path = _config_path()
    init = (
        initialize_config_module(path[len("pkg://") :], version_base="1.3")
        if path.startswith("pkg://")
        else initialize_config_dir(path, version_base="1.3")
    )
    with init:
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = os.path.abspath(run_dir or os.getcwd())
        cfg.hydra.runtime.cwd = os.getcwd()
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


# ---- the job -------------------------------------------------------------------------------------
def run(cfg: DictConfig) -> dict[str, Any]:
    """One Hydra job: build, then fit and test (``mode=fit``) or evaluate a checkpoint
    (``mode=validate``, ``test``, ``predict``), report. Returns what the sweep summary shows."""
    from hydra.types import RunMode

    with console.warnings_logged():  # warnings on stderr as ever, and in <run dir>/taskfit.log
        try:
            return _run(cfg)
        except Exception as exc:
            # past Hydra, which would print "Error executing job ...":
            if HydraConfig.get().mode == RunMode.RUN:
                # main() reports it once (a sweep's jobs keep Hydra's line)
                raise _JobFailed(exc) from None
            raise


class _JobFailed(BaseException):
    """Carries a single run's error past Hydra's job runner to :func:`main`."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def _run(cfg: DictConfig) -> dict[str, Any]:
    from hydra.utils import instantiate

    started = time.perf_counter()
    run_dir = HydraConfig.get().runtime.output_dir
    # a config that fails before training leaves no run directory behind (Hydra created it already)
    try:
        config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        config_errors.check_root(
            config, OmegaConf.to_container(cfg), OmegaConf.to_container(HydraConfig.get())
        )
        config_errors.check_groups(config, HydraConfig.get().runtime)
        # a config's name (the command
        config_errors.check_name(config["name"], config["paths"]["log_dir"])
        # line's is checked before Hydra's directory): its run directory, outside paths.log_dir, is
        # removed
        check_targets(config)  # every _target_ imports, every key is an argument: before any work
        mode = modes.check_mode(config)
        if mode in modes.EVALUATING:
            modes.check_checkpoint_arg(mode, config.get("ckpt_path"), str(config["name"]))
        if _is_leader():  # torchrun: only rank 0 writes; the others share its directory
            OmegaConf.save(OmegaConf.create(config), os.path.join(run_dir, "config.yaml"))
        ckpt_path = _ckpt_path(config, run_dir, mode)
        if mode in modes.EVALUATING:
            # exists, readable, has weights: before the task is built
            modes.check_checkpoint(ckpt_path)
        elif ckpt_path not in (None, "best"):
            modes.check_resume_path(ckpt_path)
        callbacks = build_callbacks(config)
        _describe_run(callbacks, config)
        if mode == "predict":
            predict = config.get("predict") or {}
            callbacks.append(
                cbs.PredictionWriter(
                    predict.get("output_dir") or os.path.join(run_dir, "predictions"),
                    predict.get("write_interval", "batch"),
                )
            )
        seed = config["trainer"].get("seed")
        if seed is not None:  # before the task is built: its initial weights depend on the seed
            seed_everything(seed, workers=seeds_workers())
        task = instantiate(config["task"], _convert_="all")
        trainer = build_trainer(config, callbacks)
    except Exception:
        if _is_leader():
            _discard_unused(run_dir)
        raise
    try:
        # ddp workers append rank 0's lines to this run's taskfit.log
        with console.shared_with_workers():
            # a learning-rate range test; it prints its own report (trainer/tune.py)
            if mode == "lr_find":
                return lr_finder.lr_find_command(trainer, task, config, run_dir)
            # the batch size finder; it prints its own report (tools/tuner.py)
            if mode == "scale_batch_size":
                return tuner.scale_batch_size_command(trainer, task, config, run_dir)
            result = _fit(trainer, task, config, run_dir, ckpt_path) if mode == "fit" else \
                _evaluate(trainer, task, config, run_dir, mode, ckpt_path, callbacks[-1])
    # a value the run rejected before saving anything (task.batch_size=-4): name its key
    except Exception as exc:
        error = config_errors.blame(exc, config)
        if error is None or glob.glob(
            os.path.join(glob.escape(run_dir), "**", "*.ckpt"), recursive=True
        ):
            raise
        if _is_leader():
            shutil.rmtree(run_dir, ignore_errors=True)
            _discard_unused(run_dir)
        raise error from exc
    # the job's W&B run is complete (offline: ready for `wandb sync`) before the report names it
    for cb in trainer.callbacks:
        if isinstance(cb, cbs.WandbLogger):
            cb.finish()
    if trainer.is_main:
        _print_report(result, time.perf_counter() - started)
    return result


def _fit(
    trainer: Any, task: Any, config: dict[str, Any], run_dir: str, ckpt_path: str | None
) -> dict[str, Any]:
    trainer.fit(task, ckpt_path=ckpt_path)
    cb = trainer.checkpoint_callback
    best = getattr(cb, "best_model_path", None) or None
    tested = None
    if config.get("test", True) and task.test_dataloader() is not None:
        tested = trainer.test(task, ckpt_path=best if best and checkpoint_exists(best) else None)[0]
    return _result(trainer, run_dir, best, tested)


def _evaluate(
    trainer: Any,
    task: Any,
    config: dict[str, Any],
    run_dir: str,
    mode: str,
    ckpt_path: str,
    writer: Any,
) -> dict[str, Any]:
    loader = (
        modes.use_loader(task, (config.get("predict") or {}).get("dataloader"))
        if mode == "predict"
        else None
    )
    out = modes.evaluate(trainer, task, mode, ckpt_path)
    tensorboard = (
        any(isinstance(c, TensorBoardLogger) for c in trainer.callbacks) and mode != "predict"
    )
    result = {
        "run_dir": run_dir,
        "log_dir": trainer.log_dir if tensorboard else None,
        "best_checkpoint": None,
        "ckpt_path": ckpt_path,
        "mode": out.get("mode", "min"),
        "run_mode": mode,
        "monitor": out.get("monitor"),
        "score": out.get("score"),
        "kind": out.get("kind"),
        "metrics": out["metrics"],
        "test": out["metrics"] if mode == "test" else None,
        "loggers": _logger_lines(trainer),
    }
    if mode == "predict":
        result.update(
            output_dir=writer.output_dir,
            predictions=modes.prediction_files(writer.output_dir),
            loader=f"{type(task).__name__}.{loader}",
        )
    return result


def _describe_run(callbacks: list[Any], config: dict[str, Any]) -> None:
    """What the loggers show of this job (TensorBoard's HParams tab, MLflow's params): the task's
    arguments, the keys the command line set and the trainer settings that change results; the keys
    its sweep varies first (and, in HParams, only them), or in a single run the keys its command
    line and optimizer tuned (unless the config says)."""
    from hydra.types import RunMode

    from ..callbacks.loggers.tensorboard_hparams import tuned_keys

    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    varying = sweep.job_swept_keys(hydra_cfg) if hydra_cfg.mode == RunMode.MULTIRUN else []
    if varying is None:  # a sweeper that did not save its command line: every override of the job
        varying = [o.key_or_group for o in sweep.parse(overrides) if not o.is_delete()]
    for cb in callbacks:
        if isinstance(cb, cbs.Logger) and hasattr(cb, "hparams"):  # TensorBoardLogger, MLFlowLogger
            if cb.hparams is None:
                cb.hparams = sweep.hparams_of(config, overrides, dict(hydra_cfg.runtime.choices))
            if hasattr(cb, "varying") and not cb.varying:
                cb.varying = list(varying)
            if hasattr(cb, "tuned") and not cb.tuned and not varying:
                cb.tuned = tuned_keys(cb.hparams, [o.key_or_group for o in sweep.parse(overrides)])


def _discard_unused(run_dir: str) -> None:
    """Remove a run directory that holds only what Hydra and the config wrote (no run started in
    it), then the folders above it that this leaves empty (<log_dir>/<name>/runs, <log_dir>/<name>,
    <log_dir>: three at most, never the working directory or one above it)."""
    hydra_files = {".hydra", "config.yaml", "taskfit.log"}
    if os.path.isdir(run_dir) and set(os.listdir(run_dir)) <= hydra_files:
        shutil.rmtree(run_dir, ignore_errors=True)
    if os.path.isdir(run_dir):
        return  # something of a run is in it: kept
    folder, cwd = os.path.dirname(os.path.abspath(run_dir)), os.path.abspath(os.getcwd())
    for _ in range(3):
        if (
            (cwd + os.sep).startswith(folder + os.sep)
            or not os.path.isdir(folder)
            or os.listdir(folder)
        ):
            return
        os.rmdir(folder)
        folder = os.path.dirname(folder)


def _result(
    trainer: Any, run_dir: str, best: str | None, tested: dict[str, float] | None
) -> dict[str, Any]:
    cb = trainer.checkpoint_callback
    metrics = dict(trainer.state.metrics)
    monitor, mode = getattr(cb, "monitor", None), getattr(cb, "mode", "min")
    score = getattr(cb, "best_model_score", None) if monitor else None
    kind = "best"
    # nothing ranked checkpoints: show the final validation loss
    if monitor is None or score is None:
        monitor = monitor or next(
            (k for k in ("val/loss", "train/loss_epoch", "train/loss") if k in metrics), None
        )
        score, kind = metrics.get(monitor) if monitor else None, "final"
    tensorboard = any(isinstance(c, TensorBoardLogger) for c in trainer.callbacks)
    return {
        "run_dir": run_dir,
        "log_dir": trainer.log_dir if tensorboard else None,
        "best_checkpoint": best,
        "monitor": monitor,
        "mode": mode,
        "score": None if score is None else float(score),
        "kind": kind,
        "metrics": metrics,
        "test": tested,
        "loggers": _logger_lines(trainer),
    }


def _logger_lines(trainer: Any) -> list[str]:
    """Where the CSV, MLflow and W&B loggers wrote (the report's lines; TensorBoard has its own)."""
    lines = []
    for cb in trainer.callbacks:
        if isinstance(cb, cbs.CSVLogger) and trainer.log_dir:
            lines.append(f"  CSV:             {os.path.join(trainer.log_dir, 'metrics.csv')}")
        # with the `mlflow ui` command and the runs table's URL
        elif isinstance(cb, cbs.MLFlowLogger):
            run = f", run {cb.run_id}" if cb.run_id else ""
            first, *how = cb.ui_lines(f"  MLflow:          experiment '{cb.experiment_name}'{run}")
            lines += [first] + [f"{'':19}{line.strip()}" for line in how]
        # W&B: the run's folder and its `wandb sync` command (online: its URL)
        elif isinstance(cb, cbs.WandbLogger) and cb.sync_lines():
            first, *how = cb.sync_lines()
            lines += [f"  W&B:             {first}"] + [f"{'':19}{line}" for line in how]
    return lines


def _print_report(result: dict[str, Any], seconds: float) -> None:
    mode = result.get("run_mode", "fit")
    score = "" if result["score"] is None else f"  ({result['monitor']}={result['score']:.4g})"
    lines = [f"taskfit: {'done' if mode == 'fit' else mode} in {seconds:.1f} s",
             f"  run directory:   {result['run_dir']}  (config.yaml: the resolved config)"]
    if mode != "predict":
        # a resumed fit: its run's
        lines.append("  TensorBoard:     " + (f"{result['log_dir']}  (tensorboard --logdir "
                                              # (checkpoint.py records it)
                                              f"{os.path.dirname(result['log_dir'])})"
                                              if result["log_dir"] else "off"))
    if mode != "fit":
        lines += modes.report_lines(mode, result)
    else:
        lines.append(f"  best checkpoint: {result['best_checkpoint'] or 'none'}"
                     f"{score if result['best_checkpoint'] else ''}")
    lines += result.get("loggers") or []
    if mode == "fit" and result["best_checkpoint"] is None and result["score"] is not None:
        lines.append(f"  {result['kind']} {result['monitor']}: {result['score']:.4g}")
    if mode == "fit" and result["test"]:
        lines.append(
            "  test:            " + ", ".join(f"{k}={v:.4g}" for k, v in result["test"].items())
        )
    console.echo("\n".join(lines), name="taskfit.cli")


# ---- sweeps --------------------------------------------------------------------------------------
# conf/hydra/default.yaml's callback (taskfit.cli.SweepSummary), in sweep.py
SweepSummary = sweep.SweepSummary


# ---- the command ---------------------------------------------------------------------------------
_app = hydra.main(version_base="1.3", config_path=_config_path(), config_name="config")(run)


def _follower_overrides() -> list[str]:
    """Under torchrun (or SLURM's srun) every rank runs this command. Ranks other than 0 get no
    directory, log file or saved config of their own: their Trainer takes rank 0's log directory (a
    broadcast), and rank 0 writes."""
    if not _is_leader():
        return [
            "hydra.run.dir=.",
            "hydra.sweep.dir=.",
            "hydra.sweep.subdir=.",
            "hydra.output_subdir=null",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
        ]
    return []


def _fail(error: BaseException) -> None:
    """The error as one message (its HINT included) on stderr, and in the job's taskfit.log when a
    job started."""
    console.echo(
        console.describe(error), stream=sys.stderr, level=logging.ERROR, name="taskfit.cli"
    )
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``taskfit``: ``argv`` (default ``sys.argv[1:]``) are Hydra flags and
    overrides."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv), *_follower_overrides()]
    # `task._target_=mypkg.MyTask` works from the folder that holds mypkg
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    user_wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Hydra re-raises instead of printing: errors are explained below
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        try:
            # before Hydra creates <log_dir>/<name>/runs/<time>
            config_errors.check_name_overrides(sys.argv[1:])
            _app()
        except _JobFailed as failed:
            raise failed.error  # noqa: B904 - the job's own error, with its own traceback
    except Exception as exc:
        if user_wants_traceback:
            raise
        cause = find_in_chain(exc, TaskfitError)  # e.g. inside Hydra's InstantiationException
        if cause is not None:
            _fail(cause)
        if isinstance(exc, (HydraException, OmegaConfBaseException)):
            _fail(explain(exc))
        explained = (
            config_errors.null_group(exc, sys.argv[1:])
            or config_errors.yaml_error(exc)
            or config_errors.unreadable_config(exc)
            or config_errors.run_dir_error(exc, sys.argv[1:])
        )
        if explained is not None:
            _fail(explained)
        raise


if __name__ == "__main__":
    main()
