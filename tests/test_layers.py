"""The package's layer rule, read from the source (docs/concepts.md, "The layers").

Every import of the package (``from .x import``, at any depth, inside functions and ``if TYPE_CHECKING:`` blocks
too) goes to a module of the same layer or a lower one, the imports form no circle, and nothing outside trainer.py
sets an attribute on the Trainer. Every module is in a declared layer, and nothing below the Trainer
(the domains and the loop) reads one of its attributes: they read the Run's configuration
(``run.config``). The last tests prove each of these checks can fail.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = (("trainer", "taskfit"), ("callbacks", "taskfit.callbacks"))

Layers = tuple[tuple[str, tuple[str, ...]], ...]

# Lowest first. Every module is listed: ``name`` is that module only, ``name.*`` a package and every
# module in it. A module in no entry fails (test_every_module_is_in_a_layer): a new top-level module
# must be placed here.
LAYERS: Layers = (
    ("leaves", ("taskfit.errors", "taskfit.version", "taskfit.console", "taskfit.cluster",
                "taskfit.seed", "taskfit.state", "taskfit.init_args", "taskfit.arguments",
                "taskfit.optim", "taskfit.callback", "taskfit.trainer_config")),
    ("domains", ("taskfit.data.*", "taskfit.precision", "taskfit.strategies.*",
                 "taskfit.checkpoint.*", "taskfit.logs.*")),
    ("user classes", ("taskfit.module", "taskfit.datamodule")),
    ("loop", ("taskfit.loop.*",)),
    ("callbacks", ("taskfit.callbacks.*", "taskfit.profilers.*")),
    ("lightning layer", ("taskfit.compat.lightning.*",)),
    ("trainer", ("taskfit.trainer",)),
    ("entry points", ("taskfit.cli.*", "taskfit.tools.*", "taskfit.__main__", "taskfit.consolidate",
                      "taskfit.compat.old_paths", "taskfit.compat", "taskfit")),
)

# Below the Trainer (these layers), nothing reads an attribute of the Trainer: the configuration
# is the Run's ``run.config`` (trainer_config.py), and the Trainer is only handed to hooks.
# Except where the Run is built:
CORE = ("domains", "loop")
TRAINER_NAMES = ("trainer", "run.trainer", "self.trainer", "self._trainer", "self.run.trainer")
ALLOWED_READS: dict[tuple[str, str, str], str] = {}  # (module, function, attribute): why; none


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


def layer_of(module: str, layers: Layers = LAYERS) -> int:
    for rank, (_, owners) in enumerate(layers):
        for owner in owners:
            package = owner[:-2] if owner.endswith(".*") else None
            inside = package is not None and (module == package or module.startswith(package + "."))
            if module == owner or inside:
                return rank
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py's LAYERS: add it where it belongs")


def _source(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _imports(module: str, path: str, source: str | None = None) -> set[str]:
    """The package's modules that ``module`` imports, every import counted (TYPE_CHECKING, function level)."""
    tree = ast.parse(_source(path) if source is None else source)
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


def upward_imports(graph: dict[str, set[str]], layers: Layers = LAYERS) -> list[str]:
    def rank(module: str) -> int:
        return layer_of(module, layers)
    return [f"{m} ({layers[rank(m)][0]}) imports {t} ({layers[rank(t)][0]})"
            for m, targets in sorted(graph.items()) for t in sorted(targets) if rank(t) > rank(m)]


