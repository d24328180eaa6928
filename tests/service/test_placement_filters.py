"""The filter list of the placement tables (decode and vision, no gRPC).

A filter (:class:`fulcrum.state.placement.SlotFilter`) narrows the GPUs one request may
take before the policy's select; it hears which slots a request holds and when it holds
nothing any more (release, expiry, loss with its member). The test-only filter here is a
per-slot cap on the requests one "tenant" (the request id's prefix) holds: what a
per-tenant concurrency cap is, written as one filter and one ``filters.append``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pytest

from fulcrum.config.decode import DecodeSettings
from fulcrum.config.vision import VisionSettings
from fulcrum.core.types import (
    DecodeInstanceShape,
    Member,
    MemberKind,
    VisionMachineShape,
)
from fulcrum.errors import InvalidArgument, ResourceExhausted
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
    """At most ``cap`` requests of one tenant (request id up to the first '/') per slot."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.on_slot: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.held_slots: dict[str, tuple[str, Sequence[int]]] = {}
        self.freed_ids: list[str] = []

    def allowed(self, request: DecodeRequest | VisionRequest, slots: int, now_ns: int) -> SlotMask:
        tenant = request.request_id.split("/")[0]
        mask = np.ones(slots, dtype=np.bool_)
        for slot, n in self.on_slot[tenant].items():
            if n >= self.cap:
                mask[slot] = False
        return mask

    def held(self, request_id: str, request: object, slots: Sequence[int]) -> None:
        tenant = request_id.split("/")[0]
        self.held_slots[request_id] = (tenant, list(slots))
        for slot in slots:
            self.on_slot[tenant][slot] += 1

    def freed(self, request_id: str) -> None:
        self.freed_ids.append(request_id)
        tenant, slots = self.held_slots.pop(request_id)
        for slot in slots:
            self.on_slot[tenant][slot] -= 1


class Refuse:
    def allowed(self, request: object, slots: int, now_ns: int) -> SlotMask:
        raise ResourceExhausted("tenant over its cap", 50)

    def held(self, request_id: str, request: object, slots: Sequence[int]) -> None:
        raise AssertionError("never placed")

    def freed(self, request_id: str) -> None:
        raise AssertionError("never placed")


def test_decode_a_tenant_cap_spreads_one_tenant_and_frees_on_release() -> None:
    cap = TenantSlotCap(1)
    state = DecodeState(
        DecodeSettings(policy="least_requests"), np.random.default_rng(1), filters=[cap]
    )
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
    state.filters.append(TenantSlotCap(1))
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


def test_decode_filters_hear_expiry_and_loss() -> None:
    state = DecodeState(DecodeSettings(lease_ms=10), np.random.default_rng(1))
    state.on_join(decode_member("d0"), 0)
    state.on_join(decode_member("d1"), 0)
    cap = TenantSlotCap(8)
    state.filters.append(cap)
    for i in range(4):
        state.place(f"t/{i}", 1_000, 0)
    on_d0 = {rid for rid, (_, slots) in cap.held_slots.items() if slots[0] < 2}
    state.on_leave(decode_member("d0"), "deregistered", 1)
    assert set(cap.freed_ids) == on_d0
    assert state.expire(20 * MS) == 4 - len(on_d0)
    assert sorted(cap.freed_ids) == [f"t/{i}" for i in range(4)]
    assert cap.held_slots == {}


def test_vision_a_tenant_cap_spreads_the_images_of_one_tenant() -> None:
    state = VisionState(VisionSettings(policy="least_patches"), np.random.default_rng(1))
    for i in range(2):
        state.on_join(vision_member(f"v{i}"), 0)
    cap = TenantSlotCap(1)
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
    state = VisionState(VisionSettings(), np.random.default_rng(1))
    state.on_join(vision_member("v0"), 0)
    state.filters.append(Refuse())
    with pytest.raises(ResourceExhausted, match="over its cap"):
        state.place("r", [ImageRequest(64, 64)], 0)
    assert state.held == 0
    assert state.machine_load("v0") == ([0, 0], 0, 0)
