"""The docs are part of the product: the site builds strictly, marked examples run, and nothing drifts.

- ``mkdocs build --strict`` passes (no broken link, no missing page, every API object resolves).
- Every ```python block preceded by ``<!-- test -->`` runs: the marked blocks of one page run in order, as one
  script (``__main__``), in a fresh process forked from a runner that imported torch once; a failure is
  confirmed in a plain ``python script.py`` before it is reported.
- docs/troubleshooting.md documents every error taskfit raises: the ``raise``-able error classes (subclasses of
  ``TaskfitError``) constructed anywhere in ``trainer/`` and ``callbacks/`` are found with ``ast``; each message
  must be matched by an example in a ```text block of the page (``ClassName: message`` with placeholders filled
  in), and every example there must still match a message the code raises.
- docs/trainer.md names every ``Trainer`` argument, docs/callbacks.md every hook, docs/api.md every callback.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SOURCES = ("trainer", "callbacks", "examples")  # every folder of the taskfit package


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TASKFIT_QUICK="1", PYTHONUNBUFFERED="1")
    env.pop("TASKFIT_SEED", None)
    return env


# ---- the site ---------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs/mkdocstrings-python are not installed (pip install -e '.[docs]')")
def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                             "--config-file", str(ROOT / "mkdocs.yml")], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=240)
    problems = [line for line in result.stderr.splitlines() if re.match(r"(WARNING|ERROR)\b", line.strip())]
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or [result.stderr[-4000:]])
    assert (tmp_path / "site" / "api" / "index.html").is_file()


# ---- runnable examples in the pages ---------------------------------------------------------------------
_MARKED = re.compile(r"<!--\s*test\s*-->[ \t]*\n(?:[ \t]*\n)*```python[^\n]*\n(.*?)\n```", re.S)


def _marked_blocks(text: str) -> list[tuple[int, str]]:
    """(line, code) of every ```python block preceded by ``<!-- test -->`` (blank lines may separate them)."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _MARKED.finditer(text)]


def _pages_with_blocks() -> list[Path]:
    return [p for p in sorted(DOCS.glob("**/*.md")) if _marked_blocks(p.read_text(encoding="utf-8"))]


def test_marker_convention():
    """Only blocks right after the marker are collected, with their line numbers and whole bodies."""
    text = ("# Page\n<!-- test -->\n```python\na = 1\n\nb = 2\n```\n\n```python\nnot_run()\n```\n"
            "<!-- test -->\n\n```python\nc = 3\n```\n```bash\n<!-- test -->\n```\n")
    assert _marked_blocks(text) == [(4, "a = 1\n\nb = 2"), (15, "c = 3")]
    assert _marked_blocks((DOCS / "quickstart.md").read_text(encoding="utf-8")), "quickstart has tested blocks"


# The blocks of a page run as one script in a fresh process, as a user would run them. To avoid paying the
# imports of torch, tensorboard, sklearn... once per page, a runner process imports them once and forks a
# child per page (the child chdirs to the page's tmp dir and runs the script as __main__). A page that fails
# in the forked child is re-run in a plain `python script.py` before it is reported, so fork-specific
# behaviour can never make a page fail.
_RUNNER = r"""
import json, os, runpy, signal, sys, time, traceback
import torch
torch.set_num_threads(1)
import torchmetrics, tqdm, taskfit, taskfit.callbacks
for name in ("taskfit.callbacks.tensorboard", "taskfit.callbacks.checkpoint", "taskfit.callbacks.throughput",
             "taskfit.callbacks.progress", "taskfit.callbacks.summary", "taskfit.callbacks.lr_monitor",
             "taskfit.callbacks.early_stopping", "sklearn.datasets"):
    try:
        __import__(name)
    except Exception:
        pass
# Warm up what every page pays on first use (creating the first optimizer imports torch._dynamo: seconds).
_w = torch.nn.Linear(2, 1)
_opt = torch.optim.SGD(_w.parameters(), lr=0.1)
_w(torch.zeros(1, 2)).sum().backward()
_opt.step()
del _w, _opt
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.chdir(job["cwd"])
            out = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            sys.argv = [job["script"]]
            sys.path[0] = os.path.dirname(job["script"])
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    deadline = time.monotonic() + job["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = 124 << 8
            break
        time.sleep(0.05)
    rc = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status >> 8
    print(json.dumps({"rc": rc}), flush=True)
os._exit(0)  # stdin closed: skip the interpreter's slow teardown of torch
"""


class _Runner:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _RUNNER], cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready", "the docs runner did not start"

    def run(self, script: Path, timeout: float) -> tuple[int, str]:
        log = script.with_suffix(".log")
        self.proc.stdin.write(json.dumps({"script": str(script), "cwd": str(script.parent), "log": str(log),
                                          "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        rc = json.loads(self.proc.stdout.readline())["rc"]
        return rc, log.read_text(errors="replace") if log.exists() else ""

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def runner():
    if not hasattr(os, "fork"):
        yield None
        return
    r = _Runner()
    yield r
    r.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the forking runner needs os.fork")
def test_runner_reports_failures(tmp_path, runner):
    """The runner's verdict can fail: an exception, an exit status and a hang are all reported."""
    cases = {"ok.py": ("print('fine')", 0), "boom.py": ("raise ValueError('boom')", 1),
             "exit.py": ("import sys; sys.exit(3)", 3), "hang.py": ("import time; time.sleep(60)", 124)}
    for name, (code, expected) in cases.items():
        (tmp_path / name).write_text(code)
        rc, output = runner.run(tmp_path / name, timeout=2)
        assert rc == expected, (name, rc, output)
    assert "ValueError: boom" in runner.run(tmp_path / "boom.py", timeout=10)[1]


@pytest.mark.parametrize("page", _pages_with_blocks(), ids=lambda p: str(p.relative_to(DOCS)))
def test_marked_code_blocks_run(page, tmp_path, runner):
    parts = [f"# ---- {page.relative_to(ROOT)}, block at line {line} ----\n{code}\n"
             for line, code in _marked_blocks(page.read_text(encoding="utf-8"))]
    script = tmp_path / "doc_blocks.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + "\n".join(parts), encoding="utf-8")
    if runner is not None:
        rc, output = runner.run(script, timeout=180)
        if rc == 0:
            return
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, (
        f"the <!-- test --> blocks of {page.relative_to(ROOT)} failed (exit {result.returncode}); script: {script}\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")


# ---- every error taskfit raises is documented -----------------------------------------------------------
@dataclass
class ErrorSite:
    cls: str
    where: str
    message: re.Pattern[str] | None  # None: the message is not a literal/f-string we can read
    hint: re.Pattern[str] | None
    text: str  # the message with placeholders shown as {...}


def _error_classes(files: list[Path]) -> set[str]:
    """TaskfitError and every class that derives from it (transitively) in the sources."""
    bases: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(
                    b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute)))
    found, grew = {"TaskfitError"}, True
    while grew:
        new = {name for name, parents in bases.items() if parents & found} - found
        found |= new
        grew = bool(new)
    return found


def _pattern(node: ast.AST | None, assigned: dict[str, ast.AST]) -> tuple[str, str] | None:
    """(regex, readable) for a str constant, f-string, implicit/explicit concatenation; None if unreadable."""
    if node is None:
        return None
    if isinstance(node, ast.Name) and node.id in assigned:
        return _pattern(assigned[node.id], {})
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value), node.value
    if isinstance(node, ast.JoinedStr):
        regex, text = "", ""
        for part in node.values:
            if isinstance(part, ast.Constant):
                regex, text = regex + re.escape(part.value), text + part.value
            else:
                regex, text = regex + ".*?" if not regex.endswith(".*?") else regex, text + "{...}"
        return regex, text
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _pattern(node.left, assigned), _pattern(node.right, assigned)
        left = left or (".*?", "{...}")
        right = right or (".*?", "{...}")
        return left[0] + right[0], left[1] + right[1]
    return None


def _error_sites() -> list[ErrorSite]:
    files = [p for src in SOURCES for p in sorted((ROOT / src).rglob("*.py"))]
    classes = _error_classes(files)
    sites = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]:
            assigned = {t.id: n.value for n in ast.walk(func) if isinstance(n, ast.Assign)
                        for t in n.targets if isinstance(t, ast.Name)}
            body_nodes = func.body if isinstance(func, ast.Module) else [func]
            for node in (n for b in body_nodes for n in ast.walk(b)):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.id if isinstance(node.func, ast.Name) else (
                    node.func.attr if isinstance(node.func, ast.Attribute) else None)
                if name not in classes or (path.name == "errors.py" and name == "TaskfitError"):
                    continue
                kwargs = {k.arg: k.value for k in node.keywords}
                what = node.args[0] if node.args else kwargs.get("what")
                hint = node.args[1] if len(node.args) > 1 else kwargs.get("hint")
                message, hint_pattern = _pattern(what, assigned), _pattern(hint, assigned)
                sites.append(ErrorSite(
                    name, f"{path.relative_to(ROOT)}:{node.lineno}",
                    re.compile(message[0], re.S) if message else None,
                    re.compile(hint_pattern[0], re.S) if hint_pattern else None,
                    message[1] if message else "<not a literal>"))
    unique = {(s.cls, s.where): s for s in sites}  # a node is visited from its function and from the module
    return sorted(unique.values(), key=lambda s: s.where)


_EXAMPLE = re.compile(r"```text\n(?:[\w.]+\.)?(\w+Error): (.*?)\n```", re.S)


def _documented_examples() -> list[tuple[str, str, str | None]]:
    """(class, message, hint or None) of every ```text block of troubleshooting.md that shows an error."""
    page = DOCS / "troubleshooting.md"
    text = page.read_text(encoding="utf-8") if page.exists() else ""
    out = []
    for m in _EXAMPLE.finditer(text):
        body = m.group(2)
        message, _, hint = body.partition("\n  HINT: ")
        out.append((m.group(1), " ".join(message.split()), " ".join(hint.split()) or None))
    return out


def test_error_scanner_finds_known_errors():
    """Guard the scanner: errors that certainly exist in the core are found, with their readable text."""
    sites = _error_sites()
    texts = {s.text for s in sites}
    assert ("Trainer(gradient_clip_val={...}) is not valid.") in texts
    assert any(s.cls == "TaskModuleError" and "does not define `{...}`, which {...} needs." in s.text for s in sites)
    assert any(s.cls == "NonFiniteLossError" for s in sites)
    unreadable = [f"{s.where} ({s.cls})" for s in sites
                  if s.message is None or len(s.text.replace("{...}", "").strip()) < 8]  # too little fixed text
    assert not unreadable, ("these errors are raised with a message that is not a string literal or f-string, so "
                            "docs/troubleshooting.md cannot be checked against them: " + ", ".join(unreadable))


def _matches(site: ErrorSite, example: tuple[str, str, str | None]) -> bool:
    cls, message, hint = example
    if cls != site.cls or site.message is None or not site.message.fullmatch(message):
        return False
    return hint is None or site.hint is None or bool(site.hint.fullmatch(hint))


def test_troubleshooting_documents_every_error():
    sites = [s for s in _error_sites() if s.message is not None]
    examples = _documented_examples()
    missing = [s for s in sites if not any(_matches(s, e) for e in examples)]
    stale = [e for e in examples if not any(_matches(s, e) for s in sites)]
    report = []
    if missing:
        report.append("errors raised in the code but not documented in docs/troubleshooting.md (add a section with "
                      "a ```text block `ClassName: <message as printed>` and its HINT line, then cause and fix):")
        report += [f"  {s.where}  {s.cls}: {s.text}" for s in missing]
    if stale:
        report.append("examples in docs/troubleshooting.md that no error in the code produces any more "
                      "(message or HINT changed?):")
        report += [f"  {cls}: {message}" + (f"\n    HINT: {hint}" if hint else "") for cls, message, hint in stale]
    assert not report, "\n".join(report)


# ---- reference pages name everything they describe -----------------------------------------------------------
def test_trainer_page_documents_every_argument():
    """Every argument of ``Trainer.__init__`` has a row ``| `name` | `default` | meaning |`` in docs/trainer.md's
    tables, in which the default is the signature's (a Python literal), and no row names an argument it lacks."""
    from taskfit import Trainer

    params = {k: p.default for k, p in inspect.signature(Trainer.__init__).parameters.items() if k != "self"}
    page = (DOCS / "trainer.md").read_text(encoding="utf-8")
    tables = page[: page.index("| method | returns |")] if "| method | returns |" in page else page
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`|]*)` \|", tables, re.M))
    missing = [p for p in params if p not in rows]
    assert params and not missing, f"docs/trainer.md does not document Trainer arguments: {missing}"
    assert not set(rows) - set(params), f"docs/trainer.md documents arguments Trainer lacks: {set(rows) - set(params)}"
    wrong = {k: (rows[k], v) for k, v in params.items() if ast.literal_eval(rows[k]) != v}
    assert not wrong, f"docs/trainer.md defaults differ from the signature (page, signature): {wrong}"


