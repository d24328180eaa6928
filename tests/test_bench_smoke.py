"""Smoke test of the benchmark suite: every module imports and exposes ``run(quick)``.

No benchmark runs here (speed belongs to ``make bench``, not to the test suite); this
only catches a broken import or a renamed entry point before ``make bench`` does.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from benchmarks import run as bench_run

MODULES = bench_run.discover()


def test_modules_are_discovered() -> None:
    names = {p.stem for p in MODULES}
    assert {"bench_prefill", "bench_service", "bench_overload"} <= names
    assert MODULES[-1].stem == "bench_sim"  # the longest runs last


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_module_has_run(path: Path) -> None:
    mod = bench_run.load(path)
    fn = getattr(mod, "run", None)
    assert callable(fn), f"{path.stem} has no run()"
    params = list(inspect.signature(fn).parameters)
    assert params == ["quick"], f"{path.stem}.run takes {params}, not (quick)"


@pytest.mark.parametrize(
    ("only", "expected"),
    [
        (None, [p.stem for p in MODULES]),
        ([], [p.stem for p in MODULES]),
        (["prefill"], ["bench_prefill"]),
        (["bench_service", "prefill"], ["bench_prefill", "bench_service"]),
    ],
)
def test_only_selects(only: list[str] | None, expected: list[str]) -> None:
    assert [p.stem for p in bench_run._select(MODULES, only)] == expected


def test_only_rejects_unknown_names() -> None:
    with pytest.raises(SystemExit, match="unknown bench"):
        bench_run._select(MODULES, ["no_such_bench"])
