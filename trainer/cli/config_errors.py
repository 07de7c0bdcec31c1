"""The ``taskfit`` command's errors that Hydra and the checks of ``config.py`` do not catch, each turned into one
:class:`~trainer.errors.MisconfigurationError` that names the key and what it accepts (the command then exits 1
and leaves no run directory behind):

* a root key nobody reads (``+ckpt_pth=last``: Hydra's ``+`` adds any key, and a key that nothing uses does
  nothing, silently);
* a value the run rejects once it is used (``task.batch_size=-4``: the DataLoader's ValueError names
  ``batch_size`` and ``-4``, so the config key that holds them is the one to fix);
* ``task=null`` (a config group takes an option name) and a YAML syntax error in a config file (Hydra raises
  them as a ValueError and yaml's own error, with 40 lines of traceback).
"""
from __future__ import annotations

import difflib
import importlib.util
import os
import re
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import MisconfigurationError

# The root of conf/config.yaml (tests/test_config.py keeps this in step with the composed config).
ROOT_KEYS = ("name", "mode", "ckpt_path", "test", "predict", "lr_find", "task", "trainer", "callbacks", "logger",
             "paths")
_INTERPOLATION = re.compile(r"\$\{\s*([A-Za-z_][\w-]*)")


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, Mapping):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _strings(value)


def check_root(config: Mapping[str, Any], *unresolved: Any) -> None:
    """Refuse a root key of ``config`` that taskfit does not know and no interpolation (``${key}``) in the
    ``unresolved`` configs (the job's and Hydra's, as plain containers) reads: a typo, ``+`` or not."""
    used = {m.group(1) for tree in unresolved for text in _strings(tree) for m in _INTERPOLATION.finditer(text)}
    for key in config:
        if key in ROOT_KEYS or key in used:
            continue
        close = difflib.get_close_matches(str(key), ROOT_KEYS, n=3, cutoff=0.6)
        did_you_mean = f"did you mean {' or '.join(close)}? " if close else ""
        raise MisconfigurationError(
            f"Unknown config key '{key}' at the root of the config: taskfit does not read it, and nothing in the "
            f"config uses it (no ${{{key}}}).",
            f"{did_you_mean}Root keys: {', '.join(ROOT_KEYS)}; the Trainer's arguments are trainer.*, the task's "
            f"task.*. A key of your own at the root must be used somewhere as ${{{key}}}.")


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{prefix}[{i}]")
    elif isinstance(node, (int, float, str)) and not isinstance(node, bool):
        yield prefix, node


def blame(exc: BaseException, config: Mapping[str, Any]) -> MisconfigurationError | None:
    """A ValueError/TypeError of the run's set-up whose message names a config key's name and its value (torch's
    ``batch_size should be a positive integer value, but got batch_size=-4``): the error, naming that key. None
    when no key (or more than one) fits: then it is not the config's, and the traceback is what helps."""
    if not isinstance(exc, (ValueError, TypeError)):
        return None
    message = " ".join(str(exc).split())
    hits = []
    for key, value in _leaves(config):
        name = re.split(r"[.\[]", key)[-1]
        shown = str(value)
        if len(name) > 2 and len(shown) and not name.startswith("_") and \
                re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message) and \
                re.search(rf"(?<![\w.+-]){re.escape(shown)}(?![\w.])", message):
            hits.append((key, value))
    if len(hits) != 1:
        return None
    key, value = hits[0]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.sep + "site-packages" + os.sep not in f.filename
              and os.sep + "lib" + os.sep + "python" not in f.filename]
    where = f" (raised from {frames[-1].name}() in {os.path.basename(frames[-1].filename)}, line {frames[-1].lineno})" \
        if frames else ""
    return MisconfigurationError(
        f"Config value {key}={value!r} is not valid: {type(exc).__name__}: {message}{where}.",
        f"set {key} to a value the message accepts, e.g. `taskfit {key}=...`; `taskfit --cfg job` prints the config.")


def _config_dirs(argv: Sequence[str]) -> list[str]:
    """taskfit's conf/ and the ``--config-dir``/``-cd`` folder of the command line, if any."""
    spec = importlib.util.find_spec("taskfit.conf")  # installed (editable or not), else a checkout's conf/
    dirs = list(spec.submodule_search_locations or []) if spec is not None else \
        [os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")]
    for i, arg in enumerate(argv):
        if arg.startswith("--config-dir="):
            dirs.append(arg.split("=", 1)[1])
        elif arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(argv[i + 1])
    return dirs


def null_group(exc: BaseException, argv: Sequence[str]) -> MisconfigurationError | None:
    """``task=null``: Hydra's ``Config group override must be a string or a list. Got NoneType``."""
    if "Config group override must be a string or a list" not in str(exc):
        return None
    dirs = _config_dirs(argv)
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if value in ("null", "~", "None") and any(os.path.isdir(os.path.join(d, key)) for d in dirs):
            options = sorted({n[:-5] for d in dirs if os.path.isdir(os.path.join(d, key))
                              for n in os.listdir(os.path.join(d, key)) if n.endswith(".yaml")})
            return MisconfigurationError(
                f"{arg}: '{key}' is a config group, which takes the name of one of its options, not null.",
                f"use one of {', '.join(f'{key}={o}' for o in options)}; `~{key}` removes an optional group "
                "(experiment, debug) from the defaults; `taskfit --help` lists every group.")
    return None


def yaml_error(exc: BaseException) -> MisconfigurationError | None:
    """A YAML syntax error in a config file (anywhere in ``exc``'s causes): the file, the line and the problem."""
    import yaml

    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, yaml.YAMLError):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    mark = getattr(seen, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a config file"
    problem = ": ".join(filter(None, (getattr(seen, "context", None), getattr(seen, "problem", None)))) or str(seen)
    name = getattr(mark, "name", "")
    group, option = os.path.basename(os.path.dirname(name)), os.path.splitext(os.path.basename(name))[0]
    return MisconfigurationError(
        f"The config file {name or '?'} is not valid YAML: {problem} ({where}).",
        f"fix that line of the file (the option '{option}' of the group '{group}'); YAML lists are written [a, b], "
        "mappings key: value, and a value with ':' or '#' needs quotes.")
