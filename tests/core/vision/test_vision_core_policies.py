"""Table-driven tests of the VE fleet view and the three policies."""

from __future__ import annotations

import re

import numpy as np
import pytest
from vision_fixtures import fleet_with, uniform_topology

from fulcrum.core.vision import least_patches, power_of_two, random_machine
from fulcrum.core.vision.base import eligible_machines, place_many
from fulcrum.core.vision.fleet import (
    MachineSpec,
    NoCapacity,
    Placement,
    VisionFleet,
    VisionTopology,
    commit,
    imbalance,
    release,
)
from fulcrum.core.vision.patches import patches
from fulcrum.core.vision.registry import (
    DEFAULT_POLICY,
    REGISTRY,
    make_policy,
    policy_names,
)

ALL = policy_names()


# --------------------------------------------------------------------------- registry


def test_registry_names_and_default() -> None:
    assert set(ALL) == {"random_machine", "power_of_two", "least_patches"}
    assert DEFAULT_POLICY == "random_machine"
    for name in ALL:
        assert make_policy(name).name == name
    assert random_machine.NAME in REGISTRY
    assert power_of_two.NAME in REGISTRY
    assert least_patches.NAME in REGISTRY


def test_unknown_policy_raises_value_error() -> None:
    with pytest.raises(ValueError, match="policy: unknown VE policy 'nope'"):
        make_policy("nope")


# --------------------------------------------------------------------------- topology


