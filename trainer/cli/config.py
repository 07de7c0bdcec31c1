"""Structured configs and checks for the ``taskfit`` command: a wrong key or type fails before any
work.

Two layers, both before the first batch:

1. **Schemas** (the dataclasses of ``schemas.py``, registered in Hydra's ConfigStore as
   ``taskfit_<name>``). The yaml files of ``conf/trainer`` and ``conf/callbacks`` start from them
   (``defaults: [/taskfit_trainer@_here_]``), so Hydra rejects ``trainer.max_epoch=3`` or
   ``trainer.max_epochs=abc`` while composing the config. :func:`explain` turns Hydra's error into
   one :class:`~trainer.errors.MisconfigurationError` that names the key, the expected type and the
   close valid names (``did you mean trainer.max_epochs (int or null)?``).
2. :func:`check_targets` walks the composed config: every ``_target_`` must import, and every other
   key of its node must be an argument of that target, with a value of the annotated type when the
   annotation is simple (``int``, ``float``, ``str``, ``bool``, ``None`` and unions of them). This
   covers the task and the user's own classes, which have no schema.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import re
import types
import typing
from typing import Any

from ..errors import MisconfigurationError
from .schemas import SCHEMAS

# Keys Hydra's instantiate reads itself; they are not arguments of the target.
DIRECTIVES = frozenset({"_target_", "_partial_", "_args_", "_recursive_", "_convert_"})


# The schemas (dataclasses registered in Hydra's ConfigStore) live in schemas.py; TrainerConf is
# built there from Trainer.__init__'s signature.


def choice(group: str, *, _root_: Any) -> str:
    """``${taskfit.choice:task}``: the option chosen for a config group (``digits`` for
    ``task=digits``).

    Hydra's ``${hydra:runtime.choices.task}`` only resolves inside a job; the sweep directory of
    ``taskfit -m`` is computed before any job starts, from the config that still holds
    ``hydra.runtime.choices``.
    """
    from hydra.core.hydra_config import HydraConfig

    hydra_node = _root_.get("hydra") if hasattr(_root_, "get") else None
    choices = hydra_node.runtime.choices if hydra_node is not None else \
        HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    value = choices.get(group)
    if value is None:
        raise MisconfigurationError(f"${{taskfit.choice:{group}}}: no option is chosen for the "
                                    f"group '{group}'.",
                                    "name a group of the defaults list (task, trainer...), or set "
                                    "the value directly.")
    return str(value)


def register() -> None:
    """Store every schema in Hydra's ConfigStore as ``taskfit_<name>`` and register
    ``${taskfit.choice:...}`` (idempotent; done on import; ``${taskfit.job_dir:}`` is registered by
    trainer/sweep.py)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        store.store(name=f"taskfit_{name}", node=node)
    if not OmegaConf.has_resolver("taskfit.choice"):
        OmegaConf.register_new_resolver("taskfit.choice", choice)


# ---- explaining Hydra's composition errors -------------------------------------------------------
def type_name(annotation: Any) -> str:
    """``Optional[int]`` -> ``int or null``; ``List[str]`` -> ``list of str``; ``Any`` -> ``any
    value``."""
    if annotation is Any:
        return "any value"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        return "list" + (f" of {type_name(args[0])}" if args else "")
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _schema_fields(object_type: Any) -> dict[str, tuple[Any, Any]]:
    """``{field: (type, default)}`` of a schema dataclass; empty for anything else."""
    if not (isinstance(object_type, type) and dataclasses.is_dataclass(object_type)):
        return {}
    hints = typing.get_type_hints(object_type)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(object_type)}


def _yaml(value: Any) -> str:
    """A value as it is written on the command line (None -> null, True -> true)."""
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


# an unknown key's message: three lines of at most this many columns (the valid keys on request)
_WIDTH = 120


