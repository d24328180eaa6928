"""Per-engine prefix caches in the simulator (issue 15)."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.sim.cluster import Cluster
from fulcrum.sim.engine import simulate
from fulcrum.sim.policies import get_policy_set
from fulcrum.sim.report import summarize
from fulcrum.sim.workload import BLOCK_TOKENS, Request

PER_ENGINE = Cluster().with_overrides(
    prefill={"engines": 4, "ranks_per_engine": 2},
    decode={"instances": 1, "gpus_per_instance": 4},
    vision={"machines": 1, "gpus_per_machine": 2},
    cache={"mode": "per_engine", "capacity_blocks": 4_000},
)
GLOBAL = PER_ENGINE.with_overrides(cache={"mode": "global"})


def conversations(seed: int, n_conv: int = 12, turns: int = 6) -> list[Request]:
    """Multi-turn conversations: each turn repeats the previous turn's context and adds
    1-4 blocks; block ids are unique per conversation (chained, as Mooncake's)."""
    rng = np.random.default_rng(seed)
    out: list[tuple[int, int, tuple[int, ...]]] = []
    next_id = 0
    for c in range(n_conv):
        t = int(rng.integers(0, 5_000_000_000))
        blocks: list[int] = []
        for _ in range(turns):
            for _ in range(int(rng.integers(1, 5))):
                blocks.append(next_id)
                next_id += 1
            out.append((t, len(blocks) * BLOCK_TOKENS - int(rng.integers(0, 200)),
                        tuple(blocks)))
            t += int(rng.integers(500_000_000, 3_000_000_000))
        del c
    out.sort()
    return [Request(rid=i, arrival_ns=t, input_tokens=n, output_tokens=20, hash_ids=h)
            for i, (t, n, h) in enumerate(out)]


def _run(cluster: Cluster, policy: str, reqs: list[Request]) -> dict[str, object]:
    s = summarize(simulate(cluster, get_policy_set(policy), reqs, seed=1))
    assert s["unfinished"] == 0, policy
    return s


def test_affinity_matches_a_global_pool_and_beats_load_only_routing() -> None:
    reqs = conversations(1)
    glob = _run(GLOBAL, "default", reqs)["block_hit_ratio"]
    aff = _run(PER_ENGINE, "default", reqs)["block_hit_ratio"]
    plain = _run(PER_ENGINE, "default_noaffinity", reqs)["block_hit_ratio"]
    lw = _run(PER_ENGINE, "least_work", reqs)["block_hit_ratio"]
    assert isinstance(glob, float) and isinstance(aff, float)
    assert isinstance(plain, float) and isinstance(lw, float)
    assert glob > 0.5  # every turn but the first reuses its conversation's prefix
    assert aff >= 0.95 * glob
    assert aff > plain and aff > lw


@pytest.mark.parametrize("policy", ["prefix_load", "cache_aware"])
def test_prefix_aware_push_baselines_hit_their_prefixes(policy: str) -> None:
    reqs = conversations(2)
    hit = _run(PER_ENGINE, policy, reqs)["block_hit_ratio"]
    lw = _run(PER_ENGINE, "least_work", reqs)["block_hit_ratio"]
    assert isinstance(hit, float) and isinstance(lw, float)
    assert hit > lw


def test_no_cache_no_hits_and_costs_are_fresh() -> None:
    reqs = conversations(3, n_conv=4, turns=3)
    off = PER_ENGINE.with_overrides(cache={"capacity_blocks": 0})
    res = simulate(off, get_policy_set("default"), reqs, seed=1)
    assert summarize(res)["block_hit_ratio"] == 0.0
    assert int(res.cached_tokens.sum()) == 0


def test_same_seed_same_output_per_engine() -> None:
    reqs = conversations(4)
    a = simulate(PER_ENGINE, get_policy_set("default"), reqs, seed=3)
    b = simulate(PER_ENGINE, get_policy_set("default"), reqs, seed=3)
    assert np.array_equal(a.first_token_ns, b.first_token_ns)
    assert a.block_hit_ratio == b.block_hit_ratio
