"""Lightning's imports pointed at taskfit, for ``benchmarks/lightning_tests.py`` (loaded by its
conftest).

An import finder answers every ``lightning``, ``lightning.pytorch``, ``pytorch_lightning`` and
``lightning_fabric`` module: a public name resolves to taskfit's after the guide's rename
(docs/migrating-lightning.md: ``LightningModule`` -> ``TaskModule``...); Lightning's test helpers
(``demos/boring_classes.py``) are loaded from the fetched snapshot with the same redirection; any
other name is a placeholder. A placeholder costs nothing until a test uses it: then it raises
``LightningInternal`` (a private name or module: out of reach) or ``MissingInTaskfit`` (a public
name taskfit lacks: a gap), and the test's report says which. Nothing of Lightning's is stored here.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from typing import Any

import pytest
import torch

GIT_DIR = os.environ.get("LIGHTNING_GIT", "")
REV = os.environ.get("LIGHTNING_REV", "HEAD")
ROOTS = ("lightning", "pytorch_lightning", "lightning_fabric")
# Lightning module -> the taskfit modules holding its public names (a prefix covers submodules)
PUBLIC = {
    "lightning": ("taskfit", "taskfit.callbacks"),
    "lightning.pytorch": ("taskfit", "taskfit.callbacks"),
    "lightning.pytorch.core": ("taskfit",),
    "lightning.pytorch.core.module": ("taskfit",),
    "lightning.pytorch.core.datamodule": ("taskfit",),
    "lightning.pytorch.trainer": ("taskfit",),
    "lightning.pytorch.trainer.trainer": ("taskfit",),
    "lightning.pytorch.trainer.states": ("taskfit.state",),
    "lightning.pytorch.callbacks": ("taskfit.callbacks",),
    "lightning.pytorch.loggers": ("taskfit.callbacks", "taskfit.callbacks.loggers.logger"),
    "lightning.pytorch.profilers": ("taskfit.profilers",),
    "lightning.pytorch.utilities": ("taskfit", "taskfit.init_args"),
    "lightning.pytorch.utilities.exceptions": ("taskfit",),
    "lightning.fabric.utilities.exceptions": ("taskfit",),
    "lightning.pytorch.strategies": ("taskfit",),
    "lightning.pytorch.tuner": ("taskfit.tools",),
}
PREFIXES = (
    "lightning.pytorch.callbacks.",
    "lightning.pytorch.loggers.",
    "lightning.pytorch.profilers.",
    "lightning.pytorch.tuner.",
)
RENAMES = {"LightningModule": "TaskModule", "LightningDataModule": "DataModule",
           "MisconfigurationException": "MisconfigurationError", "TQDMProgressBar": "ProgressBar"}
# Lightning's warning classes: the standard class they derive from (pytest.warns still matches the
# text)
WARNINGS = {"PossibleUserWarning": UserWarning, "LightningDeprecationWarning": DeprecationWarning}
# Lightning modules run from the snapshot's source, their imports redirected too (the tests'
# helpers)
FROM_SOURCE = {"lightning.pytorch.demos.boring_classes"}
# Lightning modules whose functions a test patches
# (``mock.patch("...batch_size_scaling.is_oom_error")``): the taskfit module that calls the function
# of that name, so that the patch reaches it
PATCHED_IN = {"lightning.pytorch.tuner.batch_size_scaling": "taskfit.callbacks.batch_size_finder"}
TOUCHED: list[str] = []  # placeholders used by the running test ("internal:..." or "missing:...")


class LightningInternal(Exception):
    """A test used a private name of Lightning's: out of reach of an import rename."""


class MissingInTaskfit(Exception):
    """A test used a public name of Lightning's that taskfit has no equivalent for."""


class _Placeholder(type):
    """The class of a placeholder: subclassable, usable in annotations; raises when used."""

    def _fail(cls) -> None:
        TOUCHED.append(f"{cls._kind}:{cls._path}")
        error = LightningInternal if cls._kind == "internal" else MissingInTaskfit
        raise error(cls._path)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        cls._fail()

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls._path}.{name}", cls._kind)

    def __instancecheck__(cls, obj: Any) -> bool:
        TOUCHED.append(f"{cls._kind}:{cls._path}")
        return False

    def __iter__(cls) -> Any:
        cls._fail()


