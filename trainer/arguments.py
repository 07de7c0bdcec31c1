"""Constructor arguments: one catalogued error for an unknown, positional or Lightning-only
argument.

Python's own ``TypeError: __init__() got an unexpected keyword argument 'x'`` names neither the
valid arguments nor what to use instead. :func:`arguments_checked` wraps an ``__init__`` (the
Trainer's, a callback's, a logger's) so that every such mistake is one
:class:`MisconfigurationError` with a HINT, raised before anything is built:

- an argument the class does not have: the closest valid name (``did you mean max_epochs?``);
- an argument Lightning's class of the same name takes and taskfit's does not: what to do instead,
  from the ``lightning`` table the class passes (docs/migrating-lightning.md lists them);
- positional arguments beyond what the signature allows, or a required one missing.
"""
from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

from .errors import MisconfigurationError

Init = Callable[..., None]


def arguments_checked(init: Init | None = None, *, lightning: Mapping[str, str] | None = None,
                      docs: str = "the API reference (docs/api.md)") -> Any:
    """Decorate an ``__init__``: a call its signature does not accept raises one
    MisconfigurationError.

    ``lightning``: ``{argument: hint}`` for arguments of the Lightning class of the same name that
    this class does not take (the hint says what to use instead). ``docs``: where every argument is
    listed, named in the hint of an unknown argument. Usable bare (``@arguments_checked``) or with
    arguments.
    """
    table = dict(lightning or {})

    def wrap(init: Init) -> Init:
        signature = inspect.signature(init)

        # inspect.signature (and so the config schema checks) still sees the real arguments
        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                signature.bind(self, *args, **kwargs)
            except TypeError:
                raise argument_error(
                    type(self).__name__, signature, args, kwargs, table, docs
                ) from None
            init(self, *args, **kwargs)

        return checked

    return wrap if init is None else wrap(init)


def argument_error(
    name: str,
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    lightning: Mapping[str, str],
    docs: str,
) -> MisconfigurationError:
    """The error for a call of ``name(*args, **kwargs)`` that ``signature`` (of ``__init__``) does
    not bind."""
    params = {k: p for k, p in signature.parameters.items() if k != "self"}
    named = [k for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for key in kwargs:
        if key in named or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        if key in lightning:
            return MisconfigurationError(
                f"{name}({key}=...) is an argument of Lightning's {name} that taskfit's does not "
                "take.",
                lightning[key])
        close = difflib.get_close_matches(key, named, n=1)
        return MisconfigurationError(
            f"{name}() got an unknown argument {key!r}.",
            (f"did you mean {close[0]}? " if close else "") + f"{docs} lists every argument.",
        )
    positional = [
        k for k, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(args) > len(positional):
        if not positional:
            first = named[0] if named else "x"
            return MisconfigurationError(f"{name}() takes keyword arguments only; got {len(args)} "
                                         "positional.",
                                         f"name each one, e.g. {name}({first}=...).")
        return MisconfigurationError(
            f"{name}() takes at most {len(positional)} positional arguments "
            f"({', '.join(positional)}); got "
            f"{len(args)}.", "name the others, e.g. " + f"{name}({positional[0]}=..., ...).")
    bound = set(positional[:len(args)]) | set(kwargs)
    missing = [k for k, p in params.items() if p.default is p.empty and k not in bound
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        return MisconfigurationError(
            f"{name}() is missing the argument {missing[0]!r}.",
            f"pass it, e.g. {name}({missing[0]}=...); {docs} describes it.",
        )
    return MisconfigurationError(f"{name}() cannot take these arguments: {signature}.",
                                 f"{docs} lists every argument.")
