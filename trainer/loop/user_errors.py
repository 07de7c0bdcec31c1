"""An error raised in the user's code during a run, as a person reads it: torch's (or Python's)
message as it was, one added line naming the user's function and the batch where it happened, and a
traceback without taskfit's own frames (the user's frames and torch's stay).
``TASKFIT_FULL_TRACEBACK=1`` keeps every frame.

Lightning shows the bare error under a long traceback through its loops; the added line saves the
search for which batch and which of the task's methods failed. Only the error path pays for this:
the loop is untouched.
"""
from __future__ import annotations

import os
import sys
import types
from typing import Any

from ..errors import TaskfitError

# taskfit's folders: the package (trainer/ in a checkout) and its callbacks (callbacks/ in a
# checkout, inside the package when installed)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STAGES = {
    "train": "training",
    "val": "validation",
    "sanity": "the sanity check's validation",
    "test": "test",
    "predict": "predict",
}


def _folders() -> tuple[str, ...]:
    callbacks = sys.modules.get("taskfit.callbacks")
    extra = (os.path.dirname(os.path.abspath(callbacks.__file__)),) if callbacks is not None else ()
    return tuple(folder + os.sep for folder in (_PACKAGE, *extra))


def is_taskfit_frame(tb: types.TracebackType, folders: tuple[str, ...] | None = None) -> bool:
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(folders or _folders())


def where(run: Any, tb: types.TracebackType | None) -> str | None:
    """``"raised in Task.forward (model.py:12), training batch 3 of epoch 0 (fit)"``, or None when
    the error did not come from the user's code during a pass over batches."""
    stage = run.state.stage
    if stage not in _STAGES:
        return None
    frames, folders = [], _folders()
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    user = [f for f in frames if not is_taskfit_frame(f, folders)
            and os.sep + "torch" + os.sep not in f.tb_frame.f_code.co_filename]
    if not user:
        return None
    origin = user[-1]  # the innermost of the user's frames: where it happened
    code = origin.tb_frame.f_code
    owner = origin.tb_frame.f_locals.get("self")
    name = f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name
    batch = run.state.batch_idx if stage == "train" else run.logs.current.batch_idx
    return (f"taskfit: raised in {name} ({os.path.basename(code.co_filename)}:{origin.tb_lineno}), "
            f"{_STAGES[stage]} batch {batch} of epoch {run.state.epoch} ({run.fn}). "
            "TASKFIT_FULL_TRACEBACK=1 shows taskfit's frames too.")


def without_taskfit_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback less the frames of taskfit's package (the user's and torch's kept, in
    order)."""
    kept, folders = [], _folders()
    while tb is not None:
        if not is_taskfit_frame(tb, folders):
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


def explain(exc: BaseException, run: Any) -> BaseException:
    """``exc`` with the added line and, unless ``TASKFIT_FULL_TRACEBACK`` is set, its traceback
    trimmed; taskfit's own errors (they say what is wrong already), interrupts and exits as they
    are."""
    if (
        isinstance(exc, (TaskfitError, KeyboardInterrupt, SystemExit))
        or not isinstance(exc, Exception)
        or run is None
        or getattr(exc, "_taskfit_explained", False)
    ):
        return exc
    line = where(run, exc.__traceback__)
    if line is None:
        return exc
    # nested entry points (lr_find's fit) explain once
    exc._taskfit_explained = True  # type: ignore[attr-defined]
    if hasattr(exc, "add_note"):
        exc.add_note(line)
    if not os.environ.get("TASKFIT_FULL_TRACEBACK"):
        exc = exc.with_traceback(without_taskfit_frames(exc.__traceback__))
    return exc
