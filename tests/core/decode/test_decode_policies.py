"""Table-driven tests of every decode policy, both branches of dual, and the registry."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.core.decode import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    Decision,
    DualParams,
    FleetView,
    NoCapacity,
    StepTimeParams,
    dual,
    make_policy,
    params_for,
    power_of_two,
    round_robin,
    step_time,
)

DUAL_FIELDS = {"long_factor", "long_tokens", "short_slack"}

RNG_SEED = 7


def view(conc: list[int], kv: list[int], *, mc: int = 64, mk: int = 1_000_000) -> FleetView:
    n = len(conc)
    return FleetView.build(conc, kv, [mc] * n, [mk] * n)


def pick(name: str, v: FleetView, kv_tokens: int, **params: float) -> Decision:
    policy = make_policy(name, params_for(name, params))
    d = policy.select(v, kv_tokens, np.random.default_rng(RNG_SEED))
    assert isinstance(d, Decision), d
    return d


def test_registry_names_and_default() -> None:
    assert DEFAULT_POLICY == "dual"
    assert set(POLICY_NAMES) == {
        "dual",
        "step_time",
        "least_requests",
        "least_kv",
        "round_robin",
        "power_of_two",
    }
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown decode policy 'nope'"):
        make_policy("nope")


@pytest.mark.parametrize(
    ("field", "value"),
    [("long_factor", 0.0), ("long_tokens", 0), ("short_slack", -1), ("d1_ns", float("nan"))],
)
def test_params_validation(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        DualParams(**{field: value}) if field in DUAL_FIELDS else StepTimeParams(**{field: value})  # type: ignore[arg-type]


# --- dual ------------------------------------------------------------------------------

# Fleet: gpu0 few requests but lots of KV (two long ones), gpu1 many short requests and
# little KV, gpu2 in between. mean KV per request = 204_000 / 24 = 8_500 tokens.
DUAL_CONC = [2, 12, 10]
DUAL_KV = [180_000, 6_000, 18_000]


@pytest.mark.parametrize(
    ("kv_tokens", "kind", "gpu"),
    [
        (100_000, dual.LONG, 1),  # worked example: smallest KV although most requests
        (17_000, dual.LONG, 1),  # 17_000 >= 2 * 8_500
        (16_999, dual.SHORT, 0),  # short: fewest requests, and it has the most KV
        (500, dual.SHORT, 0),
    ],
)
def test_dual_branches(kv_tokens: int, kind: str, gpu: int) -> None:
    d = pick("dual", view(DUAL_CONC, DUAL_KV), kv_tokens)
    assert (d.kind, d.gpu) == (kind, gpu)


def test_dual_worked_example_100k_goes_to_smallest_kv_not_fewest_requests() -> None:
    # gpu0 has the fewest requests; gpu2 the smallest total KV.
    v = view([1, 8, 9, 7], [150_000, 90_000, 40_000, 60_000])
    assert int(np.argmin(v.concurrency)) == 0
    d = pick("dual", v, 100_000)
    assert (d.kind, d.gpu) == ("long", 2)


def test_dual_threshold_definition() -> None:
    p = dual.Dual(long_factor=3.0, long_tokens=65_536)
    empty = view([0, 0], [0, 0])
    assert p.threshold(empty) == 65_536.0  # no request: absolute bound only
    v = view([4, 4], [8_000, 8_000])  # mean 2_000
    assert p.threshold(v) == 6_000.0
    assert p.is_long(v, 6_000) and not p.is_long(v, 5_999)
    heavy = view([1, 1], [500_000, 500_000])  # mean 500K: capped by long_tokens
    assert p.threshold(heavy) == 65_536.0


def test_dual_short_ties_on_concurrency_prefer_more_kv() -> None:
    d = pick("dual", view([3, 3, 5], [1_000, 9_000, 50_000]), 10)
    assert (d.kind, d.gpu) == ("short", 1)


def test_dual_short_slack_widens_candidates() -> None:
    v = view([3, 4, 9], [1_000, 9_000, 50_000])
    assert pick("dual", v, 10).gpu == 0
    assert pick("dual", v, 10, short_slack=1).gpu == 1
    assert pick("dual", v, 10, short_slack=6).gpu == 2


def test_dual_long_ties_on_kv_prefer_fewer_requests() -> None:
    d = pick("dual", view([5, 2, 7], [10_000, 10_000, 10_000]), 200_000)
    assert (d.kind, d.gpu) == ("long", 1)


def test_dual_skips_winner_without_room() -> None:
    # gpu0 would win the short branch (fewest requests, most KV) but lacks KV room.
    v = view([1, 5, 6], [995_000, 3_000, 2_000])
    d = pick("dual", v, 8_000)
    assert d.kind == "short" and d.gpu == 1
    # long: smallest KV gpu2 is full on concurrency -> next smallest KV
    v2 = FleetView.build([1, 5, 4], [995_000, 3_000, 2_000], [64, 64, 4], [1_000_000] * 3)
    assert pick("dual", v2, 100_000).gpu == 1


# --- other policies --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("conc", "kv", "kv_tokens", "gpu"),
    [
        ([3, 1, 2], [0, 900_000, 10], 100, 1),  # fewest requests, whatever the KV
        ([1, 1, 2], [50, 10, 0], 100, 0),  # tie -> lowest index
        ([3, 1, 2], [0, 990_000, 10], 20_000, 2),  # gpu1 lacks room
    ],
)
def test_least_requests(conc: list[int], kv: list[int], kv_tokens: int, gpu: int) -> None:
    assert pick("least_requests", view(conc, kv), kv_tokens).gpu == gpu


@pytest.mark.parametrize(
    ("conc", "kv", "mc", "gpu"),
    [
        ([9, 1, 2], [100, 900, 500], 64, 0),  # least KV, whatever the requests
        ([9, 1, 2], [100, 100, 500], 64, 1),  # KV tie -> fewer requests
        ([9, 1, 2], [100, 900, 500], 9, 2),  # gpu0 full on concurrency
    ],
)
def test_least_kv(conc: list[int], kv: list[int], mc: int, gpu: int) -> None:
    assert pick("least_kv", view(conc, kv, mc=mc), 10).gpu == gpu


@pytest.mark.parametrize(
    ("d1", "d2", "conc", "kv", "gpu"),
    [
        (20_000.0, 0.5, [10, 1], [0, 400_000], 0),  # 220.5us vs 240.5us after placement
        (20_000.0, 0.5, [10, 1], [0, 100_000], 1),  # 220.5us vs 90.5us
        (0.0, 1.0, [10, 1], [5, 10], 0),  # pure KV
        (1.0, 0.0, [10, 1], [5, 10], 1),  # pure concurrency
        (0.0, 0.0, [10, 1], [5, 10], 0),  # all equal -> lowest index
    ],
)
def test_step_time(d1: float, d2: float, conc: list[int], kv: list[int], gpu: int) -> None:
    assert pick("step_time", view(conc, kv), 1_000, d1_ns=d1, d2_ns=d2).gpu == gpu


def test_step_time_prediction_counts_the_request() -> None:
    p = step_time.StepTime(d0_ns=1_000.0, d1_ns=10.0, d2_ns=0.5)
    pred = p.predict_ns(view([0, 3], [0, 100]), 200)
    assert pred.tolist() == [1_000 + 10 + 100, 1_000 + 40 + 150]


def test_round_robin_cursor_is_passed_in_and_returned() -> None:
    p = round_robin.RoundRobin()
    v = FleetView.build([0, 0, 4, 0], [0, 0, 0, 0], [4] * 4, [100] * 4, [True, True, True, False])
    rng = np.random.default_rng(0)
    seen = []
    cursor = 0
    for _ in range(5):
        d = p.select(v, 1, rng, cursor)
        assert isinstance(d, Decision)
        seen.append(d.gpu)
        cursor = d.cursor
    assert seen == [0, 1, 0, 1, 0]  # gpu2 full, gpu3 dead
    d = p.select(v, 1, rng, 2)
    assert isinstance(d, Decision) and (d.gpu, d.cursor) == (0, 1)
    d = p.select(v, 1, rng, 1_000_000)  # cursor taken modulo the fleet size
    assert isinstance(d, Decision) and d.gpu == 0


def test_power_of_two_prefers_fewer_requests_of_two_draws() -> None:
    p = power_of_two.PowerOfTwo()
    v = view([5, 0], [0, 999_000])
    for seed in range(20):
        d = p.select(v, 100, np.random.default_rng(seed))
        assert isinstance(d, Decision) and d.gpu == 1
    single = FleetView.build([0, 0], [0, 0], [4, 4], [10, 10], [False, True])
    d = p.select(single, 5, np.random.default_rng(0))
    assert isinstance(d, Decision) and d.gpu == 1


def test_power_of_two_fallback_when_few_eligible() -> None:
    # 100 GPUs, only 2 eligible: rejection draws mostly miss, the exact path finishes.
    conc = [4] * 100
    conc[17] = 0
    conc[83] = 1
    v = FleetView.build(conc, [0] * 100, [4] * 100, [10] * 100)
    for seed in range(10):
        d = power_of_two.PowerOfTwo().select(v, 1, np.random.default_rng(seed))
        assert isinstance(d, Decision) and d.gpu == 17


def test_power_of_two_draws_are_uniform() -> None:
    # Both members of each pair are equally likely to be chosen when loads tie.
    v = view([0] * 4, [0] * 4)
    p = power_of_two.PowerOfTwo()
    rng = np.random.default_rng(123)
    counts = np.zeros(4, dtype=np.int64)
    for _ in range(4_000):
        d = p.select(v, 1, rng)
        assert isinstance(d, Decision)
        counts[d.gpu] += 1
    assert counts.min() > 850 and counts.max() < 1_150


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_reports_no_capacity(name: str) -> None:
    v = FleetView.build([4, 0], [0, 900], [4, 4], [1_000, 1_000])
    out = make_policy(name).select(v, 200, np.random.default_rng(0))
    assert isinstance(out, NoCapacity)
    assert "kv_tokens: no live decode GPU has both" in out.reason
    assert out.kind == ("short" if name == "dual" else "")  # 200 < 2 * mean (900 / 4)
    empty = FleetView.build([], [], [], [])
    assert isinstance(make_policy(name).select(empty, 1, np.random.default_rng(0)), NoCapacity)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_rejects_non_positive_kv(name: str) -> None:
    with pytest.raises(ValueError, match="kv_tokens"):
        make_policy(name).select(view([0], [0]), 0, np.random.default_rng(0))


def test_dual_steers_long_requests_away_from_gpus_full_of_long_ones() -> None:
    # SPEC section 9, last row: GPUs 0-1 hold a few long requests (lots of KV, few
    # requests), GPUs 2-3 many short ones. Later long requests go to 2-3 until KV evens out.
    from fulcrum.core.decode.copies import commit

    v = view([6, 6, 30, 30], [600_000, 600_000, 50_000, 50_000])
    p = make_policy("dual")
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(10):
        d = p.select(v, 100_000, rng)
        assert isinstance(d, Decision) and d.kind == "long"
        chosen.append(d.gpu)
        v = commit(v, d.gpu, 100_000)
    assert chosen.count(2) == 5 and chosen.count(3) == 5  # never GPUs 0-1 (550K < 600K)
    lr = make_policy("least_requests")
    d = lr.select(view([6, 6, 30, 30], [600_000, 600_000, 50_000, 50_000]), 100_000, rng)
    assert isinstance(d, Decision) and d.gpu == 0  # the baseline piles onto the full GPU
