"""Sweeps of the ``taskfit`` command: what a job's command line changed, which keys its sweep
varies, the job's directory name (``0_lr=0.1``), the hyperparameters TensorBoard's HParams tab
shows, and the sweep summary.

A job knows its own overrides (``task.optimizer.lr=0.1``), not which of them the sweep varies;
Hydra's sweeper writes the sweep's command line to ``<sweep dir>/multirun.yaml`` before any job
starts, so a job reads it there (any launcher: the basic one runs jobs in the launching process,
joblib in worker processes). The summary likewise collects each job's result from a file the job
writes, ``<sweep dir>/.taskfit_jobs/<job>.yaml``.
"""
from __future__ import annotations

import functools
import glob
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf

from ..cluster import global_rank
from .config import DIRECTIVES

# Trainer settings that change a run's result: always among the HParams hyperparameters of the
# command.
RESULT_SETTINGS = (
    "max_epochs",
    "max_steps",
    "precision",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "seed",
)
_JOBS = ".taskfit_jobs"  # <sweep dir>/.taskfit_jobs/<job>.yaml: each job's row of the summary
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+-]+")
MAX_NAME = 80  # characters of a job directory's override part


# ---- overrides -----------------------------------------------------------------------------------
def parse(overrides: Iterable[str]) -> list[Any]:
    """Hydra's parsed ``Override`` objects of command-line strings."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([str(o) for o in overrides])


def swept_keys(raw: Iterable[str], sweeper_params: Mapping[str, Any] | None = None) -> list[str]:
    """The keys a sweep varies: of its command line (``raw``, as typed: ``lr=0.1,0.01``) and of the
    sweeper's ``params`` (a preset's sweep), those with several values (a list, ``range``,
    ``choice``, ``glob``)."""
    typed = list(raw) + [f"{k}={v}" for k, v in (sweeper_params or {}).items()]
    return list(dict.fromkeys(o.key_or_group for o in parse(typed) if o.is_sweep_override()))


@functools.lru_cache(maxsize=8)
def _sweep_command_line(path: str, mtime: float) -> tuple[str, ...] | None:
    try:
        saved = OmegaConf.load(path)
    except Exception:  # noqa: BLE001 - unreadable: fall back to every override of the job
        return None
    raw = OmegaConf.select(saved, "hydra.overrides.task", default=None)
    return None if raw is None else tuple(str(o) for o in raw)


def job_swept_keys(hydra_cfg: Any) -> list[str] | None:
    """The keys the sweep of this job varies (``hydra_cfg``: Hydra's config node of a job); None
    when the job is not part of a sweep or the sweep's command line is not known (then every
    override counts)."""
    sweep_dir = OmegaConf.select(hydra_cfg, "sweep.dir", default=None)
    path = os.path.join(os.path.abspath(str(sweep_dir)), "multirun.yaml") if sweep_dir else ""
    raw = (
        _sweep_command_line(path, os.path.getmtime(path)) if path and os.path.isfile(path) else None
    )
    if raw is None:
        return None
    params = OmegaConf.select(hydra_cfg, "sweeper.params", default=None)
    return swept_keys(raw, OmegaConf.to_container(params) if params is not None else None)


def _value_text(override: Any) -> str:
    value = override.value()
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else \
        override.get_value_element_as_str().strip("'\"")


def run_name(overrides: Sequence[str], keys: Sequence[str] | None) -> str:
    """``lr=0.1,channels=16``: the overrides of ``keys`` (all of them when None), each named by its
    last part (the full key where two last parts are the same), safe as a folder name, at most
    ``MAX_NAME`` characters."""
    chosen = [
        o
        for o in parse(overrides)
        if not o.is_delete() and (keys is None or o.key_or_group in keys)
    ]
    short = [o.key_or_group.rsplit(".", 1)[-1] for o in chosen]
    names = [s if short.count(s) == 1 else o.key_or_group for s, o in zip(short, chosen)]
    text = ",".join(f"{name}={_value_text(o)}" for name, o in zip(names, chosen))
    return _UNSAFE.sub("-", text)[:MAX_NAME].strip("-")


def job_dir(*, _root_: Any) -> str:
    """``${taskfit.job_dir:}``, a sweep job's folder (``hydra.sweep.subdir``): its number, then the
    values its sweep varies, ``0_lr=0.1``, so that TensorBoard's run names (and ``ls``) tell the
    jobs apart."""
    hydra_cfg = _root_.hydra
    num = str(hydra_cfg.job.num)
    keys = job_swept_keys(hydra_cfg)
    name = run_name(list(hydra_cfg.overrides.task), keys) if keys is None or keys else ""
    return f"{num}_{name}" if name else num


if not OmegaConf.has_resolver("taskfit.job_dir"):  # conf/hydra/default.yaml: hydra.sweep.subdir
    OmegaConf.register_new_resolver("taskfit.job_dir", job_dir)


# ---- what the HParams tab shows ------------------------------------------------------------------
def _short_class(path: Any) -> str:
    return str(path).rsplit(".", 1)[-1]


def _select(config: Mapping[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _leaves(node: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    """The task's arguments: leaves by dotted name; a nested ``_target_`` node (an optimizer) as its
    class name."""
    for key, value in node.items():
        if key in DIRECTIVES:
            continue
        name = f"{prefix}.{key}"
        if isinstance(value, Mapping):
            if "_target_" in value:
                out[name] = _short_class(value["_target_"])
            _leaves(value, name, out)
        else:
            out[name] = value


def hparams_of(config: Mapping[str, Any], overrides: Sequence[str] = (),
               choices: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The hyperparameters of a ``taskfit`` run as HParams shows them: the task's arguments
    (``task.channels``, ``task.optimizer`` as ``AdamW``, ``task.optimizer.lr``...), every key the
    command line set (a group's option by its name: ``task=diabetes`` is ``task: diabetes``) and the
    trainer settings in ``RESULT_SETTINGS`` that are set. No ``_target_``, ``_partial_``, callbacks
    or paths unless the command line set them."""
    out: dict[str, Any] = {}
    if isinstance(config.get("task"), Mapping):
        _leaves(config["task"], "task", out)
    trainer = config.get("trainer") or {}
    for key in RESULT_SETTINGS:
        if trainer.get(key) is not None:
            out[f"trainer.{key}"] = trainer[key]
    for o in parse(overrides):
        key = o.key_or_group
        if o.is_delete() or key.startswith("hydra"):
            continue
        if choices is not None and key in choices:  # a config group: its chosen option
            out[key] = choices[key]
            continue
        value = _select(config, key)
        if isinstance(value, Mapping):
            if "_target_" not in value:
                continue
            value = _short_class(value["_target_"])
        out[key] = value
    return out