def test_imports_go_down_the_layers_only():
    upward = upward_imports(GRAPH)
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
    tree = ast.parse(_source(path))
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
        for node in ast.walk(ast.parse(_source(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "run":
                used.add(node.attr)
    assert used - declared == set()


# ---- attribute reaches: below the Trainer nothing reads the Trainer ------------------------
def trainer_reads(module: str, source: str) -> list[str]:
    """Each ``trainer.x`` / ``run.trainer.x`` (and ``getattr(trainer, "x")``) that ``module``'s
    source reads, as ``module:line function: read``, except :data:`ALLOWED_READS`. Handing the
    Trainer on (``fn(run.trainer, task)``, ``task.trainer = run.trainer``) is not a read."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        read = None
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in TRAINER_NAMES:
            read = node.attr
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr")
              and len(node.args) > 1 and ast.unparse(node.args[0]) in TRAINER_NAMES
              and isinstance(node.args[1], ast.Constant)):
            read = str(node.args[1].value)
        if read is not None and (module, function, read) not in ALLOWED_READS:
            found.append(f"{module}:{node.lineno} {function}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def _core_modules() -> list[str]:
    core = {rank for rank, (name, _) in enumerate(LAYERS) if name in CORE}
    return sorted(m for m in MODULES if layer_of(m) in core)


def test_nothing_below_the_trainer_reads_a_trainer_attribute():
    """The loop, checkpoints, logs, data and strategies read the Run's configuration
    (``run.config``) and parts, never the Trainer: a new setting is a field of
    trainer_config.py's TrainerConfig, not a back door."""
    found = [line for m in _core_modules() for line in trainer_reads(m, _source(MODULES[m]))]
    assert not found, "\n".join(found)


def test_the_allowed_reads_are_few_and_still_there():
    """At most 5 reads where the Run is built, each one still in the source: an allowance
    nothing uses is removed, not kept."""
    built = [key for key in ALLOWED_READS if key[1] in ("new_run", "_attach")]
    assert len(built) <= 5
    for module, function, attribute in ALLOWED_READS:
        tree = ast.parse(_source(MODULES[module]))
        body = next(n for n in ast.walk(tree)
                    if isinstance(n, ast.FunctionDef) and n.name == function)
        names = {n.attr for n in ast.walk(body) if isinstance(n, ast.Attribute)}
        names |= {n.value for n in ast.walk(body) if isinstance(n, ast.Constant)}
        assert attribute in names, (module, function, attribute)


# ---- the checks can fail: each mutation the issue found unseen is reported -----------------
def test_a_loop_module_reaching_through_run_trainer_is_reported():
    """Issue 44 (a): a loop module reading ``run.trainer.checkpoint_callback.best_model_path``."""
    source = _source(MODULES["taskfit.loop.evaluation"]) + (
        "\n\ndef best(run):\n    return run.trainer.checkpoint_callback.best_model_path\n")
    assert trainer_reads("taskfit.loop.evaluation", source) == [
        "taskfit.loop.evaluation:%d best: run.trainer.checkpoint_callback" % (source.count("\n"))]


@pytest.mark.parametrize("read", ["trainer.max_epochs", "trainer.accumulate_grad_batches",
                                  "getattr(trainer, 'limits')", "self.trainer.log_every_n_steps"])
def test_a_configuration_read_below_the_trainer_is_reported(read):
    source = f"def cadence(trainer, self=None):\n    return {read}\n"
    for module in ("taskfit.data.loaders", "taskfit.strategies.ddp", "taskfit.checkpoint.files",
                   "taskfit.logs.buffer", "taskfit.loop.lifecycle"):
        assert len(trainer_reads(module, source)) == 1, (module, read)


def test_handing_the_trainer_to_a_hook_is_not_a_read():
    source = ("def call(run, fn):\n    fn(run.trainer, run.task)\n"
              "    run.task.trainer = run.trainer\n")
    assert trainer_reads("taskfit.loop.hooks", source) == []


def test_a_new_top_level_module_importing_the_trainer_is_reported():
    """Issue 44 (b): a new ``trainer/helpers.py`` that imports the Trainer is in no layer (the
    table lists modules, so ``taskfit`` itself no longer takes in every top-level module), and once
    placed low, its import goes up."""
    source = "from .trainer import Trainer\n"
    path = os.path.join(ROOT, "trainer", "helpers.py")
    with pytest.raises(AssertionError, match="taskfit.helpers is in no layer"):
        layer_of("taskfit.helpers")
    assert _imports("taskfit.helpers", path, source) == {"taskfit.trainer"}
    graph = {**GRAPH, "taskfit.helpers": _imports("taskfit.helpers", path, source)}
    placed = ((LAYERS[0][0], LAYERS[0][1] + ("taskfit.helpers",)), *LAYERS[1:])
    assert upward_imports(graph, placed) == [
        "taskfit.helpers (leaves) imports taskfit.trainer (trainer)"]


@pytest.mark.parametrize("module", ["taskfit.helpers", "taskfit.compat.shim",
                                    "taskfit.trainer_helpers", "taskfit.callbacks_extra"])
def test_a_module_in_no_declared_layer_is_reported(module):
    with pytest.raises(AssertionError, match=f"{module} is in no layer"):
        layer_of(module)
