"""The errors taskfit raises: one class per kind of mistake, each message says what is wrong and how
to fix it.

Every message has the shape ``<what is wrong>`` followed by ``HINT: <how to fix it>``;
docs/troubleshooting.md lists them all (a test keeps that page in step with the code).
"""
from __future__ import annotations

from typing import TypeVar

_E = TypeVar("_E", bound=BaseException)


class TaskfitError(Exception):
    """Base class of every error taskfit raises on purpose."""

    def __init__(self, what: str, hint: str | None = None) -> None:
        self.what, self.hint = what, hint
        super().__init__(what if hint is None else f"{what}\n  HINT: {hint}")


class MisconfigurationError(TaskfitError, ValueError):
    """A Trainer/callback argument or a config value is invalid."""


class MissingAttributeError(MisconfigurationError, AttributeError):
    """A tool was asked to set an attribute the task does not have (``lr_find(update_attr=True)``);
    an AttributeError too, as Lightning raises it."""


class TaskModuleError(TaskfitError, TypeError):
    """The TaskModule does not fulfil its contract (missing method, wrong return type...)."""


class NonFiniteLossError(TaskfitError, FloatingPointError):
    """The loss became NaN or Inf."""


class CheckpointError(TaskfitError, RuntimeError):
    """A checkpoint is missing, corrupt, unsafe or does not fit the module."""


def find_in_chain(
    exc: BaseException, kind: type[_E] | tuple[type[_E], ...], *, contexts: bool = False
) -> _E | None:
    """The first exception of ``kind`` in ``exc``'s chain of ``__cause__`` (also ``__context__``,
    the exception being handled when it was raised, with ``contexts=True``), ``exc`` itself first;
    None when there is none. Hydra and OmegaConf wrap the error that explains a failure (e.g. a
    TaskfitError inside an InstantiationException)."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, kind):
        seen = seen.__cause__ or (seen.__context__ if contexts else None)
    return seen
