"""Goodput: the highest arrival rate at which every latency SLO holds, found by search.

**Definition.** For a workload (a trace window) and a policy, the *goodput* is the
arrival rate, in requests per second of the trace's own arrival process, at the highest
rate scale ``s`` whose run meets every SLO:

* TTFT p99 of every prefill tier <= that tier's TTFT SLO (tiers by total input length,
  the prefill tiers' bounds), and
* TPOT p99 (time per output token after the first) <= the TPOT SLO, and
* every request finished. A request that never gets its first token, or never
  finishes, has an unbounded latency; the run summary does not say which tier it
  belonged to, so **any unfinished request fails the run**. A policy that starves a tier
  therefore cannot pass at a rate where that tier's requests wait past the end of the
  run, and where they are served late its tier's p99 fails.

``goodput_rps = s * (n - 1) / span`` with ``n`` requests arriving over ``span`` seconds
(first to last arrival) at scale 1 (:func:`base_rate`: one over the mean inter-arrival
gap). It is 0 when even the lowest scale searched fails.

**Search** (:func:`search`): bracket, then bisect, on the rate scale in log space.
Start at ``start`` (the CLI starts at its fixed-load run, offered prefill load 0.5 by
default); while runs pass, multiply the scale by ``growth`` (1.4), up to ``max_scale``
(the CLI and the benchmark: offered load 1.0, the fleet's compute, see
:data:`DEFAULT_MAX_LOAD`; a search that passes there is ``capped``); while they fail,
divide it by ``shrink`` (2), down to ``min_scale`` (the CLI: an offered load of 0.25,
half the fixed load; a run at a low rate is the dearest, since its arrivals span the
longest virtual time). Then bisect (geometric mean) between the highest passing and
the lowest failing scale until their ratio is at most ``1 + rel_tol`` (0.05) or
``max_runs`` (8) evaluations are spent: a bracket of 1.4 needs three bisections, so a
goodput between 1x and 2.7x the start costs 5-7 runs. Deterministic
(the evaluations are seeded runs); the reported scale is always one that was run and
passed, never an interpolation. The search assumes that the pass/fail outcome is
monotone in the rate; where it is not, it still reports a verified passing scale, and
lists every run it made (``GoodputResult.runs``).

Use a window of thousands of requests (the CLI's ``--limit`` / ``--duration``): a finite
trace played fast enough becomes one burst, and a burst of a few dozen requests clears
within every SLO however fast it comes, so on a tiny trace the search runs out of budget
while still passing (``converged`` false) and the figure says nothing.

**Default SLOs** (:func:`default_slo`; every value configurable, see ``fulcrum simulate
--slo-ttft / --slo-tpot``). A tier's TTFT SLO is **2.5 x the unloaded prefill time of
the tier's longest fresh prompt** under the cluster's cost model (a prompt at the
tier's upper bound; for the open top tier, twice its lower bound), rounded up to two
significant digits. With the default cluster (cost model ``a = 2 ns/token^2``,
``b = 56 us/token``, tiers at 16K / 64K / 256K tokens) that is:

======== ===================== ===================
tier     longest prompt, alone TTFT p99 SLO
======== ===================== ===================
<16K     1.19 s (16K tokens)   3.0 s
16K-64K  7.97 s (64K tokens)   20 s
64K-256K 83.4 s (256K tokens)  210 s
>=256K   304 s (512K tokens)   770 s
======== ===================== ===================

TPOT p99 SLO: **0.1 s** per output token.

Why these values:

* *Relative to the request's own cost.* A fixed TTFT target cannot serve a fleet whose
  prompts span three orders of magnitude: a 200K-token prompt takes more than a minute
  on an idle rank, while a chat turn should answer in seconds. Splitwise (Patel et al.,
  ISCA'24) and Mooncake (Qin et al., FAST'25) both state their TTFT SLOs as a multiple
  of the latency the same request has without interference; the tier is our unit of
  "same kind of request", and its longest prompt makes the bound hold for every request
  of the tier.
* *The factor 2.5* leaves the queueing and chunk-interleaving delay a loaded,
  disaggregated system must add (one and a half times the request's own compute) while
  still failing a policy that lets a tier wait behind other work. Cross-check against
  absolute published targets: DistServe (Zhong et al., OSDI'24) sets TTFT SLOs of 2.5 s
  and 4 s for chatbot traffic on OPT-66B / OPT-175B and 15 s for LongBench
  summarisation (long prompts); our 3.0 s for prompts under 16K and 20 s for 16K-64K
  sit in that range for a larger (DeepSeek-V3-class) model.
* *TPOT 0.1 s* is DistServe's tightest chatbot TPOT SLO (0.1-0.2 s across its models),
  about reading speed (10 tokens/s). It is 2-10x the decode step time of the default
  decode model (10 ms + 50 us/request + 10 ns/KV token), so it fails when decode
  queues or is overloaded, not under normal batching.

These defaults were chosen from the cost model and the papers above, not tuned on any
trace. **The paper figures above are unverified**: they were written from memory, and a
search of stored public pages found the papers' abstracts but not their SLO tables; the
defaults stand on the cost-relative argument, not on the citations. They are the only
SLO defaults in the project: ``fulcrum simulate --goodput`` and ``benchmarks/bench_sim.py``
both call :func:`default_slo` and :func:`search`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from fulcrum.core.cost import CostModel
from fulcrum.core.prefill.tiers import tier_label

SLO_TTFT_FACTOR: Final = 2.5
"""Default TTFT SLO of a tier = this x the unloaded prefill time of its longest prompt."""

DEFAULT_TPOT_SLO_S: Final = 0.1
"""Default TPOT p99 SLO (s per output token after the first)."""

DEFAULT_MAX_RUNS: Final = 8
"""Default budget of simulator runs per goodput search (CLI ``--goodput-runs``, bench_sim)."""

DEFAULT_REL_TOL: Final = 0.05
"""Default bisection tolerance: stop when lowest failing / highest passing <= 1 + this."""

DEFAULT_MIN_LOAD: Final = 0.25
"""Default lowest offered prefill load a search tries; below it goodput is reported 0."""

DEFAULT_MAX_LOAD: Final = 1.0
"""Default highest offered prefill load a search tries: the fleet's compute (offered
prefill work per second = the prefill ranks' capacity under the cost model, without the
per-step cost ``k``). A rate above it cannot be sustained by any policy: a finite trace
window played that fast passes only because the burst ends before the backlog it builds
breaks an SLO, so its figure rewards burst absorption, not throughput (measured: with no
cap, a policy that favours the short tiers passed the synthetic mix at offered load 10,
a tenfold overload). A search that passes at the cap reports ``capped``: goodput is at
least the fleet's capacity on that window."""