def test_callbacks_page_documents_every_hook():
    from taskfit.callbacks import HOOKS

    page = (DOCS / "callbacks.md").read_text(encoding="utf-8")
    missing = [h for h in HOOKS + ("state_dict", "load_state_dict", "order", "should_stop") if f"`{h}`" not in page]
    assert not missing, f"docs/callbacks.md does not document: {missing}"


def test_api_page_covers_every_callback_and_strategy():
    import importlib

    from taskfit import callbacks
    from taskfit.strategies.base import Strategy

    page = (DOCS / "api.md").read_text(encoding="utf-8")
    # mkdocstrings reads the source folders: taskfit.<m> is trainer/<m>.py, taskfit.callbacks.<m> is callbacks/<m>.py
    # (subpackages included: taskfit.strategies.ddp is trainer/strategies/ddp.py)
    strategies = [f"::: trainer.{module}.{name}" for module in ("strategies.base", "strategies.ddp", "strategies.fsdp")
                  for name, obj in vars(importlib.import_module(f"taskfit.{module}")).items()
                  if isinstance(obj, type) and issubclass(obj, Strategy) and obj.__module__ == f"taskfit.{module}"
                  and not name.startswith("_")]
    wanted = [f"::: callbacks{callbacks.LAZY[name]}.{name}" for name in callbacks.LAZY] + strategies + [
        "::: trainer.Trainer", "::: trainer.TaskModule", "::: trainer.callback.Callback"]
    assert len(strategies) >= 3, strategies
    missing = [w for w in wanted if w not in page]
    assert not missing, f"docs/api.md lacks: {missing}"