def test_topology_layout() -> None:
    t = VisionTopology.build(
        [MachineSpec("a", (0, 1)), MachineSpec("b", (4, 5, 6), max_patches=100)]
    )
    assert t.n_machines == 2 and t.n_gpus == 5
    assert t.machine_start.tolist() == [0, 2, 5]
    assert t.gpu_machine.tolist() == [0, 0, 1, 1, 1]
    assert t.gpu_ordinal.tolist() == [0, 1, 4, 5, 6]
    assert t.capacity.tolist() == [0, 0, 100, 100, 100]
    assert not t.unlimited and t.all_live
    assert list(t.gpus_of(1)) == [2, 3, 4]
    assert t.machine_index("b") == 1
    with pytest.raises(KeyError):
        t.machine_index("zz")
    assert not t.capacity.flags.writeable


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([MachineSpec("", (0,))], r"machines\[0\].machine_id: must not be empty"),
        ([MachineSpec("a", (0,)), MachineSpec("a", (1,))], r"machines\[1\].machine_id: dup"),
        ([MachineSpec("a", ())], r"machines\[0\].gpus: must not be empty"),
        ([MachineSpec("a", (0, 0))], r"machines\[0\].gpus: ordinals must be unique"),
        ([MachineSpec("a", (-1,))], r"machines\[0\].gpus: ordinals must be >= 0"),
        ([MachineSpec("a", (0,), max_patches=-1)], r"machines\[0\].max_patches: must be >= 0"),
    ],
)
def test_topology_rejects_bad_specs(specs: list[MachineSpec], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VisionTopology.build(specs)


def test_with_live_masks_a_machine() -> None:
    t = uniform_topology(3, 2).with_live(1, False)
    assert t.live.tolist() == [True, True, False, False, True, True]
    assert t.live_machines.tolist() == [0, 2]
    assert t.limit[2] == -1 and t.limit[3] == -1
    assert not t.all_live
    assert t.with_live(1, True).all_live


# --------------------------------------------------------------------------- commit/release


def test_commit_release_are_pure() -> None:
    f = VisionFleet.empty(uniform_topology(2, 2))
    f2 = commit(f, Placement(machine=1, gpu=3, patches=4_000))
    assert f.patches_in_flight.tolist() == [0, 0, 0, 0]
    assert f2.patches_in_flight.tolist() == [0, 0, 0, 4_000]
    f3 = release(f2, 3, 4_000)
    assert f3.patches_in_flight.tolist() == [0, 0, 0, 0]
    assert f2.patches_in_flight.tolist() == [0, 0, 0, 4_000]


@pytest.mark.parametrize(
    ("gpu", "count", "message"),
    [
        (4, 1, "gpu: index 4 out of range"),
        (-1, 1, "gpu: index -1 out of range"),
        (0, 0, "patches: must be >= 1"),
        (0, 11, "patches: releasing 11 but only 10 in flight"),
    ],
)
def test_release_errors(gpu: int, count: int, message: str) -> None:
    f = fleet_with(uniform_topology(2, 2), [10, 0, 0, 0])
    with pytest.raises(ValueError, match=message):
        release(f, gpu, count)


@pytest.mark.parametrize(
    ("loads", "live_machine1", "expected"),
    [
        ([0, 0, 0, 0], True, 1.0),
        ([4, 4, 4, 4], True, 1.0),
        ([8, 0, 0, 0], True, 4.0),
        ([6, 2, 0, 0], True, 3.0),
        ([6, 2, 100, 100], False, 1.5),  # dead GPUs do not count
    ],
)
def test_imbalance(loads: list[int], live_machine1: bool, expected: float) -> None:
    t = uniform_topology(2, 2)
    if not live_machine1:
        t = t.with_live(1, False)
    assert imbalance(fleet_with(t, loads)) == pytest.approx(expected)


# --------------------------------------------------------------------------- worked example


@pytest.mark.parametrize("seed", range(8))
def test_screenshot_goes_to_least_loaded_gpu_of_random_machine(seed: int) -> None:
    t = uniform_topology(4, 4)
    per_machine = [
        [500, 100, 300, 200],  # m0: GPU 1
        [0, 0, 10, 10],  # m1: GPU 0 (tie with 1 -> lowest index)
        [7, 7, 7, 3],  # m2: GPU 3
        [9, 8, 9, 9],  # m3: GPU 1
    ]
    loads = [x for row in per_machine for x in row]
    best_local = {0: 1, 1: 0, 2: 3, 3: 1}
    f = fleet_with(t, loads)
    expected_machine = int(np.random.default_rng(seed).integers(4))
    p = random_machine.RandomMachine().select(
        f, patches(1280, 800, 16), np.random.default_rng(seed)
    )
    assert p.patches == 4_000
    assert p.machine == expected_machine
    assert p.gpu == 4 * expected_machine + best_local[expected_machine]


def test_random_machine_is_uniform_over_machines_not_gpus() -> None:
    # Machine a has 1 GPU, b has 7: a machine-uniform rule sends ~half to a.
    t = VisionTopology.build([MachineSpec("a", (0,)), MachineSpec("b", tuple(range(7)))])
    f = VisionFleet.empty(t)
    rng = np.random.default_rng(7)
    pol = random_machine.RandomMachine()
    hits = sum(pol.select(f, 1, rng).machine == 0 for _ in range(2_000))
    assert 850 < hits < 1_150


# --------------------------------------------------------------------------- power of two


@pytest.mark.parametrize("seed", range(12))
def test_power_of_two_picks_less_loaded_of_the_two_draws(seed: int) -> None:
    t = uniform_topology(5, 2)
    loads = [10, 10, 0, 4, 50, 50, 4, 0, 3, 3]  # machine loads 20, 4, 100, 4, 6
    machine_load = [20, 4, 100, 4, 6]
    rng = np.random.default_rng(seed)
    i, j = divmod(int(rng.integers(5 * 4)), 4)
    j += j >= i
    a, b = sorted((i, j))
    expect = b if machine_load[b] < machine_load[a] else a
    p = power_of_two.PowerOfTwo().select(fleet_with(t, loads), 5, np.random.default_rng(seed))
    assert p.machine == expect
    local = loads[2 * expect : 2 * expect + 2]
    assert p.gpu == 2 * expect + int(np.argmin(local))


def test_power_of_two_normalises_by_live_gpus() -> None:
    # a: 1 GPU with 10 in flight (10/GPU); b: 4 GPUs with 12 in flight (3/GPU) -> b.
    t = VisionTopology.build([MachineSpec("a", (0,)), MachineSpec("b", (0, 1, 2, 3))])
    f = fleet_with(t, [10, 3, 3, 3, 3])
    for seed in range(5):
        assert power_of_two.PowerOfTwo().select(f, 1, np.random.default_rng(seed)).machine == 1


def test_power_of_two_single_machine_draws_nothing() -> None:
    t = uniform_topology(1, 3)
    rng = np.random.default_rng(3)
    state = rng.bit_generator.state
    p = power_of_two.PowerOfTwo().select(fleet_with(t, [5, 1, 5]), 2, rng)
    assert (p.machine, p.gpu) == (0, 1)
    assert rng.bit_generator.state == state


# --------------------------------------------------------------------------- least patches


@pytest.mark.parametrize(
    ("loads", "expected_gpu"),
    [
        ([5, 4, 3, 2, 1, 0], 5),
        ([0, 0, 0, 0, 0, 0], 0),  # tie -> lowest global index
        ([3, 1, 2, 1, 9, 9], 1),
        ([9, 9, 9, 9, 9, 8], 5),
    ],
)
def test_least_patches_table(loads: list[int], expected_gpu: int) -> None:
    t = uniform_topology(3, 2)
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    p = least_patches.LeastPatches().select(fleet_with(t, loads), 4_000, rng)
    assert p.gpu == expected_gpu
    assert p.machine == expected_gpu // 2
    assert rng.bit_generator.state == state  # no randomness used


# --------------------------------------------------------------------------- liveness, capacity


@pytest.mark.parametrize("name", ALL)
def test_dead_machines_are_never_chosen(name: str) -> None:
    t = uniform_topology(4, 2).with_live(0, False).with_live(2, False)
    f = fleet_with(t, [0, 0, 50, 50, 0, 0, 50, 50])  # dead GPUs look most attractive
    pol = make_policy(name)
    rng = np.random.default_rng(11)
    for _ in range(50):
        assert pol.select(f, 1, rng).machine in (1, 3)


@pytest.mark.parametrize("name", ALL)
def test_no_live_machine_is_resource_exhausted(name: str) -> None:
    t = uniform_topology(2, 2).with_live(0, False).with_live(1, False)
    out = make_policy(name).select(VisionFleet.empty(t), 1, np.random.default_rng(0))
    assert isinstance(out, NoCapacity) and out.reason == "no live VE machine"


@pytest.mark.parametrize("name", ALL)
def test_empty_fleet_is_resource_exhausted(name: str) -> None:
    t = VisionTopology.build([])
    out = make_policy(name).select(VisionFleet.empty(t), 1, np.random.default_rng(0))
    assert isinstance(out, NoCapacity)


@pytest.mark.parametrize("name", ALL)
def test_capacity_filters_before_scoring(name: str) -> None:
    # Capacity 5000: only GPU 3 (load 900) can take 4,000 more.
    t = uniform_topology(2, 2, max_patches=5_000)
    f = fleet_with(t, [1_001, 1_500, 4_999, 900])
    for seed in range(20):
        p = make_policy(name).select(f, 4_000, np.random.default_rng(seed))
        assert p.gpu == 3 and p.machine == 1


@pytest.mark.parametrize("name", ALL)
def test_capacity_exhausted_reports_largest_free(name: str) -> None:
    t = uniform_topology(2, 2, max_patches=5_000)
    f = fleet_with(t, [4_000, 3_000, 4_500, 5_000])
    out = make_policy(name).select(f, 4_000, np.random.default_rng(0))
    assert isinstance(out, NoCapacity)
    assert re.search(r"room for 4000 patches.*largest free.*2000", out.reason)


def test_eligible_machines_with_capacity() -> None:
    t = uniform_topology(3, 2, max_patches=10)
    f = fleet_with(t, [10, 10, 9, 10, 0, 10])
    assert eligible_machines(f, 1).tolist() == [1, 2]
    assert eligible_machines(f, 2).tolist() == [2]
    assert eligible_machines(f, 11).tolist() == []


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [0, -3, True, 2.5])
def test_bad_patch_count(name: str, bad: object) -> None:
    with pytest.raises(ValueError, match="patches: must be"):
        make_policy(name).select(
            VisionFleet.empty(uniform_topology(1, 1)),
            bad,  # type: ignore[arg-type]
            np.random.default_rng(0),
        )


