"""The daemon's decode table (no gRPC) under random sequences of fleet and placement events.

Invariants after every step: the view's derived fields are consistent; a placement never
takes a GPU past a capacity; the placements held are exactly those of live instances;
releasing everything that was placed since the last report restores the view exactly.
"""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config.decode import DecodeSettings
from fulcrum.core.decode import POLICY_NAMES
from fulcrum.core.decode.copies import copy_view
from fulcrum.core.types import DecodeInstanceLoad, DecodeInstanceShape, Member, MemberKind
from fulcrum.errors import FulcrumError, NotFound, ResourceExhausted
from fulcrum.state.decode import DecodeState

IDS = ("d-a", "d-b", "d-c")

events = st.lists(
    st.one_of(
        st.tuples(st.just("place"), st.integers(1, 3_000)),
        st.tuples(st.just("release"), st.integers(0, 40)),
        st.tuples(st.just("join"), st.integers(0, 2)),
        st.tuples(st.just("leave"), st.integers(0, 2)),
        st.tuples(st.just("report"), st.integers(0, 2)),
        st.tuples(st.just("expire"), st.integers(0, 3)),
    ),
    max_size=40,
)


def shape(i: int) -> DecodeInstanceShape:
    return DecodeInstanceShape((3,) * (i + 1), (4_000 + 1_000 * i,) * (i + 1))


@settings(max_examples=60, deadline=None)
@given(events=events, policy=st.sampled_from(POLICY_NAMES), seed=st.integers(0, 1_000))
def test_random_event_sequences_keep_the_table_sound(
    events: list[tuple[str, int]], policy: str, seed: int
) -> None:
    state = DecodeState(DecodeSettings(policy=policy, lease_ms=1_000), np.random.default_rng(seed))
    incarnation = 0
    members: dict[str, Member] = {}
    placed: list[str] = []
    now = 0
    for kind, arg in events:
        now += 100_000_000  # 0.1 s per event
        if kind == "join":
            member_id = IDS[arg]
            if member_id in members:
                state.on_leave(members[member_id], "replaced", now)
            incarnation += 1
            members[member_id] = Member(
                member_id, MemberKind.DECODE_INSTANCE, incarnation, shape(arg), now
            )
            state.on_join(members[member_id], now)
        elif kind == "leave" and IDS[arg] in members:
            state.on_leave(members.pop(IDS[arg]), "lapsed", now)
        elif kind == "report" and IDS[arg] in members:
            n = arg + 1
            load = DecodeInstanceLoad((1,) * n, (500,) * n)
            state.validate_load(members[IDS[arg]], load)
            state.on_load(members[IDS[arg]], load, now)
        elif kind == "expire":
            state.expire(now + arg * 300_000_000)
        elif kind == "place":
            before = copy_view(state.view)
            rid = f"r{len(placed)}"
            try:
                r = state.place(rid, arg, now)
            except ResourceExhausted:
                assert state.view.same_as(before)  # refused: nothing changed
            else:
                placed.append(rid)
                cap_c, cap_k = (
                    shape(IDS.index(r.instance_id)).max_concurrency[0],
                    shape(IDS.index(r.instance_id)).max_kv_tokens[0],
                )
                assert r.gpu_concurrency <= cap_c and r.gpu_kv_tokens <= cap_k
        elif kind == "release" and placed:
            rid = placed[arg % len(placed)]
            with contextlib.suppress(NotFound):
                state.release(rid, now)
        state.view.check()
        live = {m for m in members}
        assert {i for i, *_ in state.gpu_loads()} == live
        assert state.held <= len(placed)


def test_release_everything_restores_the_view_exactly() -> None:
    state = DecodeState(DecodeSettings(), np.random.default_rng(0))
    for i, member_id in enumerate(IDS):
        m = Member(member_id, MemberKind.DECODE_INSTANCE, i + 1, shape(2), 0)
        state.on_join(m, 0)
        state.on_load(m, DecodeInstanceLoad((1, 0, 2), (300, 0, 1_000)), 0)
    before = copy_view(state.view)
    done = []
    for k in range(12):
        try:
            state.place(f"r{k}", 100 + 97 * k, 0)
            done.append(f"r{k}")
        except FulcrumError:
            pass
    assert done
    for rid in reversed(done):
        state.release(rid, 0)
    assert state.view.same_as(before)