def test_concepts_maps_every_module_of_the_package():
    """docs/concepts.md's "The modules, one line each" names every module of taskfit by its path in the package
    (`loop/run.py` for trainer/loop/run.py, `callbacks/loggers/csv_logger.py` for callbacks/loggers/csv_logger.py),
    names no module that does not exist, and "The layout" names every subpackage as a folder (`loop/`)."""
    page = (DOCS / "concepts.md").read_text(encoding="utf-8")
    table = page[page.index("## The modules, one line each"):page.index("## One batch, call by call")]
    layout = page[page.index("## The layout"):page.index("## The layers")]
    modules, folders = set(), set()
    for folder, prefix in (("trainer", ""), ("callbacks", "callbacks/")):
        for dirpath, dirnames, files in os.walk(ROOT / folder):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = Path(dirpath).relative_to(ROOT / folder).as_posix()
            here = prefix + ("" if rel == "." else rel + "/")
            if here:
                folders.add(here.rstrip("/").rsplit("/", 1)[-1] + "/")
            modules.update(here + name for name in files if name.endswith(".py") and name != "__init__.py")
    assert {"trainer.py", "loop/run.py", "callbacks/progress.py", "callbacks/loggers/csv_logger.py"} <= modules
    missing = sorted(m for m in modules if f"| `{m}` |" not in table)
    assert not missing, f"docs/concepts.md's module table lacks: {missing}"
    named = set(re.findall(r"^\| `([^`]+\.py)` \|", table, re.M))
    assert not named - modules, f"docs/concepts.md's module table names modules that do not exist: {named - modules}"
    missing_folders = sorted(f for f in folders if not re.search(rf"[\s─]{re.escape(f)}\s", layout))
    assert not missing_folders, f"docs/concepts.md's layout lacks the folders: {missing_folders}"
