"""The VE table's slot layout under joins, leaves (with compaction forced), reports,
multi-image placements and releases, against a plain model keyed by (machine, GPU).

Invariants after every step: per-GPU patches in flight equal the model's; free slots
are never chosen; the published snapshot equals the table; after everything is released
(without reports in between) the table is back at zero.
"""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config.vision import VisionSettings
from fulcrum.core.types import Member, MemberKind, VisionMachineLoad, VisionMachineShape
from fulcrum.core.vision import registry
from fulcrum.errors import ResourceExhausted
from fulcrum.state.vision import ImageRequest, VisionState

IDS = tuple(f"ve-{i}" for i in range(6))

events = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 5), st.integers(1, 4)),
        st.tuples(st.just("leave"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("place"), st.integers(1, 3), st.integers(16, 400)),
        st.tuples(st.just("release"), st.integers(0, 60), st.just(0)),
        st.tuples(st.just("report"), st.integers(0, 5), st.integers(0, 500)),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(
    events=events,
    seed=st.integers(0, 1_000),
    min_waste=st.sampled_from([0, 1024]),
    policy=st.sampled_from(registry.policy_names()),
    cap=st.sampled_from([0, 2_000]),
)
def test_slots_follow_the_model(
    events: list[tuple[str, int, int]], seed: int, min_waste: int, policy: str, cap: int
) -> None:
    state = VisionState(VisionSettings(policy=policy), np.random.default_rng(seed))
    state._alloc.min_waste = min_waste
    members: dict[str, Member] = {}
    model: dict[tuple[str, int], int] = {}
    held: dict[str, list[tuple[str, int, int]]] = {}
    incarnation = 0

    def drop(member_id: str) -> None:
        nonlocal model
        model = {k: v for k, v in model.items() if k[0] != member_id}
        for rid in list(held):
            keep = [im for im in held[rid] if im[0] != member_id]
            if keep:
                held[rid] = keep
            else:
                del held[rid]

    for n, (kind, a, b) in enumerate(events):
        if kind == "join":
            member_id = IDS[a]
            if member_id in members:
                state.on_leave(members.pop(member_id), "replaced", 0)
                drop(member_id)
            incarnation += 1
            shape = VisionMachineShape(gpus=b, max_patches_in_flight=cap)
            members[member_id] = Member(member_id, MemberKind.VISION_MACHINE, incarnation, shape, 0)
            state.on_join(members[member_id], 0)
            model.update({(member_id, g): 0 for g in range(b)})
        elif kind == "leave" and IDS[a] in members:
            state.on_leave(members.pop(IDS[a]), "lapsed", 0)
            drop(IDS[a])
        elif kind == "report" and IDS[a] in members:
            # Release what is held first, so that the model needs no report generations.
            for rid, images in held.items():
                state.release(rid, 0)
                for machine_id, g, p in images:
                    model[(machine_id, g)] -= p
            held.clear()
            m = members[IDS[a]]
            load = VisionMachineLoad((b,) * m.shape.gpus)
            state.validate_load(m, load)
            state.on_load(m, load, 0)
            model.update({(m.member_id, g): b for g in range(m.shape.gpus)})
        elif kind == "place":
            rid = f"r{n}"
            images = [ImageRequest(b, b, 16)] * a
            with contextlib.suppress(ResourceExhausted):
                placed = state.place(rid, images, 0)
                for p in placed:
                    model[(p.machine_id, p.gpu_index)] += p.patches
                    assert cap == 0 or model[(p.machine_id, p.gpu_index)] <= cap
                held[rid] = [(p.machine_id, p.gpu_index, p.patches) for p in placed]
        elif kind == "release" and held:
            rid = sorted(held)[a % len(held)]
            images = held.pop(rid)
            state.release(rid, 0)
            for machine_id, g, p in images:
                model[(machine_id, g)] -= p
        got = {(i, g): p for i, g, p in state.gpu_loads()}
        assert got == model
        assert state.held == len(held)
        snap = state.publisher.current()
        published = {
            (m.member_id, g): int(m.values[0][g])
            for m in snap.members
            for g in range(m.values[0].shape[0])
        }
        assert published == model
        t = state.fleet().topology
        assert int(t.live.sum()) == len(model)
        assert sorted(t.live_machine_list) == list(t.live_machine_list)
        assert {t.machine_ids[i] for i in t.live_machine_list} == set(members)
    for rid in list(held):
        for machine_id, g, p in held.pop(rid):
            model[(machine_id, g)] -= p
        state.release(rid, 0)
    assert {(i, g): p for i, g, p in state.gpu_loads()} == model