def explain(exc: BaseException) -> MisconfigurationError:
    """One MisconfigurationError that says what is wrong with the config, from a Hydra/OmegaConf
    error.

    OmegaConf attaches ``key``, ``full_key``, ``value``, ``object_type`` and ``parent_node`` to its
    errors; Hydra chains them as ``__cause__`` of its ConfigCompositionException.
    """
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = (
        exc
        if isinstance(exc, (ConfigKeyError, ConfigAttributeError, ValidationError))
        else exc.__cause__
    )
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        full_key, key = str(cause.full_key), str(cause.key)
        prefix = full_key[: len(full_key) - len(key)]
        parent = cause.parent_node
        names = [str(k) for k in parent.keys()] if hasattr(parent, "keys") else []
        fields = _schema_fields(cause.object_type)
        group = prefix.rstrip(".")
        valid = [n for n in names if n not in DIRECTIVES]
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
        described = [
            f"{prefix}{n}" + (f" ({type_name(fields[n][0])})" if n in fields else "") for n in close
        ]
        while len(described) > 1 and len(" or ".join(described)) > _WIDTH - len(
            "  HINT: did you mean ?"
        ):
            described.pop()  # the best match first, and only as many as fit on the line
        # A near miss of an existing key is a typo to fix, never a key to add with `+`.
        first = f"did you mean {' or '.join(described)}?" if described else \
            f"+{full_key}=VALUE adds a key that is not in the config."
        listing = f"Valid keys{f' of {group}' if group else ''}: {', '.join(valid)}."
        if len(listing) + 2 > _WIDTH:  # the Trainer's 36 keys: on request
            listing = f"Its keys and values: `taskfit --cfg job -p {group}`." if group else \
                "The whole config: `taskfit --cfg job`."
        return MisconfigurationError(
            f"Unknown config key '{full_key}'.", "\n  ".join((first, listing))
        )
    if isinstance(cause, ValidationError) and cause.full_key:
        full_key, key = str(cause.full_key), str(cause.key)
        spec = _schema_fields(cause.object_type).get(key)
        expected = type_name(spec[0]) if spec is not None else "a different type"
        default = (
            ""
            if spec is None or spec[1] is dataclasses.MISSING
            else f", e.g. {full_key}={_yaml(spec[1])}"
        )
        return MisconfigurationError(
            f"Config value {full_key}={cause.value!r} is not valid: expected {expected}.",
            f"pass a value of that type{default} (null is None).")
    # Hydra's OverrideParseException: the override it could not parse
    override = getattr(exc, "override", None)
    if isinstance(override, str) and override:
        key, eq, value = override.partition("=")
        detail = " ".join(str(getattr(exc, "message", exc)).split())
        detail = re.sub(r"^Error parsing override '.*?'\s*", "", detail)
        detail = re.sub(r"\s*See https://hydra\S*( for details)?", "", detail).rstrip(".")
        hint = (
            "close its brackets and quotes ([a, b], {k: v}), or quote the value: "
            f"'{key}=\"{value}\"' "
            "(docs/configuration.md has the syntax)."
        )
        if not eq:
            return MisconfigurationError(f"The override {override!r} cannot be parsed: {detail}.",
                                         "an override is key=value, group=option, +key=value or "
                                         "~key (docs/configuration.md has the syntax).")
        return MisconfigurationError(f"Config value {key.lstrip('+~')}={value!r} cannot be parsed: "
                                     f"{detail}.", hint)
    missing = re.search(r"Could not find '([^']+)'", str(exc))
    if missing:
        options = re.findall(r"^\t(\S+)$", str(exc), re.M)
        group, _, option = missing.group(1).rpartition("/")
        close = difflib.get_close_matches(option, options, n=3, cutoff=0.5)
        did_you_mean = (
            f"did you mean {' or '.join(f'{group}={c}' for c in close)}? " if close else ""
        )
        return MisconfigurationError(
            f"There is no config '{missing.group(1)}' (the option '{option}' of the group "
            f"'{group}').",
            f"{did_you_mean}Options of '{group}': {', '.join(options) or 'none'}. `taskfit --help` "
            "lists every group; --config-dir DIR adds your own.")
    folder = _missing_config_dir(str(exc))
    if folder is not None:
        return folder
    detail = " ".join(str(exc).split())
    if exc.__cause__ is not None:
        detail += " (" + " ".join(str(exc.__cause__).split()) + ")"
    return MisconfigurationError(
        f"The configuration cannot be composed: {detail}",
        "overrides are key=value, group=option, +new_key=value or ~key; quote values with special "
        "characters ('key=\"a=b\"'). `taskfit --help` lists the groups, docs/configuration.md the "
        "syntax.")


def _missing_config_dir(message: str) -> MisconfigurationError | None:
    """Hydra's "config directory ... not found" (``--config-dir``/``-cd``, ``--config-path``/
    ``-cp``) as an error that names the folder and the flag; None for any other message."""
    found = re.search(r"Additional config directory '([^']+)' not found", message)
    flag = "--config-dir"
    if found is None:
        found, flag = re.search(r"the config directory '([^']+)' exists", message), "--config-path"
    if found is None:
        return None
    folder = found.group(1)
    what = "is a file, not a folder" if os.path.isfile(folder) else "does not exist"
    relative = f"; a relative path starts from the current folder, {os.getcwd()}" \
        if flag == "--config-dir" else ""
    hint = f"pass the folder that holds your config files (e.g. {flag} ./conf){relative}."
    return MisconfigurationError(f"{flag} {folder}: that path {what}.", hint)


