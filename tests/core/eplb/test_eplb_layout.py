"""Group shapes (SPEC.md section 6 worked example) and the placement map views."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.core.eplb import PlacementMap, identity_map, make_layout, rebalance


@pytest.mark.parametrize(
    ("role", "ep", "redundant", "physical", "per_gpu"),
    [
        ("decode", 64, None, 448, 7),  # EP64DP64 "384+64" (decode default 1 per GPU)
        ("prefill", 8, None, 416, 52),  # EP8DP8 "384+32" (prefill default 4 per GPU)
        ("prefill", 4, None, 400, 100),  # EP4 with the default: 384 + 4 x 4
        ("prefill", 4, 8, 416, 104),  # published EP4DP4 prefill "384+32" = 8 per GPU
        ("decode", 5, None, 390, 78),  # 384 + 5 = 389 rounded up to a multiple of 5
        ("decode", 256, None, 768, 3),  # 384 + 256 = 640 rounded up to 768
        ("prefill", 2, 0, 384, 192),
    ],
)
def test_physical_slots_follow_the_rounding_rule(
    role: str, ep: int, redundant: int | None, physical: int, per_gpu: int
) -> None:
    layout = make_layout(role, ep, 58, 384, redundant_per_gpu=redundant)  # type: ignore[arg-type]
    assert layout.n_physical == physical
    assert layout.slots_per_gpu == per_gpu
    assert layout.n_physical % ep == 0


@pytest.mark.parametrize(
    ("role", "redundant", "window", "period"),
    [("prefill", 4, 100, 1_000), ("decode", 1, 1_000, 10_000)],
)
def test_role_defaults(role: str, redundant: int, window: int, period: int) -> None:
    layout = make_layout(role, 8, 4, 64)  # type: ignore[arg-type]
    assert (layout.redundant_per_gpu, layout.window_steps, layout.period_steps) == (
        redundant,
        window,
        period,
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "train"}, "role"),
        ({"ep_size": 0}, "ep_size"),
        ({"ep_size": 12}, "ep_size"),  # not a multiple of 8 GPUs per node
        ({"n_groups": 5}, "n_groups"),  # does not divide 64 experts
        ({"redundant_per_gpu": -1}, "redundant_per_gpu"),
        ({"expert_bytes": -1}, "expert_bytes"),
        ({"ep_size": 1, "redundant_per_gpu": 1}, "redundant_per_gpu"),  # forces co-location
        ({"window_steps": 0}, "window_steps"),
    ],
)
def test_invalid_layouts_name_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"role": "prefill", "ep_size": 8, "n_layers": 2, "n_logical": 64}
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        make_layout(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("role", "ep"), [("prefill", 4), ("prefill", 8), ("decode", 64)])
@pytest.mark.parametrize("algorithm", ["reference", "stable"])
def test_worked_example_maps_are_correctly_sized(role: str, ep: int, algorithm: str) -> None:
    layout = make_layout(role, ep, 3, 384, expert_bytes=1)  # type: ignore[arg-type]
    loads = np.random.default_rng(ep).lognormal(0.0, 0.8, size=(3, 384)) * 100
    placement = rebalance(algorithm, layout, loads, None).placement
    assert placement.phy2log.shape == (3, layout.n_physical)
    assert placement.gpu_slots.shape == (3, ep, layout.slots_per_gpu)
    assert (placement.replica_counts >= 1).all()
    assert (placement.replica_counts.sum(axis=1) == layout.n_physical).all()
    if role == "decode":
        assert placement.n_physical == 448 and placement.slots_per_gpu == 7


def test_identity_map_has_every_expert_and_no_colocation() -> None:
    layout = make_layout("decode", 64, 2, 384)
    m = identity_map(layout)
    assert (m.replica_counts >= 1).all()
    assert m.colocated() == 0


def test_log2phy_lists_slots_in_order_padded() -> None:
    m = PlacementMap.from_phy2log([[0, 1, 2, 0], [2, 2, 1, 0]], ep_size=2, n_logical=3)
    assert m.replica_counts.tolist() == [[2, 1, 1], [1, 1, 2]]
    assert m.log2phy.tolist() == [[[0, 3], [1, -1], [2, -1]], [[3, -1], [2, -1], [0, 1]]]
    assert m.colocated() == 1  # layer 1, GPU 0 holds expert 2 twice
    assert not m.phy2log.flags.writeable


@pytest.mark.parametrize(
    ("p2l", "ep", "match"),
    [
        ([0, 1, 2], 1, "2-D"),
        ([[0, 1, 2]], 2, "divide"),
        ([[0, 3]], 1, "expert ids"),
        ([[0, -1]], 1, "expert ids"),
    ],
)
def test_from_phy2log_rejects_bad_maps(p2l: object, ep: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PlacementMap.from_phy2log(p2l, ep, 3)  # type: ignore[arg-type]
