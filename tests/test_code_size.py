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
# Written exceptions, each argued, with their own limit. The scheduler twin
# mirrors vLLM's ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``), which
# is one class: kept one class in one file, it diffs against upstream
# method by method, and its state is declared once (split into stateless
# bases to fit 400 lines, each base declared again the ``self`` it read,
# and a diff meant reading six files). vLLM's is over 1,500 lines; kvsim's
# reduced twin stays well under this limit.
CLASS_EXCEPTIONS = {("sim/sched/scheduler.py", "Scheduler"): 800}


def _class_limit(path: str, name: str) -> int:
    return CLASS_EXCEPTIONS.get((path, name), MAX_CLASS_LINES)


def oversized(source: str, path: str) -> list[str]:
    """Every function over 60 lines and class over 400 in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        lines = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
            found.append(f"{path} function {node.name}: {lines} lines (line {node.lineno})")
        elif isinstance(node, ast.ClassDef) and lines > CLASS_EXCEPTIONS.get(
            (path, node.name), MAX_CLASS_LINES
        ):
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


def test_a_class_over_its_written_exception_is_found():
    """Control: the scheduler's exception holds for it alone, and only to
    its own limit."""
    body = "    x = 1\n" * 500
    source = "class Scheduler:\n" + body
    assert oversized(source, "sim/sched/scheduler.py") == []
    assert len(oversized(source, "sim/sched/other.py")) == 1
    assert len(oversized("class Scheduler:\n" + "    x = 1\n" * 800, "sim/sched/scheduler.py")) == 1
