"""The HParams plugin's records, as TensorBoard's HParams tab shows them when it opens
(TensorBoardLogger writes them).

What the tab does with them (tensorboard 2.x): the hyperparameter columns are those of one run's
experiment record, sorted by name, those marked ``differs`` first, and the first five are ticked
(always five, or all when fewer); the metric columns come in the order written, and the first five
are ticked; a metric's value is the last scalar of its tag in the run. So: a sweep lists only the
keys it varies (marked ``differs``: ticked; its constants would fill the other ticks and push the
metrics off-screen), a single run marks the keys its user tuned (the command line's, the
optimizer's) so that they come first, the monitored metric and the other validation metrics come
first, and every metric is followed by its best value. The best values are scalars under ``BEST``
(``~best/val/loss``): ``~`` sorts after every letter, so in the Scalars and Time Series tabs they
are the last group (collapsed as the tabs open), never in front of the curves; HParams shows them as
``best val/loss``.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

BEST = "~best/"  # the tag prefix of a metric's best value


def loggable(values: Mapping[str, Any]) -> dict[str, Any]:
    """HParams accepts numbers, strings and bools; anything else (None, lists...) is shown as
    text."""
    return {
        str(k): v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()
    }


def tuned_keys(hparams: Mapping[str, Any], command_line: Iterable[str]) -> list[str]:
    """The hyperparameters a user tunes, ticked first in a single run's HParams: the keys the
    command line set and the optimizer's (``task.optimizer``, ``task.optimizer.lr``...; any
    ``*.optimizer`` node)."""
    given = set(command_line)
    return [key for key in hparams if key in given or "optimizer" in key.split(".")]


def metric_order(
    keys: Iterable[str], monitors: Sequence[str], validation: Iterable[str] = ()
) -> list[str]:
    """The monitored keys first (in ``monitors``' order), then ``val/loss``, the other validation
    values (``val/*`` and the keys in ``validation``: named as logged, e.g. ``val_acc``),
    ``train/*``, the rest: the first columns of the table are what the run is judged by."""
    validation = set(validation)

    def rank(key: str) -> tuple[int, int, str]:
        if key in monitors:
            return 0, monitors.index(key), key
        group = 1 if key == "val/loss" else 2 if key.startswith("val/") or key in validation else \
            3 if key.startswith("train/") else 4
        return group, 0, key

    return sorted(keys, key=rank)


def _summary(tag: str, content: Any) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import metadata

    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString()
        )
    )
    return Summary(value=[Summary.Value(tag=tag, metadata=meta)])


def session_start(hparams: Mapping[str, Any]) -> Any:
    """The run's hyperparameter values (``loggable`` ones)."""
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for key, value in hparams.items():
        if isinstance(value, bool):
            info.hparams[key].bool_value = value
        elif isinstance(value, (int, float)):
            info.hparams[key].number_value = value
        else:
            info.hparams[key].string_value = str(value)
    content = plugin_data_pb2.HParamsPluginData(
        session_start_info=info, version=metadata.PLUGIN_DATA_VERSION
    )
    return _summary(metadata.SESSION_START_INFO_TAG, content)


def experiment(
    hparams: Mapping[str, Any],
    metrics: Sequence[tuple[str, str]],
    varying: Iterable[str] = (),
    tuned: Iterable[str] = (),
) -> Any:
    """The columns: the hyperparameters (a sweep's ``varying`` ones only; else all, the ``tuned``
    ones marked ``differs``: listed first and ticked) and each metric as ``(tag, shown name)``, in
    this order."""
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    varying = [key for key in varying if key in hparams]
    first = set(varying or tuned)
    infos = []
    for key, value in hparams.items():
        if varying and key not in first:
            continue
        kind = "DATA_TYPE_BOOL" if isinstance(value, bool) else "DATA_TYPE_FLOAT64" \
            if isinstance(value, (int, float)) else "DATA_TYPE_STRING"
        infos.append(
            api_pb2.HParamInfo(name=key, type=api_pb2.DataType.Value(kind), differs=key in first)
        )
    columns = [
        api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag), display_name=shown)
        for tag, shown in metrics
    ]
    exp = api_pb2.Experiment(
        hparam_infos=infos, metric_infos=columns, time_created_secs=time.time()
    )
    content = plugin_data_pb2.HParamsPluginData(
        experiment=exp, version=metadata.PLUGIN_DATA_VERSION
    )
    return _summary(metadata.EXPERIMENT_TAG, content)


def session_end(status: str) -> Any:
    """The HParams SessionEndInfo summary with ``status`` (torch's ``hparams()`` always writes
    SUCCESS)."""
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    info = plugin_data_pb2.SessionEndInfo(
        status=api_pb2.Status.Value(status), end_time_secs=time.time()
    )
    content = plugin_data_pb2.HParamsPluginData(
        session_end_info=info, version=metadata.PLUGIN_DATA_VERSION
    )
    return _summary(metadata.SESSION_END_INFO_TAG, content)


def config_text(config: Mapping[str, Any]) -> str:
    """The resolved config as YAML in a Markdown code block (TensorBoard's TEXT tab renders
    Markdown)."""
    import yaml

    def plain(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)

    body = yaml.safe_dump(plain(config), sort_keys=False, default_flow_style=False).rstrip("\n")
    # an indented block: Markdown's code block
    return "\n".join("    " + line for line in body.splitlines())