Summary = Mapping[str, Any]
Evaluate = Callable[[float], Summary]


class SummaryError(ValueError):
    """A run summary lacks a key the goodput check needs (one line, names the key)."""


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency SLOs: TTFT p99 per tier label (s) and TPOT p99 (s per output token)."""

    ttft_p99_s: Mapping[str, float]
    tpot_p99_s: float = DEFAULT_TPOT_SLO_S

    def __post_init__(self) -> None:
        for name, v in self.ttft_p99_s.items():
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"slo ttft {name}: must be a finite number > 0, got {v}")
        if not (self.tpot_p99_s > 0 and math.isfinite(self.tpot_p99_s)):
            raise ValueError(f"slo tpot: must be a finite number > 0, got {self.tpot_p99_s}")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"ttft_p99_s": dict(self.ttft_p99_s), "tpot_p99_s": self.tpot_p99_s}


def _round_up_2sig(x: float) -> float:
    if x <= 0:
        return x
    e = math.floor(math.log10(x)) - 1
    step = 10.0**e
    return round(math.ceil(x / step - 1e-9) * step, 10)


def default_slo(
    tier_bounds: Sequence[int],
    cost: CostModel,
    *,
    factor: float = SLO_TTFT_FACTOR,
    tpot_s: float = DEFAULT_TPOT_SLO_S,
) -> Slo:
    """The default SLOs of a cluster (module docstring): TTFT per tier = ``factor`` x the
    unloaded prefill time (s, cost model without the per-step cost ``k``) of a fresh
    prompt at the tier's upper bound (the open top tier: twice its lower bound), rounded
    up to two significant digits."""
    bounds = list(tier_bounds)
    tops = [*bounds, 2 * bounds[-1]]
    out = {}
    for t, top in enumerate(tops):
        alone_s = (cost.cost(top, 0) - cost.k) / 1e9
        out[tier_label(bounds, t)] = _round_up_2sig(factor * alone_s)
    return Slo(ttft_p99_s=out, tpot_p99_s=tpot_s)


def slo_from_values(
    tier_bounds: Sequence[int], ttft_s: Sequence[float], tpot_s: float
) -> Slo:
    """SLOs from one TTFT value per tier (in tier order) and a TPOT value."""
    n = len(tier_bounds) + 1
    if len(ttft_s) != n:
        raise ValueError(f"slo ttft: need one value per tier ({n}), got {len(ttft_s)}")
    return Slo({tier_label(tier_bounds, t): float(v) for t, v in enumerate(ttft_s)}, tpot_s)


# -- one run ------------------------------------------------------------------------------
def _get(summary: Summary, key: str) -> Any:
    if key not in summary:
        raise SummaryError(
            f"run summary: missing key {key!r} (needs fulcrum.sim.report.summarize with the "
            "goodput figures: ttft_by_tier, tpot_p99_s, finished, unfinished)"
        )
    return summary[key]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of one run against the SLOs; ``misses`` names every SLO missed."""

    passed: bool
    misses: tuple[str, ...]