def placeholder(path: str, kind: str) -> Any:
    """A stand-in for Lightning's ``path``; ``kind`` is "internal" or "missing"."""
    name = path.rsplit(".", 1)[-1]
    if name.endswith(("Error", "Exception")):
        return type(name, (Exception,), {"_path": path})
    # (an __init__ of its own, as Lightning's classes have: pytest does not collect a Test* subclass
    # of it)
    return _Placeholder(
        name, (), {"_path": path, "_kind": kind, "__init__": lambda self, *a, **k: None}
    )


def flag(name: str) -> Any:
    """Lightning's environment flags (``_X_AVAILABLE``, ``_TORCH_GREATER_EQUAL_2_6``...) from this
    machine."""
    if name == "_IS_WINDOWS":
        return sys.platform == "win32"
    match = re.fullmatch(r"_TORCH_GREATER_EQUAL_(\d+)_(\d+)", name)
    if match:
        have = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
        return have >= (int(match[1]), int(match[2]))
    match = re.fullmatch(r"_([A-Z0-9_]+?)_AVAILABLE", name)
    if match:
        return importlib.util.find_spec(match[1].lower()) is not None
    return None


def canonical(fullname: str) -> str:
    """``pytorch_lightning.x`` and ``lightning_fabric.x`` as
    ``lightning.pytorch.x``/``lightning.fabric.x``."""
    for old, new in (
        ("pytorch_lightning", "lightning.pytorch"),
        ("lightning_fabric", "lightning.fabric"),
    ):
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return fullname


def homes(module: str) -> tuple[str, ...]:
    """The taskfit modules holding the public names of Lightning's ``module`` (none: it is
    internal)."""
    if module in PUBLIC:
        return PUBLIC[module]
    for prefix in PREFIXES:
        if module.startswith(prefix):
            return PUBLIC[prefix[:-1]]
    return ()


def is_module(path: str) -> bool:
    """Whether Lightning's snapshot has a module or package at ``path``
    (``lightning.pytorch.callbacks``)."""
    return path.replace(".", "/") in _source_modules()


_MODULES: set[str] = set()


