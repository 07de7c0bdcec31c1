"""What a run shows on the console, also handed to Python ``logging``: the ``taskfit`` logger.

Every line taskfit shows (the model summary, the epoch lines, EarlyStopping's and
ThroughputMonitor's reports, "Resumed from ...", preemption messages, the ``taskfit`` command's
report, sweep summary and errors) goes through :func:`echo`: it is printed exactly as before
(``print(message, file=stream, flush=True)``) *and* logged as one record of the ``taskfit`` logger
(``taskfit.<part>`` children), which does not propagate to the root logger, so a root console
handler never shows a line twice. Whatever handler is attached to ``taskfit`` gets the lines: the
``taskfit`` command attaches Hydra's job log file (``<run dir>/taskfit.log``, see
``conf/hydra/job_logging/taskfit.yaml``); from Python,
``logging.getLogger("taskfit").addHandler(...)``.

Under ddp started by the command, rank 0 is a new process without Hydra's logging: the command names
its log file in ``TASKFIT_LOG_FILE`` (and its format in ``TASKFIT_LOG_FORMAT``), and the first line
a process without that handler echoes opens the file in append mode, so rank 0's lines land in the
same ``taskfit.log``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import site
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

LOGGER_NAME = "taskfit"
LOG_FILE_ENV, LOG_FORMAT_ENV = "TASKFIT_LOG_FILE", "TASKFIT_LOG_FORMAT"
# Hydra's default job-log format (hydra/job_logging/default.yaml).
DEFAULT_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"

logger = logging.getLogger(LOGGER_NAME)
# the terminal has the line already (printed); a root console handler must not repeat it
logger.propagate = False
# no "No handlers could be found" and no lastResort copy on stderr
logger.addHandler(logging.NullHandler())
logger.setLevel(logging.INFO)


def echo(
    message: str,
    *,
    stream: TextIO | None = None,
    level: int = logging.INFO,
    name: str | None = None,
    terminal: bool = True,
) -> None:
    """``message`` and a newline to ``stream or sys.stdout`` in one write, flushed, and the same
    text as a ``taskfit`` log record.

    Args:
        message: the text (several lines are one record).
        stream: where the terminal copy goes (default ``sys.stdout``, looked up now: redirections
            apply).
        level: the record's level (``logging.WARNING`` for warnings, ``logging.ERROR`` for errors).
        name: the logger, a child of ``taskfit`` (``"taskfit.progress"``); default ``taskfit``.
        terminal: False: the log record only (the progress bar already showed the line).
    """
    # one write of the line and its newline: ddp ranks sharing a stream never interleave mid-line
    if terminal:
        out = stream or sys.stdout
        out.write(f"{message}\n")
        out.flush()
    _follow_parent_log()
    logging.getLogger(name or LOGGER_NAME).log(level, message)


def _follow_parent_log() -> None:
    """In a process started by the ``taskfit`` command (a ddp worker), append to the command's log
    file too."""
    path = os.environ.get(LOG_FILE_ENV)
    if not path or any(os.path.abspath(getattr(h, "baseFilename", "")) == os.path.abspath(path)
                       for h in logger.handlers):
        return
    # the run directory is gone: nothing to add to
    if not os.path.isdir(os.path.dirname(path) or "."):
        return
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(os.environ.get(LOG_FORMAT_ENV) or DEFAULT_FORMAT))
    logger.addHandler(handler)


def log_file() -> tuple[str, str] | None:
    """The file (and its format) the ``taskfit`` logger writes to in this process, if any: what ddp
    workers started from here should append to."""
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            fmt = getattr(handler.formatter, "_fmt", None) or DEFAULT_FORMAT
            return handler.baseFilename, fmt
    return None


@contextlib.contextmanager
def shared_with_workers() -> Iterator[None]:
    """While inside: processes started from here (ddp workers) append their lines to this process's
    log file."""
    found = log_file()
    saved = {key: os.environ.get(key) for key in (LOG_FILE_ENV, LOG_FORMAT_ENV)}
    if found is not None:
        os.environ[LOG_FILE_ENV], os.environ[LOG_FORMAT_ENV] = found
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the calling function that names the user's
    line: the first caller that is neither taskfit nor installed code (the standard library,
    site-packages, a console script), however many of taskfit's frames lie between (they differ by
    path: Trainer.fit, a strategy's launch). Without such a caller (a spawned ddp worker, the
    ``taskfit`` command), a level past the stack: Python then names no file (``sys:1``) and prints
    no source line under the message."""
    installed = tuple(os.path.join(os.path.abspath(p), "") for p in
                      {sys.prefix, sys.base_prefix, sys.exec_prefix, site.getuserbase()}
                      if p and os.path.abspath(p) != os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name, path = frame.f_globals.get("__name__") or "", frame.f_code.co_filename
        ours = name == LOGGER_NAME or name.startswith(LOGGER_NAME + ".")
        if not ours and not path.startswith(("<", *installed)):
            return level
        frame, level = frame.f_back, level + 1
    return level


@contextlib.contextmanager
def warnings_logged() -> Iterator[None]:
    """While inside: each warning is shown as Python shows it (stderr) and also logged to
    ``taskfit.warnings``; one that names no caller's line (:func:`user_stacklevel` found none) as
    ``UserWarning: message``."""
    shown = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if (filename, lineno) == ("sys", 1):  # (not "sys:1: UserWarning: ...")
            text = f"{category.__name__}: {message}"
            print(text, file=file or sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)
            text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
        logging.getLogger(f"{LOGGER_NAME}.warnings").warning(text)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = shown


def results_table(title: str, metrics: dict[str, float]) -> str:
    """What ``trainer.test()``/``validate()`` print: the pass's values, one per line, sorted::

        Test results
          test/acc    0.9480
          test/loss   0.2324
    """
    width = max(len(key) for key in metrics)
    rows = [f"  {key:<{width}}  {value:.4g}" for key, value in sorted(metrics.items())]
    return "\n".join([f"{title} results", *rows])


def describe(error: BaseException) -> str:
    """An error as the ``taskfit`` command shows it: ``ClassName: message`` (with its HINT line)."""
    return f"{type(error).__name__}: {error}"


__all__ = [
    "echo",
    "logger",
    "log_file",
    "shared_with_workers",
    "warnings_logged",
    "describe",
    "results_table",
    "LOGGER_NAME",
]