def check(summary: Summary, slo: Slo) -> Verdict:
    """Whether one run's summary meets ``slo`` (module docstring: unfinished fail)."""
    misses: list[str] = []
    unfinished = int(_get(summary, "unfinished"))
    int(_get(summary, "finished"))
    if unfinished > 0:
        misses.append(f"{unfinished} requests unfinished")
    tiers = _get(summary, "ttft_by_tier")
    if not isinstance(tiers, Mapping):
        raise SummaryError("run summary: 'ttft_by_tier' must map tier -> figures")
    for name, figs in tiers.items():
        if name not in slo.ttft_p99_s:
            raise SummaryError(
                f"slo: no TTFT SLO for tier {name!r} (SLO tiers: {', '.join(slo.ttft_p99_s)})"
            )
        if not isinstance(figs, Mapping) or "p99_s" not in figs:
            raise SummaryError(f"run summary: ttft_by_tier[{name!r}] lacks key 'p99_s'")
        count = int(figs.get("count", 1) or 0)
        p99 = figs["p99_s"]
        if count == 0:
            continue
        if p99 is None or not math.isfinite(float(p99)):
            misses.append(f"TTFT p99 {name}: none")
        elif float(p99) > slo.ttft_p99_s[name]:
            misses.append(f"TTFT p99 {name}: {float(p99):.3g} s > {slo.ttft_p99_s[name]:.3g} s")
    tpot = _get(summary, "tpot_p99_s")
    if tpot is not None:
        if not math.isfinite(float(tpot)):
            misses.append("TPOT p99: not finite")
        elif float(tpot) > slo.tpot_p99_s:
            misses.append(f"TPOT p99: {float(tpot):.3g} s > {slo.tpot_p99_s:.3g} s")
    return Verdict(passed=not misses, misses=tuple(misses))


# -- the search ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Probe:
    """One evaluated rate scale."""

    scale: float
    passed: bool
    misses: tuple[str, ...]


