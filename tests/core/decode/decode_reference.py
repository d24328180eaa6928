"""Brute-force reference of the decode policies' rules (loops, no tricks), for tests."""

from __future__ import annotations

from fulcrum.core.decode import FleetView


def eligible_list(view: FleetView, kv_tokens: int) -> list[int]:
    return [
        g
        for g in range(view.n_gpus)
        if bool(view.live[g])
        and int(view.concurrency[g]) < int(view.max_concurrency[g])
        and int(view.kv_tokens[g]) + kv_tokens <= int(view.max_kv_tokens[g])
    ]


def mean_kv(view: FleetView) -> float | None:
    live = [g for g in range(view.n_gpus) if bool(view.live[g])]
    reqs = sum(int(view.concurrency[g]) for g in live)
    if reqs == 0:
        return None
    return sum(int(view.kv_tokens[g]) for g in live) / reqs


def expected(
    name: str,
    view: FleetView,
    kv_tokens: int,
    *,
    long_factor: float = 2.0,
    long_tokens: int = 65_536,
    short_slack: int = 0,
    d1: float = 20_000.0,
    d2: float = 0.5,
    cursor: int = 0,
    allowed: list[int] | None = None,
) -> int | None:
    """GPU the rule picks, or None when no GPU is eligible (not for power_of_two).

    ``allowed``: only these GPUs may be picked (the fleet's mean stays the whole fleet's).
    """
    el = eligible_list(view, kv_tokens)
    if allowed is not None:
        el = [g for g in el if g in allowed]
    if not el:
        return None
    c = {g: int(view.concurrency[g]) for g in el}
    k = {g: int(view.kv_tokens[g]) for g in el}
    if name == "dual":
        m = mean_kv(view)
        thr = float(long_tokens) if m is None else min(float(long_tokens), long_factor * m)
        if kv_tokens >= thr:
            return min(el, key=lambda g: (k[g], c[g], g))
        cmin = min(c.values())
        cand = [g for g in el if c[g] <= cmin + short_slack]
        return min(cand, key=lambda g: (-k[g], c[g], g))
    if name == "least_kv":
        return min(el, key=lambda g: (k[g], c[g], g))
    if name == "least_requests":
        return min(el, key=lambda g: (c[g], g))
    if name == "step_time":
        return min(el, key=lambda g: (d1 * (c[g] + 1) + d2 * (k[g] + kv_tokens), g))
    if name == "round_robin":
        n = view.n_gpus
        for off in range(n):
            g = (cursor + off) % n
            if g in c:
                return g
        return None
    raise AssertionError(name)
