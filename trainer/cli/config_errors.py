"""The ``taskfit`` command's errors that Hydra and the checks of ``config.py`` do not catch, each
turned into one :class:`~trainer.errors.MisconfigurationError` that names the key and what it
accepts (the command then exits 1 and leaves no run directory behind):

* a root key nobody reads (``+ckpt_pth=last``: Hydra's ``+`` adds any key, and a key that nothing
  uses does nothing, silently);
* a value the run rejects once it is used (``task.batch_size=-4``: the DataLoader's ValueError names
  ``batch_size`` and ``-4``, so the config key that holds them is the one to fix);
* ``task=null`` (a config group takes an option name) and a YAML syntax error in a config file
  (Hydra raises them as a ValueError and yaml's own error, with 40 lines of traceback);
* a config group's file that is not a mapping of keys (a task written as a YAML list: the run would
  fail later, naming no file): :func:`check_groups`.
"""
from __future__ import annotations

import difflib
import importlib.util
import os
import re
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import MisconfigurationError, find_in_chain

# The root of conf/config.yaml (tests/test_config.py keeps this in step with the composed config).
ROOT_KEYS = (
    "name",
    "mode",
    "ckpt_path",
    "test",
    "predict",
    "lr_find",
    "scale_batch_size",
    "task",
    "trainer",
    "callbacks",
    "logger",
    "paths",
)
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
    """Refuse a root key of ``config`` that taskfit does not know and no interpolation (``${key}``)
    in the ``unresolved`` configs (the job's and Hydra's, as plain containers) reads: a typo, ``+``
    or not."""
    used = {
        m.group(1)
        for tree in unresolved
        for text in _strings(tree)
        for m in _INTERPOLATION.finditer(text)
    }
    for key in config:
        if key in ROOT_KEYS or key in used:
            continue
        close = difflib.get_close_matches(str(key), ROOT_KEYS, n=3, cutoff=0.6)
        did_you_mean = f"did you mean {' or '.join(close)}? " if close else ""
        raise MisconfigurationError(
            f"Unknown config key '{key}' at the root of the config: taskfit does not read it, and "
            f"nothing in the config uses it (no ${{{key}}}).",
            f"{did_you_mean}Root keys: {', '.join(ROOT_KEYS)}; the Trainer's arguments are "
            "trainer.*, the task's task.*. A key of your own at the root must be used somewhere "
            f"as ${{{key}}}.")


# The config groups whose option is a mapping of keys (callbacks and logger may be null).
_MAPPING_GROUPS = ("task", "trainer", "callbacks", "logger", "paths")


def check_groups(config: Mapping[str, Any], runtime: Any) -> None:
    """Refuse a config group whose composed value is not a mapping (its file is a YAML list or a
    single value): one error naming the file, before any work. ``runtime``: Hydra's
    ``HydraConfig.get().runtime`` (the option chosen for each group, the config folders)."""
    for group in _MAPPING_GROUPS:
        value = config.get(group)
        if isinstance(value, Mapping) or value is None and group in ("callbacks", "logger"):
            continue
        option = runtime.choices.get(group)
        path = _group_file(runtime.config_sources, group, option)
        kind = "a YAML list" if isinstance(value, list) else f"the single value {value!r}"[:80]
        where = f"The config file {path} ({group}={option})" if path else \
            f"The config group {group} ({group}={option})"
        raise MisconfigurationError(
            f"{where} is {kind}, not a mapping of keys: the '{group}' group takes `key: value` "
            "lines.",
            f"write it as a mapping: `_target_: package.module.Class` (for {group}) and one "
            "`argument: value` per line, without the leading '- ' of a list item; `taskfit --cfg "
            "job` prints the composed config.")


def _group_file(sources: Any, group: str, option: Any) -> str | None:
    """The file of ``group``'s ``option`` in Hydra's config folders (``file`` and ``pkg``
    sources), the first that has it, as Hydra searches them."""
    if not isinstance(option, str):
        return None
    for source in sources or ():
        schema, where = getattr(source, "schema", ""), str(getattr(source, "path", ""))
        if schema == "file":
            folders = [where]
        elif schema == "pkg" and where:
            spec = importlib.util.find_spec(where.replace("/", "."))
            folders = list(spec.submodule_search_locations or []) if spec is not None else []
        else:
            continue
        for folder in folders:
            path = os.path.join(folder, group, f"{option}.yaml")
            if os.path.isfile(path):
                return os.path.abspath(path)
    return None


