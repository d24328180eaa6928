"""The adapter's restriction of the decode policy to allowed GPUs (subset hint, GPUs with
an address): the choice is always allowed, the view is left consistent and every other
GPU exactly as it was (liveness untouched), and a refused placement changes nothing."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fulcrum.config.decode import DecodeSettings
from fulcrum.config.server import FleetSettings
from fulcrum.core.types import DecodeInstanceShape, MemberKind
from fulcrum.errors import ResourceExhausted
from fulcrum.gateway.adapter import DecodeAdapter, NoEligibleEndpoint
from fulcrum.state.decode import DecodeState
from fulcrum.state.fleet import Fleet


def build(policy: str, gpus: list[int]) -> tuple[DecodeState, DecodeAdapter, list[str]]:
    fleet = Fleet(FleetSettings(heartbeat_timeout_ms=3_600_000))
    state = DecodeState(DecodeSettings(policy=policy), np.random.default_rng(0))
    fleet.add_listener(MemberKind.DECODE_INSTANCE, state)
    addresses = {}
    for i, n in enumerate(gpus):
        fleet.register(f"i{i}", DecodeInstanceShape((4,) * n, (10_000,) * n), 0)
        for g in range(n):
            addresses[(f"i{i}", g)] = f"10.0.{i}.1:{8000 + g}"
    # One instance without addresses: never picked.
    fleet.register("z-unaddressed", DecodeInstanceShape((4,), (10_000,)), 0)
    return state, DecodeAdapter(state, addresses), list(addresses.values())


@given(
    policy=st.sampled_from(["dual", "least_kv", "least_requests", "round_robin", "step_time"]),
    gpus=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    ops=st.lists(
        st.tuples(st.integers(1, 9000), st.lists(st.integers(0, 8), max_size=4), st.booleans()),
        min_size=1,
        max_size=25,
    ),
)
def test_restricted_placement(policy: str, gpus: list[int], ops: list) -> None:  # type: ignore[type-arg]
    state, adapter, addrs = build(policy, gpus)
    held: list[str] = []
    for n, (kv, picks, use_subset) in enumerate(ops):
        subset = sorted({addrs[i % len(addrs)] for i in picks}) if use_subset else None
        before = {(iid, g): (c, k) for iid, g, c, k in state.gpu_loads()}
        live_before = state.view.live.copy()
        try:
            p = adapter.place(f"r{n}", kv, 0, subset=subset)
        except (NoEligibleEndpoint, ResourceExhausted):
            after = {(iid, g): (c, k) for iid, g, c, k in state.gpu_loads()}
            assert after == before  # refused: nothing changed
        else:
            assert p.address in (subset if subset is not None else addrs)
            held.append(p.request_id)
            after = {(iid, g): (c, k) for iid, g, c, k in state.gpu_loads()}
            changed = [key for key in after if after[key] != before[key]]
            assert changed == [p.gpu]
        # The filter never touches liveness (the old adapter closed and reopened GPUs).
        assert np.array_equal(state.view.live, live_before)
        state.view.check()
    for rid in held:
        assert adapter.release(rid, 0)
    assert all(c == 0 and k == 0 for _i, _g, c, k in state.gpu_loads())


def test_empty_subset_and_unknown_addresses_are_no_eligible_endpoint() -> None:
    _state, adapter, _addrs = build("dual", [2])
    for subset in ([], ["1.1.1.1:1"]):
        try:
            adapter.place("x", 10, 0, subset=subset)
        except NoEligibleEndpoint:
            continue
        raise AssertionError("placed outside the subset")


def fresh_table(state: DecodeState, adapter: DecodeAdapter) -> dict[int, str]:
    """slot -> address, rebuilt from scratch through the public API."""
    out = {}
    for iid, start, gpus in state.slot_ranges():
        for g in range(gpus):
            a = adapter._lookup((iid, g))
            if a is not None:
                out[start + g] = a
    return out


@given(
    events=st.lists(
        st.tuples(st.sampled_from(["join", "leave", "book"]), st.integers(0, 6), st.integers(1, 4)),
        max_size=30,
    ),
    min_waste=st.sampled_from([0, 1024]),
)
def test_slot_addresses_follow_joins_leaves_and_registrations(
    events: list[tuple[str, int, int]], min_waste: int
) -> None:
    from fulcrum.core.types import Member
    from fulcrum.gateway.registry import AddressBook

    state = DecodeState(DecodeSettings(), np.random.default_rng(0))
    state._alloc.min_waste = min_waste  # compaction at every leave that frees a slot
    book = AddressBook()
    pool = {("p0", 0): "10.9.0.1:9000", ("p0", 1): "10.9.0.1:9001"}
    adapter = DecodeAdapter(state, pool, book)
    told: set[str] = set()  # what the address listeners heard (the cache picker's slots)
    adapter.address_listeners.append(told.update)
    state.on_join(
        Member("p0", MemberKind.DECODE_INSTANCE, 1, DecodeInstanceShape((4, 4), (99, 99)), 0), 0
    )
    members: dict[int, Member] = {}
    inc = 1
    last: tuple[int, dict[int, str]] = (-1, {})
    for kind, i, gpus in events:
        if kind == "join" and i not in members:
            inc += 1
            shape = DecodeInstanceShape((4,) * gpus, (10_000,) * gpus)
            members[i] = Member(f"m{i}", MemberKind.DECODE_INSTANCE, inc, shape, 0)
            state.on_join(members[i], 0)
            if i % 2 == 0:  # the fleet service records addresses right after the join
                book.record(members[i], tuple(f"10.1.{i}.{g}:80" for g in range(gpus)))
        elif kind == "leave" and i in members:
            state.on_leave(members[i], "deregistered", 0)
            book.on_leave(members.pop(i), "deregistered", 0)
        elif kind == "book" and i in members:
            m = members[i]
            n = len(m.shape.max_concurrency)
            book.record(m, None if i % 3 == 0 else tuple(f"10.2.{i}.{g}:81" for g in range(n)))
        want = fresh_table(state, adapter)
        got = {s: a for s, a in enumerate(adapter._slot_addr) if a is not None}
        assert got == want
        # A table kept by decode slot is valid for one generation (the cache-aware
        # picker's index slots): the slots' addresses never change within one.
        if adapter.generation == last[0]:
            assert got == last[1]
        last = (adapter.generation, got)
        assert set(got.values()) <= told
        for s, a in want.items():
            assert adapter.known(a) and adapter._addr_slot[a] == s
        # The "addressed GPUs only" set, through the cache, is the fresh one.
        allowed = adapter._allowed(None)
        if len(want) == sum(g for _i, _s, g in state.slot_ranges()):
            assert allowed is None
        else:
            assert allowed is not None and allowed.dtype == np.bool_
            assert np.flatnonzero(allowed).tolist() == sorted(want)


def test_subset_mask_is_cached_until_membership_changes() -> None:
    state, adapter, addrs = build("dual", [2, 2])
    hint = [addrs[3], addrs[0]]
    first = adapter._allowed(hint)
    assert first is not None
    assert adapter._allowed(list(reversed(hint))) is first  # same hint: same array
    assert first.tolist() == sorted(adapter._addr_slot[a] for a in hint)
    from fulcrum.core.types import Member

    state.on_join(
        Member("late", MemberKind.DECODE_INSTANCE, 9, DecodeInstanceShape((4,), (10,)), 0), 0
    )
    again = adapter._allowed(hint)
    assert again is not first and again is not None
    assert again.tolist() == first.tolist()


@given(
    kvs=st.lists(st.integers(1, 9000), min_size=1, max_size=12),
    subset_bits=st.lists(st.booleans(), min_size=6, max_size=6),
    use_subset=st.booleans(),
)
def test_fallbacks_are_allowed_other_gpus_with_room_in_order(
    kvs: list[int], subset_bits: list[bool], use_subset: bool
) -> None:
    state, adapter, addrs = build("least_kv", [3, 3])
    subset = [a for a, b in zip(addrs, subset_bits, strict=True) if b] if use_subset else None
    for n, kv in enumerate(kvs):
        try:
            p = adapter.place(f"r{n}", kv, 0, subset=subset, fallbacks=3)
        except (NoEligibleEndpoint, ResourceExhausted):
            continue
        view = state.view
        ok = subset if subset is not None else addrs
        want = sorted(
            (int(view.order_conc[adapter._addr_slot[a]]), adapter._addr_slot[a], a)
            for a in ok
            if a != p.address and int(view.headroom[adapter._addr_slot[a]]) >= kv
        )
        assert p.fallbacks == tuple(a for _o, _s, a in want[:3])


def test_fallbacks_through_block_minima_match_a_full_pass() -> None:
    """On a view large enough to keep block minima, the fallbacks read only some blocks
    and still list the best keys in order (ties may differ in slot, not in key)."""
    from fulcrum.core.types import DecodeInstanceLoad, Member

    state = DecodeState(DecodeSettings(), np.random.default_rng(0))
    rng = np.random.default_rng(1)
    members = []
    for i in range(520):  # 33,280 GPUs: the view keeps block minima
        shape = DecodeInstanceShape((8,) * 64, (5_000,) * 64)
        m = Member(f"m{i:03d}", MemberKind.DECODE_INSTANCE, 1, shape, 0)
        state.on_join(m, 0)
        members.append(m)
    addresses = {
        (m.member_id, g): f"10.{i // 200}.{i % 200}.1:{9000 + g}"
        for i, m in enumerate(members)
        for g in range(64)
    }
    adapter = DecodeAdapter(state, addresses)
    assert state.view.blocks is not None
    for round_ in range(6):
        for m in members[round_ * 80 : round_ * 80 + 120]:
            conc = rng.integers(0, 9, 64).tolist()
            kv = rng.integers(0, 5_000, 64).tolist()
            state.on_load(m, DecodeInstanceLoad(tuple(conc), tuple(kv)), 0)
        view = state.view
        for kv_tokens, k in ((1, 3), (4_000, 5), (4_990, 16)):
            got = adapter._fallbacks("", kv_tokens, None, k)
            keys = [int(view.order_conc[adapter._addr_slot[a]]) for a in got]
            fit = view.headroom >= kv_tokens
            want = sorted(view.order_conc[fit].tolist())[:k]
            assert keys == want


def test_fallbacks_through_block_minima_honour_the_addressed_mask() -> None:
    """Some GPUs without an address on a large view: fallbacks never list them, and list
    the best addressed keys in order."""
    from fulcrum.core.types import Member

    state = DecodeState(DecodeSettings(), np.random.default_rng(0))
    members = []
    for i in range(520):
        shape = DecodeInstanceShape((8,) * 64, (5_000,) * 64)
        m = Member(f"m{i:03d}", MemberKind.DECODE_INSTANCE, 1, shape, 0)
        state.on_join(m, 0)
        members.append(m)
    # Only odd members have addresses: the low blocks' best slots are unaddressed.
    addresses = {
        (m.member_id, g): f"10.{i // 200}.{i % 200}.1:{9000 + g}"
        for i, m in enumerate(members)
        if i % 2
        for g in range(64)
    }
    adapter = DecodeAdapter(state, addresses)
    allowed = adapter._allowed(None)
    assert allowed is not None and allowed.dtype == np.bool_
    for n in range(40):
        p = adapter.place(f"r{n}", 100 + n, 0, fallbacks=4)
        assert p.gpu in addresses
        view = state.view
        keys = [int(view.order_conc[adapter._addr_slot[a]]) for a in p.fallbacks]
        fit = (view.headroom >= 100 + n) & allowed
        fit[adapter._addr_slot[p.address]] = False
        assert keys == sorted(view.order_conc[fit].tolist())[:4]
