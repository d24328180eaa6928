"""``fulcrum simulate``: replay a workload through the core policies, side by side.

Short help: ``fulcrum simulate --help``; the full guide (every trace, where it comes from
and its licence, the goodput search, the cluster file) is docs/simulator.md.

``--trace`` takes a built-in workload name or a trace file / ServeGen directory in any
format of :mod:`fulcrum.sim.traces` (told by content, not extension); with no
``--trace`` the built-in synthetic workload runs (nothing to download). The summary table
goes to stdout (or JSON with ``--json``); plots (PNG) go to ``--out``. ``--goodput``
replaces the single run per policy by a goodput search (:mod:`fulcrum.sim.goodput`),
policies in parallel over ``--jobs`` processes, with a progress bar on a terminal.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
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
from fulcrum.sim.progress import SearchProgress
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


EXAMPLES = """\
examples:
  fulcrum simulate                                  # built-in synthetic workload
  fulcrum simulate --trace my_trace.jsonl --load 0.9
  fulcrum simulate --trace synthetic --policies default,round_robin --out sim-out
  fulcrum simulate --print-cluster > cluster.yaml   # edit, then --cluster cluster.yaml
  fulcrum simulate --trace my_trace.csv --limit 4000 --goodput --json

Traces: a file or ServeGen directory (Mooncake or minimal JSONL, Azure LLM inference CSV,
BurstGPT CSV, ServeGen), told by content; or a built-in name: mooncake, azure-code,
azure-conv and servegen are read from $FULCRUM_TRACES, or else <repo>/../shared/traces
(here: {here}).
Where each trace comes from, its licence, and every option: docs/simulator.md.
"""


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default="synthetic", metavar="NAME|PATH",
                   help=f"workload: {', '.join(scenarios.TRACES)} or a trace path "
                        "(default synthetic)")
    p.add_argument("--cluster", metavar="FILE", type=Path,
                   help="cluster YAML (see --print-cluster)")
    p.add_argument("--print-cluster", action="store_true",
                   help="print the cluster in force as YAML and exit")
    p.add_argument("--policies", default=None, metavar="A,B",
                   help=f"policy sets to compare ({len(policy_sets())} known; see "
                        "docs/simulator.md)")
    p.add_argument("--seed", metavar="N", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--start", metavar="S", type=float, default=0.0, help="trace window start, s")
    p.add_argument("--duration", metavar="S", type=float,
                   help="trace window length, s (before scaling)")
    p.add_argument("--limit", metavar="N", type=int, help="at most this many requests")
    p.add_argument("--rate-scale", metavar="X", type=float, help="arrival rate multiplier")
    p.add_argument("--load", metavar="RHO", type=float,
                   help="offered prefill load (sets the rate scale)")
    p.add_argument("--length-scale", metavar="X", type=float, default=1.0,
                   help="input length multiplier")
    p.add_argument("--tenant-mix", metavar="T:NAME:RHO,...",
                   help="mix traces as tenants, each TRACE:TENANT:LOAD[:PRIORITY[:SLO_MS]] "
                        "(replaces --trace; see docs/tenants.md)")
    p.add_argument("--mix-synthetic", action="store_true",
                   help="merge synthetic agent sessions and a surge into the trace")
    p.add_argument("--cache-blocks", metavar="N", type=int,
                   help="prefix cache, 512-token blocks (0: off)")
    p.add_argument("--cache-mode", choices=("global", "per_engine"), help="prefix cache model")
    p.add_argument("--size-fleets", action="store_true",
                   help="size decode and VE fleets to the workload")
    p.add_argument("--drain", metavar="S", type=float, default=1800.0,
                   help="virtual seconds allowed after the last arrival")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", metavar="DIR", type=Path,
                   help="folder for PNG plots and the JSON summary")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _add_goodput_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("goodput (highest arrival rate meeting every SLO)")
    g.add_argument("--goodput", action="store_true", help="search each policy's goodput")
    g.add_argument("--fixed-load", metavar="RHO", type=float, default=0.5,
                   help="offered load of the like-for-like latency run (default 0.5)")
    g.add_argument("--goodput-min-load", metavar="RHO", type=float, default=G.DEFAULT_MIN_LOAD,
                   help=f"lowest offered load searched (default {G.DEFAULT_MIN_LOAD})")
    g.add_argument("--goodput-max-load", metavar="RHO", type=float, default=G.DEFAULT_MAX_LOAD,
                   help=f"highest offered load searched (default {G.DEFAULT_MAX_LOAD})")
    g.add_argument("--slo-ttft", type=_floats, metavar="S,S,...",
                   help="TTFT p99 SLO per prefill tier, s (default: 2.5x unloaded)")
    g.add_argument("--slo-tpot", metavar="S", type=float, default=G.DEFAULT_TPOT_SLO_S,
                   help=f"TPOT p99 SLO, s per token (default {G.DEFAULT_TPOT_SLO_S})")
    g.add_argument("--goodput-runs", metavar="N", type=int, default=G.DEFAULT_MAX_RUNS,
                   help=f"runs per policy at most (default {G.DEFAULT_MAX_RUNS})")
    g.add_argument("--goodput-tol", metavar="X", type=float, default=G.DEFAULT_REL_TOL,
                   help=f"bisection tolerance (default {G.DEFAULT_REL_TOL})")
    g.add_argument("--jobs", metavar="N", type=int, default=2, help="worker processes (default 2)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fulcrum simulate`` (short help; docs/simulator.md)."""
    p = argparse.ArgumentParser(
        prog="fulcrum simulate",
        usage="fulcrum simulate [--trace NAME|PATH] [--goodput] [options]",
        description="Trace-replay simulator: every policy against the ideal.",
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
            prog, max_help_position=30, width=100),
        epilog=EXAMPLES.format(here=W.traces_dir()),
    )
    _add_workload_args(p)
    _add_goodput_args(p)
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
    progress: Any = None
    """A :class:`fulcrum.sim.progress.SearchProgress` queue, or None (no progress)."""


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
    on_probe = None
    if job.progress is not None:
        q = job.progress

        def on_probe(k: int, scale: float, passed: bool) -> None:
            SearchProgress.report(q, job.policy, k, scale * job.base_rps, passed)

    res = G.search(evaluate, job.slo, base_rps=job.base_rps, start=job.fixed_scale,
                   min_scale=min(job.min_scale, job.fixed_scale),
                   max_scale=max(job.max_scale, job.fixed_scale),
                   max_runs=job.max_runs, rel_tol=job.rel_tol, on_probe=on_probe)
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
    """Every job, over ``workers`` processes; a progress bar when stderr is a terminal."""
    parallel = workers > 1 and len(jobs) > 1
    bar = None
    if not quiet and jobs and sys.stderr.isatty():
        bar = SearchProgress(len(jobs), jobs[0].max_runs, sys.stderr, processes=parallel)
        jobs = [replace(j, progress=bar.queue) for j in jobs]

    def note(e: dict[str, Any]) -> dict[str, Any]:
        line = (f"  {e['policy']}: goodput {e['goodput_rps']:.3g} req/s "
                f"({len(e['search']['runs'])} runs incl. the fixed load, {e['wall_s']:.0f} s "
                f"wall, {e['cpu_s']:.0f} s CPU)\n")
        if bar is not None:
            bar.done(e["policy"], len(e["search"]["runs"]))
            bar.write(line)
        elif not quiet:
            sys.stderr.write(line)
        return e

    try:
        if not parallel:
            return [note(run_goodput(j)) for j in jobs]
        # spawn, not fork: a process with threads (a test runner, an embedding service)
        # can fork a child holding a lock no thread will release (seen: a worker spinning
        # in a copied thread's join, CI, 2026-12-06)
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(run_goodput, j) for j in jobs]
            return [note(f.result()) for f in futures]
    finally:
        if bar is not None:
            bar.close()


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