# How torch's errors spell a few arguments whose names are too short, or not written, in their
# messages.
_SPELLED = {"lr": ["learning rate"], "eps": ["epsilon"], "betas": ["beta parameter"]}


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
    """A ValueError/TypeError of the run's set-up whose message names a config key's name and its
    value (torch's ``batch_size should be a positive integer value, but got batch_size=-4``): the
    error, naming that key. None when no key (or more than one) fits: then it is not the config's,
    and the traceback is what helps."""
    if not isinstance(exc, (ValueError, TypeError)):
        return None
    message = " ".join(str(exc).split())
    hits, named = [], []
    for key, value in _leaves(config):
        name = re.split(r"[.\[]", key)[-1]
        shown = str(value)
        if name.startswith("_") or not len(shown):
            continue
        spelled = [name] if len(name) > 2 else []
        # torch's optimizers: "Invalid learning rate: -1" for lr=-1
        spelled += _SPELLED.get(name, [])
        if not any(
            re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", message, re.I) for word in spelled
        ):
            continue
        named.append((key, value))
        if re.search(rf"(?<![\w.+-]){re.escape(shown)}(?![\w.])", message):
            hits.append((key, value))
    if not hits and len(named) == 1 and isinstance(named[0][1], (int, float)):
        # the message names the key but not its value (torch: "num_workers option should be
        hits = named
        # non-negative"): the one number of that name is the one to fix
    if len(hits) != 1:
        return None
    key, value = hits[0]
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if os.sep + "site-packages" + os.sep not in f.filename
        and os.sep + "lib" + os.sep + "python" not in f.filename
    ]
    where = (
        f" (raised from {frames[-1].name}() in {os.path.basename(frames[-1].filename)}, "
        f"line {frames[-1].lineno})"
        if frames
        else ""
    )
    return MisconfigurationError(
        f"Config value {key}={value!r} is not valid: {type(exc).__name__}: {message}{where}.",
        f"set {key} to a value the message accepts, e.g. `taskfit {key}=...`; `taskfit --cfg job` "
        "prints the config.")


def _config_dirs(argv: Sequence[str]) -> list[str]:
    """taskfit's conf/ and the ``--config-dir``/``-cd`` folder of the command line, if any."""
    # installed (editable or not), else a checkout's conf/
    spec = importlib.util.find_spec("taskfit.conf")
    dirs = (
        list(spec.submodule_search_locations or [])
        if spec is not None
        else [
            os.path.join(
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf"
            )
        ]
    )
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
        if value in ("null", "~", "None") and any(
            os.path.isdir(os.path.join(d, key)) for d in dirs
        ):
            options = sorted({n[:-5] for d in dirs if os.path.isdir(os.path.join(d, key))
                              for n in os.listdir(os.path.join(d, key)) if n.endswith(".yaml")})
            return MisconfigurationError(
                f"{arg}: '{key}' is a config group, which takes the name of one of its options, "
                "not null.",
                f"use one of {', '.join(f'{key}={o}' for o in options)}; `~{key}` removes an "
                "optional group (experiment, debug) from the defaults; `taskfit --help` lists "
                "every group.")
    return None


def yaml_error(exc: BaseException) -> MisconfigurationError | None:
    """A YAML syntax error in a config file (anywhere in ``exc``'s causes): the file, the line and
    the problem."""
    import yaml

    seen = find_in_chain(exc, yaml.YAMLError, contexts=True)
    if seen is None:
        return None
    mark = getattr(seen, "problem_mark", None)
    where = (
        f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}"
        if mark is not None
        else "a config file"
    )
    problem = (
        ": ".join(filter(None, (getattr(seen, "context", None), getattr(seen, "problem", None))))
        or str(seen).splitlines()[0]
    )
    name = getattr(mark, "name", "")
    # a character YAML refuses (a NUL of a binary file): no mark
    if isinstance(seen, yaml.reader.ReaderError):
        name, where = str(seen.name), f"{seen.name}, character {seen.position + 1}"
    group, option = (
        os.path.basename(os.path.dirname(name)),
        os.path.splitext(os.path.basename(name))[0],
    )
    return MisconfigurationError(
        f"The config file {name or '?'} is not valid YAML: {problem} ({where}).",
        f"fix that line of the file (the option '{option}' of the group '{group}'); YAML lists are "
        "written [a, b], mappings key: value, and a value with ':' or '#' needs quotes.")


