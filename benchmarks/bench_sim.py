"""Headline figures of the simulator: goodput under SLO, utilisation, TTFT per tier.

For each workload (the four shared traces plus the synthetic long-context agent mix) the
same requests run under the default policies, the ``published`` rules and every push
baseline (same engine-side chunk planner and cost model; only routing differs; load
reports 50 ms stale). Decode and VE fleets are sized to the workload at an offered
prefill load of 1.0 and then kept fixed, so that prefill is what is measured.

* **Goodput**: :mod:`fulcrum.sim.goodput` -- the same definition, default SLOs
  (:func:`fulcrum.sim.goodput.default_slo` of the cluster) and search as ``fulcrum
  simulate --goodput``: the highest arrival rate (requests/s of the trace's arrival
  process, scaled) at which TTFT p99 of every tier and TPOT p99 meet their SLOs and every
  request finished; the search starts at the fixed load (that run is its first probe).
* **At a fixed load** ``rho`` = :data:`FIXED_LOAD`: TTFT p50/p99 per tier, TPOT p99,
  prefill and decode utilisation (useful compute without the fixed per-step cost over all
  GPU-seconds of the run, idle engines included).
* **Diagnostics**: the old per-step balance ratio and the default's loss split.
* **Per-engine prefix caches** (:data:`PER_ENGINE`, issue 21): the default against every
  prefix-aware baseline (:data:`PREFIX_POLICIES`) with no global KV pool, and each one's
  block hit ratio at the fixed load.

Run alone: ``.venv/bin/python benchmarks/bench_sim.py [--quick]``; one case:
``... --case mooncake-per-engine --json FILE`` then ``--render-per-engine FILE``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pragma: no cover - direct execution
    sys.path.insert(0, str(ROOT))

from benchmarks.common import md_table  # noqa: E402
from fulcrum.core.cost import CostModel  # noqa: E402
from fulcrum.sim import goodput as G  # noqa: E402
from fulcrum.sim import scenarios  # noqa: E402
from fulcrum.sim import workload as W  # noqa: E402
from fulcrum.sim.cluster import Cluster  # noqa: E402
from fulcrum.sim.engine import simulate  # noqa: E402
from fulcrum.sim.policies import get_policy_set  # noqa: E402
from fulcrum.sim.report import summarize  # noqa: E402

SEED = 0
#: Offered prefill load of the like-for-like latency runs (the CLI's default too): below the
#: goodput of the default and of least_work on every workload (the lowest, least_work on
#: Azure conversation x4 lengths, is about 0.53), so the default and the best baseline
#: are compared below saturation (weaker baselines fail even at 0.25 on some workloads).
#: At 0.7 the whole traces saturated least_work on four workloads.
FIXED_LOAD = 0.5
POLICIES = ("default", "published", "least_work", "least_requests", "power_of_two",
            "round_robin", "random")
QUICK_POLICIES = ("default", "published", "least_work")
LOSS_KEYS = ("prefill_idle_rank", "prefill_drained_rank", "prefill_short_rank", "prefill_moe")



def slo_of(cluster: Cluster) -> G.Slo:
    """The default SLOs of ``cluster`` (:func:`fulcrum.sim.goodput.default_slo`, the
    CLI's defaults)."""
    p = cluster.prefill
    return G.default_slo(p.tier_bounds, CostModel(a=p.cost_model.a, b=p.cost_model.b,
                                                 k=p.cost_model.k))


#: The default SLOs of the default cluster (every case runs the default prefill fleet):
#: TTFT p99 per tier (s) and TPOT p99 (s); defined once, in :mod:`fulcrum.sim.goodput`.
SLO = slo_of(Cluster())
SLO_TTFT_P99_S = dict(SLO.ttft_p99_s)
SLO_TPOT_P99_S = SLO.tpot_p99_s
#: Search range over the offered prefill load rho: the lowest load tried (below it the
#: goodput is reported as 0) and the highest (the fleet's compute; a search passing there
#: is capped, see :data:`fulcrum.sim.goodput.DEFAULT_MAX_LOAD`).
RHO_LO, RHO_HI = G.DEFAULT_MIN_LOAD, G.DEFAULT_MAX_LOAD
#: Bisection tolerance and run budget of the benchmark's searches: finer than the CLI's
#: defaults (5%, 8 runs), so that two policies a few percent apart are told apart.
REL_TOL, MAX_RUNS = 0.02, 10


@dataclass(frozen=True)
class Case:
    """One workload: how to load it, full and quick."""

    name: str
    label: str
    limit: int | None
    duration_s: float | None
    quick_limit: int
    #: Workload to load (default: ``name``), its sampling seed, window start (s) and
    #: input length multiplier (held-out variants of the shared traces).
    source: str = ""
    seed: int = SEED
    start_s: float = 0.0
    length_scale: float = 1.0
    #: Prefix-cache model of the prefill fleet (``prefill.cache_model``) and the policies
    #: run (empty: :data:`POLICIES`, or :data:`QUICK_POLICIES` in quick mode).
    cache_model: str = "global"
    policies: tuple[str, ...] = ()


#: Whole traces (ServeGen: one ten-minute window of its 35 clients): a window of a few
#: thousand requests played near the fleet's capacity lasts seconds, too short for a
#: backlog to show, so every sound policy would pass up to the cap.
CASES = (
    Case("mooncake", "Mooncake (FAST'25 synthetic trace)", None, None, 600),
    Case("azure-code", "Azure LLM 2023, code", None, None, 800),
    Case("azure-conv", "Azure LLM 2023, conversation", None, None, 800),
    Case("servegen", "ServeGen mm-image (sampled, 35 clients)", None, 600.0, 800),
    Case("synthetic", "Synthetic agents >256K + screenshots + surge", None, 200.0, 400),
)


#: Held-out workloads: none was looked at while the defaults were chosen (other ServeGen
#: windows, other synthetic seeds, longer prompts on a real arrival process).
HELDOUT = (
    Case("servegen@3h", "ServeGen mm-image, window at +3 h", None, 600.0, 800,
         source="servegen", start_s=10_800.0),
    Case("servegen@4h", "ServeGen mm-image, window at +4 h", None, 600.0, 800,
         source="servegen", start_s=14_400.0),
    Case("synthetic-seed3", "Synthetic agents, seed 3", None, 200.0, 400,
         source="synthetic", seed=3),
    Case("synthetic-seed4", "Synthetic agents, seed 4", None, 200.0, 400,
         source="synthetic", seed=4),
    Case("azure-conv-x4", "Azure LLM 2023 conversation, prompts x4 (up to 56K tokens)",
         None, None, 800, source="azure-conv", length_scale=4.0),
)


#: The prefix-aware baselines (issue 21): the same pull without the prefix index, and the
#: prefix-aware push routers of :mod:`fulcrum.sim.baselines` (llm-d's ``3 x prefix + 2 x
#: load`` and SGLang's cache-aware rule), beside the best prefix-blind push.
PREFIX_POLICIES = ("default", "default_noaffinity", "prefix_load", "cache_aware", "least_work")

#: Per-engine prefix caches (``prefill.cache_model: per_engine``, no global KV pool): the
#: one shared trace with block hashes, its first 4,000 requests as in issue 21 (quick: 600).
#: The generated conversation traces are in ``benchmarks/bench_affinity.py``.
PER_ENGINE = (
    Case("mooncake-per-engine", "Mooncake, per-engine prefix caches",
         4000, None, 600, source="mooncake", cache_model="per_engine",
         policies=PREFIX_POLICIES),
)


#: How the defaults were chosen (rendered under the goodput table).
DEFAULTS_TEXT = (
    "Defaults the simulator chose (rule set `default` of `fulcrum.core.prefill.balancer`; "
    "`published` keeps the letter of the design). The choices were made on a sweep of 16 "
    "windows of the five workloads (Mooncake 3 x 1,500 requests from 0 / 380 / 630 s; "
    "Azure code 3 x 4,000 from 0 / 1,150 / 2,300 s; Azure conversation 4 x 4,000 from "
    "0 / 900 / 1,800 / 2,700 s; ServeGen 3 x 3,000 requests of ten-minute windows at "
    "+0 / +1 / +2 h; the synthetic mix with seeds 0-2), goodput searched at 2% "
    "tolerance without the capacity cap, as a ratio to `least_work` on the same window "
    "(geometric mean over the 16; in brackets the worst window). These windows overlap "
    "the whole traces of the table above, so that table is not held out; the held-out "
    "table below is. (1) *Work waits for a step boundary*: an engine takes work between "
    "its steps (the kit's `PrefillEngineLoop`; the simulator models it since this "
    "change, the daemon hands work only to parked pulls), so a request that arrives "
    "while every engine is mid-step goes to the first engine that reaches a boundary, "
    "not to an idle rank of an engine busy for up to a step budget. With the earlier "
    "late-binding horizon of 2 step budgets this alone moved the ratio from 1.29 "
    "(0.94; busy engines took work at once) to 1.23 (0.77): the horizon then binds work "
    "for seconds ahead. (2) *Late binding at a tenth of a step budget* "
    "(`rank_horizon_steps` = 0.1, 100 ms with the 1 s budget: the chunk planner's "
    "floor, one shortest step): horizons of 2 / 1 / 0.5 / 0.25 / 0.125 / 0.1 step "
    "budgets gave 1.23 (0.77) / 1.23 (0.79) / 1.33 (0.97) / 1.37 (0.96) and, with rule "
    "(3), 0.25 / 0.125 / 0.1: 1.89 (1.02) / 1.88 (1.01) / 1.87 (0.99). 0.25 had 1-2% "
    "more goodput, 0.1 the lower TTFT at a moderate load (ServeGen at rho 0.7, TTFT p99 "
    "<16K 0.57 s at 0.25, 0.47 s at 0.1, least_work 0.52 s): ranks refilled only when "
    "nearly empty make short steps, and a first token comes at the end of its step. The "
    "issue asks for both yardsticks, so 0.1. (3) *Urgent tiers*: an engine with room "
    "takes from the tier whose head has waited longest relative to the tier's batch cap "
    "(8 / 32 / 128 / 512 s, the existing configuration, not tuned; an SLO-derived scale "
    "scored higher on Mooncake but was not adopted, since it would fit the policy to "
    "the yardstick's own SLOs), a longer tier only for work within a quarter of its own "
    "batch cap (2 s for <16K), so a surge of 300K-token prompts never takes a short "
    "tier's engine (the surge test in `tests/service/test_prefill_load.py`). It replaced "
    "\"help a shorter tier only when your own queue is empty\", which left Mooncake's "
    "short tier with one engine and a 13 s backlog while the 16K-64K tier held seven "
    "(window at 380 s, rho 0.8: TTFT p99 <16K 4.08 s -> 1.80 s). The sweep without "
    "the cap also showed why the search now stops at rho 1.0: favouring short tiers "
    "passed the synthetic mix at rho 10, a tenfold overload absorbed as one burst. Tier "
    "bounds, batch caps, hysteresis, backlog rounds and the 2 s tier dwell keep their "
    "earlier defaults (not re-tuned). The rules as shipped, on the same 16 windows: "
    "1.84 (0.99): it passes a higher rate than least_work on 15 of the 16 windows, and "
    "on the first 4,000 requests of Azure conversation it passes 0.99x."
)
#: What the table says (rendered under the defaults).
READING_TEXT = (
    "Reading the tables: the default wins goodput where the fleet falls behind before "
    "the cap -- Mooncake and the synthetic mix (long prompts that tiers keep away from "
    "short ones, which is what sinks every push router under the synthetic surge, "
    "least_work included, since a push router queues FIFO per rank) and the Azure "
    "traces played whole (bursts: work that waits in the shared queue goes to the first "
    "engine at a step boundary, where a push router must commit every request to one "
    "rank on arrival, with 50 ms old reports). On ServeGen every sound policy passes "
    "at the cap: a tie, none falls behind below the fleet's compute on those windows. At "
    "the fixed load the default has the lowest TTFT p99 of the shortest tier on every "
    "workload; where a baseline is lower it is on a longer tier, by 0.4-5% (Mooncake "
    "16K-64K, the synthetic mixes' 64K-256K and >=256K tiers) and by 14% on Azure "
    "conversation with x4 prompts (16K-64K, 416 of 19,366 requests): those tiers pay "
    "for the shorter tiers' priority -- their heads wait while a shorter tier's head is "
    "more urgent for its scale, where a pooled FIFO router (least_work) starts them at "
    "once. Weighing the tiers' waits more equally (scale ratios 1:2:4:8, or raw wait; "
    "measured on Mooncake at rho 0.7) brought the 64K-256K p99 to least_work's (43.1 s "
    "/ 40.1 s vs 40.1 s) but broke the <16K SLO at the same load (3.41 s / 5.62 s vs "
    "2.29 s). The longest tiers' p99 is also the maximum of a few requests (synthetic "
    ">=256K: 4 to 19)."
)


def meets_slo(s: dict[str, Any], slo: G.Slo = SLO) -> bool:
    """True when the run meets every SLO (:func:`fulcrum.sim.goodput.check`)."""
    return G.check(s, slo).passed


def _load(case: Case, quick: bool) -> tuple[list[W.Request], Cluster]:
    limit = case.quick_limit if quick else case.limit
    reqs = scenarios.load_workload(case.source or case.name, seed=case.seed,
                                   duration_s=case.duration_s, start_s=case.start_s,
                                   limit=limit)
    if case.length_scale != 1.0:
        reqs = W.scale_length(reqs, case.length_scale)
    base = Cluster()
    if case.cache_model != "global":
        base = base.with_overrides(prefill={"cache_model": case.cache_model})
    at_one, _ = scenarios.scale_to_load(reqs, base, 1.0)
    cluster = scenarios.size_vision(at_one, scenarios.size_decode(at_one, base))
    return reqs, cluster


def _run(reqs: list[W.Request], cluster: Cluster, policy: str, rho: float
         ) -> tuple[dict[str, Any], float]:
    scaled, _ = scenarios.scale_to_load(reqs, cluster, rho)
    s = summarize(simulate(cluster, get_policy_set(policy), scaled, seed=SEED))
    span = W.duration_ns(scaled) / 1e9
    return s, (len(scaled) / span if span > 0 else 0.0)


def goodput(reqs: list[W.Request], cluster: Cluster, policy: str,
            steps: int = MAX_RUNS, start_rho: float = FIXED_LOAD,
            cache: dict[float, dict[str, Any]] | None = None) -> tuple[float, float]:
    """(rho, requests/s) of the highest load meeting every SLO of ``cluster``, by
    :func:`fulcrum.sim.goodput.search` over the rate scale (at most ``steps`` runs,
    starting at ``start_rho``); (0, 0) when even ``RHO_LO`` misses. ``cache`` maps a rate
    scale to its run summary (the fixed-load run doubles as the first probe)."""
    base_load = scenarios.offered_load(reqs, cluster)
    if base_load <= 0:
        raise ValueError("goodput: the workload offers no prefill work")
    done = {} if cache is None else cache
    ps = get_policy_set(policy)

    def evaluate(scale: float) -> dict[str, Any]:
        if scale not in done:
            done[scale] = summarize(simulate(cluster, ps, W.scale_rate(reqs, scale),
                                             seed=SEED))
        return done[scale]

    res = G.search(evaluate, slo_of(cluster),
                   base_rps=G.base_rate([r.arrival_ns for r in reqs]),
                   start=start_rho / base_load, min_scale=RHO_LO / base_load,
                   max_scale=RHO_HI / base_load, max_runs=steps,
                   rel_tol=REL_TOL)
    if res.scale is None:
        return 0.0, 0.0
    return res.scale * base_load, res.goodput_rps


def _cell(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def run_case(case: Case, quick: bool) -> dict[str, Any]:
    """Goodput and fixed-load summaries of every policy on one workload (JSON-ready)."""
    names = list(case.policies or (QUICK_POLICIES if quick else POLICIES))
    t0 = time.perf_counter()
    reqs, cluster = _load(case, quick)
    base_load = scenarios.offered_load(reqs, cluster)
    good, fixed = {}, {}
    for n in names:
        cache: dict[float, dict[str, Any]] = {}
        # The fixed-load run is the search's first probe.
        fixed[n] = _run(reqs, cluster, n, FIXED_LOAD)[0]
        cache[FIXED_LOAD / base_load] = fixed[n]
        good[n] = goodput(reqs, cluster, n, steps=5 if quick else MAX_RUNS,
                          cache=cache)
    return {"case": case.name, "label": case.label, "requests": len(reqs), "names": names,
            "goodput": good, "fixed": fixed, "wall_s": time.perf_counter() - t0}


def _goodput_cell(g: tuple[float, float]) -> str:
    """``(rho, req/s)`` as a table cell; ``>=`` when the search passed at the cap."""
    return f"{'>= ' if g[0] >= RHO_HI * (1 - 1e-9) else ''}{g[1]:.2f} ({g[0]:.2f})"


def _verdict(r: dict[str, Any], title: str) -> str:
    """One line: the default's goodput against the best baseline's, and the tiers where a
    baseline has a lower TTFT p99 at the fixed load."""
    good, fixed = r["goodput"], r["fixed"]
    base = [n for n in r["names"] if n not in ("default", "published")]
    best = max(base, key=lambda n: good[n][1])
    worse = []
    for t, row in fixed["default"]["ttft_by_tier"].items():
        mine = row["p99_s"] or 0.0
        theirs = min((fixed[n]["ttft_by_tier"].get(t, {}).get("p99_s") or 0.0) for n in base)
        if mine > theirs + 1e-9:
            worse.append(f"{t} ({mine:.2f} s vs {theirs:.2f} s)")
    return (
        f"- {title}: default goodput {good['default'][1]:.2f} req/s vs best baseline "
        f"{best} {good[best][1]:.2f} ({good['default'][1] / max(good[best][1], 1e-9):.2f}x)"
        f"; tiers where a baseline has a lower TTFT p99 at rho {FIXED_LOAD}: "
        f"{', '.join(worse) if worse else 'none'}"
    )


def render(results: list[dict[str, Any]], quick: bool, wall: float) -> str:
    """The markdown section from :func:`run_case` results."""
    names = results[0]["names"] if results else []
    good_rows, fixed_blocks, diag_rows, loss_rows, verdicts = [], [], [], [], []
    for r in results:
        good, fixed = r["goodput"], r["fixed"]
        good_rows.append([r["case"], f"{r['requests']:,}"]
                         + [_goodput_cell(good[n]) for n in names])
        tiers = list(fixed["default"]["ttft_by_tier"])
        rows = []
        for n in names:
            s = fixed[n]
            cells = [n, _cell(s["prefill_utilisation"]), _cell(s["decode_utilisation"])]
            for t in tiers:
                row = s["ttft_by_tier"].get(t, {})
                cells.append(f"{_cell(row.get('p50_s'), 2)} / {_cell(row.get('p99_s'), 2)}")
            cells.append(_cell(None if s["tpot_p99_s"] is None else s["tpot_p99_s"] * 1e3, 1))
            cells.append(str(s["unfinished"]))
            rows.append(cells)
        fixed_blocks.append(
            f"**{r['label']}** ({r['requests']:,} requests; rho = {FIXED_LOAD})\n\n"
            + md_table(["policy", "prefill util.", "decode util.",
                        *[f"TTFT p50 / p99 {t} (s)" for t in tiers], "TPOT p99 (ms)",
                        "unfinished"], rows)
        )
        diag_rows.append([r["case"]] + [_cell(fixed[n]["balance_ratio"]) for n in names])
        lo = fixed["default"]["loss"]
        loss_rows.append([r["case"], _cell(fixed["default"]["balance_ratio"])]
                         + [_cell(lo[k]) for k in LOSS_KEYS])
        verdicts.append(_verdict(r, r["case"]))
    cmd = ".venv/bin/python benchmarks/bench_sim.py" + (" --quick" if quick else "")
    slo = ", ".join(f"{t} {v:g} s" for t, v in SLO_TTFT_P99_S.items())
    out = [
        "### Simulator: goodput under SLO, utilisation, TTFT",
        "",
        f"Command: `{cmd}`. Seed {SEED}; {wall:.0f} s wall."
        + (" Quick mode: short windows, fewer policies, coarser search." if quick else ""),
        "",
        f"SLOs: TTFT p99 per tier {slo}; TPOT p99 {SLO_TPOT_P99_S * 1e3:g} ms; every "
        "request finished. Goodput cells: requests/s at the highest rate meeting every SLO "
        "(the offered prefill load rho in brackets), found by `fulcrum.sim.goodput.search` "
        f"(the search `fulcrum simulate --goodput` runs): start at the fixed load rho = "
        f"{FIXED_LOAD} (that run is the first probe), grow x1.4 while passing or halve "
        f"while failing (down to rho {RHO_LO}, up to {RHO_HI:g}), then bisect to within "
        f"{REL_TOL:.0%}, at most {MAX_RUNS} runs per policy. A cell marked `>=` passed "
        f"at rho {RHO_HI:g}, the fleet's compute (`fulcrum.sim.goodput.DEFAULT_MAX_LOAD`): "
        "a faster rate is a burst no fleet sustains, so the search stops there.",
        "",
        "SLO defaults (`fulcrum.sim.goodput.default_slo`, the one definition the CLI and "
        "this benchmark share): a tier's TTFT p99 SLO is 2.5x the unloaded prefill time of "
        "the tier's longest fresh prompt on one DP rank under the cluster's cost model "
        "(16K tokens 1.19 s, 64K 7.97 s, 256K 83.4 s; the open top tier: a 512K prompt, "
        "304 s), rounded up to two significant digits; TPOT p99 0.1 s. The factor leaves "
        "one and a half times a request's own compute for queueing and chunk interleaving, "
        "and fails a policy that makes a tier wait behind other work; a fixed absolute "
        "TTFT cannot serve prompts spanning three orders of magnitude. The cost-relative "
        "form and the absolute figures the goodput module's docstring cites (Splitwise, "
        "Mooncake: SLOs as multiples of the unloaded latency; DistServe: TTFT 2.5-4 s for "
        "chat, 15 s for summarisation, TPOT 0.1-0.2 s) were written from memory and are "
        "UNVERIFIED: a search of the stored public pages found the papers' abstracts but "
        "not their SLO tables. Decode and VE fleets are sized for rho = 1.0 and then kept "
        "fixed, so TPOT rarely binds: the tiers' TTFT does.",
        "",
        md_table(["trace", "requests", *names], good_rows),
        "",
        *verdicts,
        "",
        DEFAULTS_TEXT,
        "",
        READING_TEXT,
        "",
        *[b + "\n" for b in fixed_blocks],
        "Diagnostic only -- the old per-step balance ratio (ideal / actual time over the "
        "steps that ran; engines that never step are not counted):",
        "",
        md_table(["trace", *names], diag_rows),
        "",
        "Where the default's prefill steps lose against a perfectly balanced step (shares "
        "of prefill GPU time; they add up to 1 - balance ratio):",
        "",
        md_table(["trace", "balance ratio", "idle rank", "drained rank",
                  "rank short of work left", "MoE stretch"], loss_rows),
    ]
    return "\n".join(out) + "\n"


def render_heldout(results: list[dict[str, Any]]) -> str:
    """The held-out goodput table (same search, SLOs and policies) from :func:`run_case`
    results, with one verdict line per workload."""
    names = results[0]["names"] if results else []
    rows = [[r["case"], f"{r['requests']:,}"] + [_goodput_cell(r["goodput"][n]) for n in names]
            for r in results]
    verdicts = [_verdict(r, f"{r['case']} ({r['label']})") for r in results]
    return "\n".join([md_table(["workload", "requests", *names], rows), "", *verdicts]) + "\n"


def render_per_engine(results: list[dict[str, Any]]) -> str:
    """The per-engine goodput table (issue 21: every prefix-aware baseline beside the
    default), with the block hit ratio at the fixed load, from :func:`run_case` results."""
    if not results:
        return ""
    names = results[0]["names"]
    hits = [[r["case"]] + [_cell(r["fixed"][n].get("block_hit_ratio")) for n in names]
            for r in results]
    return "\n".join([
        "", "#### Per-engine prefix caches", "",
        "Each prefill engine caches its own prefixes (`prefill.cache_model: per_engine`, "
        "no global KV pool); same search and SLOs. `default_noaffinity` is the default "
        "pull without the prefix index; `prefix_load` and `cache_aware` are the "
        "prefix-aware push routers of `fulcrum.sim.baselines` (llm-d-style, SGLang's rule).",
        "", render_heldout(results), f"Block hit ratio at rho {FIXED_LOAD}:", "",
        md_table(["trace", *names], hits),
    ]) + "\n"


def run(quick: bool) -> str:
    """The markdown section (see module docstring)."""
    t_start = time.perf_counter()
    cases = [c for c in CASES if not quick or c.name in ("mooncake", "synthetic")]
    results = [run_case(c, quick) for c in cases]
    heldout = [] if quick else [run_case(c, quick) for c in HELDOUT]
    per_engine = [run_case(c, quick) for c in PER_ENGINE]
    text = render(results, quick, time.perf_counter() - t_start)
    text += render_per_engine(per_engine)
    if heldout:
        text += ("\n#### Held-out workloads\n\nNot looked at while the defaults were "
                 "chosen; same search, SLOs and policies.\n\n" + render_heldout(heldout))
    return text


def _main(argv: list[str]) -> None:  # pragma: no cover - manual runs
    """``--case NAME --json FILE``: one workload's results as JSON (for runs split over
    processes); ``--render FILE...``: the markdown from such files; else :func:`run`."""
    quick = "--quick" in argv
    if "--case" in argv:
        case = next(c for c in (*CASES, *HELDOUT, *PER_ENGINE)
                    if c.name == argv[argv.index("--case") + 1])
        out = Path(argv[argv.index("--json") + 1])
        out.write_text(json.dumps(run_case(case, quick)))
    elif "--render-per-engine" in argv:
        files = argv[argv.index("--render-per-engine") + 1:]
        print(render_per_engine([json.loads(Path(f).read_text()) for f in files]))
    elif "--render-heldout" in argv:
        files = argv[argv.index("--render-heldout") + 1:]
        print(render_heldout([json.loads(Path(f).read_text()) for f in files]))
    elif "--render" in argv:
        files = argv[argv.index("--render") + 1:]
        results = [json.loads(Path(f).read_text()) for f in files]
        print(render(results, quick, sum(r["wall_s"] for r in results)))
    else:
        print(run(quick))


if __name__ == "__main__":  # pragma: no cover
    _main(sys.argv[1:])
