"""Profilers: where the time of a fit goes. ``Trainer(profiler="simple")`` prints a table per stage
(data wait, forward+loss, backward, optimizer step, validation, checkpoint...) and per callback hook
at the end of fit; ``profiler="torch"`` also records a window of steps with ``torch.profiler`` (a
Chrome/Perfetto trace per rank and the operator table). docs/tuning.md, "The profiler", has the
tables and what they cost.

Built on the hook table, not in the loop: at the start of fit the profiler puts a *mark* at the head
of each hook list that bounds a stage (``on_train_batch_start``, ``on_before_backward``,
``on_after_backward``, ``on_validation_start``...) and wraps every other callback's hook in a timer.
A mark closes the stage that was running (its time, less the hooks that ran inside it) and opens the
next. Nothing is added when the profiler is off (trainer/profiling.py): the loop pays nothing.
``profile(name)`` times a block of your own code (Lightning's ``trainer.profiler.profile("...")``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

from ..arguments import arguments_checked
from ..callbacks import Callback
from ..console import echo

clock = time.perf_counter
# The stage that runs after a hook list (its mark is the list's head). A hook not named here opens
# no stage.
NEXT_STAGE = {
    "on_fit_start": "loop",
    "on_sanity_check_start": "sanity check",
    "on_sanity_check_end": "loop",
    "on_train_start": "loop",
    "on_train_epoch_start": "loop",
    "on_train_epoch_end": "loop",
    "on_train_batch_start": "forward+loss",
    "on_before_zero_grad": "forward+loss",
    "on_before_backward": "backward",
    "on_after_backward": "optimizer step",
    "on_before_optimizer_step": "optimizer step",
    "on_train_batch_end": "loop",
    "on_validation_start": "validation",
    "on_validation_end": "loop",
    "on_train_end": "fit end",
    "on_fit_end": "fit end",
}
STAGES = (
    "setup",
    "imports",
    "data wait",
    "forward+loss",
    "backward",
    "optimizer step",
    "validation",
    "sanity check",
    # the table's order ("loop": the rest; "profiler": the marks' and timers' own time,
    # measured)
    "checkpoint",
    "callback hooks",
    "fit end",
    "loop",
    "profiler",
)


class SimpleProfiler(Callback):
    """Times every stage of the fit and every callback hook; prints both tables at the end of fit
    (rank 0).

    Args:
        dirpath: where ``filename`` goes (None: the run directory, ``trainer.log_dir``).
        filename: also write the report to ``<dirpath>/<filename>.txt`` (None: print only).
        extended: also list the hooks, one row per callback and hook.
    """

    order = -10**6  # first: it installs its marks before any other callback's hook runs

    @arguments_checked(docs="docs/tuning.md")
    def __init__(
        self, dirpath: str | None = None, filename: str | None = None, extended: bool = True
    ) -> None:
        self.dirpath, self.filename, self.extended = dirpath, filename, extended
        self.stages: dict[str, list[float]] = {}  # stage -> [times opened, seconds]
        # "Callback.hook" -> [calls, seconds of its own]
        self.hook_times: dict[str, list[float]] = {}
        self.actions: dict[str, list[float]] = {}  # profile(name) blocks -> [calls, seconds]
        self.fit_seconds = 0.0
        self.report = ""
        # the outermost first imports: module -> seconds (nested ones included)
        self.imports: dict[str, float] = {}
        self._imports: _ImportClock | None = None
        self._installed = False

    # ---- installing the marks --------------------------------------------------------------------
    def setup(self, trainer: Any, task: Any, stage: str) -> None:
        if stage == "fit":
            self._install(trainer, "setup")

    def on_fit_start(self, trainer: Any, task: Any) -> None:
        # a Trainer without the setup hook: from here on (the other on_fit_start hooks
        if not self._installed:
            self._install(trainer, "callback hooks")  # run untimed, as "callback hooks")

    def _install(self, trainer: Any, stage: str) -> None:
        self.stages, self.hook_times, self.actions = {}, {}, {}
        self._trainer, self._installed, self._start = trainer, True, clock()
        self._stage, self._opened, self._inside, self._depth, self._children = (
            stage,
            self._start,
            0.0,
            0,
            [0.0],
        )
        self._waited = trainer.state.data_wait_s  # the loop's running total of DataLoader time
        self._own = 0.0  # the profiler's own time
        self.imports = {}
        self._stage_count(stage)
        # first imports of a module (the first fit of a process: tensorboard,
        self._imports = _ImportClock(self)
        # torch._dynamo...) are a row of their own, out of the stage or hook that did them
        self._imports.install()
        # without them backward is in forward+loss
        self._backward_hooks = "on_before_backward" in trainer.hooks
        end = "teardown" if "teardown" in trainer.hooks else "on_fit_end"  # the last hook of a fit

        def timed(hook: str, fns: list[Callable[..., Any]]) -> list[Callable[..., Any]]:
            marked: list[Callable[..., Any]] = [fn if getattr(fn, "__self__", None) is self else
                                                _Timed(self, fn, hook, trainer.task) for fn in fns]
            if hook in NEXT_STAGE:
                marked.insert(0, _Mark(self, hook))
            if hook == end:
                marked.append(_Mark(self, "end"))
            return marked

        trainer.run.rewrite_hooks(timed)

    def _stage_count(self, stage: str) -> None:
        self.stages.setdefault(stage, [0, 0.0])[0] += 1

    # ---- the clock -------------------------------------------------------------------------------
    def mark(self, hook: str) -> None:
        """The head of ``hook``'s list: close the running stage (less the hooks inside it), open the
        next."""
        # a hook list run inside another hook (a save inside ModelCheckpoint's
        if self._depth or not self._installed:
            return  # hook), or after the report
        now = clock()
        spent = now - self._opened - self._inside
        # the DataLoader's time, measured by the loop, comes out of "loop"
        if hook == "on_train_batch_start":
            waited = self._trainer.state.data_wait_s - self._waited
            self._waited += waited
            self._add("data wait", waited, count=True)
            spent -= waited
        self._add(self._stage, spent)
        self._inside = 0.0
        if hook == "end":
            self._add("profiler", self._own, count=True)
            self.fit_seconds = now - self._start
            self._stage = ""
            self._finish()
            return
        stage = NEXT_STAGE[hook]
        if stage == "forward+loss" and not self._backward_hooks:
            stage = "forward+loss+backward"
        opened = stage != self._stage or hook in ("on_train_batch_start", "on_validation_start")
        # a mark inside the running stage (on_before_zero_grad in forward+loss,
        # on_before_optimizer_step
        if opened:
            # in optimizer step) neither counts it again nor labels it again
            self._stage_count(stage)
        self.on_stage(stage, hook, opened)
        self._stage, self._opened = stage, clock()
        self._own += self._opened - now

    def on_stage(self, stage: str, hook: str, opened: bool) -> None:
        """A mark: ``stage`` runs after ``hook``'s list; ``opened``: it is a new stage (counted
        once), not a mark inside the running one. The torch profiler labels each opened stage in its
        trace."""

    def _time_entry(self, fn: Callable[..., Any], args: tuple[Any, ...],
                    record: Callable[[float, float], None]) -> Any:
        """``fn(*args)`` timed as one entry of the tables (a hook, an import): ``record(own,
        elapsed)`` gets its time without the entries nested in it, and with them; the bookkeeping
        around the call is the profiler's own."""
        if not self._installed:
            return fn(*args)
        entered = clock()
        self._depth += 1
        self._children.append(0.0)
        start = clock()
        try:
            return fn(*args)
        finally:
            end = clock()
            own = end - start - self._children.pop()
            self._depth -= 1
            record(own, end - start)
            left = clock()
            self._children[-1] += left - entered
            self._own += (start - entered) + (left - end)
            if not self._depth:
                self._inside += left - entered

    def _add(self, stage: str, seconds: float, count: bool = False) -> None:
        row = self.stages.setdefault(stage, [0, 0.0])
        row[1] += seconds
        if count:
            row[0] += 1

    @contextlib.contextmanager
    def profile(self, action_name: str) -> Iterator[None]:
        """Time a block of your code: ``with trainer.profiler.profile("augment"): ...`` (a row of
        its own)."""
        start = clock()
        try:
            yield
        finally:
            row = self.actions.setdefault(action_name, [0, 0.0])
            row[0] += 1
            row[1] += clock() - start

    # ---- the report ------------------------------------------------------------------------------
    def on_exception(self, trainer: Any, task: Any, exception: BaseException) -> None:
        self._installed = False
        if self._imports is not None:  # (an error before setup: nothing installed)
            self._imports.remove()

    def _finish(self) -> None:
        self._installed = False
        if self._imports is not None:
            self._imports.remove()
        trainer = self._trainer
        self.report = self.summary()
        if trainer.is_main:
            echo(self.report, name="taskfit.profiler")
            if self.filename:
                folder = self.dirpath or trainer.log_dir
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, f"{self.filename}.txt"), "w") as fh:
                    fh.write(self.report + "\n")

    def summary(self) -> str:
        """The tables: per stage (calls, total, mean, share of the fit), then per hook and per
        ``profile`` block."""
        total = self.fit_seconds or 1e-12
        rows = sorted(
            self.stages.items(), key=lambda kv: STAGES.index(kv[0]) if kv[0] in STAGES else 2.5
        )
        accounted = sum(seconds for _, (_, seconds) in rows)
        lines = [
            f"Profiler ({type(self).__name__}): fit took {self.fit_seconds:.3f} s; by stage:",
            "",
            f"{'stage':<26}{'calls':>8}{'total (s)':>12}{'mean (ms)':>12}{'share':>8}",
        ]
        for stage, (calls, seconds) in rows:
            label = "loop (logging, epoch ends)" if stage == "loop" else stage
            lines.append(
                f"{label:<26}{int(calls):>8}{seconds:>12.3f}"
                f"{seconds / max(calls, 1) * 1e3:>12.3f}{seconds / total:>8.1%}"
            )
        lines.append(f"{'total':<26}{'':>8}{accounted:>12.3f}{'':>12}{accounted / total:>8.1%}")
        if "imports" in self.stages:
            slowest = sorted(self.imports.items(), key=lambda kv: -kv[1])[:3]
            lines += ["", f"imports: {int(self.stages['imports'][0])} modules this process "
                      "imported for the first time during the fit (slowest: "
                      "" + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in slowest)
                      + "), taken out of the stage or hook that imported them. One-time costs: a "
                      "later fit in the same process does not pay them."]
        for title, table in (
            ("hook", self.hook_times if self.extended else {}),
            ("profile(...) block", self.actions),
        ):
            if table:
                lines += ["", f"{title:<46}{'calls':>8}{'total (s)':>12}{'mean (ms)':>12}"]
                for name, (calls, seconds) in sorted(table.items(), key=lambda kv: -kv[1][1]):
                    lines.append(
                        f"{name:<46}{int(calls):>8}{seconds:>12.4f}"
                        f"{seconds / max(calls, 1) * 1e3:>12.3f}"
                    )
        return "\n".join(lines)

    def describe(self) -> None:
        """Print the report (Lightning's ``describe``)."""
        echo(self.summary(), name="taskfit.profiler")