def _check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a combination ``fulcrum simulate`` refuses."""
    if args.load is not None and args.rate_scale is not None:
        raise ValueError("--load and --rate-scale: give one, not both")
    if args.jobs < 1:
        raise ValueError(f"--jobs: must be >= 1, got {args.jobs}")
    if not args.goodput:
        return
    if args.load is not None or args.rate_scale is not None:
        raise ValueError("--goodput: the search sets the rate; drop --load / --rate-scale "
                         "(--fixed-load sets the like-for-like run)")
    if not 0 < args.goodput_min_load <= args.fixed_load:
        raise ValueError("--goodput-min-load: must be in (0, --fixed-load]")
    if not args.goodput_max_load >= args.fixed_load:
        raise ValueError("--goodput-max-load: must be >= --fixed-load")


def _cluster(args: argparse.Namespace) -> Cluster:
    cluster = load_cluster(args.cluster)
    if args.cache_blocks is not None:
        cluster = cluster.with_overrides(cache={"capacity_blocks": args.cache_blocks})
    if args.cache_mode is not None:
        cluster = cluster.with_overrides(prefill={"cache_model": args.cache_mode})
    return cluster


def _workload(args: argparse.Namespace, cluster: Cluster) -> tuple[list[W.Request], float]:
    """The requests to run (windowed, mixed, scaled) and the rate scale applied."""
    if args.tenant_mix:
        from fulcrum.sim.tenant_mix import parse_mix

        return parse_mix(args.tenant_mix, cluster, args.seed, args.duration), 1.0
    reqs = load_trace(args)
    if args.mix_synthetic:
        from fulcrum.sim.synthetic import SyntheticSpec, generate

        span = max(1.0, W.duration_ns(reqs) / 1e9)
        reqs = W.merge(reqs, generate(SyntheticSpec(duration_s=span),
                                      np.random.default_rng(args.seed + 1)))
    if args.length_scale != 1.0:
        reqs = W.scale_length(reqs, args.length_scale)
    scale = 1.0
    if args.load is not None:
        reqs, scale = scenarios.scale_to_load(reqs, cluster, args.load)
    elif args.rate_scale is not None:
        scale = args.rate_scale
        reqs = W.scale_rate(reqs, scale)
    return reqs, scale


def _run_plain(args: argparse.Namespace, cluster: Cluster, names: list[str],
               reqs: list[W.Request], scale: float) -> int:
    """One run per policy set; prints the table (or JSON) and writes ``--out``."""
    if args.size_fleets:
        cluster = scenarios.size_vision(reqs, scenarios.size_decode(reqs, cluster))
    rho = scenarios.offered_load(reqs, cluster)
    meta = {
        "trace": args.trace, "requests": len(reqs), "rate_scale": scale,
        "length_scale": args.length_scale, "offered_prefill_load": rho, "seed": args.seed,
        "prefill_gpus": cluster.prefill.n_ranks, "decode_gpus": cluster.decode.n_gpus,
        "ve_gpus": cluster.vision.n_gpus,
    }
    if not args.quiet:
        sys.stderr.write(
            f"{args.trace}: {len(reqs)} requests, rate x{scale:.3g}, offered prefill load "
            f"{rho:.2f}, {cluster.prefill.n_ranks} prefill / {cluster.decode.n_gpus} decode /"
            f" {cluster.vision.n_gpus} VE GPUs\n"
        )
    results: list[SimResult] = []
    for ps in (get_policy_set(n) for n in names):
        t0 = time.perf_counter()
        results.append(
            simulate(cluster, ps, reqs, seed=args.seed, drain_s=args.drain,
                     progress=not args.quiet)
        )
        if not args.quiet:
            sys.stderr.write(f"  {ps.name}: {time.perf_counter() - t0:.1f} s wall\n")
    summaries = [summarize(r) for r in results]
    out = to_json(summaries, meta) if args.json else format_table(summaries)
    sys.stdout.write(out + "\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(to_json(summaries, meta) + "\n")
        for path in plot_runs(results, args.out):
            if not args.quiet:
                sys.stderr.write(f"wrote {path}\n")
    return 0


def main(argv: list[str]) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        cluster = _cluster(args)
        if args.print_cluster:
            sys.stdout.write(dump_cluster(cluster))
            return 0
        if args.policies is None:
            args.policies = GOODPUT_POLICIES if args.goodput else DEFAULT_POLICIES
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        for n in names:
            get_policy_set(n)
        _check_args(args)
        reqs, scale = _workload(args, cluster)
        if not reqs:
            raise ValueError("the workload holds no request")
        if not args.goodput:
            return _run_plain(args, cluster, names, reqs, scale)
        meta = {"trace": args.trace, "requests": len(reqs), "length_scale": args.length_scale,
                "seed": args.seed, "prefill_gpus": cluster.prefill.n_ranks,
                "policies": names, "jobs": args.jobs}
        return main_goodput(args, cluster, names, reqs, meta)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"fulcrum simulate: {_one_line(exc)}\n")
        return 2


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
