"""Headline figures: every shared trace replayed through the core policies vs the ideal.

For each workload (the shared traces plus the synthetic long-context agent mix), arrivals
are scaled to a stated offered prefill load (``rho``: predicted prefill compute / prefill
capacity over the arrival span, prefix cache applied), decode and VE fleets are sized to
the workload (about 48 requests per decode GPU, 60% VE utilisation), and the same
requests are run under the default policies, each baseline, and the ideal. Plots of two
workloads go to ``docs/``.

Run alone: ``.venv/bin/python benchmarks/bench_sim.py [--quick]``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pragma: no cover - direct execution
    sys.path.insert(0, str(ROOT))

from benchmarks.common import md_table  # noqa: E402
from fulcrum.sim import scenarios  # noqa: E402
from fulcrum.sim import workload as W  # noqa: E402
from fulcrum.sim.cluster import Cluster  # noqa: E402
from fulcrum.sim.engine import SimResult, simulate  # noqa: E402
from fulcrum.sim.policies import get_policy_set  # noqa: E402
from fulcrum.sim.report import format_markdown, plot_runs, summarize  # noqa: E402

LOAD = 0.9
SEED = 0
POLICIES = ("default", "round_robin", "random", "least_requests", "power_of_two", "ideal")
QUICK_POLICIES = ("default", "round_robin", "ideal")
LOSS_KEYS = ("prefill_idle_rank", "prefill_drained_rank", "prefill_short_rank", "prefill_moe",
             "decode_imbalance", "decode_moe")
QUICK_CASES = ("mooncake", "azure-code", "synthetic")
PLOTTED = ("mooncake", "synthetic")
DOCS = ROOT / "docs"


@dataclass(frozen=True)
class Case:
    """One workload of the headline: how to load it, full and quick."""

    name: str
    label: str
    duration_s: float | None
    quick_duration_s: float


CASES = (
    Case("mooncake", "Mooncake (FAST'25 synthetic trace)", None, 200.0),
    Case("azure-code", "Azure LLM 2023, code", None, 600.0),
    Case("azure-conv", "Azure LLM 2023, conversation", None, 600.0),
    Case("servegen", "ServeGen mm-image (sampled, 35 clients)", 1_200.0, 150.0),
    Case("synthetic", "Synthetic agents >256K + screenshots + surge", 600.0, 100.0),
)


def _run_case(case: Case, quick: bool) -> tuple[dict[str, Any], list[SimResult]]:
    dur = case.quick_duration_s if quick else case.duration_s
    reqs = scenarios.load_workload(case.name, seed=SEED, duration_s=dur)
    base = Cluster()
    reqs, scale = scenarios.scale_to_load(reqs, base, LOAD)
    cluster = scenarios.size_vision(reqs, scenarios.size_decode(reqs, base))
    results: list[SimResult] = []
    t0 = time.perf_counter()
    for name in QUICK_POLICIES if quick else POLICIES:
        results.append(simulate(cluster, get_policy_set(name), reqs, seed=SEED))
    meta = {
        "case": case,
        "requests": len(reqs),
        "scale": scale,
        "span_s": W.duration_ns(reqs) / 1e9,
        "gpus": (cluster.prefill.n_ranks, cluster.decode.n_gpus, cluster.vision.n_gpus),
        "wall_s": time.perf_counter() - t0,
        "summaries": [summarize(r) for r in results],
    }
    return meta, results


def _shortest(summary: dict[str, Any]) -> tuple[str, float | None]:
    tiers = summary["ttft"]
    if not tiers:
        return "-", None
    label = next(iter(tiers))
    return label, tiers[label]["ttft_p99_s"]


def _cell(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _eplb_table(quick: bool) -> str:
    dur = 120.0 if quick else None
    reqs = scenarios.load_workload("mooncake", seed=SEED, duration_s=dur)
    base = Cluster()
    reqs, _ = scenarios.scale_to_load(reqs, base, LOAD)
    cluster = scenarios.size_decode(reqs, base)
    rows = []
    for name in ("default", "eplb_reference", "eplb_static"):
        ps = get_policy_set(name)
        s = summarize(simulate(cluster, ps, reqs, seed=SEED))
        rows.append([ps.eplb, _cell(s["prefill_moe_lb"]), _cell(s["decode_moe_lb"]),
                     _cell(s["prefill_fraction"]), _cell(s["fraction"]),
                     str(s["eplb_rebalances"])])
    return md_table(
        ["EPLB", "prefill moe_lb", "decode moe_lb", "prefill fraction", "throughput fraction",
         "rebalances"],
        rows,
    )


#: An ablation: tight caps below the cost of long fresh prompts (the first daemon default).
TIGHT_CAPS_S = (4.0, 8.0, 16.0, 64.0)


def _caps_table(quick: bool) -> str:
    """Default policies with the default per-tier batch caps vs tight ones (ablation)."""
    rows = []
    for name in ("mooncake", "synthetic"):
        case = next(c for c in CASES if c.name == name)
        dur = case.quick_duration_s if quick else case.duration_s
        reqs = scenarios.load_workload(name, seed=SEED, duration_s=dur)
        base = Cluster()
        reqs, _ = scenarios.scale_to_load(reqs, base, LOAD)
        sized = scenarios.size_vision(reqs, scenarios.size_decode(reqs, base))
        tight = sized.with_overrides(prefill={"batch_cap_s": TIGHT_CAPS_S})
        cells = []
        for cl in (sized, tight):
            s = summarize(simulate(cl, get_policy_set("default"), reqs, seed=SEED))
            _, p99 = _shortest(s)
            cells.append((s["prefill_fraction"], s["prefill_capacity_fraction"], p99))
        caps_sim = "/".join(f"{c:g}" for c in base.prefill.batch_cap_s)
        caps_d = "/".join(f"{c:g}" for c in TIGHT_CAPS_S)
        for label, (pf, cf, p99) in zip((caps_sim, caps_d), cells, strict=True):
            rows.append([name, label, _cell(pf), _cell(cf), _cell(p99, 2)])
    return md_table(["trace", "tier batch caps (s)", "prefill / ideal", "capacity fraction",
                     "TTFT p99 <16K (s)"], rows)


def run(quick: bool) -> str:
    """The markdown section (see module docstring)."""
    t_start = time.perf_counter()
    cases = [_run_case(c, quick) for c in CASES if not quick or c.name in QUICK_CASES]
    names = list(QUICK_POLICIES if quick else POLICIES)
    baselines = [n for n in names if n not in ("default", "ideal")]

    def metric_table(key: str, digits: int = 3) -> str:
        rows = []
        for meta, _ in cases:
            by = {s["policy"]: s for s in meta["summaries"]}
            rows.append([meta["case"].name] + [_cell(by[n][key], digits) for n in names])
        return md_table(["trace", *names], rows)

    head_rows = []
    for meta, _ in cases:
        by = {s["policy"]: s for s in meta["summaries"]}
        d = by["default"]
        best = max(baselines, key=lambda n: by[n]["fraction"])
        tier, p99 = _shortest(d)
        base_p99 = [_shortest(by[n])[1] for n in baselines]
        finite = [x for x in base_p99 if x is not None]
        p, dgp, ve = meta["gpus"]
        head_rows.append([
            meta["case"].name,
            f"{meta['requests']:,}",
            f"x{meta['scale']:.3g} ({meta['span_s']:.0f} s)",
            f"{p}/{dgp}/{ve}",
            _cell(d["fraction"]),
            f"{by[best]['fraction']:.3f} ({best})",
            _cell(d["prefill_fraction"]),
            _cell(max(by[n]["prefill_fraction"] for n in baselines)),
            tier,
            _cell(p99, 2),
            _cell(min(finite) if finite else None, 2),
        ])
    headline = md_table(
        ["trace", "requests", "rate (span)", "GPUs P/D/VE", "default: throughput / ideal",
         "best baseline", "default: prefill / ideal", "best baseline prefill",
         "shortest tier", "default TTFT p99 (s)", "best baseline TTFT p99 (s)"],
        head_rows,
    )
    plots: list[str] = []
    for meta, results in cases:
        if meta["case"].name in PLOTTED and not quick:
            shown = [r for r in results if r.policy != "ideal"]
            for path in plot_runs(shown, DOCS, prefix=f"sim_{meta['case'].name}_"):
                plots.append(str(path.relative_to(ROOT)))
    loss_rows = []
    for meta, _ in cases:
        d = next(s for s in meta["summaries"] if s["policy"] == "default")
        lo = d["loss"]
        loss_rows.append([meta["case"].name, _cell(d["fraction"])] + [
            _cell(lo[k]) for k in LOSS_KEYS
        ] + [_cell(sum(lo.values()))])
    losses = md_table(
        ["trace", "throughput / ideal", "prefill: idle rank", "prefill: drained rank",
         "prefill: rank short of work left", "prefill: MoE stretch", "decode: GPU imbalance",
         "decode: MoE stretch", "total loss"],
        loss_rows,
    )
    moon = next(m for m, _ in cases if m["case"].name == "mooncake")
    skipped = "(skipped in quick mode)"
    eplb = skipped if quick else _eplb_table(quick)
    caps = skipped if quick else _caps_table(quick)
    wall = time.perf_counter() - t_start
    cmd = ".venv/bin/python benchmarks/bench_sim.py" + (" --quick" if quick else "")
    detail = "\n\n".join(
        f"**{m['case'].label}** ({m['requests']:,} requests, rate x{m['scale']:.3g}, "
        f"{m['wall_s']:.0f} s wall)\n\n{format_markdown(m['summaries'])}"
        for m, _ in cases
        if not quick or m["case"].name == "mooncake"
    )
    del moon
    out = [
        "### Simulator: throughput as a fraction of ideal",
        "",
        f"Command: `{cmd}` (or `fulcrum simulate --trace NAME --load {LOAD} --size-fleets`)."
        f" Seed {SEED}; {wall:.0f} s wall." + (" Quick mode: short windows, fewer policies."
                                                 if quick else ""),
        "",
        f"Every workload is replayed at an offered prefill load of **{LOAD}** (predicted "
        "prefill compute / prefill capacity over the arrival span, prefix cache applied) "
        "on the default cluster (8 prefill engines of EP4DP4 = 32 GPUs, decode EP16 "
        "instances and VE machines sized to the workload; `fulcrum simulate "
        "--print-cluster`). *Throughput / ideal* = sum over every prefill and decode step "
        "of its perfectly balanced time (total work / ranks, moe_lb = 1) / its simulated "
        "time, GPU-weighted over both stages; *prefill / ideal* is the same for prefill "
        "alone. The ideal column is 1.0 by definition; its run (default decisions, every "
        "step at its balanced time) gives the TTFT floor. *Capacity fraction* counts idle "
        "engines too: balanced prefill work done while requests arrive / (prefill GPUs x "
        "time); at this load it approaches 0.9 when the fleet keeps up.",
        "",
        "The Azure traces stay below 16K tokens and no trace reaches 256K; the synthetic "
        "workload adds agent sessions growing past 256K (high prefix-cache hit ratio), "
        "1280x800 screenshots and a surge of >=256K requests. Sources: Mooncake "
        "(Apache-2.0), Azure LLM inference traces 2023 (CC-BY-4.0), ServeGen "
        "(Apache-2.0); see `../shared/traces/README.md`.",
        "",
        headline,
        "",
        "Throughput / ideal (both stages), per policy:",
        "",
        metric_table("fraction"),
        "",
        "Prefill / ideal, per policy:",
        "",
        metric_table("prefill_fraction"),
        "",
        "Prefill capacity fraction (idle engines count as lost), per policy:",
        "",
        metric_table("prefill_capacity_fraction"),
        "",
        "Where the default policies lose against ideal: the gap (1 - throughput / ideal) "
        "split by cause, each a share of the run's GPU time. A prefill GPU waits for its "
        "group's slowest rank with no request at all in the step (*idle rank*: the "
        "engine holds fewer requests than ranks, e.g. one 256K-token prompt on one of "
        "four ranks), after all of its requests ended (*drained rank*), or although "
        "work was left (chunk cap, budget rounding); the MoE phase stretches by moe_lb; "
        "a decode GPU waits for the slowest of its instance:",
        "",
        losses,
        "",
        "EPLB on Mooncake (same routing, default policies): the core's default "
        "(migration-aware `stable`), the published `reference`, and a static map. No "
        "periodic rebalance falls inside these runs (prefill every 1,000 steps of about "
        "1 s, decode every 10,000 steps): each group runs on its warm-start map (computed "
        "from the popularity at time 0) while popularity drifts; moe_lb is token-weighted "
        "over steps, and decode steps of a few tokens are noisy:",
        "",
        eplb,
        "",
        "Per-tier batch caps (default policies): the defaults (daemon and simulator alike) "
        "lie above the cost of each tier's largest fresh request; with tight caps "
        "(4/8/16/64 s, an ablation) a request above the cap (any fresh prompt of about "
        "150K tokens or more) waits for a fully idle engine and runs alone on one of its "
        "four ranks:",
        "",
        caps,
        "",
        "Reading the tables: the default policies win most where prompts are long and "
        "mixed (Mooncake, the synthetic agents): time-budget chunks keep the ranks of a "
        "group level where fixed-size chunks let one long-context rank hold the others "
        "back, and each rank proposing the time of its own work as its step budget (the "
        "MIN applies across the group) ends a step when its lightest busy rank is done "
        "instead of leaving that rank drained for the rest of a full budget. On the "
        "short-prompt Azure and ServeGen traces every policy is close. "
        "The largest remaining loss is idle ranks: an engine running fewer requests "
        "than it has ranks, at moments when no tier has queued work to give it (the "
        "engine with the most remaining quota takes each arrival, so a lightly loaded "
        "tier spreads one request per engine; packing them instead raises this figure "
        "but multiplies short-request TTFT). The synthetic workload stays far from ideal "
        "for every policy: a fresh 256K-400K-token prompt runs on one DP rank for "
        "80-180 s, much of it after the last arrival, and no rank assignment can spread "
        "one request over the group.",
        "",
        "<details><summary>Full side-by-side tables</summary>",
        "",
        detail,
        "",
        "</details>",
    ]
    if plots:
        out += ["", "Plots: " + ", ".join(f"`{p}`" for p in plots)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(run("--quick" in sys.argv[1:]))