class _Mark:
    """The head of a hook list: a stage boundary (``__self__``: the profiler, for the batch-hook
    filter)."""

    def __init__(self, profiler: SimpleProfiler, hook: str) -> None:
        self.__self__, self.hook = profiler, hook

    def __call__(self, *args: Any) -> None:
        self.__self__.mark(self.hook)


class _Timed:
    """A hook with its own time (nested hooks' time taken out) added to its row and its stage:
    ModelCheckpoint's to "checkpoint", the others' to "callback hooks". Keeps what the hook table
    reads of an entry: ``__self__`` (the callback, whose ``needs_batch_hooks`` decides) or
    ``task_hook`` (the task's or data module's own)."""

    def __init__(
        self, profiler: SimpleProfiler, fn: Callable[..., Any], hook: str, task: Any
    ) -> None:
        from ..callbacks import ModelCheckpoint

        owner = getattr(fn, "__self__", None)
        self.task_hook = getattr(fn, "task_hook", False)
        if owner is not None:
            self.__self__ = owner
        kind = (
            type(task).__name__
            if self.task_hook
            else type(owner).__name__
            if owner is not None
            else None
        )
        self.profiler, self.fn = profiler, fn
        # the Trainer's own
        self.name = f"{kind}.{hook}" if kind else f"Trainer.{getattr(fn, '__name__', hook)}"
        self.stage = "checkpoint" if isinstance(owner, ModelCheckpoint) else "callback hooks"

    def __call__(self, *args: Any) -> Any:
        return self.profiler._time_entry(self.fn, args, self._record)

    def _record(self, own: float, elapsed: float) -> None:
        row = self.profiler.hook_times.setdefault(self.name, [0, 0.0])
        row[0] += 1
        row[1] += own
        self.profiler._add(self.stage, own, count=True)


