"""``fulcrum simulate``: replay a workload through the core policies, side by side.

Examples::

    fulcrum simulate --trace mooncake --load 0.9
    fulcrum simulate --trace azure-conv --duration 600 --rate-scale 8 --json
    fulcrum simulate --trace synthetic --policies default,round_robin --out sim-out
    fulcrum simulate --print-cluster > cluster.yaml   # edit, then --cluster cluster.yaml
    fulcrum simulate --trace my_trace.csv --limit 4000 --goodput --json

``--trace`` takes a built-in workload name or a trace file / ServeGen directory in any
format of :mod:`fulcrum.sim.traces` (told by content, not extension). The summary table
goes to stdout (or JSON with ``--json``); plots (PNG) go to ``--out``.

``--goodput`` replaces the single run per policy by a goodput search
(:mod:`fulcrum.sim.goodput`): per policy, the highest arrival rate meeting every TTFT
(per tier) and TPOT SLO, with utilisation and per-tier TTFT at that rate, plus one run at
a fixed offered prefill load (``--fixed-load``, default 0.5) for a like-for-like latency
comparison below saturation. Policies run in parallel over ``--jobs`` processes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fulcrum.core.cost import CostModel
from fulcrum.sim import goodput as G
from fulcrum.sim import scenarios
from fulcrum.sim import traces as T
from fulcrum.sim import workload as W
from fulcrum.sim.cluster import Cluster, dump_cluster, load_cluster
from fulcrum.sim.engine import SimResult, simulate
from fulcrum.sim.policies import get_policy_set, policy_sets
from fulcrum.sim.report import format_table, plot_runs, summarize, to_json

DEFAULT_POLICIES = "default,least_work,round_robin,random,least_requests,power_of_two,ideal"
GOODPUT_POLICIES = "default,least_work,round_robin,random,least_requests,power_of_two"
"""``--goodput`` default: the deployable policies (``ideal`` is a balance bound, not a
policy a deployment can run; name it in ``--policies`` to search it too)."""


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fulcrum simulate``."""
    p = argparse.ArgumentParser(
        prog="fulcrum simulate",
        description="Trace-replay simulator: every policy against the ideal.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Built-in traces (mooncake, azure-code, azure-conv, servegen) are read from\n"
            "$FULCRUM_TRACES, or else <repo>/../shared/traces\n"
            f"(here: {W.traces_dir()}).\n\n"
            "Trace files are recognised by content: Mooncake JSONL or the minimal JSONL\n"
            "(one object a line: timestamp in ms, input_length, output_length in tokens,\n"
            "optional hash_ids of 512-token prefix blocks), Azure LLM inference CSV\n"
            "(2023/2024: TIMESTAMP, ContextTokens, GeneratedTokens), BurstGPT CSV\n"
            "(Timestamp in s, Request tokens, Response tokens), ServeGen client data\n"
            "(a directory of chunk-N-trace.csv + chunk-N-dataset.json, or one of them;\n"
            "language, reasoning or multimodal). See fulcrum.sim.traces."
        ),
    )
    p.add_argument("--trace", default="mooncake",
                   help=f"workload: {', '.join(scenarios.TRACES)}, or a trace file or ServeGen "
                        "directory in any supported format (see below)")
    p.add_argument("--cluster", type=Path, help="cluster YAML (see --print-cluster)")
    p.add_argument("--print-cluster", action="store_true",
                   help="print the cluster in force as YAML and exit")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated policy sets (known: {', '.join(policy_sets())}; "
                        f"default {DEFAULT_POLICIES}; with --goodput {GOODPUT_POLICIES})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=float, default=0.0, help="trace window start (s)")
    p.add_argument("--duration", type=float, help="trace window length (s, before scaling)")
    p.add_argument("--limit", type=int, help="at most this many requests")
    p.add_argument("--rate-scale", type=float, help="arrival rate multiplier")
    p.add_argument("--load", type=float,
                   help="offered prefill load rho (sets the rate scale; see scenarios)")
    p.add_argument("--length-scale", type=float, default=1.0, help="input length multiplier")
    p.add_argument("--mix-synthetic", action="store_true",
                   help="merge synthetic agent sessions / surge into the trace")
    p.add_argument("--cache-blocks", type=int,
                   help="prefix-cache capacity in 512-token blocks (0 disables)")
    p.add_argument("--cache-mode", choices=("global", "per_engine"),
                   help="prefix-cache model: one global pool, or one cache per prefill "
                   "engine of --cache-blocks / engines blocks (prefix-aware baselines: "
                   "prefix_load, cache_aware)")
    p.add_argument("--size-fleets", action="store_true",
                   help="size decode and VE fleets to the workload (about 48 requests/GPU)")
    p.add_argument("--drain", type=float, default=1800.0,
                   help="virtual seconds allowed after the last arrival")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", type=Path, help="folder for PNG plots (and summary.json)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    g = p.add_argument_group("goodput (see fulcrum.sim.goodput)")
    g.add_argument("--goodput", action="store_true",
                   help="search each policy's goodput: highest arrival rate meeting every SLO")
    g.add_argument("--fixed-load", type=float, default=0.5,
                   help="offered prefill load of the like-for-like latency run (default 0.5; "
                        "keep it below every policy's saturation)")
    g.add_argument("--goodput-min-load", type=float, default=G.DEFAULT_MIN_LOAD,
                   help=f"lowest offered prefill load searched (default {G.DEFAULT_MIN_LOAD}); "
                        "a policy failing "
                        "there reports goodput 0 and the rate it failed at")
    g.add_argument("--goodput-max-load", type=float, default=G.DEFAULT_MAX_LOAD,
                   help=f"highest offered prefill load searched (default {G.DEFAULT_MAX_LOAD}, "
                        "the fleet's compute: a faster rate is a burst no fleet sustains); "
                        "a policy passing there reports goodput_capped")
    g.add_argument("--slo-ttft", type=_floats, metavar="S,S,...",
                   help="TTFT p99 SLO per prefill tier, shortest tier first (s; default "
                        "2.5x the unloaded prefill time of the tier's longest prompt)")
    g.add_argument("--slo-tpot", type=float, default=G.DEFAULT_TPOT_SLO_S,
                   help=f"TPOT p99 SLO (s per output token; default {G.DEFAULT_TPOT_SLO_S})")
    g.add_argument("--goodput-runs", type=int, default=G.DEFAULT_MAX_RUNS,
                   help="at most this many runs per policy, the fixed-load run included "
                        f"(default {G.DEFAULT_MAX_RUNS})")
    g.add_argument("--goodput-tol", type=float, default=G.DEFAULT_REL_TOL,
                   help="stop when highest pass / lowest fail rate is within 1 + this "
                        f"(default {G.DEFAULT_REL_TOL})")
    g.add_argument("--jobs", type=int, default=2,
                   help="processes running policies in parallel (default 2)")
    return p


def load_trace(args: argparse.Namespace) -> list[W.Request]:
    """The workload named by ``--trace`` (built-in name or trace path), windowed."""
    if args.trace in scenarios.TRACES:
        return scenarios.load_workload(
            args.trace, seed=args.seed, duration_s=args.duration, start_s=args.start,
            limit=args.limit,
        )
    path = Path(args.trace)
    if not path.exists():
        known = ", ".join(scenarios.TRACES)
        raise T.TraceError(path, f"no such file or directory (built-in workloads: {known})")
    kind = T.detect(path)
    if kind.startswith("servegen"):
        return T.read_trace(path, limit=args.limit, rng=np.random.default_rng(args.seed),
                            start_s=args.start, duration_s=args.duration)
    # Rows come in time order in every supported record format: with no start offset
    # reading can stop at --limit.
    head = args.limit if not args.start else None
    reqs = T.read_trace(path, limit=head)
    return W.window(reqs, start_s=args.start, duration_s=args.duration, limit=args.limit)


# -- goodput ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GoodputJob:
    """One policy's goodput search and fixed-load run (picklable, for a worker process)."""

    policy: str
    cluster: Cluster
    requests: tuple[W.Request, ...]
    seed: int
    drain_s: float
    slo: G.Slo
    base_rps: float
    base_load: float
    fixed_scale: float
    min_scale: float
    max_runs: int
    rel_tol: float
    max_scale: float = float("inf")


def _figures(summary: Mapping[str, Any] | None) -> dict[str, Any]:
    keys = ("prefill_utilisation", "decode_utilisation", "ttft_by_tier", "tpot_p50_s",
            "tpot_p99_s", "finished", "unfinished", "block_hit_ratio")
    if summary is None:
        return {k: None for k in keys}
    out = {}
    for k in keys:
        if k not in summary:
            raise G.SummaryError(f"run summary: missing key {k!r}")
        out[k] = summary[k]
    return out


def run_goodput(job: GoodputJob) -> dict[str, Any]:
    """Goodput search and fixed-load run of one policy; a JSON-ready ``runs`` entry."""
    t0, c0 = time.perf_counter(), time.process_time()
    ps = get_policy_set(job.policy)

    done: dict[float, dict[str, Any]] = {}

    def evaluate(scale: float) -> dict[str, Any]:
        if scale not in done:
            reqs = W.scale_rate(job.requests, scale)
            done[scale] = summarize(
                simulate(job.cluster, ps, reqs, seed=job.seed, drain_s=job.drain_s)
            )
        return done[scale]

    # The fixed-load run doubles as the search's first probe.
    fixed = evaluate(job.fixed_scale)
    fixed_verdict = G.check(fixed, job.slo)
    res = G.search(evaluate, job.slo, base_rps=job.base_rps, start=job.fixed_scale,
                   min_scale=min(job.min_scale, job.fixed_scale),
                   max_scale=max(job.max_scale, job.fixed_scale),
                   max_runs=job.max_runs, rel_tol=job.rel_tol)
    entry: dict[str, Any] = {
        "policy": job.policy,
        "goodput_rps": res.goodput_rps,
        "goodput_rate_scale": res.scale,
        "goodput_offered_load": None if res.scale is None else res.scale * job.base_load,
        # Goodput lies below this rate (req/s): the lowest rate run that missed an SLO.
        "fails_at_rps": None if res.lowest_failing is None else (
            res.lowest_failing * job.base_rps
        ),
        # True: the search passed at --goodput-max-load (goodput is at least that rate).
        "goodput_capped": res.capped,
    }
    entry.update(_figures(res.summary))
    entry["at_fixed_load"] = {
        "offered_load": job.fixed_scale * job.base_load,
        "rate_scale": job.fixed_scale,
        "rps": job.fixed_scale * job.base_rps,
        **_figures(fixed),
        "slo_met": fixed_verdict.passed,
        "slo_misses": list(fixed_verdict.misses),
    }
    entry["search"] = res.as_dict()
    entry["wall_s"] = time.perf_counter() - t0
    entry["cpu_s"] = time.process_time() - c0
    return entry


def _run_jobs(jobs: Sequence[GoodputJob], workers: int, quiet: bool) -> list[dict[str, Any]]:
    def note(e: dict[str, Any]) -> None:
        if not quiet:
            sys.stderr.write(
                f"  {e['policy']}: goodput {e['goodput_rps']:.3g} req/s "
                f"({len(e['search']['runs'])} runs incl. the fixed load, {e['wall_s']:.0f} s wall, "
                f"{e['cpu_s']:.0f} s CPU)\n"
            )

    if workers <= 1 or len(jobs) <= 1:
        out = []
        for j in jobs:
            out.append(run_goodput(j))
            note(out[-1])
        return out
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        futures = [pool.submit(run_goodput, j) for j in jobs]
        out = []
        for f in futures:
            out.append(f.result())
            note(out[-1])
        return out


def _slo(args: argparse.Namespace, cluster: Cluster) -> G.Slo:
    p = cluster.prefill
    if args.slo_ttft is not None:
        return G.slo_from_values(p.tier_bounds, args.slo_ttft, args.slo_tpot)
    cost = CostModel(a=p.cost_model.a, b=p.cost_model.b, k=p.cost_model.k)
    return G.default_slo(p.tier_bounds, cost, tpot_s=args.slo_tpot)


def _goodput_table(runs: Sequence[Mapping[str, Any]]) -> str:
    tiers: list[str] = []
    for r in runs:
        for t in (r["at_fixed_load"]["ttft_by_tier"] or {}):
            if t not in tiers:
                tiers.append(t)

    def f(v: Any, d: int = 3) -> str:
        return "-" if v is None else f"{v:.{d}g}" if isinstance(v, float) else str(v)

    head = ["policy", "goodput req/s", "load", "util P", "util D",
            *[f"TTFT p99 {t} @fixed (s)" for t in tiers]]
    rows = []
    for r in runs:
        fx = r["at_fixed_load"]["ttft_by_tier"] or {}
        gp = f(r["goodput_rps"]) if r["goodput_rate_scale"] is not None else (
            f"<{f(r['fails_at_rps'])}"
        )
        rows.append([r["policy"], gp, f(r["goodput_offered_load"]),
                     f(r["prefill_utilisation"]), f(r["decode_utilisation"]),
                     *[f(fx.get(t, {}).get("p99_s")) for t in tiers]])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def main_goodput(args: argparse.Namespace, cluster: Cluster, names: list[str],
                 reqs: list[W.Request], meta: dict[str, Any]) -> int:
    """``--goodput``: one search per policy; prints the ``runs`` document."""
    t0 = time.perf_counter()
    slo = _slo(args, cluster)
    base_rps = G.base_rate([r.arrival_ns for r in reqs])
    base_load = scenarios.offered_load(reqs, cluster)
    if base_load <= 0:
        raise ValueError("goodput: the workload offers no prefill work")
    fixed_scale = args.fixed_load / base_load
    if args.size_fleets:
        fixed = W.scale_rate(reqs, fixed_scale)
        cluster = scenarios.size_vision(fixed, scenarios.size_decode(fixed, cluster))
    jobs = [
        GoodputJob(
            policy=name, cluster=cluster, requests=tuple(reqs), seed=args.seed,
            drain_s=args.drain, slo=slo, base_rps=base_rps, base_load=base_load,
            fixed_scale=fixed_scale, min_scale=args.goodput_min_load / base_load,
            max_scale=args.goodput_max_load / base_load,
            max_runs=args.goodput_runs, rel_tol=args.goodput_tol,
        )
        for name in names
    ]
    runs = _run_jobs(jobs, args.jobs, args.quiet)
    missed = [r["policy"] for r in runs if not r["at_fixed_load"]["slo_met"]]
    unfinished = [r["policy"] for r in runs if r["at_fixed_load"]["unfinished"]]
    if missed and not args.quiet:
        sys.stderr.write(
            f"note: at --fixed-load {args.fixed_load} {', '.join(missed)} miss an SLO (their "
            "goodput lies below that load)\n"
        )
    if unfinished and not args.quiet:
        sys.stderr.write(
            f"warning: at --fixed-load {args.fixed_load} {', '.join(unfinished)} leave "
            "requests unfinished: the load is not below every policy's saturation\n"
        )
    meta.update({
        "slo": slo.as_dict(),
        "base_rps": base_rps,
        "base_offered_load": base_load,
        "fixed_load": args.fixed_load,
        "fixed_load_slo_missed_by": missed,
        "fixed_load_unfinished_by": unfinished,
        "decode_gpus": cluster.decode.n_gpus,
        "ve_gpus": cluster.vision.n_gpus,
        "wall_s": time.perf_counter() - t0,
    })
    doc = {"meta": meta, "runs": runs}
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(_goodput_table(runs) + "\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "goodput.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 0


def main(argv: list[str]) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
        if args.cache_blocks is not None:
            cluster = cluster.with_overrides(cache={"capacity_blocks": args.cache_blocks})
        if args.cache_mode is not None:
            cluster = cluster.with_overrides(prefill={"cache_model": args.cache_mode})
        if args.print_cluster:
            sys.stdout.write(dump_cluster(cluster))
            return 0
        if args.policies is None:
            args.policies = GOODPUT_POLICIES if args.goodput else DEFAULT_POLICIES
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        sets = [get_policy_set(n) for n in names]
        if args.goodput and (args.load is not None or args.rate_scale is not None):
            raise ValueError("--goodput: the search sets the rate; drop --load / --rate-scale "
                             "(--fixed-load sets the like-for-like run)")
        if args.goodput and not 0 < args.goodput_min_load <= args.fixed_load:
            raise ValueError("--goodput-min-load: must be in (0, --fixed-load]")
        if args.goodput and not args.goodput_max_load >= args.fixed_load:
            raise ValueError("--goodput-max-load: must be >= --fixed-load")
        if args.jobs < 1:
            raise ValueError(f"--jobs: must be >= 1, got {args.jobs}")
        reqs = load_trace(args)
        if args.mix_synthetic:
            import numpy as np

            from fulcrum.sim.synthetic import SyntheticSpec, generate

            span = max(1.0, W.duration_ns(reqs) / 1e9)
            reqs = W.merge(reqs, generate(SyntheticSpec(duration_s=span),
                                          np.random.default_rng(args.seed + 1)))
        if args.length_scale != 1.0:
            reqs = W.scale_length(reqs, args.length_scale)
        if args.load is not None and args.rate_scale is not None:
            raise ValueError("--load and --rate-scale: give one, not both")
        scale = 1.0
        if args.load is not None:
            reqs, scale = scenarios.scale_to_load(reqs, cluster, args.load)
        elif args.rate_scale is not None:
            scale = args.rate_scale
            reqs = W.scale_rate(reqs, scale)
        if args.size_fleets and not args.goodput:
            cluster = scenarios.size_vision(reqs, scenarios.size_decode(reqs, cluster), )
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"fulcrum simulate: {_one_line(exc)}\n")
        return 2
    if not reqs:
        sys.stderr.write("fulcrum simulate: the workload holds no request\n")
        return 2
    if args.goodput:
        meta = {"trace": args.trace, "requests": len(reqs), "length_scale": args.length_scale,
                "seed": args.seed, "prefill_gpus": cluster.prefill.n_ranks,
                "policies": names, "jobs": args.jobs}
        try:
            return main_goodput(args, cluster, names, reqs, meta)
        except ValueError as exc:
            sys.stderr.write(f"fulcrum simulate: {_one_line(exc)}\n")
            return 2
    rho = scenarios.offered_load(reqs, cluster)
    meta = {
        "trace": args.trace,
        "requests": len(reqs),
        "rate_scale": scale,
        "length_scale": args.length_scale,
        "offered_prefill_load": rho,
        "seed": args.seed,
        "prefill_gpus": cluster.prefill.n_ranks,
        "decode_gpus": cluster.decode.n_gpus,
        "ve_gpus": cluster.vision.n_gpus,
    }
    if not args.quiet:
        sys.stderr.write(
            f"{args.trace}: {len(reqs)} requests, rate x{scale:.3g}, offered prefill load "
            f"{rho:.2f}, {cluster.prefill.n_ranks} prefill / {cluster.decode.n_gpus} decode /"
            f" {cluster.vision.n_gpus} VE GPUs\n"
        )
    results: list[SimResult] = []
    for ps in sets:
        t0 = time.perf_counter()
        results.append(
            simulate(cluster, ps, reqs, seed=args.seed, drain_s=args.drain,
                     progress=not args.quiet)
        )
        if not args.quiet:
            sys.stderr.write(f"  {ps.name}: {time.perf_counter() - t0:.1f} s wall\n")
    summaries = [summarize(r) for r in results]
    if args.json:
        sys.stdout.write(to_json(summaries, meta) + "\n")
    else:
        sys.stdout.write(format_table(summaries) + "\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(to_json(summaries, meta) + "\n")
        for path in plot_runs(results, args.out):
            if not args.quiet:
                sys.stderr.write(f"wrote {path}\n")
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
