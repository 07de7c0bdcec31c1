"""The package's layer rule, read from the source (docs/concepts.md, "The layers").

Every import of the package (``from .x import``, at any depth, inside functions and ``if TYPE_CHECKING:`` blocks
too) goes to a module of the same layer or a lower one, the imports form no circle, and nothing outside trainer.py
sets an attribute on the Trainer.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = (("trainer", "taskfit"), ("callbacks", "taskfit.callbacks"))

# Lowest first. A module belongs to the first entry that is its name or a package above it.
LAYERS = (
    ("leaves", ("taskfit.errors", "taskfit.version", "taskfit.console", "taskfit.cluster", "taskfit.seed",
                "taskfit.state", "taskfit.init_args", "taskfit.arguments", "taskfit.optim", "taskfit.callback")),
    ("domains", ("taskfit.data", "taskfit.precision", "taskfit.strategies", "taskfit.checkpoint",
                 "taskfit.logs")),
    ("user classes", ("taskfit.module", "taskfit.datamodule")),
    ("loop", ("taskfit.loop",)),
    ("callbacks", ("taskfit.callbacks", "taskfit.profilers")),
    ("lightning layer", ("taskfit.compat.lightning",)),
    ("trainer", ("taskfit.trainer",)),
    ("entry points", ("taskfit.cli", "taskfit.tools", "taskfit.__main__", "taskfit.consolidate",
                      "taskfit.compat.old_paths", "taskfit.compat", "taskfit")),
)


def _modules() -> dict[str, str]:
    found = {}
    for folder, package in FOLDERS:
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, files in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = os.path.relpath(dirpath, base)
            parts = [] if rel == "." else rel.split(os.sep)
            if package == "taskfit" and parts[:1] == ["callbacks"]:
                continue
            for name in files:
                if name.endswith(".py"):
                    stem = name[:-3]
                    dotted = ".".join([package, *parts] + ([] if stem == "__init__" else [stem]))
                    found[dotted] = os.path.join(dirpath, name)
    return found


MODULES = _modules()


def layer_of(module: str) -> int:
    for rank, (_, owners) in enumerate(LAYERS):
        if any(module == o or module.startswith(o + ".") for o in owners):
            return rank
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py's LAYERS: add it where it belongs")


def _imports(module: str, path: str) -> set[str]:
    """The package's modules that ``module`` imports, every import counted (TYPE_CHECKING, function level)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                targets.add(full if full in MODULES else target)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
    return {t for t in targets if t in MODULES and t != module}


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_go_down_the_layers_only():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in sorted(GRAPH.items()) for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_no_import_circle_counting_type_checking_and_function_imports():
    # A package's __init__ may import its own submodules; a submodule importing its package's __init__ is an edge.
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_core_never_imports_the_trainer_nor_the_callbacks():
    core = [m for m in MODULES if layer_of(m) <= layer_of("taskfit.loop")]
    offenders = [f"{m} imports {t}" for m in core for t in GRAPH[m]
                 if t == "taskfit.trainer" or t.startswith("taskfit.callbacks")]
    assert not offenders, "\n".join(offenders)


def _trainer_assignments(path: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            leaves = target.elts if isinstance(target, ast.Tuple) else [target]
            for leaf in leaves:
                if isinstance(leaf, ast.Subscript):  # trainer.hooks[name] = ...: the Trainer's (or run's) table
                    leaf = leaf.value
                if isinstance(leaf, ast.Attribute) and ast.unparse(leaf.value) in ("trainer", "self.trainer",
                                                                                    "run.trainer"):
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(leaf)} = ...")
    return found


def test_nothing_outside_trainer_py_sets_a_trainer_attribute():
    found = [line for module, path in MODULES.items() if module != "taskfit.trainer"
             for line in _trainer_assignments(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module", ["taskfit.loop.run", "taskfit.loop.steps", "taskfit.loop.evaluation"])
def test_the_run_is_declared_where_the_loop_reads_it(module):
    """Every ``run.<name>`` the loop's modules read is a field or method of loop/run.py's Run (no late-bound
    attribute: go-to-definition on ``run.backward`` finds its declaration)."""
    import dataclasses

    from taskfit.loop.run import Run

    declared = {f.name for f in dataclasses.fields(Run)} | {n for n in vars(Run) if not n.startswith("__")}
    paths = [MODULES["taskfit.trainer"], MODULES[module], MODULES["taskfit.loop.lifecycle"],
             MODULES["taskfit.loop.checkpointing"]]
    used = set()
    for path in paths:
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "run":
                used.add(node.attr)
    assert used - declared == set()
