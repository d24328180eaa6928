"""Trace readers, transforms, the LRU prefix cache and the synthetic generator."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fulcrum.sim import workload as W
from fulcrum.sim.cache import BlockCache
from fulcrum.sim.synthetic import SyntheticSpec, agent_sessions, generate, screenshot_patches

#: Excerpts of the public traces, shipped with their licences (tests/data/traces/README.md).
TRACES = Path(__file__).parents[1] / "data" / "traces"


def test_read_mooncake_head() -> None:
    reqs = W.read_mooncake(TRACES / "mooncake_synthetic_trace.jsonl", limit=2)
    assert [r.input_tokens for r in reqs] == [40160, 36640]
    assert reqs[0].arrival_ns == 0
    assert len(reqs[0].hash_ids) == math.ceil(40160 / W.BLOCK_TOKENS)


def test_read_azure_relative_times() -> None:
    reqs = W.read_azure(TRACES / "azure2023_code.csv", limit=2)
    assert reqs[0].arrival_ns == 0
    # 18:17:03.9799600 -> 18:17:04.0319600 is 52 ms.
    assert reqs[1].arrival_ns == 52_000_000
    assert (reqs[0].input_tokens, reqs[0].output_tokens) == (4808, 10)


def test_azure_timestamp_fraction_digits(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:00:00.5,10,2\n2023-11-16 18:00:01.0000001,20,3\n")
    reqs = W.read_azure(p)
    assert [r.arrival_ns for r in reqs] == [0, 500_000_100]


def test_servegen_sampling_matches_distributions() -> None:
    rng = np.random.default_rng(0)
    reqs = W.servegen_requests(TRACES / "servegen-mm-image", rng, start_s=36_000,
                               duration_s=300)
    # The excerpt's five clients publish 0.773 + 0.057 + 2.577 + 0.147 + 0.150 requests/s
    # in the 36,000 s window: 1,111 expected in 300 s.
    assert len(reqs) == pytest.approx(1111, rel=0.1)
    images = np.array([len(r.image_patches) for r in reqs])
    assert 1.0 <= images.mean() <= 3.0
    assert max(p for r in reqs for p in r.image_patches) <= 1_280 * W.PATCHES_PER_IMAGE_TOKEN
    times = [r.arrival_ns for r in reqs]
    assert times == sorted(times) and times[0] >= 0


def test_scale_rate_and_window() -> None:
    reqs = [W.Request(i, i * 1_000_000_000, 10, 1) for i in range(10)]
    fast = W.scale_rate(reqs, 2.0)
    assert [r.arrival_ns for r in fast][:3] == [0, 500_000_000, 1_000_000_000]
    win = W.window(reqs, start_s=2.0, duration_s=3.0)
    assert [r.arrival_ns for r in win] == [0, 1_000_000_000, 2_000_000_000]
    with pytest.raises(ValueError):
        W.scale_rate(reqs, 0)


def test_scale_length_keeps_shared_prefixes() -> None:
    a = W.Request(0, 0, 1024, 1, hash_ids=(1, 2))
    b = W.Request(1, 0, 1536, 1, hash_ids=(1, 2, 3))
    sa, sb = W.scale_length([a, b], 2.5)
    assert sa.input_tokens == 2560 and len(sa.hash_ids) == 5
    assert sb.hash_ids[: len(sa.hash_ids)] == sa.hash_ids
    assert len(set(sb.hash_ids)) == len(sb.hash_ids)


def test_block_cache_prefix_hits_and_lru() -> None:
    c = BlockCache(3)
    assert c.lookup_and_insert((1, 2), 1024) == 0
    assert c.lookup_and_insert((1, 2, 3), 1500) == 1024
    # A full hit still computes the last token.
    assert c.lookup_and_insert((1, 2, 3), 1536) == 1535
    # A prefix loses its tail first (its head is touched last), as vLLM frees a request's
    # blocks last block first: block 3 goes, and 1, 2 still make a hit.
    c.lookup_and_insert((4,), 512)
    assert 3 not in c and 4 in c
    assert c.lookup_and_insert((1, 2), 1024) == 1023
    c.lookup_and_insert((5, 6), 1024)  # evicts 4, then the tail 2 of the older prefix
    assert 2 not in c and 1 in c
    assert c.lookup_and_insert((1, 2), 1024) == 512  # the head still hits
    assert BlockCache(0).lookup_and_insert((1,), 512) == 0
    with pytest.raises(ValueError):
        BlockCache(-1)


def test_screenshot_patches_match_spec() -> None:
    assert screenshot_patches(1280, 800, 16) == 4000
    assert screenshot_patches(1281, 800, 16) == 81 * 50


def test_agent_sessions_grow_past_256k_with_high_hit_ratio() -> None:
    spec = SyntheticSpec(duration_s=3_000, agent_sessions=4, agent_gap_s=2.0)
    reqs = sorted(agent_sessions(spec, np.random.default_rng(1)), key=lambda r: r.arrival_ns)
    assert max(r.input_tokens for r in reqs) >= 256 * 1024
    cache = BlockCache(None)
    for r in reqs:
        cache.lookup_and_insert(r.hash_ids, r.input_tokens)
    assert cache.hit_ratio > 0.8
    assert any(r.image_patches == (4000,) for r in reqs)


def test_synthetic_is_deterministic_and_has_a_surge() -> None:
    spec = SyntheticSpec(duration_s=300)
    a = generate(spec, np.random.default_rng(5))
    b = generate(spec, np.random.default_rng(5))
    assert a == b
    surge = [r for r in a if r.source == "surge"]
    assert surge and all(r.input_tokens >= 256 * 1024 for r in surge)
    assert all(200e9 <= r.arrival_ns < 260e9 for r in surge)
