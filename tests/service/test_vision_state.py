"""The daemon's VE table (state/vision.py) without gRPC: accounting, leases, leaving."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fulcrum.config.vision import VisionSettings
from fulcrum.core.types import Member, MemberKind, VisionMachineLoad, VisionMachineShape
from fulcrum.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from fulcrum.state.vision import ImageRequest, VisionState

SHOT = ImageRequest(1280, 800)
MS = 1_000_000


def member(machine_id: str, gpus: int = 4, cap: int = 0, incarnation: int = 1) -> Member:
    return Member(
        machine_id, MemberKind.VISION_MACHINE, incarnation, VisionMachineShape(gpus, cap), 0
    )


def make_state(seed: int = 7, n: int = 3, gpus: int = 4, cap: int = 0, **kw: object) -> VisionState:
    state = VisionState(VisionSettings(**kw), np.random.default_rng(seed))  # type: ignore[arg-type]
    for i in range(n):
        state.on_join(member(f"ve-{i}", gpus, cap), 0)
    return state


def test_settings_refuse_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown VE policy 'nope'"):
        VisionSettings(policy="nope")


def test_release_restores_exactly_and_unknown_is_not_found() -> None:
    state = make_state()
    before = state.fleet().patches_in_flight.copy()
    placed = state.place("r", [SHOT, ImageRequest(512, 512)], 0)
    assert [p.patches for p in placed] == [4_000, 1_024]
    assert state.held == 1
    assert state.release("r", 0) == (2, 5_024)
    assert np.array_equal(state.fleet().patches_in_flight, before)
    with pytest.raises(NotFound, match="request_id: 'r'"):
        state.release("r", 0)


def test_refusals_change_nothing() -> None:
    state = make_state(max_placements=1)
    state.place("a", [SHOT], 0)
    before = state.fleet().patches_in_flight.copy()
    with pytest.raises(AlreadyExists):
        state.place("a", [SHOT], 0)
    with pytest.raises(ResourceExhausted, match="max_placements"):
        state.place("b", [SHOT], 0)
    with pytest.raises(InvalidArgument, match=r"images\[1\].patch_size"):
        state.place("c", [SHOT, ImageRequest(10, 10, 100_000)], 0)
    assert np.array_equal(state.fleet().patches_in_flight, before)
    assert state.held == 1


def test_join_and_leave_keep_other_machines_figures() -> None:
    state = make_state(n=2, gpus=2)
    state.on_load(member("ve-1", 2), VisionMachineLoad((5, 6)), 0)
    placed = state.place("r", [SHOT], 0)
    load_before = {m: state.machine_load(m)[0] for m in state.machine_ids()}
    state.on_join(member("ve-0a", 2), 0)  # sorts between ve-0 and ve-1
    assert state.machine_ids() == ["ve-0", "ve-0a", "ve-1"]
    for m, load in load_before.items():
        assert state.machine_load(m)[0] == load
    assert state.machine_load("ve-0a")[0] == [0, 0]
    state.on_leave(member("ve-0a", 2), "deregistered", 0)
    assert {m: state.machine_load(m)[0] for m in state.machine_ids()} == load_before
    assert state.release("r", 0) == (1, 4_000)
    assert state.machine_load(placed[0].machine_id)[0] in ([0, 0], [5, 6])


def test_stale_incarnation_leave_is_ignored() -> None:
    state = make_state(n=1)
    state.on_leave(member("ve-0", incarnation=99), "replaced", 0)
    assert state.machine_ids() == ["ve-0"]


def test_leases_expire_in_order() -> None:
    state = make_state(lease_ms=1_000)
    state.place("a", [SHOT], 0)
    state.place("b", [SHOT], 500 * MS)
    state.release("a", 600 * MS)
    assert state.expire(999 * MS) == 0
    assert state.expire(1_500 * MS) == 1  # b
    assert state.held == 0
    assert int(state.fleet().patches_in_flight.sum()) == 0
    state.place("c", [SHOT], 2_000 * MS)
    # A placement call also expires what is due before deciding.
    state.place("d", [SHOT], 3_001 * MS)
    assert state.held == 1


def test_apply_settings_switches_policy() -> None:
    state = make_state()
    state.apply_settings(VisionSettings(policy="least_patches"))
    assert state.policy_name == "least_patches"
    assert state.place("r", [SHOT], 0)[0].machine_id == "ve-0"


def test_liveness_check_drops_lapsed_machine_and_chooses_again() -> None:
    dead = {"ve-0", "ve-2"}
    state = VisionState(
        VisionSettings(), np.random.default_rng(3), liveness=lambda m, inc, now: m not in dead
    )
    for i in range(3):
        state.on_join(member(f"ve-{i}"), 0)
    for i in range(5):
        assert state.place(f"r{i}", [SHOT], 0)[0].machine_id == "ve-1"
    assert state.machine_ids() == ["ve-1"]


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("place"),
            st.lists(st.sampled_from([(1280, 800), (512, 512), (64, 64)]), min_size=1, max_size=3),
        ),
        st.tuples(st.just("release"), st.integers(0, 30)),
    ),
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(
    seq=ops,
    seed=st.integers(0, 1_000),
    policy=st.sampled_from(["random_machine", "power_of_two", "least_patches"]),
)
def test_any_sequence_keeps_the_books(
    seq: list[tuple[str, object]], seed: int, policy: str
) -> None:
    """Capacity never broken; releasing everything restores zero; same seed, same answers."""

    def run() -> list[object]:
        state = make_state(seed=seed, n=3, gpus=2, cap=10_000, policy=policy)
        out: list[object] = []
        names: list[str] = []
        for i, (kind, arg) in enumerate(seq):
            if kind == "place":
                assert isinstance(arg, list)
                try:
                    placed = state.place(f"r{i}", [ImageRequest(w, h) for w, h in arg], 0)
                except ResourceExhausted as err:
                    out.append(err.message)
                    continue
                names.append(f"r{i}")
                out.append(placed)
            elif names:
                assert isinstance(arg, int)
                out.append(state.release(names.pop(arg % len(names)), 0))
            pif = state.fleet().patches_in_flight
            assert np.all(pif <= 10_000) and np.all(pif >= 0)
        for name in names:
            state.release(name, 0)
        assert int(state.fleet().patches_in_flight.sum()) == 0
        assert state.held == 0
        return out

    assert run() == run()


@pytest.mark.parametrize("policy", ["random_machine", "power_of_two", "least_patches"])
def test_state_decides_exactly_as_the_pure_core_fold(policy: str) -> None:
    """The daemon's in-place fold equals core.vision.place_many with the same seed."""
    from fulcrum.core.vision.base import place_many
    from fulcrum.core.vision.registry import make_policy

    state = make_state(seed=11, n=4, gpus=3, cap=9_000, policy=policy)
    state.on_load(member("ve-2", 3, 9_000), VisionMachineLoad((100, 0, 7_000)), 0)
    images = [SHOT, ImageRequest(512, 512), SHOT, ImageRequest(1920, 1080), SHOT]
    counts = [4_000, 1_024, 4_000, 8_160, 4_000]
    start = state.fleet()
    expected, after = place_many(make_policy(policy), start, counts, np.random.default_rng(11))
    placed = state.place("r", images, 0)
    ids = state.machine_ids()
    assert [(p.machine_id, p.gpu_index, p.patches) for p in placed] == [
        (ids[e.machine], e.gpu - 3 * e.machine, e.patches) for e in expected
    ]
    assert np.array_equal(state.fleet().patches_in_flight, after.patches_in_flight)
