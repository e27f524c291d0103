"""Simple code (the project's brief): no function over 60 lines, no class
over 400, in what ships (``sim/``). Counted from the ``def``/``class`` line
to the last line of the body, decorators excluded."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SIM = Path(__file__).resolve().parents[1] / "sim"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 400


def oversized(source: str, path: str) -> list[str]:
    """Every function over 60 lines and class over 400 in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
            found.append(f"{path} function {node.name}: {lines} lines (line {node.lineno})")
        elif isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
            found.append(f"{path} class {node.name}: {lines} lines (line {node.lineno})")
    return found


def test_no_function_over_60_lines_and_no_class_over_400():
    found = [
        problem
        for path in sorted(SIM.rglob("*.py"))
        for problem in oversized(path.read_text(), str(path.relative_to(SIM.parent)))
    ]
    assert found == []


@pytest.mark.parametrize(("body_lines", "expected"), [(59, 0), (60, 1)])
def test_the_count_finds_a_function_one_line_too_long(body_lines, expected):
    """Control: a function of 61 lines (the def and 60 body lines) is found,
    one of 60 is not."""
    source = "def f():\n" + "    x = 1\n" * body_lines
    assert len(oversized(source, "f.py")) == expected
