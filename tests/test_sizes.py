"""No class in ocache/ over 450 lines and no function over 80 (docs/architecture.md §0 Layout:
one room per concern). No server needed.

A size is ``end_lineno - lineno + 1`` of the ``ast`` node: the ``class``/``def`` line through its
last line, docstring and nested definitions included, decorators not. A function nested in
another, or a method, is measured on its own as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CLASS = 450
MAX_FUNCTION = 80


def oversized(source: str, where: str = "<source>") -> list[str]:
    """``"where:LINE Name N lines"`` for each class over ``MAX_CLASS`` and each function (method,
    nested function) over ``MAX_FUNCTION`` lines in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            limit = MAX_CLASS
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit = MAX_FUNCTION
        else:
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > limit:
            out.append(f"{where}:{node.lineno} {node.name} {lines} lines (at most {limit})")
    return out


def test_checker_catches_a_451_line_class_and_an_81_line_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(450))
    assert oversized(f"class Big:\n{body}\n") == ["<source>:1 Big 451 lines (at most 450)"]
    assert oversized(f"class Fits:\n{body[: body.rindex(chr(10))]}\n") == []
    fbody = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert oversized(f"def big():\n{fbody}\n") == ["<source>:1 big 81 lines (at most 80)"]


def test_no_class_over_450_lines_and_no_function_over_80():
    found = []
    for path in sorted((ROOT / "ocache").rglob("*.py")):
        found += oversized(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []
