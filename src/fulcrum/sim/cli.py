"""``fulcrum simulate``: replay a workload through the core policies, side by side.

Examples::

    fulcrum simulate --trace mooncake --load 0.9
    fulcrum simulate --trace azure-conv --duration 600 --rate-scale 8 --json
    fulcrum simulate --trace synthetic --policies default,round_robin --out sim-out
    fulcrum simulate --print-cluster > cluster.yaml   # edit, then --cluster cluster.yaml

The summary table goes to stdout (or JSON with ``--json``); plots (PNG) go to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fulcrum.sim import scenarios
from fulcrum.sim import workload as W
from fulcrum.sim.cluster import dump_cluster, load_cluster
from fulcrum.sim.engine import SimResult, simulate
from fulcrum.sim.policies import get_policy_set, policy_sets
from fulcrum.sim.report import format_table, plot_runs, summarize, to_json

DEFAULT_POLICIES = "default,round_robin,random,least_requests,power_of_two,ideal"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fulcrum simulate``."""
    p = argparse.ArgumentParser(
        prog="fulcrum simulate",
        description="Trace-replay simulator: every policy against the ideal.",
    )
    p.add_argument("--trace", default="mooncake",
                   help=f"workload: {', '.join(scenarios.TRACES)}, or a .jsonl/.csv path")
    p.add_argument("--cluster", type=Path, help="cluster YAML (see --print-cluster)")
    p.add_argument("--print-cluster", action="store_true",
                   help="print the cluster in force as YAML and exit")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated policy sets (known: {', '.join(policy_sets())})")
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
    p.add_argument("--size-fleets", action="store_true",
                   help="size decode and VE fleets to the workload (about 48 requests/GPU)")
    p.add_argument("--drain", type=float, default=1800.0,
                   help="virtual seconds allowed after the last arrival")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", type=Path, help="folder for PNG plots (and summary.json)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main(argv: list[str]) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
        if args.cache_blocks is not None:
            cluster = cluster.with_overrides(cache={"capacity_blocks": args.cache_blocks})
        if args.print_cluster:
            sys.stdout.write(dump_cluster(cluster))
            return 0
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        sets = [get_policy_set(n) for n in names]
        reqs = scenarios.load_workload(
            args.trace, seed=args.seed, duration_s=args.duration, start_s=args.start,
            limit=args.limit,
        )
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
        if args.size_fleets:
            cluster = scenarios.size_vision(reqs, scenarios.size_decode(reqs, cluster), )
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"fulcrum simulate: {exc}\n")
        return 2
    if not reqs:
        sys.stderr.write("fulcrum simulate: the workload holds no request\n")
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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
