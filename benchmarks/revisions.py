"""This checkout's Trainer against earlier revisions' Trainers, on the same machine, in alternating processes.

    python benchmarks/revisions.py 4e7544e 99473ed        # this checkout vs two revisions (~4 minutes)
    python benchmarks/revisions.py HEAD --procs 1 --runs 1 --epochs 2   # a smoke run

A ratio read today cannot be compared with one a past round read on another day: the same code moved by about one
point between days here (round 2's code, 1.030-1.036 when it was written, reads 1.040-1.047 now). This puts each
revision's ``taskfit`` (its trainer/, callbacks/, examples/ and conf/, from ``git archive``) in a folder of its own
and runs the interleaved harness of interleaved.py (the current one, for every revision: it uses only public API)
in a fresh process per revision and repetition, the revisions taking turns, so that a slow drift of the machine
and the luck of one process's memory layout spread over all of them. Printed per revision: the median of the
processes' median per-epoch ratios with their range, and the Trainer's and the hand-written loop's median epoch:
a ratio can move because either side did.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PACKAGE_DIRS = {"trainer": "taskfit", "callbacks": "taskfit/callbacks", "examples": "taskfit/examples",
                "conf": "taskfit/conf"}  # pyproject.toml's package-dir, fixed by the product's layout


def child(settings_name: str, runs: int, epochs: int) -> None:
    """In the revision's process: ``runs`` interleaved fits; prints their (Trainer s, hand s) per epoch as JSON."""
    sys.path.insert(0, HERE)
    import taskfit
    import torch
    from interleaved import run_interleaved
    from overhead import BREAKDOWN
    from workloads import WORKLOADS, make_data

    torch.set_num_threads(1)
    spec = WORKLOADS["tiny MLP"]
    data = make_data(spec)
    pairs = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as root:
            epoch_s, _, _ = run_interleaved(spec, data, epochs, root, **BREAKDOWN.get(settings_name, {}))
        pairs += epoch_s[1:]  # the first epoch warms up
    print(json.dumps({"taskfit": taskfit.__file__, "pairs": pairs}))


def package(revision: str | None, into: str) -> str:
    """A folder holding ``taskfit`` as ``revision`` had it (None: this working tree, uncommitted changes too)."""
    os.makedirs(into)
    source = ROOT
    if revision is not None:
        source = os.path.join(into, "src")
        os.makedirs(source)
        proc = subprocess.run(["git", "-C", ROOT, "archive", revision, *PACKAGE_DIRS], capture_output=True)
        if proc.returncode != 0:
            raise SystemExit(f"revisions.py: git cannot read revision {revision!r} here: "
                             f"{proc.stderr.decode(errors='replace').strip()}\nHINT: name a commit, tag or branch "
                             "of this repository (`git log --oneline` lists them).")
        archive = proc.stdout
        subprocess.run(["tar", "-x", "-C", source], input=archive, check=True)
    for folder, target in PACKAGE_DIRS.items():
        shutil.copytree(os.path.join(source, folder), os.path.join(into, "pkg", target),
                        ignore=shutil.ignore_patterns("__pycache__"))
    return os.path.join(into, "pkg")


def run_child(path: str, settings_name: str, runs: int, epochs: int) -> list[tuple[float, float]]:
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    env.pop("TASKFIT_SEED", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", settings_name, str(runs),
                           str(epochs)], env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"revisions.py: the run of {path} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["taskfit"].startswith(path):  # an installed taskfit took precedence: the wrong code was timed
        raise SystemExit(f"revisions.py: imported {result['taskfit']}, not the copy in {path}.")
    return [tuple(pair) for pair in result["pairs"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="*", help="git revisions to compare with this working tree")
    parser.add_argument("--procs", type=int, default=6, help="processes per revision (default 6)")
    parser.add_argument("--runs", type=int, default=2, help="interleaved fits per process (default 2)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs per fit, the first dropped (default 6)")
    parser.add_argument("--settings", default="taskfit, all off", choices=["taskfit", "taskfit, all off"],
                        help="the Trainer's defaults, or all of them off (default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        paths = {"this checkout": package(None, os.path.join(scratch, "checkout"))}
        for i, revision in enumerate(args.revisions):
            paths[revision] = package(revision, os.path.join(scratch, f"revision{i}"))
        per_process: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in paths}
        for _ in range(args.procs):  # the revisions take turns
            for name, path in paths.items():
                per_process[name].append(run_child(path, args.settings, args.runs, args.epochs))
    print(f"\nInterleaved, tiny MLP, {args.settings!r}; {args.procs} processes per revision x {args.runs} fits x "
          f"{args.epochs} epochs (first dropped). Ratio: the median over processes of each process's median "
          "per-epoch ratio to the hand-written loop.\n")
    print("| revision | ratio to hand | [min-max over processes] | Trainer epoch (ms) | hand epoch (ms) |")
    print("|---|---|---|---|---|")
    for name, processes in per_process.items():
        ratios = [statistics.median(t / h for t, h in pairs) for pairs in processes]
        trainer = statistics.median(t for pairs in processes for t, _ in pairs) * 1e3
        hand = statistics.median(h for pairs in processes for _, h in pairs) * 1e3
        print(f"| {name} | {statistics.median(ratios):.4f} | [{min(ratios):.4f}-{max(ratios):.4f}] | "
              f"{trainer:.1f} | {hand:.1f} |")


if __name__ == "__main__":
    if "--child" in sys.argv:
        settings_name, runs, epochs = sys.argv[sys.argv.index("--child") + 1:][:3]
        child(settings_name, int(runs), int(epochs))
    else:
        main()