# ---- checking targets and arguments --------------------------------------------------------------
def locate(path: str, key: str) -> Any:
    """Import ``a.b.C`` as Hydra does (the first module, then attributes, importing submodules on
    the way), with an error that says which module is missing or broken and what to check."""
    parts = path.split(".")
    if not all(parts):
        raise MisconfigurationError(f"{key}._target_='{path}' is not an import path.",
                                    "write the full path of a class or function: "
                                    "package.module.Name.")
    obj: Any = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        if i and hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
            continue
        if i == 0 or isinstance(obj, types.ModuleType):
            try:
                obj = importlib.import_module(name)
                continue
            except ModuleNotFoundError as exc:
                if exc.name != name:  # the module exists, but something it imports does not
                    raise MisconfigurationError(
                        f"{key}._target_='{path}': importing module '{name}' failed: {exc}.",
                        f"install the missing package ({exc.name}) in this environment.") from exc
            except Exception as exc:
                raise MisconfigurationError(
                    f"{key}._target_='{path}': importing module '{name}' raised "
                    f"{type(exc).__name__}: {exc}.",
                    f"fix that module; `python -c \"import {name}\"` shows the traceback.") from exc
        if i == 0:
            raise MisconfigurationError(
                f"{key}._target_='{path}': no module named '{name}' can be imported.",
                "check the spelling, and that the package is installed (`pip install -e .` in its "
                "project) or on PYTHONPATH; taskfit also imports from the directory it is started "
                "in.")
        owner = ".".join(parts[:i])
        close = difflib.get_close_matches(
            parts[i], [a for a in dir(obj) if not a.startswith("_")], n=3
        )
        did_you_mean = (
            f"did you mean {' or '.join(f'{owner}.{c}' for c in close)}? " if close else ""
        )
        raise MisconfigurationError(
            f"{key}._target_='{path}': '{owner}' has no attribute '{parts[i]}'.",
            f"{did_you_mean}_target_ is the full import path of a class or function, module.Name.")
    return obj


def _parameters(target: Any) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    """The named parameters of ``target`` (a class: its ``__init__``, not a custom ``__new__``) and
    their hints."""
    func = target.__init__ if isinstance(target, type) else target
    try:
        params = dict(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return {}, {}
    if isinstance(target, type):
        params.pop(next(iter(params), ""), None)  # self
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # annotations that do not evaluate on this Python: check names only
        hints = {}
    return params, hints


_SIMPLE = (int, float, str, bool, type(None))


def _accepts(annotation: Any, value: Any) -> bool | None:
    """Whether ``value`` fits ``annotation``; None when the annotation is not simple enough to
    check."""
    allowed = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    tensor = [
        a
        for a in allowed
        if getattr(a, "__module__", "") == "torch" and getattr(a, "__name__", "") == "Tensor"
    ]
    # `lr: float | Tensor`: a config value is never a Tensor
    allowed = tuple(a for a in allowed if a not in tensor)
    if not allowed or not all(a in _SIMPLE for a in allowed):
        return None
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        return int in allowed or float in allowed
    return isinstance(value, tuple(allowed))


def check_targets(node: Any, key: str = "") -> None:
    """Raise MisconfigurationError for the first ``_target_`` in ``node`` (a resolved plain
    container) that does not import, or whose node has a key that is not an argument of the target
    or a value of the wrong type."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            check_targets(item, f"{key}[{i}]")
        return
    if not isinstance(node, dict):
        return
    target = node.get("_target_")
    if isinstance(target, str):
        obj = locate(target, key or "<root>")
        params, hints = _parameters(obj)
        open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        named = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        for name, value in node.items():
            if name in DIRECTIVES or not params:
                continue
            full = f"{key}.{name}" if key else name
            if name not in params:
                if open_kwargs:
                    continue
                close = difflib.get_close_matches(name, named, n=3, cutoff=0.6)
                did_you_mean = (
                    f"did you mean {' or '.join(f'{key}.{c}' for c in close)}? " if close else ""
                )
                raise MisconfigurationError(
                    f"Unknown config key '{full}': {target} takes no argument '{name}'.",
                    f"{did_you_mean}Its arguments: {', '.join(named)}.")
            if (isinstance(value, dict) and "_target_" in value) or name not in hints:
                continue
            if _accepts(hints[name], value) is False:
                default = params[name].default
                raise MisconfigurationError(
                    f"Config value {full}={value!r} is not valid: {target} expects "
                    f"{type_name(hints[name])}.",
                    f"pass a value of that type (null is None), e.g. the default: "
                    f"{full}={_yaml(default) if default is not params[name].empty else '...'}.")
    for name, value in node.items():
        if name not in DIRECTIVES:
            check_targets(value, f"{key}.{name}" if key else str(name))


register()