# ---- the sweep summary ---------------------------------------------------------------------------
def _sweep_dir(hydra_cfg: Any) -> str | None:
    value = OmegaConf.select(hydra_cfg, "sweep.dir", default=None)
    return os.path.abspath(str(value)) if value else None


class SweepSummary(HydraCallback):
    """At the end of ``taskfit -m``: each job's overrides and its best monitored value (the
    checkpoint callback's ``monitor``; the final ``val/loss`` when nothing is monitored), printed
    and saved as ``sweep_summary.yaml``.

    Each job writes its row where it ran (``on_job_end``: the launching process, or a joblib worker)
    to ``<sweep dir>/.taskfit_jobs/<job>.yaml``; the launching process reads them at the end (and
    removes them)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = _sweep_dir(config.hydra)
        # a reused sweep dir: not an earlier sweep's rows
        if folder and os.path.isdir(os.path.join(folder, _JOBS)):
            for path in glob.glob(os.path.join(folder, _JOBS, "*.yaml")):
                os.unlink(path)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        hydra_cfg = job_return.hydra_cfg.hydra
        # the job's config: resolvable
        folder = _sweep_dir(config.hydra) if "hydra" in config else None
        if hydra_cfg.mode != RunMode.MULTIRUN or folder is None or global_rank() != 0:
            return
        ok = job_return.status == JobStatus.COMPLETED
        value = job_return.return_value if ok else None
        row = {"job": int(hydra_cfg.job.num), "overrides": list(job_return.overrides or []),
               "status": "ok" if ok else "failed", "run_dir": hydra_cfg.runtime.output_dir}
        if isinstance(value, dict):
            row.update(
                {k: value.get(k) for k in ("monitor", "mode", "score", "kind", "best_checkpoint")}
            )
        os.makedirs(os.path.join(folder, _JOBS), exist_ok=True)
        path = os.path.join(folder, _JOBS, f"{row['job']}.yaml")
        OmegaConf.save(OmegaConf.create(row), path + ".tmp")
        os.replace(path + ".tmp", path)  # the launching process never reads half a row

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        folder = _sweep_dir(config.hydra)
        if folder is None or global_rank() != 0:
            return
        rows = [
            OmegaConf.to_container(OmegaConf.load(p))
            for p in glob.glob(os.path.join(folder, _JOBS, "*.yaml"))
        ]
        rows.sort(key=lambda r: r["job"])
        if rows:
            summarize(rows, folder)  # sweep_summary.yaml holds them now
        shutil.rmtree(os.path.join(folder, _JOBS), ignore_errors=True)


def summarize(rows: list[dict[str, Any]], sweep_dir: str) -> dict[str, Any]:
    """Print the table of ``rows`` (one per job), mark the best with ``*``, save
    ``<sweep_dir>/sweep_summary.yaml``."""
    scored = [r for r in rows if r.get("score") is not None]
    best = None
    if scored:
        pick = min if scored[0].get("mode", "min") == "min" else max
        best = pick(scored, key=lambda r: r["score"])
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    lines = [f"Sweep summary: {len(rows)} job(s) in {sweep_dir}"]
    if common:
        lines.append("  every job: " + " ".join(o for o in rows[0]["overrides"] if o in common))
    lines.append(f"{'job':>5}  {'value':>10}  {'metric':<20}overrides")
    for r in rows:
        value = (
            "failed"
            if r["status"] != "ok"
            else "-"
            if r.get("score") is None
            else f"{r['score']:.4g}"
        )
        metric = f"{r.get('kind') or ''} {r.get('monitor') or ''}".strip()
        varying = " ".join(o for o in r["overrides"] if o not in common) or "(none)"
        lines.append(f"{r['job']:>5}  {value:>10}  "
                     f"{metric:<20}{varying}{'  *' if r is best else ''}")
    if best is not None:
        lines.append(f"Best (*): job {best['job']}, {best['monitor']}={best['score']:.4g}: "
                     f"{best['run_dir']}")
    lines.append(f"Compare the runs: tensorboard --logdir {sweep_dir}  (HParams tab; run names: "
                 "the job folders)")
    # The terminal only (and the yaml file): the taskfit logger still writes to the last job's
    # taskfit.log.
    print("\n".join(lines), flush=True)
    summary = {"best_job": None if best is None else best["job"], "jobs": rows}
    OmegaConf.save(OmegaConf.create(summary), os.path.join(sweep_dir, "sweep_summary.yaml"))
    return summary
