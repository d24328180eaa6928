"""Goodput search on hand-made evaluation functions (no simulator in the loop)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from fulcrum.core.cost import CostModel
from fulcrum.core.prefill.tiers import DEFAULT_TIER_BOUNDS
from fulcrum.sim import goodput as G

COST = CostModel(a=2.0, b=56_000.0, k=5_000_000.0)
SLO = G.default_slo(DEFAULT_TIER_BOUNDS, COST)
TIERS = list(SLO.ttft_p99_s)


def summary(
    p99: dict[str, float | None] | None = None,
    *,
    tpot: float | None = 0.02,
    unfinished: int = 0,
    count: int = 100,
) -> dict[str, Any]:
    """A run summary with the keys the search reads; every tier fine unless given."""
    p99 = {t: 0.5 for t in TIERS} | (p99 or {})
    return {
        "ttft_by_tier": {
            t: {"p50_s": v, "p99_s": v, "count": count} for t, v in p99.items()
        },
        "tpot_p50_s": tpot,
        "tpot_p99_s": tpot,
        "finished": 400 - unfinished,
        "unfinished": unfinished,
    }


class Recorder:
    """Wraps an evaluation function; records every scale it was asked for."""

    def __init__(self, fn: Callable[[float], dict[str, Any]]) -> None:
        self.fn = fn
        self.calls: list[float] = []

    def __call__(self, scale: float) -> dict[str, Any]:
        self.calls.append(scale)
        return self.fn(scale)


def test_default_slos_follow_the_documented_rule() -> None:
    assert SLO.ttft_p99_s == {"<16K": 3.0, "16K-64K": 20.0, "64K-256K": 210.0, ">=256K": 770.0}
    assert SLO.tpot_p99_s == 0.1
    # 2.5 x the unloaded time of a fresh 16K-token prompt (1.19 s), rounded up.
    assert 2.5 * (COST.cost(16 * 1024, 0) - COST.k) / 1e9 <= 3.0


@pytest.mark.parametrize("boundary", [0.37, 1.0, 2.9, 17.5])
@pytest.mark.parametrize("start", [0.5, 1.0, 4.0])
def test_monotone_boundary_found_within_tolerance(boundary: float, start: float) -> None:
    # TTFT p99 of the shortest tier grows with the rate; the SLO (3 s) is met up to
    # ``boundary``.
    ev = Recorder(lambda s: summary({"<16K": 3.0 * s / boundary}))
    res = G.search(ev, SLO, base_rps=2.0, start=start, rel_tol=0.05, max_runs=20)
    assert res.scale is not None and res.lowest_failing is not None
    assert res.scale <= boundary < res.lowest_failing
    assert res.lowest_failing / res.scale <= 1.05
    assert res.converged
    assert res.goodput_rps == pytest.approx(2.0 * res.scale)
    # Bracketing takes the start plus floor(log(distance)) + 1 steps of x1.4 up or /2 down;
    # bisecting a 1.4 bracket to 5% takes three runs, a 2 bracket four.
    step, bisect = (1.4, 3) if boundary >= start else (2.0, 4)
    bracket = math.floor(abs(math.log(boundary / start)) / math.log(step)) + 2
    assert len(ev.calls) == len(res.runs) <= bracket + bisect
    assert len(set(ev.calls)) == len(ev.calls)  # no scale run twice


def test_bounded_number_of_runs_and_deterministic() -> None:
    fn = lambda s: summary({"<16K": 3.0 * s / 7.3})  # noqa: E731
    a = G.search(Recorder(fn), SLO, base_rps=1.0, start=1.0, max_runs=4)
    b = G.search(Recorder(fn), SLO, base_rps=1.0, start=1.0, max_runs=4)
    assert len(a.runs) == 4 and a.runs == b.runs and a.scale == b.scale
    assert not a.converged  # 4 runs cannot bracket 7.3 within 5% from 1.0


def test_never_reports_a_rate_it_did_not_verify() -> None:
    # Not monotone: passes at a few isolated scales only.
    def fn(s: float) -> dict[str, Any]:
        ok = s < 1.2 or 2.0 <= s < 2.1
        return summary({"<16K": 1.0 if ok else 99.0})

    ev = Recorder(fn)
    res = G.search(ev, SLO, base_rps=1.0, start=1.0, max_runs=10)
    passed = {p.scale for p in res.runs if p.passed}
    assert res.scale in passed
    assert res.scale == max(s for s in passed if s < (res.lowest_failing or math.inf))
    assert res.summary == fn(res.scale)


def test_nothing_passes_reports_zero() -> None:
    ev = Recorder(lambda s: summary({"<16K": 50.0}))
    res = G.search(ev, SLO, base_rps=3.0, start=1.0, max_runs=6)
    assert res.scale is None and res.goodput_rps == 0.0 and res.summary is None
    assert len(res.runs) == 6 and not any(p.passed for p in res.runs)


def test_starving_policy_is_bounded_by_the_starved_tiers_slo() -> None:
    # Every tier but >=256K is served at once at any rate; the >=256K tier waits in
    # proportion to the rate (100 s at scale 1). Its SLO (770 s) bounds the goodput at 7.7,
    # whatever the other tiers do.
    ev = Recorder(lambda s: summary({t: 0.1 for t in TIERS} | {">=256K": 100.0 * s}))
    res = G.search(ev, SLO, base_rps=1.0, start=1.0, max_runs=12)
    assert res.scale is not None and res.scale <= 7.7 < (res.lowest_failing or 0)
    assert any(">=256K" in m for p in res.runs for m in p.misses)


def test_unfinished_requests_fail_the_run() -> None:
    # A policy that never serves some requests above scale 2: the served ones look fine
    # (finished-only p99s would pass), but the run must fail.
    ev = Recorder(lambda s: summary(unfinished=0 if s <= 2.0 else 3))
    res = G.search(ev, SLO, base_rps=1.0, start=1.0, max_runs=12)
    assert res.scale is not None and res.scale <= 2.0
    v = G.check(summary(unfinished=1), SLO)
    assert not v.passed and "unfinished" in v.misses[0]


def test_a_tier_without_a_first_token_fails() -> None:
    v = G.check(summary({"64K-256K": None}), SLO)
    assert not v.passed
    # A tier with no request at all is not checked.
    s = summary()
    s["ttft_by_tier"]["64K-256K"] = {"p50_s": None, "p99_s": None, "count": 0}
    assert G.check(s, SLO).passed


def test_tpot_slo() -> None:
    assert G.check(summary(tpot=0.1), SLO).passed
    v = G.check(summary(tpot=0.2), SLO)
    assert not v.passed and "TPOT" in v.misses[0]
    ev = Recorder(lambda s: summary(tpot=0.05 * s))
    res = G.search(ev, SLO, base_rps=1.0, start=1.0, max_runs=12)
    assert res.scale is not None and res.scale <= 2.0 < (res.lowest_failing or 0)


def test_missing_summary_key_is_one_clear_error() -> None:
    s = summary()
    del s["unfinished"]
    with pytest.raises(G.SummaryError, match="'unfinished'"):
        G.check(s, SLO)
    s = summary()
    s["ttft_by_tier"]["1M+"] = {"p99_s": 1.0, "count": 1}
    with pytest.raises(G.SummaryError, match="no TTFT SLO for tier '1M\\+'"):
        G.check(s, SLO)


def test_slo_values_and_validation() -> None:
    slo = G.slo_from_values(DEFAULT_TIER_BOUNDS, [1, 2, 3, 4], 0.05)
    assert slo.ttft_p99_s == {"<16K": 1.0, "16K-64K": 2.0, "64K-256K": 3.0, ">=256K": 4.0}
    with pytest.raises(ValueError, match="one value per tier"):
        G.slo_from_values(DEFAULT_TIER_BOUNDS, [1, 2], 0.05)
    with pytest.raises(ValueError):
        G.Slo({"<16K": 0.0})
    with pytest.raises(ValueError):
        G.search(lambda s: summary(), SLO, base_rps=0.0)


def test_base_rate_is_one_over_the_mean_gap() -> None:
    assert G.base_rate([0, 500_000_000, 1_000_000_000]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        G.base_rate([5])
    with pytest.raises(ValueError):
        G.base_rate([5, 5])


def test_search_stops_at_the_lowest_scale() -> None:
    ev = Recorder(lambda s: summary({"<16K": 50.0}))
    res = G.search(ev, SLO, base_rps=1.0, start=1.0, min_scale=0.25, max_runs=8)
    assert ev.calls == [1.0, 0.5, 0.25]
    assert res.scale is None and res.lowest_failing == 0.25 and res.converged


def test_bench_sim_uses_the_one_goodput_definition() -> None:
    """benchmarks/bench_sim.py carries no SLOs or search of its own: its SLOs are
    :func:`fulcrum.sim.goodput.default_slo` of the default cluster, and its verdict is
    :func:`fulcrum.sim.goodput.check`."""
    from benchmarks import bench_sim
    from fulcrum.sim.cluster import Cluster

    p = Cluster().prefill
    slo = G.default_slo(p.tier_bounds, CostModel(a=p.cost_model.a, b=p.cost_model.b,
                                                 k=p.cost_model.k))
    assert slo == bench_sim.SLO
    assert dict(slo.ttft_p99_s) == bench_sim.SLO_TTFT_P99_S
    assert bench_sim.SLO_TPOT_P99_S == G.DEFAULT_TPOT_SLO_S
    # An unfinished request fails the bench's verdict as it fails the CLI's.
    ok = {"ttft_by_tier": {"<16K": {"count": 1, "p99_s": 0.1}}, "tpot_p99_s": 0.01,
          "finished": 1, "unfinished": 0}
    assert bench_sim.meets_slo(ok)
    assert not bench_sim.meets_slo({**ok, "unfinished": 1})


def test_search_stops_at_the_cap_and_says_so() -> None:
    # Passes at every rate (a burst absorbed whatever its speed): the search stops at
    # max_scale and reports it as capped, never a rate above it.
    ev = Recorder(lambda s: summary())
    res = G.search(ev, SLO, base_rps=2.0, start=0.7, max_scale=1.0, max_runs=8)
    assert res.capped and res.converged and res.scale == 1.0
    assert max(ev.calls) == 1.0 and ev.calls == [0.7, pytest.approx(0.98), 1.0]
    assert res.as_dict()["capped"] is True
    # Below the cap, a failing rate leaves the search uncapped.
    res2 = G.search(Recorder(lambda s: summary({"<16K": 3.0 * s / 0.9})), SLO,
                    base_rps=2.0, start=0.7, max_scale=1.0, max_runs=8)
    assert not res2.capped and res2.scale is not None and res2.scale <= 0.9


def test_default_cap_is_the_fleets_compute() -> None:
    from benchmarks import bench_sim

    assert G.DEFAULT_MAX_LOAD == 1.0
    assert bench_sim.RHO_HI == G.DEFAULT_MAX_LOAD
