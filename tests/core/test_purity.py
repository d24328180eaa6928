"""The core is pure: it imports nothing that touches the network, the clock, randomness,
metrics or logs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "src" / "fulcrum" / "core"
FORBIDDEN = {"grpc", "asyncio", "prometheus_client", "logging", "structlog", "time", "random",
             "datetime", "os", "threading", "socket"}
FILES = sorted(CORE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_imports_nothing_impure(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            root = name.split(".")[0]
            assert root not in FORBIDDEN, f"{path.name} imports {name}"
            if root == "fulcrum":
                assert name.startswith(("fulcrum.core", "fulcrum.errors")), (
                    f"{path.name} imports {name} from outside the core"
                )
