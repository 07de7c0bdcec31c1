"""The structured configs of the ``taskfit`` command: one dataclass per configurable class (the Trainer and the
built-in callbacks and loggers), registered in Hydra's ConfigStore as ``taskfit_<name>`` by :func:`trainer.config.
register`. The yaml files of ``conf/trainer`` and ``conf/callbacks`` start from them (``defaults:
[/taskfit_trainer@_here_]``), so Hydra rejects ``trainer.max_epoch=3`` or ``trainer.max_epochs=abc`` while composing
the config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


# ---- schemas ------------------------------------------------------------------------------------------
# One field per argument of the class named in _target_, with the same default. Arguments that accept a union
# OmegaConf cannot express (``int | float``, ``int | str | list``) are ``Any`` here; check_targets checks them
# against the real annotation. tests/test_config.py keeps these in step with the signatures.
@dataclass
class TrainerConf:
    """``trainer.*``: the keyword arguments of :class:`taskfit.Trainer` (except ``callbacks`` and ``config``,
    which the command builds)."""

    _target_: str = "taskfit.Trainer"
    max_epochs: Optional[int] = None
    min_epochs: Optional[int] = None
    max_steps: Optional[int] = None
    min_steps: Optional[int] = None
    accelerator: str = "auto"
    devices: Any = "auto"
    strategy: Any = "auto"
    precision: str = "32"
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    limit_train_batches: Any = 1.0
    limit_val_batches: Any = 1.0
    limit_test_batches: Any = 1.0
    limit_predict_batches: Any = 1.0
    val_check_interval: Any = 1.0
    check_val_every_n_epoch: Optional[int] = 1
    num_sanity_val_steps: int = 2
    log_every_n_steps: int = 50
    fast_dev_run: Any = False
    overfit_batches: Any = 0
    deterministic: bool = False
    default_root_dir: Optional[str] = None
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    enable_checkpointing: bool = True
    logger: bool = True
    nonfinite_loss: str = "raise"
    seed: Optional[int] = None
    compile: bool = False
    channels_last: bool = False
    preempt_signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    preempt_exit_code: Optional[int] = None
    requeue: Optional[bool] = None
    profiler: Optional[str] = None
    activation_checkpointing: Any = None


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


@dataclass
class CSVLoggerConf:
    _target_: str = "taskfit.callbacks.CSVLogger"
    save_dir: Optional[str] = None
    name: Optional[str] = None
    version: Any = None
    prefix: str = ""


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
class ProgressBarConf:
    _target_: str = "taskfit.callbacks.ProgressBar"
    stream: Any = None
    leave: bool = True


@dataclass
class ModelSummaryConf:
    _target_: str = "taskfit.callbacks.ModelSummary"
    max_depth: int = 1


SCHEMAS: dict[str, type] = {"trainer": TrainerConf, "model_checkpoint": ModelCheckpointConf,
                            "early_stopping": EarlyStoppingConf, "lr_monitor": LearningRateMonitorConf,
                            "throughput": ThroughputMonitorConf, "tensorboard": TensorBoardLoggerConf,
                            "csv": CSVLoggerConf, "mlflow": MLFlowLoggerConf,
                            "progress_bar": ProgressBarConf, "model_summary": ModelSummaryConf}
