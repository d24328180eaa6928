"""The house's size bounds (issue 19): no function over 60 lines and no class over 400
lines in ``src/fulcrum`` (the generated ``fulcrum.v1`` left out)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fulcrum"
MAX_FUNCTION, MAX_CLASS = 60, 400


def _too_long(tree: ast.AST, where: str) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            bound = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
            if lines > bound:
                out.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_the_check_sees_a_long_function() -> None:
    body = "def f():\n" + "    x = 1\n" * 70
    assert _too_long(ast.parse(body), "t") == ["t:1 f (71 lines)"]


def test_no_function_over_60_lines_and_no_class_over_400() -> None:
    files = [p for p in SRC.rglob("*.py") if "v1" not in p.relative_to(SRC).parts]
    assert len(files) > 100
    found = [x for p in files for x in _too_long(ast.parse(p.read_text()), str(p))]
    assert found == []
