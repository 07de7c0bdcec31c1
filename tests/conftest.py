"""Shared test setup: one torch thread (the machine has 2 cores and tests run subprocesses too), and each test's
tier marker (``pytest -m unit``: the fast lane; README.md, "Run the tests")."""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)  # the checkout (tests import the installed taskfit)
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_test(monkeypatch, tmp_path):
    """Each test starts unseeded, outside any SLURM job, in its own working directory (so ./taskfit_logs never lands in the checkout)."""
    monkeypatch.delenv("TASKFIT_SEED", raising=False)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:  # pytest inside a SLURM job: no run is a task
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def quiet():
    """Trainer kwargs for tests that do not look at progress, summary, checkpoints or TensorBoard."""
    return dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)


# ---- tiers: every test gets exactly one of these markers, from what its code does ------------------------------
# The code read: the test function (with its decorators), the fixtures it uses and, transitively, the functions and
# classes of tests/ and the module-level strings that these name. The first rule whose patterns are all found wins,
# else "unit"; a test marked with a tier itself (@pytest.mark.unit, or a module's pytestmark) keeps that one.
TIERS = ("unit", "integration", "e2e", "stress", "multiprocess")  # described in pyproject.toml's markers
RUNS = r"\.(fit|validate|test|predict)\(|lr_find\(|scale_batch_size\("
TIER_RULES = [
    # several processes: torchrun, processes started by hand, the ddp example (it starts its own ranks)...
    ("multiprocess", [r"torch\.distributed\.run|mp\.spawn|start_processes\(|ddp_torchrun\.py"]),
    # ... or a ddp/fsdp Trainer (or the taskfit command) on 2+ CPU devices that runs, here or in a subprocess
    ("multiprocess", [r"devices=[2-9]|Strategy\(\"cpu\", [2-9]", RUNS + r"|subprocess\."]),
    # the same scenario many times over (a race tested by repetition)
    ("stress", [r"for (trial|rep|repetition|attempt)\w* in range\(|\brepetitions\b"]),
    # a process of its own: a python subprocess (the taskfit command, a script, a benchmark), a fork
    ("e2e", [r"subprocess\.|sys\.executable|\bPopen\b|os\.fork\("]),
    # a whole program in this process: the taskfit command's main, an example's main, examples/, docs/, the README
    ("e2e", [r"taskfit\.cli import main|cli\.main\(|examples\.\w+ import main|[\"'/](examples|docs)[\"'/]|README"]),
    # a Trainer (or the tuner) that runs in this process: fit, validate, test, predict, lr_find
    ("integration", [RUNS]),
]


@functools.cache
def _definitions(path: str) -> dict[str, str]:
    """The source of each top-level function and class of a file, by name: one parse per file (inspect.getsource
    parses the whole file again for every class)."""
    with open(path) as fh:
        lines = fh.read().splitlines(keepends=True)
    nodes = [n for n in ast.parse("".join(lines)).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    return {n.name: "".join(lines[min([n.lineno, *(d.lineno for d in n.decorator_list)]) - 1:n.end_lineno])
            for n in nodes}


@functools.cache
def _read(obj: Any, module: types.ModuleType) -> tuple[str, tuple[tuple[Any, types.ModuleType], ...]]:
    """The text of ``obj`` (a function or class of tests/, or a string of ``module``) and the functions, classes and
    strings it names (through its module's globals, or a ``from test_x import helper`` of tests/ in it)."""
    path = inspect.getsourcefile(obj) if inspect.isfunction(obj) or inspect.isclass(obj) else None
    if path and path.startswith(TESTS):
        top_level = obj.__qualname__ == obj.__name__
        text = (top_level and _definitions(path).get(obj.__name__)) or inspect.getsource(obj)
        module = sys.modules[obj.__module__]  # its names are its module's
    elif isinstance(obj, str):
        text = obj
    else:
        return "", ()
    names = [(module, name) for name in set(re.findall(r"[A-Za-z_]\w*", text))]
    for source, imported in re.findall(r"^\s*from (\w+) import ([\w, ]+)$", text, re.MULTILINE):
        if os.path.isfile(os.path.join(TESTS, source + ".py")):
            names += [(importlib.import_module(source), name.strip()) for name in imported.split(",")]
    named = [inspect.unwrap(found) if callable(found) else found  # a fixture: the function it wraps
             for found in (getattr(owner, name, None) for owner, name in names)]
    return text, tuple((found, owner) for found, (owner, _) in zip(named, names)
                       if inspect.isfunction(found) or inspect.isclass(found) or isinstance(found, str))


def _code(item: pytest.Function) -> str:
    """The source of the test, its fixtures and, transitively, what they name (:func:`_read`)."""
    todo = [(item.obj, item.module), *((getattr(item.module, name, None), item.module) for name in item.fixturenames)]
    todo = [(inspect.unwrap(obj) if callable(obj) else obj, module) for obj, module in todo]
    seen, parts = set(), []
    while todo:
        key = todo.pop()
        if key not in seen and isinstance(key[0], (str, type, types.FunctionType)):
            seen.add(key)
            text, named = _read(*key)
            parts.append(text)
            todo += named
    return "\n".join(parts)


def tier_of(item: pytest.Item) -> str:
    marked = {m.name for m in item.iter_markers() if m.name in TIERS}
    if len(marked) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked with several tiers: {sorted(marked)}; give it one")
    if marked or not isinstance(item, pytest.Function):
        return marked.pop() if marked else "e2e"  # not a Python test function (none in tests/ so far): not a unit
    code = _code(item)
    return next((tier for tier, patterns in TIER_RULES if all(re.search(p, code) for p in patterns)), "unit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker(tier := tier_of(item)) is None:
            item.add_marker(tier)


@pytest.fixture
def tmpfs(tmp_path):
    """A mount point: ``tmpfs(size_kb, read_only=False)`` mounts a small tmpfs there (root only; the test is skipped
    where it cannot mount), unmounted after the test (test_faults, test_async_checkpoint, test_checkpoint_integrity)."""
    mounted = []

    def mount(size_kb: int, read_only: bool = False) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        options = f"size={size_kb}k" + (",ro" if read_only else "")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)
