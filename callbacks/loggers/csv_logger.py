"""CSVLogger: ``metrics.csv`` (a column per key, a row per step that logged) and ``hparams.yaml`` in
the run's directory, for pandas, a spreadsheet or ``csv.DictReader``; no dependency beyond the
standard library and PyYAML (which hydra-core already needs).

The values of one step arrive in several ``on_log`` calls (the loss, the learning rate, the
throughput, at an epoch's last step also the epoch means and the fit's summary); they are merged
into one row, written when the step moves on, at every epoch end, before a checkpoint records the
run, and when the run ends (values of a step that arrive after its row was written are merged into
it). A row is appended with one ``write`` and flushed, so a killed process leaves a valid file, at
worst without its last step. When a key appears that the header lacks (the first validation, a test
after fit), the file is rewritten with the wider header into a temporary file that replaces it
atomically; so is it when a resumed fit drops the rows of the steps it redoes. A resumed fit's
values at the checkpoint's own step (an epoch's last step: the epoch means again) merge into that
step's row, so every step keeps one row.

A ``metrics.csv`` found damaged when a run (or a resume) opens it (not UTF-8, NUL bytes, its
header lost, a row cut short or garbled) never stops training: the file is kept aside as
``metrics.csv.damaged`` (``-1``, ``-2``... if taken), ``metrics.csv`` continues from its intact
beginning, and a warning says so (:func:`_read_checked`).
"""
from __future__ import annotations

import csv
import io
import os
import warnings
from typing import Any

import torch

from ...arguments import arguments_checked
from ...errors import MisconfigurationError
from ...logs.outputs import check_writable, hparams_dict, replace_file, write_hparams_yaml
from .logger import PREFIX_SEPARATOR, Logger

# the first columns: the global step of the row, and the epoch it belongs to
STEP, EPOCH = "step", "epoch"


