"""Load calibration and fleet sizing."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.sim import scenarios
from fulcrum.sim.cluster import Cluster
from fulcrum.sim.synthetic import SyntheticSpec, generate
from fulcrum.sim.workload import Request


def test_scale_to_load_hits_target() -> None:
    reqs = generate(SyntheticSpec(duration_s=120, agent_sessions=2),
                    np.random.default_rng(0))
    c = Cluster()
    scaled, scale = scenarios.scale_to_load(reqs, c, 0.8)
    assert scenarios.offered_load(scaled, c) == pytest.approx(0.8, rel=1e-3)
    assert scale > 0


def test_offered_load_by_hand() -> None:
    # Two 1,000-token requests 1 s apart on 32 ranks: quota 57e6 ns each.
    reqs = [Request(0, 0, 1000, 1), Request(1, 1_000_000_000, 1000, 1)]
    c = Cluster()
    assert scenarios.offered_work_ns(reqs, c) == pytest.approx(2 * 57e6)
    assert scenarios.offered_load(reqs, c) == pytest.approx(2 * 57e6 / (1e9 * 32))
    with pytest.raises(ValueError):
        scenarios.rate_for_load(reqs, c, 0)


def test_fleet_sizing_grows_with_traffic() -> None:
    light = [Request(i, i * 1_000_000_000, 1000, 200) for i in range(10)]
    heavy = [Request(i, i * 1_000_000, 1000, 200, image_patches=(4000,)) for i in range(1000)]
    c = Cluster()
    assert scenarios.size_decode(light, c).decode.instances == 1
    assert scenarios.size_decode(heavy, c).decode.instances > 1
    assert scenarios.size_vision(light, c).vision.machines == c.vision.machines
    assert scenarios.size_vision(heavy, c).vision.machines >= 1


def test_unknown_workload() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        scenarios.load_workload("nope")