def _source_modules() -> set[str]:
    if not _MODULES and GIT_DIR:
        out = subprocess.run(
            ["git", f"--git-dir={GIT_DIR}", "ls-tree", "-r", "--name-only", REV, "src/"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for line in out.splitlines():
            if line.endswith(".py"):
                path = line[len("src/"):-len(".py")]
                _MODULES.add(path[: -len("/__init__")] if path.endswith("/__init__") else path)
    return _MODULES


def resolve(module: str, name: str) -> Any:
    """Lightning's ``module.name`` in taskfit's terms."""
    if name == "__version__":  # `from lightning.pytorch import __version__` (test_hooks.py)
        return importlib.import_module("taskfit").__version__
    if name.startswith("__"):
        raise AttributeError(name)
    if is_module(f"{module}.{name}"):
        return importlib.import_module(f"{module}.{name}")
    value = flag(name)
    if value is not None:
        return value
    if name in WARNINGS:
        return WARNINGS[name]
    for home in homes(module):
        try:
            return getattr(importlib.import_module(home), RENAMES.get(name, name))
        except AttributeError:
            continue
    public = bool(homes(module)) and not name.startswith("_")
    return placeholder(f"{module}.{name}", "missing" if public else "internal")


class _Forwarding(types.ModuleType):
    """A Lightning module of PATCHED_IN: setting or deleting a public name (a test's mock.patch)
    does it on the taskfit module instead."""

    def __setattr__(self, attr: str, value: Any) -> None:
        if attr.startswith("__"):
            super().__setattr__(attr, value)
        else:
            setattr(importlib.import_module(PATCHED_IN[canonical(self.__name__)]), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(importlib.import_module(PATCHED_IN[canonical(self.__name__)]), attr)


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers Lightning's module names (see the module docstring)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] not in ROOTS:
            return None
        # only Lightning's modules: `mock.patch("lightning.pytorch.loggers.TensorBoardLogger.x")`
        # must find the class (an attribute), not a module made up under its name
        if GIT_DIR and not is_module(canonical(fullname)):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        name = canonical(spec.name)
        module = (_Forwarding if name in PATCHED_IN else types.ModuleType)(spec.name)
        module.__path__ = []
        if name in PATCHED_IN:  # its names are the taskfit module's (a deleted one is gone)
            module.__getattr__ = lambda attr: getattr(  # type: ignore[attr-defined]
                importlib.import_module(PATCHED_IN[name]), attr)
        else:
            module.__getattr__ = lambda attr: resolve(name, attr)  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        name = canonical(module.__name__)
        if name in FROM_SOURCE and GIT_DIR:
            path = "src/" + name.replace(".", "/") + ".py"
            text = subprocess.run(["git", f"--git-dir={GIT_DIR}", "show", f"{REV}:{path}"],
                                  capture_output=True, text=True, check=True).stdout
            module.__file__ = path
            exec(compile(text, path, "exec"), module.__dict__)


def install() -> None:
    """Put the finder first, so that an installed Lightning is not used either."""
    if any(isinstance(finder, Finder) for finder in sys.meta_path):
        return
    for name in [m for m in sys.modules if m.split(".")[0] in ROOTS]:
        del sys.modules[name]
    sys.meta_path.insert(0, Finder())


# Requirements a CPU-only machine without Lightning cannot meet (RunIf's keywords)
_PLATFORM = {
    "min_cuda_gpus",
    "tpu",
    "mps",
    "standalone",
    "deepspeed",
    "bf16_cuda",
    "dynamo",
    "onnx",
    "windows",
    "ipu",
    "hpu",
    "fairscale",
    "horovod",
    "xla",
}


def RunIf(**kwargs: Any) -> Any:  # noqa: N802 (Lightning's name)
    """Lightning's ``RunIf``: a skip naming the requirements this machine does not meet."""
    reasons = []
    for key, value in kwargs.items():
        if key in ("mps",) and value is False:
            continue
        if key in _PLATFORM and value:
            reasons.append(key)
        elif (
            key in ("sklearn", "rich", "omegaconf", "onnx", "tensorboard", "wandb", "mlflow")
            and value
        ):
            if importlib.util.find_spec({"sklearn": "sklearn"}.get(key, key)) is None:
                reasons.append(key)
        elif key == "min_torch" and torch.__version__ < str(value):
            reasons.append(key)
        elif key == "max_torch" and torch.__version__ >= str(value):
            reasons.append(key)
        elif key == "skip_windows" and sys.platform == "win32":
            reasons.append(key)
    return pytest.mark.skipif(bool(reasons), reason=f"platform: requires {' + '.join(reasons)}")


_xfail_gloo_windows = pytest.mark.skipif(False, reason="")


def _count(monkeypatch: Any, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)


@pytest.fixture
def cuda_count_0(monkeypatch: Any) -> None:
    _count(monkeypatch, 0)


@pytest.fixture
def mps_count_0() -> None:
    pass


@pytest.fixture(autouse=True)
def _touched() -> Any:
    TOUCHED.clear()
    yield


def _write(record: dict[str, Any]) -> None:
    out = os.environ.get("LIGHTNING_TESTS_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collectreport(report: Any) -> None:
    """A test file or class that could not be collected: one record."""
    if report.failed:
        lines = [line for line in str(report.longrepr).splitlines() if line.startswith("E ")]
        _write({"test": report.nodeid, "when": "collect", "outcome": "error",
                "first": (lines[-1][1:].strip() if lines else str(report.longrepr)[-300:])[:300],
                "touched": sorted(set(TOUCHED))})


def pytest_runtest_makereport(item: Any, call: Any) -> None:
    """Each phase's outcome, first error line and placeholders used, one JSON line
    (LIGHTNING_TESTS_OUT)."""
    if call.when != "call" and call.excinfo is None:
        return
    excinfo = call.excinfo
    if excinfo is None:
        outcome, first = "passed", ""
    elif excinfo.errisinstance(pytest.skip.Exception):
        outcome, first = (
            "skipped",
            str(excinfo.value.msg if hasattr(excinfo.value, "msg") else excinfo.value),
        )
    else:
        outcome = "failed" if call.when == "call" else "error"
        text = str(excinfo.value).strip().splitlines()
        first = f"{excinfo.typename}: {text[0] if text else ''}"
    _write({"test": item.nodeid, "when": call.when, "outcome": outcome, "first": first[:300],
            "touched": sorted(set(TOUCHED))})