class CSVLogger(Logger):
    """Writes ``metrics.csv`` and ``hparams.yaml`` into its run directory (rank 0; one per fit:
    ``<save_dir>/<name>/version_N``, as Lightning's CSVLogger).

    ``metrics.csv`` starts with a ``step`` column (the global step) and an ``epoch`` column, then
    one column per logged key in the order keys first appeared; a row leaves the keys not logged at
    its step empty. Read it with ``pandas.read_csv(path)`` or ``csv.DictReader``.

    Outside a run (Lightning's use without a Trainer: ``CSVLogger("logs").log_metrics({...})``)
    there is no ``epoch`` column, and the rows are written every ``flush_logs_every_n_steps``
    steps, at :meth:`save` and at :meth:`finalize`, as Lightning's.

    Args:
        save_dir: the folder of the runs (None: ``Trainer(default_root_dir=...)``).
        name: a folder below ``save_dir`` (None: none; Lightning's default is ``"lightning_logs"``).
        version: ``3`` writes ``version_3``; a string names the folder; None: the next free
            ``version_N``.
        prefix: put ``<prefix>-`` before every column name.
        flush_logs_every_n_steps: outside a run, write the rows when a step ``s`` with ``(s + 1)``
            a multiple of it is logged (Lightning's); in a run each step's row is written as soon
            as the step is complete, which is sooner.
    """

    @arguments_checked(docs="docs/logging.md")
    def __init__(
        self,
        save_dir: str | os.PathLike | None = None,
        name: str | None = None,
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        self._where(save_dir, name, version, prefix)
        n = flush_logs_every_n_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise MisconfigurationError(f"CSVLogger(flush_logs_every_n_steps={n!r}) is not valid.",
                                        "pass a positive number of steps (Lightning's default is "
                                        "100).")
        self.flush_logs_every_n_steps = n
        # a run's rows have an epoch column; a standalone file (no Trainer) has none, as Lightning's
        self._epochs = True
        self._writer: ExperimentWriter | None = None
        self._path: str | None = None
        self._header: list[str] = []
        self._row: dict[str, Any] = {}  # the current step's values, not written yet
        self._row_step = 0
        self._epoch = 0  # trainer.state.epoch when the current row's values were logged
        # the last row, written before its step was over (merge into it)
        self._written: dict[str, Any] | None = None
        # a resumed fit: the checkpoint's step, whose row takes its values again
        self._redo_step: int | None = None

    @property
    def metrics_path(self) -> str | None:
        """``<log_dir>/metrics.csv`` of the current run (None before one, and on ranks other than
        0)."""
        return self._path

    @property
    def experiment(self) -> ExperimentWriter | None:
        """Lightning's ``ExperimentWriter``: the rows not yet written (``metrics``), the file
        (``metrics_file_path``), ``log_metrics``/``save``/``log_hparams``. Outside a run, with a
        ``save_dir``, it opens the run directory (Lightning's use without a Trainer); None on ranks
        other than 0."""
        if self._path is None and not self._open_standalone_file():
            return None
        if self._writer is None:
            self._writer = ExperimentWriter(self)
        return self._writer

    def _open_standalone_file(self) -> bool:
        """Open ``metrics.csv`` of a run outside a Trainer (no epoch column); False: none now."""
        if not self.open_standalone():
            return False
        self._path, self._epochs = os.path.join(self._run_dir, "metrics.csv"), False
        if os.path.isfile(self._path):
            self._header = _read_checked(self._path)[0]
        return True

    # ---- the Logger interface --------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        check_writable(self.log_dir, "CSVLogger")
        path = os.path.join(self.log_dir, "metrics.csv")
        self._epochs = True
        if path != self._path:
            self._path, self._header, self._row, self._written, self._redo_step = (
                path,
                [],
                {},
                None,
                None,
            )
            # a run directory written before (validate/test into a finished fit's)
            if os.path.isfile(path):
                header, rows = _read_checked(path)
                self._header = header
                # the steps after the checkpoint's were written by the killed run: redone now
                if self.resuming:
                    step = trainer.state.log_step
                    kept = [r for r in rows if not r or not r[0].isdigit() or int(r[0]) <= step]
                    if len(kept) != len(rows):
                        replace_file(path, _table(header, kept))
                    last = kept[-1] if kept else []
                    if last and last[0].isdigit() and int(last[0]) == step:
                        # The checkpoint's step has its row already; what the resumed fit logs at
                        # that step again (an epoch's last step: the epoch means, validation) merges
                        # into it, a value replacing the killed run's: the step keeps one row.
                        self._written = {k: v for k, v in zip(header, last) if v != ""}
                        self._written[STEP], self._redo_step = step, step

    def log_hyperparams(self, params: dict[str, Any] | Any = None) -> None:
        """``hparams.yaml``: the flattened hyperparameters (numbers, strings, bools, null; anything
        else as text); a dict, an ``argparse.Namespace`` or None (an empty file), as Lightning
        takes them (outside a run too)."""
        if self._run_dir is None and not self.open_standalone():
            return
        write_hparams_yaml(self._run_dir, hparams_dict(params))

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Values of ``step`` into the row being built (outside a run too: Lightning's ``step=None``
        is the row after the last; tensors are written as numbers)."""
        # no run: Lightning's use without a Trainer (CSVLogger("logs").log_metrics(...))
        if self._path is None and not self._open_standalone_file():
            return
        if self._for is None and self.prefix:
            metrics = {f"{self.prefix}{PREFIX_SEPARATOR}{k}": v for k, v in metrics.items()}
        step = self._add(metrics, step)
        # outside a run rows wait as Lightning's do (in a run they are written as steps complete)
        if self._for is None and (step + 1) % self.flush_logs_every_n_steps == 0:
            self.save()

    def _add(self, metrics: dict[str, Any], step: int | None) -> int:
        """``metrics`` into the row of ``step`` (None: the row after the last); returns the step."""
        metrics = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        if step is None:
            step = self._row_step + 1 if self._row or self._written is not None else 0
        if self._row and (step != self._row_step or not self._row.keys().isdisjoint(metrics)):
            # a new step, or a key again at the same step (a validate after fit): a new row
            self._write_row()
        # its row is on disk: more values of that step merge in
        if not self._row and self._written is not None:
            if self._written[STEP] == step and (
                step == self._redo_step or self._written.keys().isdisjoint(metrics)
            ):
                self._row, self._written, self._row_step = dict(self._written), None, step
                del self._row[STEP]
                self._row.update(metrics)
                self._write_row(replace_last=True, keep=True)
                return step
            self._written = None
        self._row_step = step
        self._row.update(metrics)
        return step

    def on_log(self, trainer: Any, task: Any, metrics: dict[str, float]) -> None:
        self._epoch = trainer.state.epoch  # the row's epoch column
        super().on_log(trainer, task, metrics)

    def save(self) -> None:
        """Write the pending row (every epoch end, and before a checkpoint records the run): what a
        checkpoint covers is on disk; a later value of the same step merges into the row."""
        self._write_row(keep=True)

    def finalize(self, status: str = "success") -> None:
        self._write_row()
        self._written = self._redo_step = None  # a test after fit starts a row of its own

    # ---- the file --------------------------------------------------------------------------------
    def _write_row(self, replace_last: bool = False, keep: bool = False) -> None:
        if not self._row or self._path is None:
            return
        epoch = self._row.pop(EPOCH, self._epoch if self._epochs else None)
        row: dict[str, Any] = {
            STEP: self._row_step,
            **({} if epoch is None else {EPOCH: epoch}),
            **self._row,
        }
        self._row = {}
        self._written = row if keep else None
        new = [key for key in row if key not in self._header]
        if not new and not replace_last:
            with open(self._path, "a", newline="", encoding="utf-8") as fh:
                # one write: a whole row or none
                fh.write(_line([row.get(key, "") for key in self._header]))
            return
        rows = _read_checked(self._path)[1] if os.path.isfile(self._path) else []
        if replace_last and rows:
            rows.pop()
        self._header = (self._header or ([STEP, EPOCH] if EPOCH in row else [STEP])) + [
            key for key in new if key not in (STEP, EPOCH)
        ]
        replace_file(
            self._path,
            _table(self._header, rows + [[str(row.get(key, "")) for key in self._header]]),
        )


class ExperimentWriter:
    """``CSVLogger.experiment``, as Lightning's ``ExperimentWriter``: its file names, the rows not
    written yet, and its calls, which go through the logger (one writer of ``metrics.csv``)."""

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, logger: CSVLogger) -> None:
        self._logger = logger

    @property
    def log_dir(self) -> str | None:
        """The run directory (the logger's ``log_dir``)."""
        return self._logger.log_dir

    @property
    def metrics_file_path(self) -> str | None:
        """``<log_dir>/metrics.csv``."""
        return self._logger.metrics_path

    @property
    def metrics_keys(self) -> list[str]:
        """The columns of ``metrics.csv`` so far."""
        return list(self._logger._header)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The rows logged and not written yet (``step`` included): empty after :meth:`save`."""
        row = self._logger._row
        return [{**row, STEP: self._logger._row_step}] if row else []

    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        """Values of ``step`` (None: the row after the last), written at the next :meth:`save`."""
        self._logger._add(metrics_dict, step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """``hparams.yaml`` (the logger's ``log_hyperparams``)."""
        self._logger.log_hyperparams(params)

    def save(self) -> None:
        """Write the rows logged so far."""
        self._logger.save()


def _read_checked(path: str) -> tuple[list[str], list[list[str]]]:
    """``metrics.csv``'s header and rows. A damaged file is moved aside and replaced by its intact
    beginning (the rows before the damage; none without a header), with a warning naming both:
    a resume over it goes on."""
    with open(path, "rb") as fh:
        data = fh.read()
    header, rows, damage = _intact_beginning(data)
    if damage is None:
        return header, rows
    aside = _free_name(f"{path}.damaged")
    os.replace(path, aside)
    if header:
        replace_file(path, _table(header, rows))
    kept = f"continues from its first {len(rows)} rows" if header else "starts anew"
    warnings.warn(
        f"{path} is damaged ({damage}): it is kept as {aside}, and {path} {kept}; training goes "
        f"on. HINT: nothing to do for the run; the rows after the damage are only in {aside} (a "
        "disk error, a copy cut short or a tool writing into the file damaged it).",
        UserWarning, stacklevel=2)
    return header, rows


def _intact_beginning(data: bytes) -> tuple[list[str], list[list[str]], str | None]:
    """The header and rows of ``data`` up to its first damage, and what that damage is (None:
    none). A row of this logger has as many fields as the header, and whole numbers for its
    step and epoch; every line ends with a line end."""
    try:
        text, damage = data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        text = data[:exc.start].decode("utf-8")
        damage = f"byte {exc.start} (line {text.count(chr(10)) + 1}) is not UTF-8"
    if "\0" in text:
        text = text[:text.index("\0")]
        damage = damage or f"a NUL byte on line {text.count(chr(10)) + 1}"
    if not text.endswith("\n") and text:
        torn = text.splitlines()[-1][:40]
        damage = damage or f"its last line is cut short (no line end): {torn!r}"
        text = text[:text.rfind("\n") + 1]
    lines = list(csv.reader(io.StringIO(text)))
    header = lines[0] if lines else []
    if header and (header[0] != STEP or len(set(header)) != len(header) or "" in header):
        return [], [], damage or f"its first line is not a header (step,epoch,...): {text[:40]!r}"
    # (a file written outside a run has no epoch column)
    epochs = header[1:2] == [EPOCH]
    for i, row in enumerate(lines[1:]):
        if len(row) != len(header) or not (row[0].isdigit() and (not epochs or row[1].isdigit())):
            why = f"line {i + 2} has {len(row)} fields, not {len(header)}"
            if len(row) == len(header):
                why = f"line {i + 2} has no whole step and epoch: {row[:2]}"
            return header, lines[1:i + 1], damage or why
    return header, lines[1:], damage


def _free_name(path: str) -> str:
    """``path``, or ``path-1``, ``path-2``... the first that does not exist."""
    n, name = 0, path
    while os.path.lexists(name):
        n += 1
        name = f"{path}-{n}"
    return name


def _table(header: list[str], rows: list[list[str]]) -> str:
    """The whole file: ``header``, then ``rows`` (older rows get the new columns empty)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(r + [""] * (len(header) - len(r)) for r in rows)
    return out.getvalue()


def _line(values: list[Any]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(values)
    return out.getvalue()
