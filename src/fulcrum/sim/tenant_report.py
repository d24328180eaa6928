"""Per-tenant and per-priority figures of a run (issue 23): ``by_tenant``, ``by_priority``.

Each entry (keys: the tenant string, ``default`` for the default class; the priority as
a string) is::

    {"requests", "finished", "shed", "ttft_p50_s", "ttft_p99_s",
     "ttft_by_tier": {tier label: {"p50_s", "p99_s"}}, "compute_share",
     "max_service_gap_s"}

TTFT is from arrival to the first token over the requests not shed, an unfinished one
counted until the run ended (a lower bound, as in ``ttft_by_tier``).
``compute_share`` = the class's useful prefill ns / all prefill GPU-ns of the run
(prefill GPUs x run span; idle time counts, so the shares add up to the prefill
utilisation and a policy that idles cannot score). ``max_service_gap_s``: the longest
time the class waited for its next request to be handed to an engine while it had
requests queued (the starvation yardstick; 0 when never waiting; None under a push
router, which never queues centrally).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from fulcrum.core.prefill.tiers import tier_label

if TYPE_CHECKING:
    from fulcrum.sim.engine import SimResult


def _pct(values: npt.NDArray[np.float64], q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def max_service_gap_s(arrival_ns: npt.NDArray[np.int64], taken_ns: npt.NDArray[np.int64],
                      end_ns: int) -> float:
    """Longest wait (s) of a class for its next hand-out while it had work queued: over
    the hand-out times in order, the time from the later of the previous hand-out and
    the earliest arrival still waiting, to the next hand-out (or the run's end)."""
    if arrival_ns.size == 0:
        return 0.0
    taken = np.where(taken_ns >= 0, taken_ns, end_ns)
    order = np.argsort(taken, kind="stable")
    t_sorted, a_sorted = taken[order], arrival_ns[order]
    # earliest arrival among requests handed out at or after each hand-out
    waiting_from = np.minimum.accumulate(a_sorted[::-1])[::-1]
    prev = np.concatenate(([np.iinfo(np.int64).min], t_sorted[:-1]))
    start = np.maximum(prev, waiting_from)
    gaps = np.maximum(0, t_sorted - start)
    return float(gaps.max()) / 1e9


def _entry(res: SimResult, mask: npt.NDArray[np.bool_], tiers: npt.NDArray[np.int64],
           ttft: npt.NDArray[np.float64], gpu_ns: float) -> dict[str, Any]:
    shed = res.shed if res.shed is not None else np.zeros_like(mask)
    live = mask & ~shed
    by_tier: dict[str, dict[str, float | None]] = {}
    for t in np.unique(tiers[live]).tolist():
        vals = ttft[live & (tiers == t)]
        by_tier[tier_label(res.tier_bounds, int(t))] = {
            "p50_s": _pct(vals, 50), "p99_s": _pct(vals, 99)}
    useful = float(res.useful_ns[mask].sum()) if res.useful_ns is not None else 0.0
    gap = None
    if res.taken_ns is not None and bool((res.taken_ns[live] >= 0).any()):
        gap = max_service_gap_s(res.arrival_ns[live], res.taken_ns[live], res.end_ns)
    return {
        "requests": int(mask.sum()),
        "finished": int((mask & (res.finish_ns >= 0)).sum()),
        "shed": int((mask & shed).sum()),
        "ttft_p50_s": _pct(ttft[live], 50),
        "ttft_p99_s": _pct(ttft[live], 99),
        "ttft_by_tier": by_tier,
        "compute_share": useful / gpu_ns if gpu_ns > 0 else 0.0,
        "max_service_gap_s": gap,
    }


def class_tables(res: SimResult) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(by_tenant, by_priority)`` of one run (module docstring)."""
    n = int(res.arrival_ns.size)
    classes = res.classes
    tenants = np.array([c.tenant for c in classes] if classes else ["default"] * n,
                       dtype=object)
    prios = np.array([c.priority for c in classes] if classes else [0] * n, dtype=np.int64)
    first = np.where(res.first_token_ns >= 0, res.first_token_ns, res.end_ns)
    ttft = np.maximum(0, first - res.arrival_ns) / 1e9
    tiers = np.searchsorted(np.asarray(res.tier_bounds), res.input_tokens, side="right")
    gpu_ns = float(res.span_ns) * res.prefill_gpus
    by_tenant = {str(t): _entry(res, tenants == t, tiers, ttft, gpu_ns)
                 for t in sorted(set(tenants.tolist()))}
    by_priority = {str(p): _entry(res, prios == p, tiers, ttft, gpu_ns)
                   for p in sorted(set(prios.tolist()), reverse=True)}
    return by_tenant, by_priority
