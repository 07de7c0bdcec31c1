"""Lightning's own public-API tests, run against taskfit: the specification for issue 46.

    fetch github:Lightning-AI/pytorch-lightning            # the snapshot (a git directory)
    python benchmarks/lightning_tests.py                   # the 21 files below, one pytest process each
    python benchmarks/lightning_tests.py --only hooks csv  # some of them (names: the FILES keys)
    python benchmarks/lightning_tests.py --save after.json --compare before.json
    python benchmarks/lightning_tests.py --revision 97290ad --save before.json   # taskfit as of a commit

The files are taken from the snapshot (``--git``, default the fetched mirror; ``--rev``, default HEAD) into
``--out`` (default ./lightning_tests_runs) at every run: nothing of Lightning's is stored in this repository.
Their imports are pointed at taskfit by ``benchmarks/lightning_shim.py`` (an import finder: the guide's
rename, Lightning's test helpers loaded from the snapshot, placeholders for the rest); ``RunIf`` skips what
this machine cannot run. Each test is counted once:

- passed, failed (a test error, a setup error or its file not collected counts as failed);
- internal: failed on a private name of Lightning's (a placeholder used, a ``trainer._x``/loop attribute,
  ``mock.patch`` of a Lightning path): out of reach of an import rename, left out of the denominator;
- skipped: RunIf's platform requirements (GPUs, standalone multi-process runs, missing packages).

``--revision`` runs them against taskfit as of a git revision of this repository (its package assembled under
``--out``, ahead of the installed one on the path) instead of the working tree.

The report: per file and in total, "passed of in reach" (in reach = tests - internal - skipped), then the
failures grouped by their first error line, most frequent first.
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import io

HERE = os.path.dirname(os.path.abspath(__file__))
MIRROR = "/work/.mirror/Lightning-AI+pytorch-lightning/repo"
ROOT = "tests/tests_pytorch"
FILES = {  # name: the file under tests/tests_pytorch, by area (issue 46)
    "early_stopping": "callbacks/test_early_stopping.py",
    "model_checkpoint": "checkpointing/test_model_checkpoint.py",
    "trainer_checkpoint": "checkpointing/test_trainer_checkpoint.py",
    "train_loop_logging": "trainer/logging_/test_train_loop_logging.py",
    "eval_loop_logging": "trainer/logging_/test_eval_loop_logging.py",
    "hooks": "models/test_hooks.py",
    "check_val_every_n_epoch": "trainer/flags/test_check_val_every_n_epoch.py",
    "val_check_interval": "trainer/flags/test_val_check_interval.py",
    "fast_dev_run": "trainer/flags/test_fast_dev_run.py",
    "limit_batches": "trainer/flags/test_limit_batches.py",
    "csv": "loggers/test_csv.py",
    "tensorboard": "loggers/test_tensorboard.py",
    "lr_monitor": "callbacks/test_lr_monitor.py",
    "lr_finder": "tuner/test_lr_finder.py",
    "scale_batch_size": "tuner/test_scale_batch_size.py",
    "weight_averaging": "callbacks/test_weight_averaging.py",
    "swa": "callbacks/test_stochastic_weight_avg.py",
    "finetuning": "callbacks/test_finetuning_callback.py",
    "datamodules": "core/test_datamodules.py",
    "manual_optimization": "trainer/optimization/test_manual_optimization.py",
    "multiple_optimizers": "trainer/optimization/test_multiple_optimizers.py",
}
# A failure on one of these is Lightning's machinery, not its public API
INTERNAL = re.compile(r"LightningInternal|(has no|does not have the) attribute '(_\w+|\w+_loop|strategy|"
                      r"accelerator|precision_plugin)'|<module '(lightning|pytorch_lightning)|"
                      r"Strategy' object has no attribute")
# A failed test whose code mocks one of Lightning's private methods tested its internals
MOCKS_PRIVATE = re.compile(r"patch(\.object)?\([^)]*[\"'.]_[a-z]\w*[\"']|\._[a-z]\w* = (Mock|MagicMock)")
CONFTEST = """pytest_plugins = ["lightning_shim"]
"""
# Also in the processes a test starts (ddp workers): the finder is installed at interpreter start
SITECUSTOMIZE = """import sys
sys.path.insert(0, {here!r})
import lightning_shim
lightning_shim.install()
"""
RUNIF = "from lightning_shim import RunIf, _xfail_gloo_windows  # noqa: F401\n"


def extract(git_dir: str, rev: str, out: str, names: list[str]) -> None:
    """The chosen files, their packages' ``__init__.py``, Lightning's test helpers; RunIf is the shim's."""
    paths = {f"{ROOT}/__init__.py", f"{ROOT}/helpers"}
    for name in names:
        parts = FILES[name].split("/")
        paths.add(f"{ROOT}/{FILES[name]}")
        paths.update(f"{ROOT}/{'/'.join(parts[:i])}/__init__.py" for i in range(1, len(parts)))
    listed = subprocess.run(["git", f"--git-dir={git_dir}", "ls-tree", "-r", "--name-only", rev, ROOT],
                            capture_output=True, text=True, check=True).stdout.split()
    wanted = [p for p in listed if p in paths or p.startswith(f"{ROOT}/helpers/")]
    tar = subprocess.run(["git", f"--git-dir={git_dir}", "archive", rev, *wanted], capture_output=True,
                         check=True).stdout
    shutil.rmtree(out, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(out, filter="data")
    tests = os.path.join(out, "tests")
    with open(os.path.join(tests, "tests_pytorch", "helpers", "runif.py"), "w") as f:
        f.write(RUNIF)
    with open(os.path.join(tests, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    with open(os.path.join(tests, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE.format(here=HERE))
    with open(os.path.join(tests, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")


def taskfit_at(revision: str, out: str) -> str:
    """A folder holding taskfit's package as of ``revision`` (pyproject's layout: trainer/ is ``taskfit``,
    callbacks/, examples/, conf/ its subpackages), to put first on PYTHONPATH."""
    repo = os.path.dirname(HERE)
    tar = subprocess.run(["git", "-C", repo, "archive", revision, "trainer", "callbacks", "examples", "conf"],
                         capture_output=True, check=True).stdout
    root = os.path.join(out, f"taskfit_{revision}")
    shutil.rmtree(root, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(root, filter="data")
    package = os.path.join(root, "taskfit")
    os.rename(os.path.join(root, "trainer"), package)
    for sub in ("callbacks", "examples", "conf"):
        os.rename(os.path.join(root, sub), os.path.join(package, sub))
    return root


def run_file(name: str, out: str, git_dir: str, rev: str, timeout: int, path: str = "") -> list[dict]:
    """One file in its own pytest process and scratch folder; its JSON records."""
    tests = os.path.join(out, "tests")
    scratch = os.path.join(out, "scratch", name)
    os.makedirs(scratch, exist_ok=True)
    records = os.path.join(out, f"{name}.jsonl")
    env = dict(os.environ, LIGHTNING_GIT=git_dir, LIGHTNING_REV=rev, LIGHTNING_TESTS_OUT=records,
               PYTHONPATH=os.pathsep.join(p for p in (path, tests) if p), TQDM_DISABLE="1")
    command = [sys.executable, "-m", "pytest", os.path.join(out, ROOT, FILES[name]), "-q", "-p", "no:randomly",
               "-p", "no:cacheprovider", "--continue-on-collection-errors", "-c", os.path.join(tests, "pytest.ini"),
               "--rootdir", tests, f"--timeout={timeout}", "--basetemp", os.path.join(scratch, "tmp")]
    subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
    return read_records(out, name)


def read_records(out: str, name: str) -> list[dict]:
    """The JSON records of file ``name``'s run under ``out``."""
    records = os.path.join(out, f"{name}.jsonl")
    if not os.path.exists(records):
        return [{"test": FILES[name], "when": "collect", "outcome": "error", "first": "pytest wrote nothing",
                 "touched": []}]
    with open(records) as f:
        return [json.loads(line) for line in f]


def test_sources(out: str, name: str) -> dict[str, str]:
    """The source of each test function of file ``name`` (as extracted under ``out``), by function name."""
    path = os.path.join(out, ROOT, FILES[name])
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        text = f.read()
    return {node.name: ast.get_source_segment(text, node) or "" for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")}


def verdicts(records: list[dict], sources: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Each test's one verdict and first error line: passed, failed, internal or skipped."""
    result: dict[str, tuple[str, str]] = {}
    for r in records:
        if r["outcome"] == "passed":
            result.setdefault(r["test"], ("passed", ""))
        elif r["outcome"] == "skipped":
            result[r["test"]] = ("skipped", r["first"])
        elif result.get(r["test"], ("passed",))[0] == "passed":
            function = r["test"].split("::")[-1].split("[")[0]
            internal = (any(t.startswith("internal:") for t in r["touched"]) or INTERNAL.search(r["first"])
                        or MOCKS_PRIVATE.search(sources.get(function, "")))
            result[r["test"]] = ("internal" if internal else "failed", r["first"])
    return result


def group_key(first: str) -> str:
    """A first error line with its run-specific parts (paths, addresses, numbers) masked."""
    first = re.sub(r"0x[0-9a-f]+", "0x.", first)
    first = re.sub(r"(/[\w.-]+)+/", ".../", first)
    first = re.sub(r"\d+(\.\d+)?", "N", first)
    return first[:160]


def report(results: dict[str, dict[str, tuple[str, str]]]) -> str:
    """The per-file table, the total and the failures grouped by first line."""
    lines = [f"{'file':26} {'tests':>5} {'passed':>6} {'failed':>6} {'internal':>8} {'skipped':>7}"]
    totals: collections.Counter = collections.Counter()
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for name, tests in results.items():
        counts = collections.Counter(v for v, _ in tests.values())
        counts["tests"] = len(tests)
        totals.update(counts)
        lines.append(f"{name:26} {counts['tests']:5} {counts['passed']:6} {counts['failed']:6} "
                     f"{counts['internal']:8} {counts['skipped']:7}")
        for test, (verdict, first) in tests.items():
            if verdict == "failed":
                groups[group_key(first)].append(f"{name}::{test.split('::', 1)[-1]}")
    lines.append(f"{'total':26} {totals['tests']:5} {totals['passed']:6} {totals['failed']:6} "
                 f"{totals['internal']:8} {totals['skipped']:7}")
    reach = totals["tests"] - totals["internal"] - totals["skipped"]
    lines.append(f"\npassed {totals['passed']} of {reach} in reach")
    lines.append("\nfailures by first error line:")
    for key, tests in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"{len(tests):4}  {key}")
        lines.extend(f"        {t}" for t in tests[:4])
        if len(tests) > 4:
            lines.append(f"        ... {len(tests) - 4} more")
    return "\n".join(lines)


def compare(before: dict, after: dict) -> str:
    """The tests whose verdict changed between two saved runs."""
    changes = []
    for name, tests in after.items():
        for test, (verdict, _) in tests.items():
            old = before.get(name, {}).get(test, ("absent", ""))[0]
            if old != verdict:
                changes.append(f"{old:>8} -> {verdict:8} {name}::{test.split('::', 1)[-1]}")
    return "changed verdicts:\n" + "\n".join(sorted(changes)) if changes else "no verdict changed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git", default=os.environ.get("LIGHTNING_GIT", MIRROR))
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--out", default=os.path.abspath("lightning_tests_runs"))
    parser.add_argument("--only", nargs="+", choices=sorted(FILES), default=list(FILES))
    parser.add_argument("--revision", help="run against taskfit as of this git revision (default: the tree)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test (a hang fails it)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: report the records an earlier run left in --out")
    parser.add_argument("--save", help="write the verdicts to this JSON file")
    parser.add_argument("--compare", help="a JSON file --save wrote: list the verdicts that changed")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.git):
        print(f"No Lightning snapshot at {args.git}. HINT: fetch github:Lightning-AI/pytorch-lightning "
              "and pass its git directory as --git.")
        return 0
    out = os.path.abspath(args.out)
    if not args.report_only:
        extract(args.git, args.rev, out, args.only)
    path = taskfit_at(args.revision, out) if args.revision and not args.report_only else ""
    results = {}
    for name in args.only:
        records = read_records(out, name) if args.report_only else run_file(name, out, args.git, args.rev,
                                                                             args.timeout, path)
        results[name] = verdicts(records, test_sources(out, name))
        print(f"{name}: {collections.Counter(v for v, _ in results[name].values())}", flush=True)
    print(report(results))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(results, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            print(compare(json.load(f), results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
