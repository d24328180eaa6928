"""The grace of the prefix-aware pull (issue 21): a request may wait for a holder
predicted later than the puller by the recompute the holder saves, at most
``GRACE_FLOORS`` step floors, only while nobody else waits for that holder, and less
the longer it has waited, and never past its tier's tail (the unloaded cost of the
tier's largest prompt); the take order reads past the requests left to a holder."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.core.prefill import order as aff_order
from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.items import EngineEntry, Queued

MS = 1_000_000
GRACE = aff_order.grace_ns(100 * MS)  # the default step floor, 100 ms: 200 ms


def cost(q: int, c: int) -> int:
    """1 ms per computed token plus 1 ms fixed (ns)."""
    return MS * q + MS


def _aff(scan: int = 32) -> Affinity:
    aff = Affinity(PrefixIndex(block_tokens=100), cost, max_wait_ns=100_000 * MS, scan=scan)
    for e in ("holder", "idle"):
        aff.index.add_engine(e, 1000)
    return aff


def _item(aff: Affinity, n: int, held: bool = True, t_ms: int = 0) -> Queued:
    """``rN``: 1,000 tokens in 10 blocks; the holder has the first 9 when ``held``
    (101 ms there against 1,001 ms on the idle engine: it saves 900 ms)."""
    hashes = tuple(range(1000 * n, 1000 * n + 10))
    if held:
        aff.index.record("holder", hashes[:-1])
    return Queued(f"r{n}", 1000, 0, 0, cost(1000, 0), t_ms * MS, hashes)


def _idle_order(aff: Affinity, items: list[Queued], holder_load_ms: int, now_ms: int = 0,
                grace_ns: int = GRACE, tail_ms: int | None = None) -> list[str]:
    now = now_ms * MS
    engines = {
        "holder": EngineEntry("holder", 1, tier=0, min_rank_ns=holder_load_ms * MS, seen_ns=now),
        "idle": EngineEntry("idle", 1, tier=0, min_rank_ns=0, seen_ns=now),
    }
    tail = None if tail_ms is None else tail_ms * MS
    w = aff_order.window(aff, items, ["holder", "idle"], now, tail_ns=tail)
    assert w is not None

    def finish(e: str, it: Queued, m: int, ahead: int) -> int:
        return aff_order.finish_ns(aff, engines[e], it, m, now, e == "idle", ahead)

    return [it.request_id for it in aff_order.order_for(aff, "idle", now, w, finish, grace_ns)]


@pytest.mark.parametrize(
    ("holder_load_ms", "now_ms", "grace_ns", "want_idle"),
    [
        # The holder finishes r1 at 1,000 + 101 ms, 100 ms after the idle engine's
        # 1,001: within the grace (min(900 saved, 200)), r1 waits for it.
        (1_000, 0, GRACE, []),
        # Without a grace, the idle engine takes it (predicted sooner).
        (1_000, 0, 0, ["r1"]),
        # 250 ms later than the idle engine: past the 200 ms cap.
        (1_150, 0, GRACE, ["r1"]),
        # Exactly at the cap: not within it.
        (1_100, 0, GRACE, ["r1"]),
        # r1 has waited 300 ms: the cap shrinks from 200 ms (at 200 ms of wait) to 0 (at
        # 400 ms), so 100 ms are left; the holder is 150 ms later: the idle engine takes it.
        (1_050, 300, GRACE, ["r1"]),
        # The same holder 50 ms later: still within what is left.
        (950, 300, GRACE, []),
        # Waited 400 ms: no grace left at all.
        (905, 400, GRACE, ["r1"]),
    ],
)
def test_the_grace_of_one_request(holder_load_ms: int, now_ms: int, grace_ns: int,
                                  want_idle: list[str]) -> None:
    aff = _aff()
    assert _idle_order(aff, [_item(aff, 1)], holder_load_ms, now_ms, grace_ns) == want_idle


def test_no_grace_from_a_holder_someone_already_waits_for() -> None:
    # r1 waits for the holder on the prediction alone (850 + 101 < 1,001 ms). r2 would
    # finish there at 850 + 101 + 101 = 1,052 ms: within a grace of the idle engine's
    # 1,001, but r1 is ahead of it on that holder, so no grace: the idle engine takes r2.
    aff = _aff()
    assert _idle_order(aff, [_item(aff, 1), _item(aff, 2)], 850) == ["r2"]


def test_the_order_reads_past_requests_left_to_a_holder() -> None:
    # scan = 1: r1 waits for the holder (sooner), so the order reads on and the idle
    # engine gets r2, which nobody holds; the window itself holds up to SCAN_CAP x scan.
    aff = _aff(scan=1)
    items = [_item(aff, 1), _item(aff, 2, held=False), _item(aff, 3, held=False)]
    assert _idle_order(aff, items, 0) == ["r2"]
    w = aff_order.window(aff, items * aff_order.SCAN_CAP, ["holder", "idle"], 0)
    assert w is not None and len(w.items) == aff_order.SCAN_CAP


def test_the_window_matches_only_as_far_as_an_order_reads() -> None:
    aff = _aff(scan=2)
    items = [_item(aff, n, held=False) for n in range(1, 9)]
    w = aff_order.window(aff, items, ["holder", "idle"], 0)
    assert w is not None and len(w.items) == 2 * aff_order.SCAN_CAP
    assert [it.request_id for it in aff_order.order_for(aff, "idle", 0, w)] == ["r1", "r2"]
    assert len(w._held) == 2  # the requests after r2 are never matched


@pytest.mark.parametrize(
    ("holder_load_ms", "now_ms", "tail_ms", "want_idle"),
    [
        # 100 ms later than the idle engine, within the grace; its first token there at
        # 0 + 1,000 + 101 ms: within a 1,200 ms tail, it waits.
        (1_000, 0, 1_200, []),
        # The same past a 1,050 ms tail: the grace would make it one of the tier's
        # slowest requests, the idle engine takes it.
        (1_000, 0, 1_050, ["r1"]),
        # Exactly at the tail: still within it.
        (999, 0, 1_100, []),
        # Waited 150 ms: 150 + 950 + 101 = 1,201 ms, past a 1,200 ms tail.
        (950, 150, 1_200, ["r1"]),
        # A holder predicted sooner is waited for whatever the tail (no grace involved):
        # 800 + 101 < 1,001 ms, even though 901 ms is past a 500 ms tail.
        (800, 0, 500, []),
        # The last tier has no tail: the grace alone decides.
        (1_000, 0, None, []),
    ],
)
def test_the_grace_stays_within_the_tiers_tail(holder_load_ms: int, now_ms: int,
                                               tail_ms: int | None,
                                               want_idle: list[str]) -> None:
    aff = _aff()
    got = _idle_order(aff, [_item(aff, 1)], holder_load_ms, now_ms, tail_ms=tail_ms)
    assert got == want_idle


@settings(max_examples=300, deadline=None, derandomize=True)
@given(load_ms=st.integers(0, 3_000), waited_ms=st.integers(0, 1_000),
       grace_ms=st.integers(0, 500), tail_ms=st.none() | st.integers(0, 4_000))
def test_a_request_never_waits_past_the_grace(load_ms: int, waited_ms: int,
                                              grace_ms: int, tail_ms: int | None) -> None:
    """Whatever the load, wait and tail: r1 waits for the holder only if the holder is
    predicted sooner, or later by less than min(saved recompute, the grace cap
    shrinking with the wait) with its first token there within the tail."""
    aff = _aff()
    item = _item(aff, 1, t_ms=0)
    got = _idle_order(aff, [item], load_ms, waited_ms, grace_ms * MS, tail_ms)
    at_holder_ms = load_ms + 101
    late_ms = at_holder_ms - 1_001
    left_ms = max(0, min(grace_ms, 2 * grace_ms - waited_ms, 900))
    if tail_ms is not None and waited_ms + at_holder_ms > tail_ms:
        left_ms = 0
    assert got == ([] if late_ms < left_ms else ["r1"])
