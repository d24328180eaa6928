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

A fit the samples cannot determine (fewer than three distinct ``(q, c)`` shapes, or
shapes so alike that the three terms cannot be told apart) is still printed, with a
warning on stderr and as a comment: its r2 may be 1.0 and still mean nothing.

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


COND_WARN: float = 1e6
"""Condition number (columns scaled to unit norm) above which the fit is called
ill-conditioned: a relative error of 1e-6 in the times moves the coefficients by ~1."""

HELP = """\
Fit the prefill cost model cost(q, c) = a*q*(c + q/2) + b*q + k (ns) to measured
prefill steps, and print it as the prefill.cost_model section of the YAML.

The CSV has a header and one measured step a row:
  q   tokens computed in the step (the prompt tokens not served from the prefix cache)
  c   prefix tokens already in the KV cache before the step (cached or earlier chunks)
  ns  the step's measured wall time, in nanoseconds
Extra columns are ignored. Vary q and c: at least three different (q, c) shapes, over
the range the engines see; the tool warns when the samples cannot determine a, b and k.

example:
  fulcrum fit-cost steps.csv >> fulcrum.yaml
"""


def diagnose(q: Sequence[int], c: Sequence[int]) -> list[str]:
    """Warnings about what the samples cannot determine (empty: a well-posed fit)."""
    qf = np.asarray(q, dtype=np.float64)
    cf = np.asarray(c, dtype=np.float64)
    x = np.column_stack([qf * (cf + qf / 2.0), qf, np.ones_like(qf)])
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    xs = x / norms
    rank = int(np.linalg.matrix_rank(xs))
    shapes = len(set(zip(q, c, strict=True)))
    if rank < 3:
        return [f"rank-deficient fit: {shapes} distinct (q, c) shape(s) determine only "
                f"{rank} of the 3 coefficients a, b, k; the r2 says nothing. Measure steps "
                "with several q and c values."]
    cond = float(np.linalg.cond(xs))
    if cond > COND_WARN:
        return [f"ill-conditioned fit (condition number {cond:.3g}): the samples barely tell "
                "a, b and k apart; widen the range of q and c."]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``fit-cost SAMPLES.csv`` (``-`` reads stdin). Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="fulcrum fit-cost", description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    warnings = diagnose(q, c)
    for w in warnings:
        print(f"fit-cost: warning: {w}", file=sys.stderr)
    sys.stdout.write(format_yaml(result) + "".join(f"# warning: {w}\n" for w in warnings))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