def unreadable_config(exc: BaseException) -> MisconfigurationError | None:
    """A config file that is not UTF-8 text (a binary file named ``.yaml``): Hydra's
    UnicodeDecodeError, with the file it was reading (``full_path`` in its ``load_config``), as one
    error naming the group and option."""
    seen = find_in_chain(exc, UnicodeDecodeError, contexts=True)
    if seen is None:
        return None
    path, tb = None, seen.__traceback__
    while tb is not None:
        found = tb.tb_frame.f_locals.get("full_path")
        if tb.tb_frame.f_code.co_name == "load_config" and isinstance(found, str):
            path = found
        tb = tb.tb_next
    if path is None:
        return None
    group, option = (
        os.path.basename(os.path.dirname(path)),
        os.path.splitext(os.path.basename(path))[0],
    )
    return MisconfigurationError(
        f"{group}={option}: the config file {path} is not text ({seen.encoding} cannot decode byte "
        f"{seen.start}: {seen.reason}).",
        f"a config file is YAML text; replace or remove {os.path.basename(path)} in the group "
        f"'{group}', or choose another option (`taskfit --help` lists them).")


_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "paths.log_dir")


def run_dir_error(exc: BaseException, argv: Sequence[str]) -> MisconfigurationError | None:
    """Hydra could not create the run (or sweep) directory (``paths.log_dir=/dev/null/x``:
    NotADirectoryError, a read-only or full disk): one error naming the override that put it there
    (``paths.log_dir`` by default)."""
    if not isinstance(exc, OSError) or not isinstance(exc.filename, str):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not any(
        f.name in ("run_job", "run", "multirun") and f"{os.sep}hydra{os.sep}" in f.filename
        for f in frames
    ):
        return None
    target = os.path.abspath(exc.filename)
    key, value = "paths.log_dir", None
    for arg in argv:
        name, _, given = arg.lstrip("+").partition("=")
        if (
            name in _DIR_KEYS
            and given
            and (target + os.sep).startswith(os.path.abspath(given) + os.sep)
        ):
            key, value = name, given
            break
    shown = f"{key}={value}" if value is not None else f"{key} (the folder of runs)"
    return MisconfigurationError(
        f"{shown}: the run directory {exc.filename} cannot be created "
        f"({exc.strerror or type(exc).__name__}).",
        f"set {key} to a folder this user can write to (a relative paths.log_dir is relative to "
        "where taskfit starts; the default is logs).")


def check_name(name: Any, log_dir: Any, key: str = "name") -> None:
    """``name`` places runs at ``<paths.log_dir>/<name>/runs/...``: it must stay inside
    ``paths.log_dir`` (no ``..`` that climbs out, not an absolute path)."""
    text = str(name)
    inside = os.path.normpath(os.path.join("log_dir", text))
    if text.strip() and not os.path.isabs(text) and not text.startswith("~") and \
            (inside + os.sep).startswith("log_dir" + os.sep) and inside != "log_dir":
        return
    raise MisconfigurationError(
        f"{key}={text!r} is not a valid run name: runs go to <paths.log_dir>/<name>/runs/, and "
        f"this name puts them outside paths.log_dir ({log_dir}).",
        "use a plain name (letters, digits, -, _; a/b makes sub-folders), without '..' or a "
        "leading '/' or '~'; set paths.log_dir to choose where runs go.")


def check_name_overrides(argv: Sequence[str]) -> None:
    """The command line's ``name=...`` (each value of a sweep ``name=a,b``), before Hydra creates a
    directory."""
    log_dir = next(
        (a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("paths.log_dir=")), "logs"
    )
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        if key != "name" or not eq or "${" in value:
            continue
        values = value.split(",") if any(a in ("-m", "--multirun") for a in argv) else [value]
        for one in values:
            check_name(one.strip().strip("'\""), log_dir)
