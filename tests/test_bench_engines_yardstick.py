"""The real-engine benchmark's yardsticks (benchmarks/bench_engines.py): the 10% balance
aim of issue 20 and the per-run nonce that opens every text."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import bench_engines as be


@pytest.mark.parametrize(
    ("per_engine", "within"),
    [
        ([12, 12], True),
        ([13, 11], True),  # 1 off a mean of 12: 8.3%
        ([14, 10], False),  # 16.7%
        ([24, 0], False),  # one engine idle
        ([0, 0, 0], True),  # nothing sent: no engine off the mean
        ([], False),
        ([30, 33, 27], True),  # 10% exactly
        ([30, 34, 26], False),
    ],
)
def test_balanced_is_every_engine_within_ten_percent_of_the_mean(
    per_engine: list[int], within: bool
) -> None:
    assert be.balanced(per_engine) is within


def test_nonce_has_the_same_length_for_every_router_and_is_fresh_per_key() -> None:
    """A router's name must not lengthen the text every request shares (a longer shared
    opening is a cached block more for that router): 16 symbols of a set the model's
    tokenizer holds as single tokens, none in its training words."""
    from tests.engines.tiny_model import WORDS

    names = ["Fulcrum (gateway.cache, unary Envoy mode)", "smg cache_aware", "x"]
    nonces = [be.nonce(f"{n}-multi-turn-1") for n in names]
    assert [len(n) for n in nonces] == [16, 16, 16]
    assert all(ch in be.NONCE_CHARS for n in nonces for ch in n)
    assert not set(be.NONCE_CHARS) & set("".join(WORDS) + "0123456789")
    assert len(set(nonces)) == 3
    assert be.nonce("k") == be.nonce("k")


def _runs(walls: dict[str, list[float]], workload: str = "no-reuse") -> list[be.Run]:
    return [be.Run(router, workload, wall_s=w, round=i)
            for router, ws in walls.items() for i, w in enumerate(ws)]


def _row(text: str, router: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if f"| {router} |" in ln]
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.parametrize(
    ("base", "mine", "median", "under"),
    [
        # Same ratio every round: the median is that ratio whatever the drift between rounds.
        ([0.60, 0.90, 0.60], [0.63, 0.945, 0.63], "1.050", "3"),
        # Unpaired medians would say 0.70 / 0.70 = 1.00x; paired, two rounds of three are slower.
        ([0.60, 0.70, 0.80], [0.70, 0.80, 0.60], "1.143", "1"),
        ([0.50, 0.50], [0.49, 0.56], "1.050", "1"),  # even count: the mean of the middle two
    ],
)
def test_paired_divides_each_round_by_the_baselines_wall_in_that_round(
    base: list[float], mine: list[float], median: str, under: str
) -> None:
    text = be.paired(_runs({"Envoy round robin": base, "Fulcrum": mine}))
    row = _row(text, "Fulcrum")
    assert row[0] == "no-reuse" and row[2] == str(len(base))
    assert row[3] == median and row[5] == under
    lo, hi = (float(x) for x in row[4].split("-"))
    assert lo <= float(median) <= hi
    assert "| Envoy round robin |" not in text  # the baseline is not paired with itself


def test_paired_skips_rounds_and_workloads_without_the_baseline() -> None:
    runs = _runs({"Envoy round robin": [0.5], "Fulcrum": [0.55, 0.9]})
    runs += _runs({"Fulcrum": [1.0]}, workload="multi-turn")
    text = be.paired(runs)
    assert _row(text, "Fulcrum")[2] == "1"  # round 1 has no baseline run
    assert "multi-turn" not in text


def test_saved_rounds_pool_by_run_and_round(tmp_path: Path) -> None:
    """Rounds saved by two bench runs come back as distinct rounds: round 0 of one run
    never pairs with round 0 of the other, and the paired table over the saved rounds is
    the table over the runs themselves."""
    path = tmp_path / "rounds.jsonl"
    a = [be.Run("Envoy round robin", "w", wall_s=1.0, round=0),
         be.Run("F", "w", wall_s=1.1, round=0),
         be.Run("Envoy round robin", "w", wall_s=2.0, round=1),
         be.Run("F", "w", wall_s=2.0, round=1)]
    b = [be.Run("Envoy round robin", "w", wall_s=4.0, round=0),
         be.Run("F", "w", wall_s=4.4, round=0)]  # round 0 again, another run
    be.save_rounds(a, path, "run a")
    be.save_rounds(b, path, "run b")
    back = be.load_rounds([path])
    assert len({r.round for r in back}) == 3
    assert be.paired(back) == be.paired([*a, *[be.Run(r.router, r.workload, wall_s=r.wall_s,
                                                        round=r.round + 2) for r in b]])
    assert "| w | F | 3 | 1.100 |" in be.paired(back)


def test_the_replay_workload_reads_the_traces_leading_blocks_and_is_absent_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mooncake-replay`` exists only where the trace is (it is not in the repository):
    the first N requests in order, each capped at REPLAY_BLOCKS leading hash ids."""
    import json

    monkeypatch.setenv("FULCRUM_TRACES", str(tmp_path))
    assert be.replay_rows(4) is None
    assert "mooncake-replay" not in be.workloads(False, (1, 1, 4))
    rows = [{"timestamp": 500 * i, "input_length": 512 * (i + 30), "output_length": 1,
             "hash_ids": list(range(i, i + 30))} for i in range(6)]
    (tmp_path / be.REPLAY_TRACE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = be.replay_rows(4)
    assert got is not None and len(got) == 4
    assert [t for t, _ in got] == [0.0, 0.5, 1.0, 1.5]
    assert got[2][1] == list(range(2, 2 + be.REPLAY_BLOCKS))
    assert "mooncake-replay" in be.workloads(False, (1, 1, 4))


def test_opt_in_workloads_run_only_when_named() -> None:
    """``many-docs`` needs engines with a small KV cache (``--kv-blocks``): the default
    set leaves it out; ``--workloads`` runs exactly what it names."""
    assert be.wanted("multi-turn", "") and not be.wanted("many-docs", "")
    assert not be.wanted("many-docs-arrivals", "")
    assert be.wanted("many-docs", "many-docs,multi-turn")
    assert not be.wanted("no-reuse", "many-docs,multi-turn")
