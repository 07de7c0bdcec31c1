"""CSVLogger: ``metrics.csv`` (a column per key, a row per step that logged) and ``hparams.yaml`` in the run's
directory, for pandas, a spreadsheet or ``csv.DictReader``; no dependency beyond the standard library and PyYAML
(which hydra-core already needs).

The values of one step arrive in several ``on_log`` calls (the loss, the learning rate, the throughput, at an
epoch's last step also the epoch means and the fit's summary); they are merged into one row, written when the
step moves on and when the run ends. A row is appended
with one ``write`` and flushed, so a killed process leaves a valid file, at worst without its last step. When a
key appears that the header lacks (the first validation, a test after fit), the file is rewritten with the wider
header into a temporary file that replaces it atomically.
"""
from __future__ import annotations

import csv
import io
import os
from typing import Any

from .logger import Logger, check_writable

STEP = "step"  # the first column: the global step of the row


class CSVLogger(Logger):
    """Writes ``metrics.csv`` and ``hparams.yaml`` into ``trainer.log_dir`` (rank 0; one run directory per fit).

    ``metrics.csv`` starts with a ``step`` column (the global step), then one column per logged key in the order
    keys first appeared; a row leaves the keys not logged at its step empty. Read it with
    ``pandas.read_csv(path)`` or ``csv.DictReader``.
    """

    def __init__(self) -> None:
        self._path: str | None = None
        self._header: list[str] = []
        self._row: dict[str, float] = {}  # the current step's values, not written yet
        self._row_step = 0

    @property
    def metrics_path(self) -> str | None:
        """``<log_dir>/metrics.csv`` of the current run (None before one, and on ranks other than 0)."""
        return self._path

    # ---- the Logger interface ---------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        check_writable(trainer.log_dir, "CSVLogger")
        path = os.path.join(trainer.log_dir, "metrics.csv")
        if path != self._path:
            self._path, self._header, self._row = path, [], {}
            if os.path.isfile(path):  # a run directory written before (validate/test into a finished fit's)
                with open(path, newline="", encoding="utf-8") as fh:
                    self._header = next(csv.reader(fh), [])

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """``hparams.yaml``: the flattened hyperparameters (numbers, strings, bools, null; anything else as text)."""
        import yaml

        plain = {str(k): v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
                 for k, v in params.items()}
        _replace(os.path.join(self._run_dir, "hparams.yaml"),
                 yaml.safe_dump(plain, sort_keys=False, default_flow_style=False, allow_unicode=True))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._row and (step != self._row_step or not self._row.keys().isdisjoint(metrics)):
            self._write_row()  # a new step, or a key again at the same step (a validate after fit): a new row
        self._row_step = step
        self._row.update(metrics)

    def save(self) -> None:
        """Nothing to do: each step's row is written (and flushed) as soon as the next step logs."""

    def finalize(self, status: str) -> None:
        self._write_row()

    # ---- the file ---------------------------------------------------------------------------------------------
    def _write_row(self) -> None:
        if not self._row or self._path is None:
            return
        row: dict[str, Any] = {STEP: self._row_step, **self._row}
        self._row = {}
        new = [key for key in row if key not in self._header]
        if not new:
            with open(self._path, "a", newline="", encoding="utf-8") as fh:
                fh.write(_line([row.get(key, "") for key in self._header]))  # one write: a whole row or none
            return
        rows = []
        if os.path.isfile(self._path):
            with open(self._path, newline="", encoding="utf-8") as fh:
                rows = [r for r in csv.reader(fh)][1:]
        self._header = (self._header or [STEP]) + [key for key in new if key != STEP]
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(self._header)
        writer.writerows(r + [""] * (len(self._header) - len(r)) for r in rows)  # new columns empty in old rows
        writer.writerow([row.get(key, "") for key in self._header])
        _replace(self._path, out.getvalue())


def _line(values: list[Any]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(values)
    return out.getvalue()


def _replace(path: str, text: str) -> None:
    """Write ``path`` through a temporary file and an atomic rename: a crash leaves the old file or the new."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
