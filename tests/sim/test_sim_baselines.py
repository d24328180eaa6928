"""Sim-local baselines and the adapters onto the core policies."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.sim import baselines
from fulcrum.sim.policies import DecodeChooser, VisionChooser, get_policy_set, policy_sets


@pytest.mark.parametrize(
    ("name", "counts", "cursor", "want"),
    [
        ("round_robin", [5, 0, 0], 0, (0, 1)),
        ("round_robin", [5, 0, 0], 5, (2, 0)),
        ("least_requests", [3, 1, 1, 2], 0, (1, 0)),
    ],
)
def test_deterministic_baselines(
    name: str, counts: list[int], cursor: int, want: tuple[int, int]
) -> None:
    arr = np.asarray(counts, dtype=np.int64)
    assert baselines.choose(name, arr, np.random.default_rng(0), cursor) == want


def test_power_of_two_prefers_fewer_and_random_is_uniform() -> None:
    rng = np.random.default_rng(1)
    counts = np.array([0, 100, 100, 100], dtype=np.int64)
    picks = [baselines.choose("power_of_two", counts, rng, 0)[0] for _ in range(400)]
    # Target 0 wins every pair it is drawn in: with 4 targets, half the pairs.
    assert 0.4 < picks.count(0) / 400 < 0.6
    picks = [baselines.choose("random", counts, rng, 0)[0] for _ in range(4000)]
    assert all(0.2 < picks.count(i) / 4000 < 0.3 for i in range(4))
    with pytest.raises(ValueError):
        baselines.choose("nope", counts, rng, 0)


def test_decode_chooser_uses_core_and_respects_capacity() -> None:
    conc = np.array([0, 0], dtype=np.int64)
    kv = np.array([900, 0], dtype=np.int64)
    cap_c = np.array([10, 10], dtype=np.int64)
    cap_kv = np.array([1000, 1000], dtype=np.int64)
    rng = np.random.default_rng(0)
    dual = DecodeChooser("dual", {})
    assert dual.choose(conc, kv, cap_c, cap_kv, 500, rng) == 1  # only GPU 1 has room
    rnd = DecodeChooser("random", {})
    assert {rnd.choose(conc, kv, cap_c, cap_kv, 500, rng) for _ in range(20)} == {1}
    assert rnd.choose(conc, kv, cap_c, cap_kv, 2000, rng) == -1
    with pytest.raises(ValueError):
        DecodeChooser("nope", {})


def test_vision_chooser_core_and_local() -> None:
    ve = VisionChooser("random_machine", machines=2, gpus_per_machine=2)
    pif = np.array([10, 0, 5, 7], dtype=np.int64)
    imgs = np.array([1, 0, 1, 1], dtype=np.int64)
    rng = np.random.default_rng(0)
    # The drawn machine's least-loaded GPU: 1 on machine 0, 2 on machine 1.
    assert {ve.choose(pif, imgs, 100, rng) for _ in range(30)} == {1, 2}
    lr = VisionChooser("least_requests", machines=2, gpus_per_machine=2)
    assert lr.choose(pif, imgs, 100, rng) == 1


def test_policy_sets_name_real_policies() -> None:
    sets = policy_sets()
    assert {"default", "ideal", "round_robin", "random", "least_requests",
            "power_of_two"} <= set(sets)
    d = get_policy_set("default")
    assert (d.decode, d.vision) == ("dual", "random_machine")
    assert get_policy_set("ideal").ideal
