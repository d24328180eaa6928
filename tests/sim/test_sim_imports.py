"""The simulator's modules import one another without a cycle (issue 19, item 8): every
import counts, also one deferred into a function body."""

from __future__ import annotations

import ast
from pathlib import Path

SIM = Path(__file__).resolve().parents[2] / "src" / "fulcrum" / "sim"


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SIM.glob("*.py"):
        mod = path.stem
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "fulcrum.sim":
                    deps.update(a.name for a in node.names)
                elif node.module.startswith("fulcrum.sim."):
                    deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names
                            if a.name.startswith("fulcrum.sim."))
        graph[mod] = deps - {mod}
    return graph


def test_no_import_cycle_in_the_simulator() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            assert state.get(d) != 1, f"import cycle: {' -> '.join([*path, m, d])}"
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