@dataclass(slots=True)
class GoodputResult:
    """Outcome of :func:`search`.

    ``scale`` -- highest rate scale that was run and met every SLO (None: none did);
    ``goodput_rps`` -- ``scale x base_rps`` (0 when ``scale`` is None); ``summary`` -- the
    run summary at ``scale``; ``lowest_failing`` -- lowest scale run that failed (None:
    none failed up to ``max_scale``); ``converged`` -- the bracket is within tolerance;
    ``runs`` -- every probe in the order run.
    """

    scale: float | None
    goodput_rps: float
    base_rps: float
    summary: Summary | None
    lowest_failing: float | None
    converged: bool
    runs: list[Probe] = field(default_factory=list)
    capped: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (without the summary)."""
        return {
            "goodput_rps": self.goodput_rps,
            "rate_scale": self.scale,
            "base_rps": self.base_rps,
            "lowest_failing_scale": self.lowest_failing,
            "converged": self.converged,
            "capped": self.capped,
            "runs": [
                {"rate_scale": p.scale, "passed": p.passed, "misses": list(p.misses)}
                for p in self.runs
            ],
        }


def base_rate(arrivals_ns: Sequence[int]) -> float:
    """Requests per second of an arrival sequence (ns): ``n / span``; the span is first to
    last arrival, so ``n`` arrivals over it are ``n - 1`` gaps plus the first: the rate of
    the trace's arrival process. Raises ValueError for fewer than two arrivals or a
    zero span."""
    if len(arrivals_ns) < 2:
        raise ValueError("goodput: need at least two requests to define an arrival rate")
    span = max(arrivals_ns) - min(arrivals_ns)
    if span <= 0:
        raise ValueError("goodput: all requests arrive at once; no arrival rate")
    return (len(arrivals_ns) - 1) / (span / 1e9)


OnProbe = Callable[[int, float, bool], None]
"""Progress callback of :func:`search`: (probes run so far, rate scale, passed)."""


def _check_search_args(base_rps: float, start: float, growth: float, shrink: float,
                       rel_tol: float, max_runs: int, min_scale: float,
                       max_scale: float) -> None:
    if not (base_rps > 0 and math.isfinite(base_rps)):
        raise ValueError(f"goodput: base_rps must be > 0, got {base_rps}")
    if not (growth > 1 and shrink > 1):
        raise ValueError(f"goodput: growth and shrink must be > 1, got {growth}, {shrink}")
    if not rel_tol > 0:
        raise ValueError(f"goodput: rel_tol must be > 0, got {rel_tol}")
    if max_runs < 1:
        raise ValueError(f"goodput: max_runs must be >= 1, got {max_runs}")
    if not (0 < min_scale <= start <= max_scale):
        raise ValueError(f"goodput: need 0 < min_scale <= start <= max_scale, got {start}")


@dataclass(slots=True)
class _Search:
    """The probes of one search so far; ``lo`` highest passing, ``hi`` lowest failing."""

    evaluate: Evaluate
    slo: Slo
    max_runs: int
    on_probe: OnProbe | None
    runs: list[Probe] = field(default_factory=list)
    summaries: dict[float, Summary] = field(default_factory=dict)
    lo: float | None = None
    hi: float | None = None

    @property
    def budget_left(self) -> bool:
        return len(self.runs) < self.max_runs

    def probe(self, scale: float) -> bool:
        summary = self.evaluate(scale)
        verdict = check(summary, self.slo)
        self.runs.append(Probe(scale, verdict.passed, verdict.misses))
        self.summaries[scale] = summary
        if verdict.passed:
            self.lo = scale if self.lo is None else max(self.lo, scale)
        else:
            self.hi = scale if self.hi is None else min(self.hi, scale)
        if self.on_probe is not None:
            self.on_probe(len(self.runs), scale, verdict.passed)
        return verdict.passed

    def bracket(self, start: float, growth: float, shrink: float, min_scale: float,
                max_scale: float) -> None:
        """Grow from a passing start until a failure or ``max_scale``; shrink from a
        failing one until a pass or ``min_scale``."""
        s = start
        if self.probe(s):
            while self.budget_left and s < max_scale:
                s = min(s * growth, max_scale)
                if not self.probe(s):
                    return
        else:
            while self.budget_left and s > min_scale:
                s = max(s / shrink, min_scale)
                if self.probe(s):
                    return

    def bisect(self, rel_tol: float) -> None:
        while (self.lo is not None and self.hi is not None and self.hi / self.lo > 1 + rel_tol
               and self.budget_left):
            self.probe(math.sqrt(self.lo * self.hi))


def search(
    evaluate: Evaluate,
    slo: Slo,
    *,
    base_rps: float,
    start: float = 1.0,
    growth: float = 1.4,
    shrink: float = 2.0,
    rel_tol: float = DEFAULT_REL_TOL,
    max_runs: int = DEFAULT_MAX_RUNS,
    min_scale: float = 1e-3,
    max_scale: float = 1e3,
    on_probe: OnProbe | None = None,
) -> GoodputResult:
    """Highest verified rate scale meeting ``slo`` (module docstring).

    ``evaluate(scale)`` runs the workload with arrivals at ``scale`` x the trace's rate and
    returns its summary (keys ``ttft_by_tier``, ``tpot_p99_s``, ``finished``,
    ``unfinished``). At most ``max_runs`` evaluations; each scale is evaluated once.
    When even ``min_scale`` fails, ``scale`` is None, ``goodput_rps`` 0 and
    ``lowest_failing`` says below which rate the goodput lies. ``on_probe`` (optional)
    hears of each evaluation as it ends (progress display).
    """
    _check_search_args(base_rps, start, growth, shrink, rel_tol, max_runs, min_scale,
                       max_scale)
    st = _Search(evaluate, slo, max_runs, on_probe)
    st.bracket(start, growth, shrink, min_scale, max_scale)
    st.bisect(rel_tol)
    lo, hi = st.lo, st.hi
    converged = (
        (lo is not None and hi is not None and hi / lo <= 1 + rel_tol)
        or (lo is not None and hi is None and lo >= max_scale)
        or (lo is None and hi is not None and hi <= min_scale)
    )
    return GoodputResult(
        scale=lo,
        goodput_rps=0.0 if lo is None else lo * base_rps,
        base_rps=base_rps,
        summary=None if lo is None else st.summaries[lo],
        lowest_failing=hi,
        converged=converged,
        runs=st.runs,
        capped=lo is not None and lo >= max_scale,
    )
