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
