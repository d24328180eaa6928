"""Hypothesis strategies and builders shared by the decode core tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from fulcrum.core.decode import FleetView


@st.composite
def fleet_views(draw: st.DrawFn, max_gpus: int = 12) -> FleetView:
    """Small random fleets, including full, dead and over-capacity GPUs."""
    n = draw(st.integers(min_value=1, max_value=max_gpus))
    mc = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    mk = draw(st.lists(st.integers(1, 2_000), min_size=n, max_size=n))
    conc = [draw(st.integers(0, m + 1)) for m in mc]
    kv = [draw(st.integers(0, m + 200)) for m in mk]
    live = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return FleetView.build(conc, kv, mc, mk, live)


def uniform(n: int, *, max_concurrency: int = 64, max_kv_tokens: int = 1_000_000) -> FleetView:
    return FleetView.empty_like(np.full(n, max_concurrency), np.full(n, max_kv_tokens))
