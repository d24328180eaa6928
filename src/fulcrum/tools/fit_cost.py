"""``fulcrum fit-cost SAMPLES.csv``: fit the prefill cost model from measured step times.

The CSV has a header ``q,c,ns`` (tokens computed, prefix tokens, measured step time in
ns; extra columns are ignored) and one sample per row. The output is a YAML snippet for
the configuration section ``prefill.cost_model`` plus the fit quality as comments::

    prefill:
      cost_model:
        a: 2.0
        b: 56000.0
        k: 5000000.0
    # fit: n=1000 r2=0.9987 rel_err p50=1.2% p90=3.4% p99=6.1% mean=1.6%

Exit status: 0 on success, 2 on unreadable or invalid input (message on stderr).
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from fulcrum.core.cost import FitResult, fit


def read_samples(stream: TextIO) -> tuple[list[int], list[int], list[float]]:
    """Parse ``q,c,ns`` rows from a CSV stream with a header; ValueError naming the row."""
    reader = csv.DictReader(stream)
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [col for col in ("q", "c", "ns") if col not in header]
    if missing:
        raise ValueError(f"header: missing column(s) {', '.join(missing)} (need q,c,ns)")
    reader.fieldnames = header
    q: list[int] = []
    c: list[int] = []
    ns: list[float] = []
    for line, row in enumerate(reader, start=2):
        try:
            q.append(int(float(row["q"])))
            c.append(int(float(row["c"])))
            ns.append(float(row["ns"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"line {line}: {exc}") from None
    return q, c, ns


def _num(x: float) -> str:
    """Six significant digits, written without an exponent for ordinary magnitudes."""
    return repr(float(f"{x:.6g}"))


def format_yaml(result: FitResult) -> str:
    """The coefficients as a ``prefill.cost_model`` YAML snippet, quality as a comment."""
    m, f = result.model, result.quality
    return (
        "prefill:\n"
        "  cost_model:\n"
        f"    a: {_num(m.a)}  # ns per token^2 (attention)\n"
        f"    b: {_num(m.b)}  # ns per token (linear + MoE)\n"
        f"    k: {_num(m.k)}  # ns per step (fixed overhead)\n"
        f"# fit: n={f.n} r2={f.r2:.4f} rel_err p50={f.rel_err_p50:.1%} "
        f"p90={f.rel_err_p90:.1%} p99={f.rel_err_p99:.1%} mean={f.rel_err_mean:.1%}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``fit-cost SAMPLES.csv`` (``-`` reads stdin). Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="fulcrum fit-cost",
        description="Fit cost(q, c) = a*q*(c + q/2) + b*q + k (ns) from q,c,ns samples.",
    )
    parser.add_argument("samples", help="CSV file with header q,c,ns ('-' for stdin)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.samples == "-":
            q, c, ns = read_samples(sys.stdin)
        else:
            with open(args.samples, newline="", encoding="utf-8") as fh:
                q, c, ns = read_samples(fh)
        result = fit(np.asarray(q), np.asarray(c), np.asarray(ns))
    except (OSError, ValueError) as exc:
        print(f"fit-cost: {args.samples}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(format_yaml(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
