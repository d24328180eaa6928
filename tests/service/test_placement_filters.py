"""The filter list of the placement tables (decode and vision, no gRPC).

A filter (:class:`fulcrum.state.placement.SlotFilter`) narrows the GPUs one request may
take before the policy's select; it hears which slots a request holds and when it holds
nothing any more (release, expiry, loss with its member). The test-only filter here is a
per-slot cap on the requests one "tenant" (the request id's prefix) holds: what a
per-tenant concurrency cap is, written as one filter and one ``filters.append``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config.decode import DecodeSettings
from fulcrum.config.vision import VisionSettings
from fulcrum.core.types import (
    DecodeInstanceShape,
    Member,
    MemberKind,
    VisionMachineShape,
)
from fulcrum.errors import FulcrumError, InvalidArgument, ResourceExhausted
from fulcrum.state.decode import DecodeRequest, DecodeState
from fulcrum.state.placement import SlotMask
from fulcrum.state.vision import ImageRequest, VisionRequest, VisionState

MS = 1_000_000


def decode_member(member_id: str, gpus: int = 2, incarnation: int = 1) -> Member:
    shape = DecodeInstanceShape((8,) * gpus, (100_000,) * gpus)
    return Member(member_id, MemberKind.DECODE_INSTANCE, incarnation, shape, 0)


def vision_member(member_id: str, gpus: int = 2) -> Member:
    return Member(member_id, MemberKind.VISION_MACHINE, 1, VisionMachineShape(gpus, 0), 0)


class TenantSlotCap:
    """At most ``cap`` requests of one tenant (request id up to the first '/') per GPU.

    Counts by ``(tenant, member_id, gpu_index)``, stable while slots move; the mask is
    built from the table's slot ranges at each call."""

    def __init__(self, table: DecodeState | VisionState, cap: int) -> None:
        self.table = table
        self.cap = cap
        self.count: dict[tuple[str, str, int], int] = defaultdict(int)
        self.held_gpus: dict[str, tuple[str, list[tuple[str, int]]]] = {}
        self.freed_ids: list[str] = []

    def allowed(self, request: DecodeRequest | VisionRequest, slots: int, now_ns: int) -> SlotMask:
        tenant = request.request_id.split("/")[0]
        mask = np.ones(slots, dtype=np.bool_)
        for member_id, start, gpus in self.table.slot_ranges():
            for gpu in range(gpus):
                if self.count.get((tenant, member_id, gpu), 0) >= self.cap:
                    mask[start + gpu] = False
        return mask

    def held(self, request_id: str, request: object, gpus: Sequence[tuple[str, int]]) -> None:
        tenant = request_id.split("/")[0]
        # A request counts once per GPU (a VE request may put several images on one GPU:
        # the mask applies to the whole request).
        self.held_gpus[request_id] = (tenant, sorted(set(gpus)))
        for member_id, gpu in self.held_gpus[request_id][1]:
            self.count[(tenant, member_id, gpu)] += 1

    def freed(self, request_id: str) -> None:
        self.freed_ids.append(request_id)
        tenant, gpus = self.held_gpus.pop(request_id)
        for member_id, gpu in gpus:
            self.count[(tenant, member_id, gpu)] -= 1


class CapFromSettings(TenantSlotCap):
    """The cap follows the table's settings (here: ``max_placements``) on reload."""

    def apply_settings(self, settings: DecodeSettings) -> None:
        self.cap = settings.max_placements


class Refuse:
    def allowed(self, request: object, slots: int, now_ns: int) -> SlotMask:
        raise ResourceExhausted("tenant over its cap", 50)

    def held(self, request_id: str, request: object, gpus: Sequence[tuple[str, int]]) -> None:
        raise AssertionError("never placed")

    def freed(self, request_id: str) -> None:
        raise AssertionError("never placed")


