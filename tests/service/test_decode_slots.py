"""The decode table's slot layout under joins, leaves (with compaction forced), reports,
placements and releases, against a plain model keyed by (instance, GPU).

Invariants after every step: the per-GPU figures equal the model's; the view's derived
fields are consistent; free slots are never chosen; the published snapshot (what the
scrape thread reads) equals the table; the per-GPU series stay within the bound.
"""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config.decode import DecodeSettings
from fulcrum.core.types import DecodeInstanceLoad, DecodeInstanceShape, Member, MemberKind
from fulcrum.errors import NotFound, ResourceExhausted
from fulcrum.state.decode import DecodeState

IDS = tuple(f"d-{i}" for i in range(6))

events = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 5), st.integers(1, 5)),
        st.tuples(st.just("leave"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("place"), st.integers(1, 3_000), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 60), st.just(0)),
        st.tuples(st.just("report"), st.integers(0, 5), st.integers(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(events=events, seed=st.integers(0, 1_000), min_waste=st.sampled_from([0, 1024]))
def test_slots_follow_the_model(
    events: list[tuple[str, int, int]], seed: int, min_waste: int
) -> None:
    state = DecodeState(DecodeSettings(), np.random.default_rng(seed))
    state._alloc.min_waste = min_waste  # compaction at every leave that frees a slot
    members: dict[str, Member] = {}
    model: dict[tuple[str, int], tuple[int, int]] = {}
    held: dict[str, tuple[str, int, int]] = {}
    incarnation = 0
    for n, (kind, a, b) in enumerate(events):
        if kind == "join":
            member_id = IDS[a]
            if member_id in members:
                state.on_leave(members.pop(member_id), "replaced", 0)
                model = {k: v for k, v in model.items() if k[0] != member_id}
                held = {r: h for r, h in held.items() if h[0] != member_id}
            incarnation += 1
            shape = DecodeInstanceShape((4,) * b, (10_000,) * b)
            members[member_id] = Member(
                member_id, MemberKind.DECODE_INSTANCE, incarnation, shape, 0
            )
            state.on_join(members[member_id], 0)
            model.update({(member_id, g): (0, 0) for g in range(b)})
        elif kind == "leave" and IDS[a] in members:
            member_id = IDS[a]
            state.on_leave(members.pop(member_id), "lapsed", 0)
            model = {k: v for k, v in model.items() if k[0] != member_id}
            held = {r: h for r, h in held.items() if h[0] != member_id}
        elif kind == "report" and IDS[a] in members:
            m = members[IDS[a]]
            gpus = m.shape.gpus
            load = DecodeInstanceLoad((b,) * gpus, (100 * b,) * gpus)
            state.validate_load(m, load)
            state.on_load(m, load, 0)
            model.update({(m.member_id, g): (b, 100 * b) for g in range(gpus)})
        elif kind == "place":
            rid = f"r{n}"
            with contextlib.suppress(ResourceExhausted):
                r = state.place(rid, a, 0)
                c, k = model[(r.instance_id, r.gpu_index)]
                assert c < 4 and k + a <= 10_000  # the capacity filter held
                model[(r.instance_id, r.gpu_index)] = (c + 1, k + a)
                assert (r.gpu_concurrency, r.gpu_kv_tokens) == (c + 1, k + a)
                held[rid] = (r.instance_id, r.gpu_index, a)
        elif kind == "release" and held:
            rid = sorted(held)[a % len(held)]
            iid, g, kv = held.pop(rid)
            r = state.release(rid, 0)
            assert (r.instance_id, r.gpu_index) == (iid, g)
            c, k = model[(iid, g)]
            model[(iid, g)] = (max(c - 1, 0), max(k - kv, 0))
        state.view.check()
        got = {(i, g): (c, k) for i, g, c, k in state.gpu_loads()}
        assert got == model
        assert state.held == len(held)
        snap = state.publisher.current()
        published = {
            (m.member_id, g): (int(m.values[0][g]), int(m.values[1][g]))
            for m in snap.members
            for g in range(m.values[0].shape[0])
        }
        assert published == model
        assert snap.held == len(held)
        live = int(state.view.live.sum())
        assert live == len(model)
    for rid in list(held):
        state.release(rid, 0)
    with contextlib.suppress(NotFound):
        state.release("nope", 0)


def test_large_table_keeps_its_block_minima() -> None:
    """At 32,832 GPUs the view keeps block minima: they stay exact through placements,
    releases, heartbeats, leaves (compaction forced) and joins."""
    state = DecodeState(DecodeSettings(), np.random.default_rng(5))
    state._alloc.min_waste = 0
    shape = DecodeInstanceShape((8,) * 64, (100_000,) * 64)
    members = [
        Member(f"d-{i:03d}", MemberKind.DECODE_INSTANCE, i + 1, shape, 0) for i in range(513)
    ]
    for m in members:
        state.on_join(m, 0)
    assert state.view.blocks is not None
    rng = np.random.default_rng(9)
    placed: list[str] = []
    for step in range(600):
        op = int(rng.integers(5))
        if op <= 1:
            with contextlib.suppress(ResourceExhausted):
                state.place(f"r{step}", int(rng.integers(1, 30_000)), 0)
                placed.append(f"r{step}")
        elif op == 2 and placed:
            with contextlib.suppress(NotFound):
                state.release(placed.pop(int(rng.integers(len(placed)))), 0)
        elif op == 3:
            m = members[int(rng.integers(len(members)))]
            state.on_load(m, DecodeInstanceLoad((1,) * 64, (int(rng.integers(0, 9_000)),) * 64), 0)
        else:
            i = int(rng.integers(len(members)))
            state.on_leave(members[i], "deregistered", 0)
            members[i] = Member(members[i].member_id, MemberKind.DECODE_INSTANCE, 1_000 + step,
                                shape, 0)
            state.on_join(members[i], 0)
        if step % 50 == 0:
            state.view.check()
    state.view.check()
