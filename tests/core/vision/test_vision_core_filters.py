"""The filter step of the VE core (:func:`fulcrum.core.vision.filters.restrict`).

- every policy's pick on a restricted fleet is an allowed, eligible GPU, and there is no
  pick exactly when no allowed GPU is eligible;
- an all-allowed mask changes no decision (same seed, same picks);
- restricting never changes the fleet it restricts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vision_fixtures import eligible, fleets

from fulcrum.core.vision.filters import restrict
from fulcrum.core.vision.fleet import MachineSpec, NoCapacity, VisionFleet, VisionTopology
from fulcrum.core.vision.registry import make_policy, policy_names

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    fleet=fleets(),
    policy=st.sampled_from(policy_names()),
    patches=st.integers(1, 6_000),
    seed=st.integers(0, 1_000),
    data=st.data(),
)
def test_a_pick_on_a_restricted_fleet_is_allowed_and_eligible(
    fleet: VisionFleet, policy: str, patches: int, seed: int, data: st.DataObject
) -> None:
    n = fleet.topology.n_gpus
    mask = np.asarray(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_)
    before = fleet.patches_in_flight.copy()
    out = make_policy(policy).select(restrict(fleet, mask), patches, np.random.default_rng(seed))
    ok = eligible(fleet, patches) & mask
    if isinstance(out, NoCapacity):
        assert not ok.any()
    else:
        assert ok[out.gpu], (out, mask)
        assert int(fleet.topology.gpu_machine[out.gpu]) == out.machine
    np.testing.assert_array_equal(fleet.patches_in_flight, before)


@SETTINGS
@given(
    fleet=fleets(),
    policy=st.sampled_from(policy_names()),
    images=st.lists(st.integers(1, 6_000), min_size=1, max_size=6),
    seed=st.integers(0, 1_000),
)
def test_an_all_allowed_mask_changes_no_decision(
    fleet: VisionFleet, policy: str, images: list[int], seed: int
) -> None:
    p = make_policy(policy)
    everything = restrict(fleet, np.ones(fleet.topology.n_gpus, dtype=np.bool_))
    rng_a, rng_b = np.random.default_rng(seed), np.random.default_rng(seed)
    picks_a = [p.select(fleet, n, rng_a) for n in images]
    picks_b = [p.select(everything, n, rng_b) for n in images]
    assert picks_a == picks_b


def test_a_mask_of_the_wrong_shape_is_refused() -> None:
    topo = VisionTopology.build([MachineSpec("m0", (0, 1))])
    fleet = VisionFleet(topo, np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        restrict(fleet, np.ones(3, dtype=np.bool_))