class _ImportClock:
    """A finder first in ``sys.meta_path`` during the fit: each module imported for the first time
    (its ``exec_module``) is timed like a hook (nested imports and hooks taken out of their parent),
    its own time added to the ``imports`` row. Only the fit's thread; modules already imported cost
    nothing (no finder is asked)."""

    def __init__(self, profiler: SimpleProfiler) -> None:
        self.profiler, self._thread, self._finding = profiler, threading.get_ident(), False
        self._outer = 0  # imports running (nested: the module's own imports)

    def install(self) -> None:
        self.remove()
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        """The spec the other finders give, its loader's ``exec_module`` timed (the spec is
        otherwise unchanged)."""
        if self._finding or threading.get_ident() != self._thread or not self.profiler._installed:
            return None
        self._finding = True
        try:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None) if finder is not self else None
                spec = find(name, path, target) if find is not None else None
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._finding = False
        loader = spec.loader
        if (
            loader is None
            or isinstance(loader, type)
            or "exec_module" in getattr(loader, "__dict__", ())
            or not hasattr(loader, "exec_module")
        ):  # built-in and frozen modules (class loaders): untimed
            return spec
        run = loader.exec_module

        def timed(module: Any) -> None:
            # the loader as it was (a module's loader stays with it)
            loader.__dict__.pop("exec_module", None)
            self._timed(module.__name__, run, module)
        try:
            loader.exec_module = timed
        except AttributeError:  # a loader with slots
            pass
        return spec

    def _timed(self, name: str, run: Any, module: Any) -> Any:
        p = self.profiler

        def record(own: float, elapsed: float) -> None:
            p._add("imports", own, count=True)
            # the outermost import: its whole time, the modules it imported included
            if self._outer == 1:
                p.imports[name] = p.imports.get(name, 0.0) + elapsed
        self._outer += 1
        try:
            return p._time_entry(run, (module,), record)
        finally:
            self._outer -= 1
