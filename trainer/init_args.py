"""What a TaskModule or DataModule was constructed with: ``hparams`` (Lightning's
``self.hparams.lr``), recorded from the ``__init__`` arguments; ``save_hyperparameters`` choosing
among them; their plain form for checkpoints (which load with ``weights_only=True``) and loggers."""
from __future__ import annotations

import argparse
import inspect
import numbers
from collections.abc import Mapping
from typing import Any

from .errors import MisconfigurationError

_PRIMITIVES = (int, float, str, bool, type(None))


def _plain(value: Any) -> Any:
    """An init argument as a checkpoint holds it (``torch.load(weights_only=True)`` reads it back):
    numbers, strings, bools and None, and tuples, lists, sets and dicts of them, each of the type
    given, so that ``load_from_checkpoint`` passes ``(1, 4)`` back as a tuple, as Lightning's
    pickled hparams do. A factory (``functools.partial``) becomes a description, anything else its
    ``repr``."""
    if type(value) in _PRIMITIVES:
        return value
    if isinstance(value, numbers.Integral):  # an IntEnum, a numpy integer: the number
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping):
        return {k if type(k) in _PRIMITIVES else str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):  # a namedtuple or torch.Size as a tuple
        return (tuple if isinstance(value, tuple) else list)(_plain(v) for v in value)
    if isinstance(value, (set, frozenset)):
        try:
            return {_plain(v) for v in value}
        except TypeError:  # an element that is a set itself (unhashable once plain)
            return repr(value)
    # functools.partial, e.g. a Hydra `_partial_: true` optimizer
    func = getattr(value, "func", None)
    if func is not None:
        args = {k: _plain(v) for k, v in getattr(value, "keywords", {}).items()}
        return {"_target_": f"{func.__module__}.{func.__qualname__}", **args}
    return repr(value)


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``self.hparams.lr`` (Lightning's
    ``AttributeDict``)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"hparams has no {key!r}; it holds {sorted(self)}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        del self[key]


def recorded_init_args(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments ``cls(*args, **kwargs)`` is constructed with, by name (defaults filled in;
    ``**kwargs`` flattened), as given: what ``hparams`` holds. Empty when they do not bind (the
    constructor then says why)."""
    try:
        signature = inspect.signature(cls.__init__)
        bound = signature.bind(None, *args, **kwargs)
    except (TypeError, ValueError):
        return {}
    bound.apply_defaults()
    recorded: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            recorded.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            recorded[name] = value
    return recorded


def select_hparams(owner: Any, args: tuple[Any, ...], ignore: Any) -> None:
    """``save_hyperparameters(*args, ignore=...)``: keep the named init arguments (all by default)
    but ``ignore``d ones; a mapping or an ``argparse.Namespace`` replaces them (Lightning's
    ``save_hyperparameters(config)``)."""
    hparams = owner.__dict__["_hparams"]
    # an OmegaConf DictConfig is kept as given, as Lightning's _set_hparams does (its
    # ALLOWED_CONFIG_TYPES): hparams == OmegaConf.create(...) holds, interpolations stay
    if len(args) == 1 and _is_config_container(args[0]) and not ignore:
        owner.__dict__["_hparams"] = args[0]
        return
    if len(args) == 1 and isinstance(args[0], argparse.Namespace):
        chosen = vars(args[0]).copy()
    elif len(args) == 1 and isinstance(args[0], Mapping):
        chosen = dict(args[0])
    else:
        names = [n for a in args for n in ([a] if isinstance(a, str) else a)]
        unknown = [n for n in names if n not in hparams]
        if unknown:
            raise MisconfigurationError(
                f"save_hyperparameters({', '.join(map(repr, names))}): {unknown[0]!r} is not an "
                f"argument of {type(owner).__name__}.__init__ (arguments: {sorted(hparams)}).",
                "name __init__ arguments, or call save_hyperparameters() to keep all of them.")
        chosen = {k: v for k, v in hparams.items() if not names or k in names}
    ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
    hparams.clear()
    hparams.update({k: v for k, v in chosen.items() if k not in ignored})


def _is_config_container(value: Any) -> bool:
    """An OmegaConf ``DictConfig`` (without importing omegaconf, an optional dependency)."""
    return isinstance(value, Mapping) and type(value).__module__.startswith("omegaconf")


def plain_hparams(owner: Any) -> dict[str, Any]:
    """``owner.hparams`` as checkpoints hold them (they load with weights_only=True), containers of
    the types given; loggers show them flattened (:func:`flatten`)."""
    return {str(k): _plain(v) for k, v in owner.__dict__.get("_hparams", {}).items()}


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b": value}`` with loggable values (anything else as its
    ``str``)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = (
                value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
            )
    return out


def run_hparams(command_config: Mapping[str, Any] | None, task: Any) -> dict[str, Any]:
    """A run's hyperparameters as loggers and checkpoints record them (``trainer.hparams``): the
    taskfit command's resolved config, else the task's init arguments (none after
    ``save_hyperparameters(logger=False)``), flattened."""
    if command_config is not None:
        return flatten(command_config)
    if task is None or not task.__dict__.get("_log_hparams", True):
        return flatten({})
    return flatten(plain_hparams(task))
