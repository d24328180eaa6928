"""Cost of one prefix-affinity pull decision (choose the puller, then take) on the loop.

Worst case for the affinity scan: 8 engines that all hold most of every queued
request's prefix (so every match walks the whole prefix), 256 queued requests. Reported
as ms per decision and as a ratio against the same decision without affinity, measured
in the same run. Run: ``.venv/bin/python benchmarks/bench_prefix.py``.
"""

from __future__ import annotations

import time

from fulcrum.core.prefill.affinity import Affinity, PrefixIndex
from fulcrum.core.prefill.balancer import BalancerConfig, Offer, PrefillBalancer, Queued

ENGINES = [f"e{i}" for i in range(8)]


def cost(q: int, c: int) -> int:
    return 1_000 * q + 1_000


def build(blocks: int, affinity: bool) -> PrefillBalancer:
    bal = PrefillBalancer(BalancerConfig(
        bounds=(10**9,), batch_cap_ns=(10**15, 10**15), backlog_rounds=1.0, hysteresis=0.0,
        max_batch_requests=8,
    ))
    aff = Affinity(PrefixIndex(), cost, max_wait_ns=10**15)
    bal.enqueue(Queued("seed", 10, 0, 0, 1, 0))
    for e in ENGINES:
        aff.index.add_engine(e, 1 << 20)  # holds everything: every match walks far
        bal.add_engine(e, 8)
    bal.remove("seed")
    for i in range(256):
        bl = tuple(range(i * 1_000, i * 1_000 + blocks))
        for e in ENGINES:
            aff.index.stored(e, bl[: blocks - 1])
        bal.enqueue(Queued(f"r{i}", blocks * 512, 0, 0, cost(blocks * 512, 0), 0, bl))
    if affinity:
        bal.affinity = aff
    return bal


def decision_ms(blocks: int, affinity: bool, reps: int = 20) -> tuple[float, float]:
    """Best of ``reps``: the first decision on a fresh queue (every match computed) and
    the next one (matches memoised; only the engine that took recomputes)."""
    first = nxt = float("inf")
    for _ in range(reps):
        bal = build(blocks, affinity)
        offers = [Offer(e, 10**12, (0,) * 8) for e in ENGINES]
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            i = bal.choose_puller(0, offers, now_ns=1)
            bal.take(ENGINES[i], 10**12, [0] * 8, now_ns=1)
            times.append(time.perf_counter() - t0)
        first, nxt = min(first, times[0]), min(nxt, times[1])
    return first * 1e3, nxt * 1e3


def main() -> None:
    print("| prefix blocks | without affinity (ms) | with affinity, fresh queue (ms) | "
          "with affinity, next decision (ms) |")
    print("|---:|---:|---:|---:|")
    for blocks in (8, 32, 200):
        base, _ = decision_ms(blocks, False)
        first, nxt = decision_ms(blocks, True)
        print(f"| {blocks} | {base:.3f} | {first:.3f} ({first / base:.1f}x) | "
              f"{nxt:.3f} ({nxt / base:.1f}x) |")


if __name__ == "__main__":
    main()
