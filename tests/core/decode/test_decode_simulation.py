"""Small closed-loop simulation per policy: many placements and releases.

Arrivals: a fixed number per step, 10% long (60K-150K tokens), the rest short
(log-normal, median ~1.8K tokens); each held request finishes with a fixed probability
per step. Measures the time-averaged imbalance (max/mean over GPUs) of total KV and of
concurrency after warm-up. The dual rule keeps BOTH bounded; least_requests balances only
concurrency and lets KV drift. Seeded, deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from fulcrum.core.decode import (
    POLICY_NAMES,
    FleetView,
    NoCapacity,
    imbalance,
    make_policy,
    params_for,
)
from fulcrum.core.decode.copies import commit, release


@dataclass(frozen=True)
class SimResult:
    kv_imbalance: float
    conc_imbalance: float
    rejected: int
    final: FleetView


def simulate(
    name: str,
    *,
    seed: int = 3,
    n_gpus: int = 8,
    steps: int = 700,
    arrivals: int = 4,
    finish: float = 0.03,
    warmup: int = 200,
) -> SimResult:
    work = np.random.default_rng(seed)
    policy_rng = np.random.default_rng(seed + 1)
    policy = make_policy(name, params_for(name, {"d1_ns": 20_000.0, "d2_ns": 0.5}))
    view = FleetView.empty_like(np.full(n_gpus, 128), np.full(n_gpus, 4_000_000))
    held: list[tuple[int, int]] = []
    cursor = 0
    kv_imb: list[float] = []
    conc_imb: list[float] = []
    rejected = 0
    for step in range(steps):
        done = work.random(len(held)) < finish
        keep: list[tuple[int, int]] = []
        for (gpu, kv), gone in zip(held, done, strict=True):
            if gone:
                view = release(view, gpu, kv)
            else:
                keep.append((gpu, kv))
        held = keep
        for _ in range(arrivals):
            if work.random() < 0.1:
                kv = int(work.integers(60_000, 150_000))
            else:
                kv = int(work.lognormal(7.5, 0.8)) + 1
            out = policy.select(view, kv, policy_rng, cursor)
            if isinstance(out, NoCapacity):
                rejected += 1
                continue
            cursor = out.cursor
            view = commit(view, out.gpu, kv)
            held.append((out.gpu, kv))
        assert (view.concurrency <= view.max_concurrency).all()
        assert (view.kv_tokens <= view.max_kv_tokens).all()
        if step >= warmup:
            kv_imb.append(imbalance(view.kv_tokens, view.live))
            conc_imb.append(imbalance(view.concurrency, view.live))
    for gpu, kv in held:
        view = release(view, gpu, kv)
    return SimResult(float(np.mean(kv_imb)), float(np.mean(conc_imb)), rejected, view)


@pytest.fixture(scope="module")
def results() -> dict[str, SimResult]:
    return {name: simulate(name) for name in POLICY_NAMES}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_simulation_is_sound(name: str, results: dict[str, SimResult]) -> None:
    r = results[name]
    assert r.rejected == 0  # fleet sized to fit; nothing refused
    assert int(r.final.concurrency.sum()) == 0 and int(r.final.kv_tokens.sum()) == 0
    assert r.final.total_concurrency == 0 and r.final.total_kv_tokens == 0
    # Every policy balances: neither dimension worse than 2.5x its mean (everything on one
    # GPU would score 8, the fleet size; measured worst: 2.10 KV for least_requests, 1.88
    # concurrency for least_kv), and each policy keeps at least one dimension within 1.4x.
    assert 1.0 <= r.kv_imbalance < 2.5
    assert 1.0 <= r.conc_imbalance < 2.5
    assert min(r.kv_imbalance, r.conc_imbalance) < 1.4


def test_dual_bounds_both_dimensions(results: dict[str, SimResult]) -> None:
    dual = results["dual"]
    assert dual.kv_imbalance < 1.5
    assert dual.conc_imbalance < 1.15


def test_dual_beats_least_requests_on_kv(results: dict[str, SimResult]) -> None:
    dual, lr = results["dual"], results["least_requests"]
    assert dual.kv_imbalance < 0.8 * lr.kv_imbalance
    # ... without giving up the concurrency balance least_requests is built for
    assert dual.conc_imbalance < lr.conc_imbalance + 0.1


def test_least_kv_trades_concurrency_for_kv(results: dict[str, SimResult]) -> None:
    assert results["least_kv"].conc_imbalance > results["dual"].conc_imbalance


def test_same_seed_same_trajectory() -> None:
    a = simulate("power_of_two", steps=150, warmup=50)
    b = simulate("power_of_two", steps=150, warmup=50)
    assert (a.kv_imbalance, a.conc_imbalance) == (b.kv_imbalance, b.conc_imbalance)