def test_decode_a_tenant_cap_spreads_one_tenant_and_frees_on_release() -> None:
    state = DecodeState(DecodeSettings(policy="least_requests"), np.random.default_rng(1))
    cap = TenantSlotCap(state, 1)
    state.filters.append(cap)
    for i in range(2):
        state.on_join(decode_member(f"d{i}"), 0)
    placed = [state.place(f"t1/{i}", 1_000, 0) for i in range(4)]
    # One request of tenant t1 per GPU: the four GPUs, each once.
    assert sorted((r.instance_id, r.gpu_index) for r in placed) == [
        ("d0", 0), ("d0", 1), ("d1", 0), ("d1", 1),
    ]
    with pytest.raises(ResourceExhausted):
        state.place("t1/4", 1_000, 0)
    assert state.place("t2/0", 1_000, 0).instance_id in {"d0", "d1"}  # another tenant fits
    state.release("t1/2", MS)
    assert cap.freed_ids == ["t1/2"]
    again = state.place("t1/5", 1_000, MS)
    assert (again.instance_id, again.gpu_index) == (placed[2].instance_id, placed[2].gpu_index)


def test_decode_filters_and_with_the_callers_allowed_slots() -> None:
    state = DecodeState(DecodeSettings(policy="least_requests"), np.random.default_rng(1))
    for i in range(2):
        state.on_join(decode_member(f"d{i}"), 0)
    state.filters.append(TenantSlotCap(state, 1))
    first = state.place("t/0", 1_000, 0, allowed=np.asarray([1, 2], dtype=np.int64))
    assert first.instance_id == "d0" and first.gpu_index == 1  # slot 1, the lower allowed
    second = state.place("t/1", 1_000, 0, allowed=np.asarray([1, 2], dtype=np.int64))
    assert (second.instance_id, second.gpu_index) == ("d1", 0)  # slot 1 is capped
    with pytest.raises(ResourceExhausted):
        state.place("t/2", 1_000, 0, allowed=np.asarray([1, 2], dtype=np.int64))
    with pytest.raises(InvalidArgument, match="allowed"):
        state.place("t/3", 1_000, 0, allowed=np.asarray([2, 1], dtype=np.int64))
    assert state.counts.placements[("least_requests", "", "invalid_argument")] == 1


def test_decode_a_filter_that_refuses_changes_nothing_and_is_counted() -> None:
    state = DecodeState(DecodeSettings(), np.random.default_rng(1))
    state.on_join(decode_member("d0"), 0)
    state.filters.append(Refuse())
    with pytest.raises(ResourceExhausted, match="over its cap"):
        state.place("r", 1_000, 0)
    assert state.held == 0
    assert state.counts.placements[("dual", "", "resource_exhausted")] == 1
    assert state.instance_load("d0") == ([0, 0], [0, 0])


def test_a_filter_with_settings_follows_a_reload() -> None:
    state = DecodeState(DecodeSettings(policy="least_requests"), np.random.default_rng(1))
    state.on_join(decode_member("d0", gpus=1), 0)
    cap = CapFromSettings(state, 1)
    state.filters.append(cap)
    state.place("t/0", 1_000, 0)
    with pytest.raises(ResourceExhausted):
        state.place("t/1", 1_000, 0)
    state.apply_settings(DecodeSettings(policy="least_requests", max_placements=2))
    assert cap.cap == 2
    assert state.place("t/1", 1_000, 0).instance_id == "d0"


def test_decode_filters_hear_expiry_and_loss() -> None:
    state = DecodeState(DecodeSettings(lease_ms=10), np.random.default_rng(1))
    state.on_join(decode_member("d0"), 0)
    state.on_join(decode_member("d1"), 0)
    cap = TenantSlotCap(state, 8)
    state.filters.append(cap)
    for i in range(4):
        state.place(f"t/{i}", 1_000, 0)
    on_d0 = {rid for rid, (_, gpus) in cap.held_gpus.items() if gpus[0][0] == "d0"}
    state.on_leave(decode_member("d0"), "deregistered", 1)
    assert set(cap.freed_ids) == on_d0
    assert state.expire(20 * MS) == 4 - len(on_d0)
    assert sorted(cap.freed_ids) == [f"t/{i}" for i in range(4)]
    assert cap.held_gpus == {}


