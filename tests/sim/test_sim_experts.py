"""Expert routing draws of the simulator (``fulcrum.sim.experts``): the block draws and the
guide-table inverse CDF give exact multinomial counts."""

from __future__ import annotations

import numpy as np

from fulcrum.sim.cluster import Cluster, ExpertModel
from fulcrum.sim.experts import EXACT_ROUTINGS, Popularity


def _pop(skew: float, seed: int = 0) -> Popularity:
    model = ExpertModel(**{**Cluster().experts.model_dump(), "skew": skew})
    return Popularity(model, np.random.default_rng(seed))


def test_guide_table_lookup_equals_binary_search() -> None:
    rng = np.random.default_rng(1)
    for skew in (0.0, 1.0, 4.0):
        pop = _pop(skew)
        probs = pop.probs(0)
        layers, _ = probs.shape
        edges = np.array([0.0, 1.0, float(layers), np.nextafter(float(layers), 0.0)])
        pop._lookup(probs, edges)  # builds the tables
        assert pop._cum is not None
        for u in [edges, *((rng.random((layers, 300)) + np.arange(layers)[:, None]).ravel()
                           for _ in range(50))]:
            assert np.array_equal(pop._lookup(probs, u), np.searchsorted(pop._cum, u))


def test_block_draws_are_multinomial_counts() -> None:
    pop = _pop(1.0)
    rng = np.random.default_rng(2)
    probs = pop.probs(0)
    layers, experts = probs.shape
    total = np.zeros((layers, experts))
    steps, n = 2_000, 200
    for _ in range(steps):  # same virtual time: one popularity, many blocks
        c = pop.sample(0, n, rng)
        assert c.shape == (layers, experts)
        assert np.all(c.sum(axis=1) == n)
        total += c
    # Mean counts match n * p within 5 standard errors per expert (seeded).
    expect = steps * n * probs
    sd = np.sqrt(expect * (1 - probs))
    assert np.all(np.abs(total - expect) <= 5 * sd + 1)
    # A drift step drops the unused block: draws follow the new probabilities.
    later = pop.sample(5_000_000_000, EXACT_ROUTINGS, rng)
    assert np.all(later.sum(axis=1) == EXACT_ROUTINGS)
