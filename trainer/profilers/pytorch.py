"""``Trainer(profiler="torch")``: the simple profiler's tables, plus ``torch.profiler`` over one
window of training batches (by default batches 2-4 of the fit, counted from 0: batch 0 waits, batch
1 warms up, 2-4 are recorded, the trace's ``ProfilerStep#2`` to ``#4``), each stage labelled once
per batch in the trace.

Every rank writes ``trace_rank<r>.json`` (Chrome trace format: open it in https://ui.perfetto.dev or
chrome://tracing) and ``operators_rank<r>.txt`` (``key_averages().table()``) into ``<run
dir>/profiler/``; rank 0 prints its operator table at the end of fit. One window only: once its
trace is ready, torch.profiler is stopped (not idled through more cycles) and the stages are no
longer labelled, so the rest of the fit runs at its normal speed (only the simple profiler's marks
remain).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..arguments import arguments_checked
from ..console import echo
from ..errors import MisconfigurationError
from .simple import SimpleProfiler


class PyTorchProfiler(SimpleProfiler):
    """``torch.profiler.profile`` over a window of steps, a trace and an operator table per rank.

    Args:
        dirpath: where the files go (None: ``<run dir>/profiler``).
        filename: also write the stage tables to ``<dirpath>/<filename>.txt``.
        export_to_chrome: write the Chrome/Perfetto trace of the window.
        row_limit: rows of the printed operator table (-1: all).
        sort_by_key: the operator table's order (None: ``"cuda_time_total"`` with CUDA, else
            ``"cpu_time_total"``).
        profiler_kwargs: passed to ``torch.profiler.profile`` (``schedule``, ``record_shapes``,
            ``profile_memory``, ``with_stack``, ``with_flops``, ``activities``); the default
            schedule is ``torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)``: one
            window, batches 2-4. Whatever the schedule, the profiler stops after its first window
            (the one trace file holds one window).
    """

    @arguments_checked(docs="docs/tuning.md")
    def __init__(
        self,
        dirpath: str | None = None,
        filename: str | None = None,
        export_to_chrome: bool = True,
        row_limit: int = 20,
        sort_by_key: str | None = None,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.export_to_chrome, self.row_limit, self.sort_by_key = (
            export_to_chrome,
            row_limit,
            sort_by_key,
        )
        self.profiler_kwargs = profiler_kwargs
        self.trace_path: str | None = None
        self.operators_path: str | None = None
        self._torch: Any = None
        self._range: Any = None
        self._events: Any = None
        self.window_done = False  # the window's trace is ready and torch.profiler is stopped

    def _install(self, trainer: Any, stage: str) -> None:
        super()._install(trainer, stage)
        self.folder = self.dirpath or os.path.join(trainer.log_dir, "profiler")
        rank = trainer.strategy.rank
        self.trace_path = (
            os.path.join(self.folder, f"trace_rank{rank}.json") if self.export_to_chrome else None
        )
        self.operators_path = os.path.join(self.folder, f"operators_rank{rank}.txt")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.strategy.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        options = {
            "activities": activities,
            "schedule": torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            **self.profiler_kwargs,
        }
        self._events, self._range, self.window_done = None, None, False
        try:
            self._torch = torch.profiler.profile(on_trace_ready=self._trace_ready, **options)
        except TypeError as exc:
            raise MisconfigurationError(
                "PyTorchProfiler(...) passes arguments "
                "torch.profiler.profile does not take: "
                f"{exc}.",
                "use torch.profiler.profile's arguments: schedule, activities, "
                "record_shapes, profile_memory, with_stack, with_flops.",
            ) from None
        self._torch.start()

    def _trace_ready(self, prof: Any) -> None:
        """The end of the recorded window: its operators (kept for the table) and its trace."""
        # a second window of a user's schedule (not reached: stopped after the first)
        if self._events is not None:
            return
        self._events = prof.key_averages()
        if self.trace_path is not None:
            os.makedirs(self.folder, exist_ok=True)
            prof.export_chrome_trace(self.trace_path)

    def on_stage(self, stage: str, hook: str, opened: bool) -> None:
        """Label each stage once in the trace; a training batch's end is a step of the torch
        profiler's schedule. After the window nothing: torch.profiler is stopped and no label is
        entered."""
        if self.window_done or not (opened or hook == "on_train_batch_end"):
            return
        self._close_range()
        if hook == "on_train_batch_end":
            self._torch.step()
            # the window's trace was written in this step: stop for good
            if self._events is not None:
                self._stop()
                return
        if stage != "fit end":
            self._range = torch.profiler.record_function(f"taskfit: {stage}")
            self._range.__enter__()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _stop(self) -> None:
        """Stop torch.profiler (a window still open is closed and its trace written); later steps
        pay nothing."""
        self._close_range()
        if not self.window_done:
            self.window_done = True
            self._torch.stop()

    def _finish(self) -> None:
        # a window still open at the end of fit (a fit shorter than the schedule) is written here
        self._stop()
        events = self._events if self._events is not None else []
        os.makedirs(self.folder, exist_ok=True)
        sort = self.sort_by_key or (
            "cuda_time_total" if self._trainer.strategy.device.type == "cuda" else "cpu_time_total"
        )
        table = (
            events.table(sort_by=sort, row_limit=-1)
            if len(events)
            else "(no step was inside the window)"
        )
        with open(self.operators_path, "w") as fh:
            fh.write(table + "\n")
        super()._finish()
        if self._trainer.is_main:
            shown = events.table(sort_by=sort, row_limit=self.row_limit) if len(events) else table
            echo(
                f"torch.profiler, {sort} (rank 0; every rank's table and trace in "
                f"{self.folder}):\n{shown}"
                + (
                    f"\ntrace: {self.trace_path}  (open in https://ui.perfetto.dev)"
                    if self.trace_path
                    else ""
                ),
                name="taskfit.profiler",
            )

    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        if self._torch is not None and self._installed:
            self._stop()
        super().on_exception(trainer, task, exception)