def test_vision_a_tenant_cap_spreads_the_images_of_one_tenant() -> None:
    state = VisionState(VisionSettings(policy="least_patches"), np.random.default_rng(1))
    for i in range(2):
        state.on_join(vision_member(f"v{i}"), 0)
    cap = TenantSlotCap(state, 1)
    state.filters.append(cap)
    shot = ImageRequest(64, 64)
    gpus = {(p.machine_id, p.gpu_index) for i in range(4) for p in state.place(f"t/{i}", [shot], 0)}
    assert gpus == {("v0", 0), ("v0", 1), ("v1", 0), ("v1", 1)}
    with pytest.raises(ResourceExhausted):
        state.place("t/4", [shot], 0)
    assert state.counts.placements[("least_patches", "resource_exhausted")] == 1
    assert state.release("t/1", MS) == (1, 16)
    assert cap.freed_ids == ["t/1"]
    assert len(state.place("t/5", [shot], MS)) == 1


def test_vision_a_filter_that_refuses_changes_nothing() -> None:
    state = VisionState(VisionSettings(), np.random.default_rng(1), filters=[Refuse()])
    state.on_join(vision_member("v0"), 0)
    with pytest.raises(ResourceExhausted, match="over its cap"):
        state.place("r", [ImageRequest(64, 64)], 0)
    assert state.held == 0
    assert state.machine_load("v0") == ([0, 0], 0, 0)


events = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.integers(0, 2), st.integers(1, 40_000)),
        st.tuples(st.just("release"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("join"), st.integers(0, 3), st.integers(1, 3)),
        st.tuples(st.just("leave"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("expire"), st.just(0), st.just(0)),
    ),
    max_size=50,
)


@settings(max_examples=60, deadline=None)
@given(events=events, vision=st.booleans(), seed=st.integers(0, 1_000))
def test_a_counting_filter_sees_exactly_what_the_table_holds(
    events: list[tuple[str, int, int]], vision: bool, seed: int
) -> None:
    """Through joins, leaves (with compaction at every leave), releases and expiry, the
    filter's counts are those of the placements held, and no tenant passes its cap."""
    rng = np.random.default_rng(seed)
    state: DecodeState | VisionState
    if vision:
        state = VisionState(VisionSettings(lease_ms=1_000), rng)
    else:
        state = DecodeState(DecodeSettings(lease_ms=1_000), rng)
    state._alloc.min_waste = 0  # compaction at every leave that leaves a hole
    cap = TenantSlotCap(state, 2)
    state.filters.append(cap)
    members: dict[str, Member] = {}
    now, n = 0, 0
    for kind, a, b in events:
        now += 100 * MS
        member_id = f"m{a}"
        if kind == "join" and member_id not in members:
            members[member_id] = (vision_member if vision else decode_member)(member_id, b)
            state.on_join(members[member_id], now)
        elif kind == "leave" and member_id in members:
            state.on_leave(members.pop(member_id), "deregistered", now)
        elif kind == "place":
            n += 1
            with contextlib.suppress(FulcrumError):
                if isinstance(state, VisionState):
                    images = [ImageRequest(b % 2_000 + 1, 64)] * (1 + b % 3)
                    state.place(f"t{a}/{n}", images, now)
                else:
                    state.place(f"t{a}/{n}", b, now)
        elif kind == "release":
            with contextlib.suppress(FulcrumError):
                state.release(f"t{a % 3}/{b or a}", now)
        elif kind == "expire":
            state.expire(now)
        assert len(cap.held_gpus) == state.held
        assert all(0 <= c <= cap.cap for c in cap.count.values())
        held = sorted(g for _, gpus in cap.held_gpus.values() for g in gpus)
        assert sum(cap.count.values()) == len(held)
