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


ORDER = ["bench_a", "bench_b", "bench_c"]


def test_merge_puts_a_region_after_the_title_of_a_file_without_one() -> None:
    old = "# Benchmarks\n\nHand-written analysis.\n\n### Old section\n\nfigures\n"
    doc = bench_run.merge(old, "head", {"bench_b": "### B\n\nnew"}, ORDER, keep=False)
    assert doc.startswith("# Benchmarks\n\n")
    assert doc.index(bench_run.BEGIN) < doc.index("### B") < doc.index(bench_run.END)
    assert doc.endswith("Hand-written analysis.\n\n### Old section\n\nfigures\n")


def test_merge_replaces_only_the_region_and_keeps_hand_text_verbatim() -> None:
    first = bench_run.merge(None, "head 1", {"bench_a": "A1", "bench_b": "B1"}, ORDER, False)
    edited = first.replace(bench_run.END, bench_run.END + "\n\nNotes by hand: B1 looked odd.")
    edited = "Preface by hand.\n" + edited
    doc = bench_run.merge(edited, "head 2", {"bench_a": "A2", "bench_b": "B2"}, ORDER, False)
    assert doc.startswith("Preface by hand.\n")
    assert doc.endswith(bench_run.END + "\n\nNotes by hand: B1 looked odd.")
    region = doc.split(bench_run.BEGIN)[1].split(bench_run.END)[0]
    assert "A2" in region and "B2" in region and "A1" not in region and "head 2" in region
    assert bench_run.merge(doc, "head 2", {"bench_a": "A2", "bench_b": "B2"}, ORDER, False) == doc


def test_merge_with_only_keeps_the_other_sections_in_module_order() -> None:
    doc = bench_run.merge(None, "h", {"bench_c": "C1", "bench_a": "A1"}, ORDER, False)
    doc = bench_run.merge(doc, "h2", {"bench_b": "B1"}, ORDER, keep=True)
    region = doc.split(bench_run.BEGIN)[1].split(bench_run.END)[0]
    assert region.index("A1") < region.index("B1") < region.index("C1")
    dropped = bench_run.merge(doc, "h3", {"bench_b": "B2"}, ORDER, keep=False)
    assert "A1" not in dropped and "B2" in dropped
