"""The structured configs of the ``taskfit`` command: one dataclass per configurable class (the
Trainer and the built-in callbacks and loggers), registered in Hydra's ConfigStore as
``taskfit_<name>`` by ``register`` in config.py. The yaml files of ``conf/trainer`` and
``conf/callbacks`` start from them (``defaults: [/taskfit_trainer@_here_]``), so Hydra rejects
``trainer.max_epoch=3`` or ``trainer.max_epochs=abc`` while composing the config.

``TrainerConf`` is not written here: :func:`schema_of` builds it from ``Trainer.__init__``'s
signature (names, defaults, annotations), the one place the Trainer's arguments are written
(docs/configuration.md says why)."""
from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..trainer import Trainer

_SCALARS = (int, float, str, bool)


def config_type(annotation: Any) -> Any:
    """The type OmegaConf can hold for an annotation: ``int``/``float``/``str``/``bool`` as they
    are, ``X | None`` -> ``Optional[X]``, a sequence of one of them (``Sequence[str]``,
    ``list[int]``, ``tuple[str, ...]``) -> ``List[X]``; anything else (``int | float``, ``Any``, a
    class) -> ``Any``, which check_targets (config.py) then checks against the real annotation."""
    if annotation in _SCALARS:
        return annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return (
            Optional[rest[0]] if len(args) == 2 and len(rest) == 1 and rest[0] in _SCALARS else Any
        )
    if origin in (list, collections.abc.Sequence) and len(args) == 1 and args[0] in _SCALARS:
        return List[args[0]]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _SCALARS:
        return List[args[0]]
    return Any


def _field(default: Any) -> Any:
    if default is inspect.Parameter.empty:
        return field(default="???")  # OmegaConf's MISSING: the key must be given
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda value=list(default): list(value))
    if isinstance(default, dict):
        return field(default_factory=lambda value=dict(default): dict(value))
    return field(default=default)


def schema_of(
    cls: type,
    target: str,
    *,
    exclude: tuple[str, ...] = (),
    narrowed: dict[str, Any] | None = None,
    name: str | None = None,
) -> type:
    """A dataclass with ``_target_: str = target`` and then one field per named argument of
    ``cls.__init__`` (in the signature's order, minus ``exclude``): the same default (a list for a
    tuple or list default) and the :func:`config_type` of its annotation, or the type given in
    ``narrowed``."""
    init = cls.__init__
    # the annotations are strings (`from __future__ import annotations`)
    hints = typing.get_type_hints(init)
    narrowed = dict(narrowed or {})
    fields: list[tuple[str, Any, Any]] = [("_target_", str, field(default=target))]
    for key, param in inspect.signature(init).parameters.items():
        if (
            key == "self"
            or key in exclude
            or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        ):
            continue
        kind = narrowed.pop(key) if key in narrowed else config_type(hints.get(key, Any))
        fields.append((key, kind, _field(param.default)))
    if narrowed:
        raise TypeError(
            f"schema_of({cls.__name__}): narrowed names no argument: {sorted(narrowed)}"
        )
    schema = dataclasses.make_dataclass(name or f"{cls.__name__}Conf", fields)
    schema.__module__ = __name__  # make_dataclass's `module=` is Python 3.12+
    schema.__doc__ = (
        f"The keyword arguments of :class:`{target}`, built from its signature by "
        ":func:`schema_of`" + (f" (except {', '.join(exclude)})" if exclude else "") + "."
    )
    return schema


# ---- schemas -------------------------------------------------------------------------------------
# ``trainer.*``: built from Trainer.__init__. ``callbacks`` and ``config`` are left out: the command
# builds them
# (the callbacks/ and logger/ groups, and the resolved config itself). TRAINER_NARROWED lists the
# arguments whose
# schema type is narrower than the signature's, on purpose (each says why); every other type is
# config_type's.
TRAINER_NARROWED: dict[str, Any] = {
    # str | int: 16 and "16" name one precision; the command keeps it a string, as
    # conf/trainer/default.yaml
    # writes it ("32"), so `trainer.precision=16` composes to "16".
    "precision": str,
    # bool | Logger | Sequence[Logger]: from the command the loggers come from the logger/ group;
    # trainer.logger only switches them (and the default TensorBoard one) on or off.
    "logger": bool,
    # Any (a name or a Profiler instance): a Profiler instance has no yaml form; "simple", "torch"
    # or null.
    "profiler": Optional[str],
}
TrainerConf = schema_of(
    Trainer,
    "taskfit.Trainer",
    exclude=("callbacks", "config"),
    narrowed=TRAINER_NARROWED,
    name="TrainerConf",
)

