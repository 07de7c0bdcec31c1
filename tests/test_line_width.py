"""Lines a reader can hold: every line of the library's Python source fits in 100 columns.

A comment goes above the code it explains, not at the end of a long line; a long message is written
as adjacent string literals. docs/concepts.md ("Style") says why.
"""
from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("trainer", "callbacks", "examples", "conf")
WIDTH = 100

pytestmark = pytest.mark.unit


def too_long(text: str, width: int = WIDTH) -> list[int]:
    """The 1-based numbers of the lines of ``text`` longer than ``width`` columns."""
    return [i for i, line in enumerate(text.splitlines(), 1) if len(line) > width]


def _sources() -> list[str]:
    found = []
    for folder in FOLDERS:
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            found += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return sorted(found)


def test_the_check_sees_a_long_line() -> None:
    assert too_long("x = 1\n" + "y = '" + "a" * 100 + "'\n") == [2]
    assert too_long("z = " + "1" * 96 + "\n") == []


def test_library_lines_fit_in_100_columns() -> None:
    sources = _sources()
    assert len(sources) > 50
    long = []
    for path in sources:
        with open(path, encoding="utf-8") as f:
            long += [f"{os.path.relpath(path, ROOT)}:{i}" for i in too_long(f.read())]
    assert not long, (
        f"{len(long)} line(s) over {WIDTH} columns; move a trailing comment above its line and "
        "wrap the rest:\n" + "\n".join(long[:40]))
