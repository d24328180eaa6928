"""Multi-tenant workloads (issue 23): mix traces as tenants, each at a chosen load.

A :class:`TenantPart` is one tenant's traffic: a workload, its tenant string, the
offered prefill load it should put on the cluster (``rho``: predicted prefill compute /
(prefill GPUs x time); 1.5 = one and a half fleets' worth), its priority and TTFT
deadline. :func:`tenant_mix` scales each part's arrival rate to its load, tags its
requests and, given ``duration_s``, repeats the part back to back (block ids offset per
copy: a copy shares no prefix with the one before) and fits its load over that window;
then it cuts every part to the shortest part's span (so all tenants send throughout)
and merges them (block ids offset per part, so tenants never share a prefix by
accident). ``fulcrum simulate --tenant-mix`` builds one from the command line
(:func:`parse_mix`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fulcrum.sim import scenarios
from fulcrum.sim import traces as T
from fulcrum.sim import workload as W
from fulcrum.sim.cluster import Cluster


@dataclass(frozen=True, slots=True)
class TenantPart:
    """One tenant's traffic: ``reqs`` at offered prefill load ``load`` (> 0)."""

    reqs: Sequence[W.Request]
    tenant: str
    load: float
    priority: int = 0
    ttft_slo_ms: int | None = None


def tag(reqs: Sequence[W.Request], tenant: str, priority: int = 0,
        ttft_slo_ms: int | None = None) -> list[W.Request]:
    """``reqs`` as requests of ``tenant`` at ``priority`` with that deadline (ms)."""
    return [replace(r, tenant=tenant, priority=priority, ttft_slo_ms=ttft_slo_ms,
                    source=tenant) for r in reqs]


def tenant_mix(parts: Sequence[TenantPart], cluster: Cluster,
               duration_s: float | None = None) -> list[W.Request]:
    """The merged workload of ``parts`` (module docstring); ``duration_s`` cuts it
    shorter still (s)."""
    if not parts:
        raise ValueError("tenant mix: needs at least one part")
    scaled = []
    for p in parts:
        if not p.reqs:
            raise ValueError(f"tenant mix: tenant {p.tenant!r} has no request")
        reqs, _ = scenarios.scale_to_load(p.reqs, cluster, p.load)
        if duration_s is not None:
            reqs = _fit(reqs, cluster, p.load, int(duration_s * 1e9))
        scaled.append(tag(reqs, p.tenant, p.priority, p.ttft_slo_ms))
    span = min(W.duration_ns(r) for r in scaled)
    if duration_s is not None:
        span = min(span, int(duration_s * 1e9))
    return W.merge(*([r for r in reqs if r.arrival_ns < span] for reqs in scaled))


def _fit(reqs: Sequence[W.Request], cluster: Cluster, load: float,
         span_ns: int) -> list[W.Request]:
    """``reqs`` repeated and cut to ``span_ns`` with offered load ``load`` over that span
    (rescaling moves the span, so a few rounds)."""
    out = list(reqs)
    for _ in range(3):
        out = [r for r in repeat(out, int(span_ns * 1.5)) if r.arrival_ns < span_ns]
        out, _ = scenarios.scale_to_load(out, cluster, load)
    return [r for r in repeat(out, span_ns) if r.arrival_ns < span_ns]


def repeat(reqs: Sequence[W.Request], span_ns: int) -> list[W.Request]:
    """``reqs`` played back to back until ``span_ns`` is covered (each copy starts one
    mean inter-arrival after the last request of the previous one; its block ids are
    offset so copies share no prefix), renumbered."""
    if not reqs:
        return []
    dur = W.duration_ns(reqs)
    gap = dur // max(1, len(reqs) - 1) if len(reqs) > 1 else 1
    period = max(1, dur + gap)
    t0 = min(r.arrival_ns for r in reqs)
    copies = max(1, -(-span_ns // period))
    out = [replace(r, arrival_ns=r.arrival_ns - t0 + k * period,
                   hash_ids=tuple(h + (k << 40) for h in r.hash_ids))
           for k in range(copies) for r in reqs]
    return W.renumber(out)


def _workload(name: str, seed: int) -> list[W.Request]:
    if name in scenarios.TRACES:
        return scenarios.load_workload(name, seed=seed)
    return T.read_trace(Path(name))


def parse_mix(spec: str, cluster: Cluster, seed: int = 0,
              duration_s: float | None = None) -> list[W.Request]:
    """A mix from ``TRACE:TENANT:LOAD[:PRIORITY[:SLO_MS]]`` parts separated by commas
    (TRACE: a built-in workload name or a path); ValueError naming the bad part."""
    parts = []
    for i, raw in enumerate(x for x in spec.split(",") if x.strip()):
        f = raw.strip().split(":")
        if not 3 <= len(f) <= 5:
            raise ValueError(f"--tenant-mix part {i} {raw!r}: expected "
                             "TRACE:TENANT:LOAD[:PRIORITY[:SLO_MS]]")
        try:
            load = float(f[2])
            prio = int(f[3]) if len(f) > 3 else 0
            slo = int(f[4]) if len(f) > 4 else None
        except ValueError:
            raise ValueError(f"--tenant-mix part {i} {raw!r}: LOAD is a number, PRIORITY "
                             "and SLO_MS integers") from None
        parts.append(TenantPart(_workload(f[0], seed), f[1], load, prio, slo))
    return tenant_mix(parts, cluster, duration_s)