# The callbacks' and loggers' schemas: one field per argument of the class named in _target_, with
# the same
# default. Arguments that accept a union OmegaConf cannot express (``int | float``, ``int | str |
# list``) are
# ``Any`` here; check_targets checks them against the real annotation. tests/test_config.py keeps
# these in step
# with the signatures.
@dataclass
class ModelCheckpointConf:
    _target_: str = "taskfit.callbacks.ModelCheckpoint"
    dirpath: Optional[str] = None
    filename: Optional[str] = "{epoch}-{step}"
    monitor: Optional[str] = None
    verbose: bool = False
    save_last: Optional[bool] = True
    save_top_k: int = 1
    save_on_exception: bool = False
    save_weights_only: bool = False
    mode: str = "min"
    auto_insert_metric_name: bool = True
    every_n_train_steps: Optional[int] = None
    train_time_interval: Optional[float] = None
    every_n_epochs: Optional[int] = None
    save_on_train_epoch_end: Optional[bool] = None
    enable_version_counter: bool = True
    min_epoch_interval: float = 1.0


@dataclass
class EarlyStoppingConf:
    _target_: str = "taskfit.callbacks.EarlyStopping"
    monitor: str = "val/loss"
    min_delta: float = 0.0
    patience: int = 3
    verbose: bool = False
    mode: str = "min"
    strict: bool = True
    check_finite: bool = True
    stopping_threshold: Optional[float] = None
    divergence_threshold: Optional[float] = None
    check_on_train_epoch_end: Optional[bool] = None
    log_rank_zero_only: bool = False


@dataclass
class LearningRateMonitorConf:
    _target_: str = "taskfit.callbacks.LearningRateMonitor"
    logging_interval: Optional[str] = None
    log_momentum: bool = False
    log_weight_decay: bool = False
    log_key_prefix: Optional[str] = None
    names: str = "lightning"  # conf/callbacks/lr_monitor.yaml chooses "vitals" for the command


@dataclass
class ThroughputMonitorConf:
    _target_: str = "taskfit.callbacks.ThroughputMonitor"
    data_wait_warning: float = 0.3
    min_data_wait_s: float = 1.0
    verbose: bool = True
    stream: Any = None


@dataclass
class TensorBoardLoggerConf:
    _target_: str = "taskfit.callbacks.TensorBoardLogger"
    save_dir: Optional[str] = None
    name: Optional[str] = None
    version: Any = None
    log_graph: bool = False
    prefix: str = ""
    sub_dir: Optional[str] = None
    hparam_metrics: Any = None
    hparams: Optional[Dict[str, Any]] = None
    varying: List[str] = field(default_factory=list)
    tuned: List[str] = field(default_factory=list)
    histogram_every_n_steps: Optional[int] = None
    flush_secs: int = 120
    max_queue: int = 10
    filename_suffix: str = ""
    default_hp_metric: bool = False


@dataclass
class CSVLoggerConf:
    _target_: str = "taskfit.callbacks.CSVLogger"
    save_dir: Optional[str] = None
    name: Optional[str] = None
    version: Any = None
    prefix: str = ""
    flush_logs_every_n_steps: int = 100


@dataclass
class MLFlowLoggerConf:
    _target_: str = "taskfit.callbacks.MLFlowLogger"
    experiment_name: str = "taskfit"
    run_name: Optional[str] = None
    tracking_uri: Optional[str] = None
    tags: Optional[Dict[str, str]] = None
    save_dir: Optional[str] = None
    log_model: bool = False
    prefix: str = ""
    artifact_location: Optional[str] = None
    run_id: Optional[str] = None
    flush_secs: float = 10.0


@dataclass
class WandbLoggerConf:
    _target_: str = "taskfit.callbacks.WandbLogger"
    name: Optional[str] = None
    save_dir: Optional[str] = None
    version: Optional[str] = None
    offline: bool = False
    dir: Optional[str] = None
    id: Optional[str] = None
    project: Optional[str] = None
    log_model: bool = False
    prefix: str = ""
    tags: Optional[List[str]] = None
    config: Optional[Dict[str, Any]] = None
    entity: Optional[str] = None
    group: Optional[str] = None
    notes: Optional[str] = None
    job_type: Optional[str] = None


@dataclass
class ProgressBarConf:
    _target_: str = "taskfit.callbacks.ProgressBar"
    stream: Any = None
    leave: bool = True


@dataclass
class ModelSummaryConf:
    _target_: str = "taskfit.callbacks.ModelSummary"
    max_depth: int = 1


SCHEMAS: dict[str, type] = {
    "trainer": TrainerConf,
    "model_checkpoint": ModelCheckpointConf,
    "early_stopping": EarlyStoppingConf,
    "lr_monitor": LearningRateMonitorConf,
    "throughput": ThroughputMonitorConf,
    "tensorboard": TensorBoardLoggerConf,
    "csv": CSVLoggerConf,
    "mlflow": MLFlowLoggerConf,
    "wandb": WandbLoggerConf,
    "progress_bar": ProgressBarConf,
    "model_summary": ModelSummaryConf,
}
