"""Fair-share precedence on the ranks (issue 23): a request taken while its tenant is under
its fair share of the fleet, with another tenant's work waiting in its band, runs half a
band up on its rank (ahead of that band's other work, behind every higher band), and the
balancer binds and places it by the work ahead of that half band."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fulcrum.core.prefill.balancer import BalancerConfig, PrefillBalancer, Queued
from fulcrum.core.prefill.bands import PRECEDENCE, rank_band, split_band
from fulcrum.core.prefill.rules import RULE_SETS
from fulcrum.core.tenants import RequestClass, TenantPolicy, TenantSpec

S = 1_000_000_000
MS = 1_000_000
WINDOW = 10 * S  # the default cap window: with 2 ranks the fleet serves 20 s a window


def _balancer(weights: dict[str, float] | None = None, order: str = "wfq_ns",
              ranks: int = 2) -> PrefillBalancer:
    policy = TenantPolicy(classes={t: TenantSpec(weight=w) for t, w in (weights or {}).items()})
    bal = PrefillBalancer(BalancerConfig(
        (16_384, 65_536, 262_144), (8 * S, 32 * S, 128 * S, 512 * S), 8.0, 1.0, 256,
        RULE_SETS["default"].with_order(order), tenants=policy))
    bal.add_engine("e0", ranks)
    return bal


def q(rid: str, tenant: str, t0: int = 0, prio: int = 0, cost_ms: int = 10) -> Queued:
    return Queued(rid, 1_000, 0, 0, cost_ms * MS, t0, cls=RequestClass(tenant, prio, None))


# (case, weights, served ns per tenant before, queued (id, tenant, priority), boosted ids)
LEADS = [
    ("one tenant: nobody to precede", {}, {}, [("a1", "a", 0), ("a2", "a", 0)], []),
    ("two tenants, neither served yet", {}, {}, [("a1", "a", 0), ("b1", "b", 0)],
     ["a1", "b1"]),
    ("the heavy one over its half", {}, {"heavy": 12 * S, "light": S},
     [("h1", "heavy", 0), ("l1", "light", 0)], ["l1"]),
    ("both over: nobody", {}, {"a": 11 * S, "b": 11 * S}, [("a1", "a", 0), ("b1", "b", 0)],
     []),
    ("weights 3:1, a under its 3/4, b over its 1/4", {"a": 3.0, "b": 1.0},
     {"a": 14 * S, "b": 6 * S}, [("a1", "a", 0), ("b1", "b", 0)], ["a1"]),
    ("another band's tenant is not a rival", {}, {"heavy": 12 * S},
     [("h1", "heavy", 0), ("p1", "light", 1)], []),
]


@pytest.mark.parametrize(("weights", "served", "queued", "boosted"),
                         [c[1:] for c in LEADS], ids=[c[0] for c in LEADS])
def test_who_is_under_its_fair_share(weights: dict[str, float], served: dict[str, int],
                                     queued: list[tuple[str, str, int]],
                                     boosted: list[str]) -> None:
    bal = _balancer(weights)
    for tenant, ns in served.items():
        bal.fair.charge(tenant, float(ns), ns, 0)
    items = [q(rid, tenant, i, prio) for i, (rid, tenant, prio) in enumerate(queued)]
    for it in items:
        bal.enqueue(it)
    queue = bal.tier_queue(0)
    assert [it.request_id for it in items if queue.leads(it)] == boosted


def test_a_light_tenant_is_taken_half_a_band_up_past_a_full_engine() -> None:
    # The engine's ranks hold far more than the late-binding horizon of the heavy
    # tenant's work, and nothing with precedence: the light request is taken (band
    # pass, by the work ahead of its half band) and placed on its emptiest rank; the
    # heavy one waits for room.
    bal = _balancer()
    bal.fair.charge("heavy", 12.0 * S, 12 * S, 0)
    bal.enqueue(q("h1", "heavy", 0))
    bal.enqueue(q("l1", "light", 1))
    full = [2 * S, 3 * S]
    taken = bal.take("e0", 0, full, now_ns=10, band_loads={0: full})
    assert [it.request_id for it in taken.items] == ["l1"]
    assert taken.bands == (PRECEDENCE,) and taken.ranks == (0,)
    assert bal.get("h1") is not None
    # Without band loads (an engine that does not order bands) nothing is taken.
    bal2 = _balancer()
    bal2.fair.charge("heavy", 12.0 * S, 12 * S, 0)
    bal2.enqueue(q("h1", "heavy", 0))
    bal2.enqueue(q("l1", "light", 1))
    assert bal2.take("e0", 0, full, now_ns=10).items == ()


def test_the_half_band_pass_looks_past_its_own_band_but_not_below_it() -> None:
    # The heavy tenant's virtual time is lower (it comes first in fair queueing) but its
    # recent service is over its share; the light one was served long ago (debt in
    # virtual time, none in the window). The pass for the half band skips h1 (priority
    # 0, no precedence) to take l1, and then the usual pass may take h1.
    bal = _balancer()
    bal.fair.charge("light", 40.0 * S, 40 * S, 0)  # decayed away by now
    now = 100 * S
    bal.fair.charge("heavy", 12.0 * S, 12 * S, now)
    bal.enqueue(q("h1", "heavy", now))
    bal.enqueue(q("l1", "light", now + 1))
    assert [it.request_id for it in bal.queued(0, now)] == ["h1", "l1"]
    taken = bal.take("e0", 0, [2 * S, 3 * S], now_ns=now + 2, band_loads={0: [2 * S, 3 * S]})
    assert [it.request_id for it in taken.items] == ["l1"]
    # A lower priority in the way ends the pass, as for any band pass.
    bal = _balancer()
    bal.fair.charge("heavy", 12.0 * S, 12 * S, 0)
    bal.enqueue(q("x1", "other", 0, prio=-1))
    bal.enqueue(q("l1", "light", 1))
    bal.enqueue(q("h1", "heavy", 2))
    # the starvation bound puts x1 first once its band waited 30 s
    later = 31 * S
    assert next(bal.queued(0, later)).request_id == "x1"
    taken = bal.take("e0", 0, [2 * S, 3 * S], now_ns=later, band_loads={-1: [2 * S, 3 * S]})
    assert [it.request_id for it in taken.items] == []


@pytest.mark.parametrize("order", ["fifo", "strict_rr", "vtc_tokens"])
def test_the_baseline_orders_give_no_precedence(order: str) -> None:
    bal = _balancer(order=order)
    bal.fair.charge("heavy", 12.0 * S, 12 * S, 0)
    bal.enqueue(q("h1", "heavy", 0))
    bal.enqueue(q("l1", "light", 1))
    taken = bal.take("e0", 10 * S, [0, 0], now_ns=10, band_loads={0: [0, 0]})
    assert set(taken.bands) <= {0.0}


def test_a_reload_that_changes_weights_reweighs_the_bands() -> None:
    bal = _balancer({"a": 1.0, "b": 1.0})
    bal.fair.charge("a", 14.0 * S, 14 * S, 0)  # over half of 20 s, under 3/4
    a1, b1 = q("a1", "a", 0), q("b1", "b", 1)
    bal.enqueue(a1)
    bal.enqueue(b1)
    queue = bal.tier_queue(0)
    assert not queue.leads(a1) and queue.leads(b1)
    cfg = bal.config
    bal.reconfigure(replace(cfg, tenants=TenantPolicy(
        classes={"a": TenantSpec(weight=3.0), "b": TenantSpec(weight=1.0)})))
    assert queue.leads(a1)


@given(st.integers(-8, 8), st.booleans())
def test_rank_bands_round_trip_and_keep_the_priority_order(priority: int, boosted: bool) -> None:
    band = rank_band(priority, boosted)
    assert split_band(band) == (priority, boosted)
    assert priority <= band < priority + 1
    assert rank_band(priority + 1, False) > band >= rank_band(priority, False)


def test_the_fleet_s_ranks_are_counted_as_engines_join_rejoin_and_leave() -> None:
    # A fair share is of ranks x window: kept as a count (read on every check), never
    # summed over the engines.
    bal = _balancer(ranks=2)
    bal.add_engine("e1", 4)
    bal.add_engine("e0", 3)  # re-joined with another shape
    assert bal.fair.ranks == 7
    bal.remove_engine("e1")
    bal.remove_engine("nobody")
    assert bal.fair.ranks == 3
    assert bal.fair.fair_ns(0.5) == 0.5 * 3 * WINDOW
