"""Issue 26's guard: every test function can fail. A test passes here when its body (or a
helper it calls, defined anywhere under tests/, followed transitively) has an ``assert``,
``pytest.raises`` / ``pytest.fail`` / ``pytest.warns``, or a call to ``assert_*`` /
``expect_*`` helpers of the same kind; otherwise it must be on :data:`ALLOWED` with a
reason. AST-based: new test files are covered as they land."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: test id ("path::function") -> why it has no assertion of its own.
ALLOWED: dict[str, str] = {
    "deploy/test_config_checks.py::test_shipped_configurations_pass":
        "load_settings raises ConfigError naming the key on any refused file: the shipped "
        "files loading is the check",
}

#: Calls that fail on a bad value by contract: numpy.testing's assert_*, and validators
#: (check_map, kubernetes_validate.validate) that raise on what they refuse.
_CHECKING_PREFIXES = ("assert", "check_", "validate")

_RAISING = {"raises", "fail", "warns", "deprecated_call"}


def _functions() -> Iterator[tuple[Path, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield path, node


def _called(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            if isinstance(f, ast.Name):
                yield f.id
            elif isinstance(f, ast.Attribute):
                yield f.attr


def _asserts_itself(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert):
            return True
        if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                and sub.func.attr in _RAISING and isinstance(sub.func.value, ast.Name)
                and sub.func.value.id == "pytest"):
            return True
        if isinstance(sub, ast.Raise) and sub.exc is not None:
            return True  # a helper that raises AssertionError (or any error) can fail
    return False


def _checking_helpers() -> set[str]:
    """Names of functions under tests/ that can fail, closed under calls."""
    defs = list(_functions())
    can_fail = {n.name for _, n in defs if _asserts_itself(n)}
    calls = {n.name: set(_called(n)) for _, n in defs}
    changed = True
    while changed:
        changed = False
        for name, called in calls.items():
            if name not in can_fail and called & can_fail:
                can_fail.add(name)
                changed = True
    return can_fail


def _checks(called: set[str]) -> bool:
    return any(name.startswith(_CHECKING_PREFIXES) for name in called)


def test_every_test_function_can_fail() -> None:
    helpers = _checking_helpers()
    silent = []
    for path, node in _functions():
        if not node.name.startswith("test_"):
            continue
        tid = f"{path.relative_to(TESTS)}::{node.name}"
        if tid in ALLOWED:
            continue
        called = set(_called(node))
        if _asserts_itself(node) or called & helpers or _checks(called):
            continue
        silent.append(tid)
    assert silent == [], (
        "test functions with no assertion, pytest.raises/fail or checking helper; add an "
        "assertion on the values that matter (or an ALLOWED entry with a reason): "
        + ", ".join(silent))


def test_the_guard_catches_a_silent_test(tmp_path: Path) -> None:
    quiet = ast.parse("def test_quiet():\n    compute()\n").body[0]
    loud = ast.parse("def test_loud():\n    assert compute() == 1\n").body[0]
    raising = ast.parse("def test_r():\n    with pytest.raises(ValueError):\n        f()\n")
    assert not _asserts_itself(quiet)
    assert _asserts_itself(loud)
    assert _asserts_itself(raising.body[0])
    assert all(reason.strip() for reason in ALLOWED.values())
