"""The simulator's baselines sit behind the generic registry (issue 19, item 5)."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.sim import baselines
from fulcrum.sim.policies import policy_sets


def test_every_baseline_is_registered_once_in_order() -> None:
    assert baselines.BASELINES.names() == baselines.NAMES
    with pytest.raises(ValueError, match="registered twice"):
        baselines.BASELINES.register(baselines.ROUND_ROBIN, lambda p: baselines.baseline(
            baselines.ROUND_ROBIN))
    assert set(baselines.NAMES) <= set(policy_sets())


def test_prefix_routers_declare_their_engine_rule() -> None:
    for name in baselines.NAMES:
        assert (baselines.baseline(name).prefix is not None) == (
            name in baselines.PREFIX_NAMES)


def test_unknown_baseline_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="did you mean 'round_robin'"):
        baselines.choose("round_robn", np.zeros(3, dtype=np.int64),
                         np.random.default_rng(0), 0)
    with pytest.raises(ValueError, match="unknown policy"):
        baselines.PushRouter("nope", 2, 2, np.random.default_rng(0))
