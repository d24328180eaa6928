"""The decode table's filter step, ``DecodeState.place(..., allowed=slots)``, and its slot
layout as followed by a listener.

- a placement always lands on an allowed slot; a refusal (no allowed GPU fits, or a
  malformed ``allowed``) changes nothing;
- with every instance's slots allowed, the decisions are those of ``allowed=None``;
- a listener's slot table follows joins, leaves, growth and compaction exactly;
- an instance found lapsed during a restricted placement does not move the other slots.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config.decode import DecodeSettings
from fulcrum.core.decode import POLICY_NAMES
from fulcrum.core.decode.copies import copy_view
from fulcrum.core.types import DecodeInstanceShape, Member, MemberKind
from fulcrum.errors import InvalidArgument, ResourceExhausted
from fulcrum.state.decode import DecodeState


def member(i: int, gpus: int, incarnation: int = 1) -> Member:
    shape = DecodeInstanceShape((3,) * gpus, (4_000,) * gpus)
    return Member(f"d{i}", MemberKind.DECODE_INSTANCE, incarnation, shape, 0)


def slots_of(state: DecodeState) -> dict[str, tuple[int, int]]:
    return {m: (s, g) for m, s, g in state.slot_ranges()}


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(POLICY_NAMES),
    gpus=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    ops=st.lists(
        st.tuples(st.integers(1, 3_000), st.lists(st.integers(0, 11), max_size=5)),
        max_size=25,
    ),
    seed=st.integers(0, 1_000),
)
def test_placements_land_on_allowed_slots_and_refusals_change_nothing(
    policy: str, gpus: list[int], ops: list[tuple[int, list[int]]], seed: int
) -> None:
    state = DecodeState(DecodeSettings(policy=policy), np.random.default_rng(seed))
    for i, n in enumerate(gpus):
        state.on_join(member(i, n), 0)
    used = sorted(s + g for _m, s, n in state.slot_ranges() for g in range(n))
    for n, (kv, picks) in enumerate(ops):
        allowed = np.array(sorted({used[p % len(used)] for p in picks}), dtype=np.int64)
        before = copy_view(state.view)
        try:
            r = state.place(f"r{n}", kv, 0, allowed=allowed)
        except ResourceExhausted:
            assert state.view.same_as(before)
            continue
        slot = slots_of(state)[r.instance_id][0] + r.gpu_index
        assert slot in allowed.tolist()
        changed = np.flatnonzero(state.view.concurrency != before.concurrency).tolist()
        assert changed == [slot]
        state.view.check()


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(POLICY_NAMES),
    gpus=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    kvs=st.lists(st.integers(1, 3_000), max_size=30),
    seed=st.integers(0, 1_000),
)
def test_every_slot_allowed_decides_as_unfiltered(
    policy: str, gpus: list[int], kvs: list[int], seed: int
) -> None:
    a = DecodeState(DecodeSettings(policy=policy), np.random.default_rng(seed))
    b = DecodeState(DecodeSettings(policy=policy), np.random.default_rng(seed))
    for i, n in enumerate(gpus):
        a.on_join(member(i, n), 0)
        b.on_join(member(i, n), 0)
    every = np.arange(b.view.n_gpus, dtype=np.int64)
    for n, kv in enumerate(kvs):
        try:
            ra = a.place(f"r{n}", kv, 0)
        except ResourceExhausted:
            with pytest.raises(ResourceExhausted):
                b.place(f"r{n}", kv, 0, allowed=every)
            continue
        rb = b.place(f"r{n}", kv, 0, allowed=every)
        assert ra == rb
    assert a.view.same_as(b.view)


def test_malformed_allowed_is_invalid_argument_and_changes_nothing() -> None:
    state = DecodeState(DecodeSettings(), np.random.default_rng(0))
    state.on_join(member(0, 2), 0)
    before = copy_view(state.view)
    for bad in (
        np.array([1, 0], dtype=np.int64),
        np.array([state.view.n_gpus], dtype=np.int64),
        np.array([0.5]),
    ):
        with pytest.raises(InvalidArgument, match="allowed"):
            state.place("x", 10, 0, allowed=bad)
        assert state.view.same_as(before) and state.held == 0


class Recorder:
    """A listener keeping slot -> instance, as the gateway's address table does."""

    def __init__(self, state: DecodeState) -> None:
        self.state = state
        self.table: dict[int, tuple[str, int]] = {}
        self.slots_moved()
        state.add_slot_listener(self)

    def slots_opened(self, instance_id: str, start: int, gpus: int) -> None:
        for g in range(gpus):
            assert start + g not in self.table
            self.table[start + g] = (instance_id, g)

    def slots_closed(self, instance_id: str, start: int, gpus: int) -> None:
        for g in range(gpus):
            assert self.table.pop(start + g) == (instance_id, g)

    def slots_moved(self) -> None:
        self.table = {s + g: (m, g) for m, s, n in self.state.slot_ranges() for g in range(n)}


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.integers(1, 40))),
    min_waste=st.sampled_from([0, 1024]),
)
def test_listener_follows_the_layout(events: list[tuple[bool, int, int]], min_waste: int) -> None:
    state = DecodeState(DecodeSettings(), np.random.default_rng(0))
    state._alloc.min_waste = min_waste  # compaction at every leave that frees a slot
    rec = Recorder(state)
    members: dict[int, Member] = {}
    for join, i, gpus in events:
        version = state.layout_version
        if join and i not in members:
            members[i] = member(i, gpus)
            state.on_join(members[i], 0)
        elif not join and i in members:
            state.on_leave(members.pop(i), "deregistered", 0)
        else:
            continue
        assert state.layout_version > version
        want = {s + g: (m, g) for m, s, n in state.slot_ranges() for g in range(n)}
        assert rec.table == want


def test_lapsed_instance_during_a_restricted_placement_keeps_the_slots() -> None:
    lapsed = {"d0"}
    state = DecodeState(
        DecodeSettings(policy="least_requests"),
        np.random.default_rng(0),
        liveness=lambda mid, _inc, _now: mid not in lapsed,
    )
    state._alloc.min_waste = 0  # a leave would compact at once
    for i in range(3):
        state.on_join(member(i, 2), 0)
    where = slots_of(state)
    allowed = np.array([where["d0"][0], where["d2"][0]], dtype=np.int64)
    r = state.place("x", 10, 0, allowed=allowed)  # d0 (lowest slot) lapses: d2 instead
    assert (r.instance_id, r.gpu_index) == ("d2", 0)
    assert slots_of(state)["d2"] == where["d2"]  # not compacted under the caller
    state.on_leave(member(1, 2), "deregistered", 0)  # the next leave compacts
    assert sum(g for _s, g in slots_of(state).values()) == 2