# --------------------------------------------------------------------------- multi-image


def test_multi_image_fold_sees_previous_images() -> None:
    # One machine, two GPUs: images alternate as each sees the previous one's patches.
    t = uniform_topology(1, 2)
    counts = [4_000, 1_000, 1_000, 5_000]
    placed, after = place_many(
        random_machine.RandomMachine(), VisionFleet.empty(t), counts, np.random.default_rng(0)
    )
    assert [p.gpu for p in placed] == [0, 1, 1, 1]
    assert [p.patches for p in placed] == counts
    assert after.patches_in_flight.tolist() == [4_000, 7_000]


@pytest.mark.parametrize("name", ALL)
def test_multi_image_all_or_nothing(name: str) -> None:
    t = uniform_topology(1, 2, max_patches=5_000)
    f = VisionFleet.empty(t)
    out = place_many(make_policy(name), f, [4_000, 4_000, 4_000], np.random.default_rng(0))
    assert isinstance(out, NoCapacity)
    assert f.patches_in_flight.tolist() == [0, 0]


@pytest.mark.parametrize("name", ["random_machine", "power_of_two"])
def test_draws_stay_uniform_over_eligible_machines_when_some_are_full(name: str) -> None:
    # Machines 0 and 2 are full; 1, 3 and 4 share the images evenly (a biased fallback
    # would favour whichever follows a full machine).
    t = uniform_topology(5, 1, max_patches=100)
    f = fleet_with(t, [100, 0, 100, 0, 0])
    rng = np.random.default_rng(21)
    pol = make_policy(name)
    hits = np.zeros(5, dtype=np.int64)
    for _ in range(3_000):
        hits[pol.select(f, 1, rng).machine] += 1
    assert hits[0] == 0 and hits[2] == 0
    if name == "random_machine":
        assert all(900 < h < 1_100 for h in hits[[1, 3, 4]])
    else:  # equal loads: the lower index of each uniform pair wins -> 2/3, 1/3, 0
        assert 1_900 < hits[1] < 2_100 and 900 < hits[3] < 1_100 and hits[4] == 0
