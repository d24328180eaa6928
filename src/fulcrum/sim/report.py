"""Summaries of simulator runs: figures, a side-by-side table, JSON, PNG plots.

The yardsticks (what a user buys) of one run (:func:`summarize`):

* ``prefill_utilisation`` / ``decode_utilisation``: useful compute over all GPU-seconds
  of the stage during the run (first arrival to the last event; idle engines and
  instances included). Useful prefill compute is the cost model WITHOUT the fixed
  per-step cost ``k`` (so more steps never raise it); useful decode compute is
  ``d1*conc + d2*kv`` per GPU and step (without ``d0``). The two are never blended.
* ``ttft_by_tier``: ``{tier name: {"p50_s", "p99_s", "count", "finished"}}`` -- TTFT
  from arrival to the first token (VE time included); a request without a first token
  counts with its time until the run ended (a lower bound, so a starved tier shows);
* ``tpot_p50_s`` / ``tpot_p99_s``: time per output token after the first, over
  finished requests of more than one output token (seconds);
* ``finished`` / ``unfinished``: requests finished / not finished when the run ended.

Diagnostics:

* ``balance_ratio`` (prefill) and ``decode_balance_ratio``: sum of the steps' ideal
  (perfectly balanced) time / sum of their actual time -- the old "fraction of ideal".
  Engines that never step are not counted, so it must not be read as throughput;
* ``loss``: where the gap to the balanced step goes, as a share of the stage's actual
  GPU time (prefill shares add up to ``1 - balance_ratio``, decode shares to
  ``1 - decode_balance_ratio``): prefill GPUs waiting for their group's slowest rank
  with no work in the step (``prefill_idle_rank``), after all their work ended
  (``prefill_drained_rank``) or although work was left (``prefill_short_rank``: chunk
  cap, budget rounding); the MoE stretch (``prefill_moe``, ``decode_moe``); decode GPUs
  waiting for their instance's slowest (``decode_imbalance``);
* ``prefill_imbalance`` / ``decode_imbalance``: mean over steps of max/mean over the
  group's ranks of the step's work; ``ve_imbalance``: mean over placements of max/mean
  patches in flight over VE GPUs; ``prefill_moe_lb`` / ``decode_moe_lb``: mean moe_lb
  over steps, weighted by the step's tokens;
* ``prefill_capacity_fraction``: balanced prefill work done while requests kept
  arriving / (prefill GPUs x that time).

Per class (issue 23, :mod:`fulcrum.sim.tenant_report`): ``by_tenant`` and
``by_priority`` (TTFT, shed, compute share of the fleet, longest service gap), and
``shed`` (requests refused on a predicted deadline miss).

``ttft`` (per tier ``requests``, ``ttft_p50_s``, ``ttft_p99_s`` over finished requests
only), ``completed``, ``tpot_p50_ms`` / ``tpot_p99_ms`` are kept for older readers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fulcrum.core.prefill.tiers import tier_label
from fulcrum.sim.engine import Series, SimResult
from fulcrum.sim.tenant_report import class_tables


def _pct(values: np.ndarray, q: float) -> float | None:
    if values.size == 0:
        return None
    return float(np.percentile(values, q))


def _tier_index(res: SimResult) -> np.ndarray:
    return np.searchsorted(np.asarray(res.tier_bounds), res.input_tokens, side="right")


def ttft_seconds(res: SimResult) -> np.ndarray:
    """TTFT of every request (s), shape (n,); unfinished ones until the run's end."""
    first = np.where(res.first_token_ns >= 0, res.first_token_ns, res.end_ns)
    out: np.ndarray = np.maximum(0, first - res.arrival_ns) / 1e9
    return out


def _ttft_tables(res: SimResult) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per tier label: TTFT of the requests that got a first token (``ttft``) and of every
    request, unfinished ones counted at the end of the run (``ttft_by_tier``), s."""
    done = res.first_token_ns >= 0
    ttft_all = ttft_seconds(res)
    ttft = (res.first_token_ns - res.arrival_ns) / 1e9
    tiers = _tier_index(res)
    per_tier: dict[str, dict[str, Any]] = {}
    by_tier: dict[str, dict[str, Any]] = {}
    for t in range(len(res.tier_bounds) + 1):
        in_tier = tiers == t
        total = int(in_tier.sum())
        if total == 0:
            continue
        label = tier_label(res.tier_bounds, t)
        vals = ttft[done & in_tier]
        per_tier[label] = {
            "requests": total,
            "ttft_p50_s": _pct(vals, 50),
            "ttft_p99_s": _pct(vals, 99),
        }
        every = ttft_all[in_tier]
        by_tier[label] = {
            "p50_s": _pct(every, 50),
            "p99_s": _pct(every, 99),
            "count": total,
            "finished": int((done & in_tier).sum()),
        }
    return per_tier, by_tier


def _share(x: float, tot: float) -> float:
    return x / tot if tot > 0 else 0.0


def _losses(res: SimResult) -> dict[str, float]:
    """Where the stages' time goes, as shares of their actual GPU time."""
    p, d = res.prefill, res.decode
    return {
        "prefill_idle_rank": _share(p.idle_ns, p.actual_ns),
        "prefill_drained_rank": _share(p.drained_ns, p.actual_ns),
        "prefill_short_rank": _share(p.short_ns, p.actual_ns),
        "prefill_moe": _share(p.moe_ns, p.actual_ns),
        "decode_imbalance": _share(d.drained_ns, d.actual_ns),
        "decode_moe": _share(d.moe_ns, d.actual_ns),
    }


def summarize(res: SimResult) -> dict[str, Any]:
    """Headline figures of one run (see module docstring for every key); JSON-ready.

    Keys read by the goodput search: ``prefill_utilisation``, ``decode_utilisation``,
    ``ttft_by_tier`` (``{tier: {"p50_s", "p99_s", "count", "finished"}}``),
    ``tpot_p50_s``, ``tpot_p99_s``, ``finished``, ``unfinished``, ``balance_ratio``.
    """
    per_tier, by_tier = _ttft_tables(res)
    multi = (res.finish_ns >= 0) & (res.output_tokens > 1)
    tpot = (res.finish_ns[multi] - res.first_token_ns[multi]) / (
        res.output_tokens[multi] - 1
    ) / 1e9
    p, d = res.prefill, res.decode
    finished = int((res.finish_ns >= 0).sum())
    tpot_p50 = _pct(tpot, 50)
    tpot_p99 = _pct(tpot, 99)
    by_tenant, by_priority = class_tables(res)
    return {
        "policy": res.policy,
        "seed": res.seed,
        "requests": int(res.arrival_ns.size),
        "finished": finished,
        "unfinished": int(res.arrival_ns.size) - finished,
        "completed": finished,
        "decode_rejected": res.decode_rejected,
        "virtual_s": res.end_ns / 1e9,
        "span_s": res.span_ns / 1e9,
        "cache_hit_ratio": res.cache_hit_ratio,
        "block_hit_ratio": res.block_hit_ratio,
        "prefill_utilisation": res.prefill_utilisation,
        "decode_utilisation": res.decode_utilisation,
        "ttft_by_tier": by_tier,
        "ttft": per_tier,
        "tpot_p50_s": tpot_p50,
        "tpot_p99_s": tpot_p99,
        "tpot_p50_ms": None if tpot_p50 is None else tpot_p50 * 1e3,
        "tpot_p99_ms": None if tpot_p99 is None else tpot_p99 * 1e3,
        "balance_ratio": p.fraction,
        "decode_balance_ratio": d.fraction,
        "prefill_imbalance": res.prefill_imbalance.mean(),
        "decode_imbalance": res.decode_imbalance.mean(),
        "ve_imbalance": res.ve_imbalance.mean(),
        "prefill_moe_lb": res.prefill_moe_lb.mean(),
        "decode_moe_lb": res.decode_moe_lb.mean(),
        "prefill_capacity_fraction": res.prefill_capacity_fraction,
        "loss": _losses(res),
        "prefill_steps": p.steps,
        "decode_steps": d.steps,
        "eplb_rebalances": res.eplb_rebalances,
        "shed": sum(e["shed"] for e in by_tenant.values()),
        "by_tenant": by_tenant,
        "by_priority": by_priority,
    }


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def table_rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """Rows (label, one cell per run) of the side-by-side table."""
    tiers: list[str] = []
    for s in summaries:
        for t in s["ttft_by_tier"]:
            if t not in tiers:
                tiers.append(t)
    rows: list[tuple[str, list[str]]] = [
        ("finished", [f"{s['finished']}/{s['requests']}" for s in summaries]),
    ]
    for t in tiers:
        for key, name in (("p50_s", "p50"), ("p99_s", "p99")):
            rows.append(
                (
                    f"TTFT {name} {t} (s)",
                    [_fmt(s["ttft_by_tier"].get(t, {}).get(key), 2) for s in summaries],
                )
            )
    spec = (
        ("TPOT p50 (ms)", "tpot_p50_ms", 1),
        ("TPOT p99 (ms)", "tpot_p99_ms", 1),
        ("prefill utilisation", "prefill_utilisation", 3),
        ("decode utilisation", "decode_utilisation", 3),
        ("prefill imbalance", "prefill_imbalance", 3),
        ("decode imbalance", "decode_imbalance", 3),
        ("VE imbalance", "ve_imbalance", 3),
        ("prefill moe_lb", "prefill_moe_lb", 3),
        ("decode moe_lb", "decode_moe_lb", 3),
        ("prefill balance ratio (diag.)", "balance_ratio", 3),
        ("decode balance ratio (diag.)", "decode_balance_ratio", 3),
        ("prefill capacity fraction", "prefill_capacity_fraction", 3),
    )
    for label, key, digits in spec:
        rows.append((label, [_fmt(s[key], digits) for s in summaries]))
    return rows


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """Plain-text table, one column per run."""
    rows = table_rows(summaries)
    head = ["metric"] + [s["policy"] for s in summaries]
    width0 = max(len(head[0]), *(len(r[0]) for r in rows))
    widths = [
        max(len(head[i + 1]), *(len(r[1][i]) for r in rows)) for i in range(len(summaries))
    ]
    lines = [
        head[0].ljust(width0) + "  " + "  ".join(h.rjust(w) for h, w in zip(head[1:], widths,
                                                                          strict=True))
    ]
    lines.append("-" * len(lines[0]))
    for label, cells in rows:
        lines.append(
            label.ljust(width0)
            + "  "
            + "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
        )
    return "\n".join(lines)


def format_markdown(summaries: Sequence[dict[str, Any]]) -> str:
    """Markdown table, one column per run."""
    rows = table_rows(summaries)
    out = ["| metric | " + " | ".join(s["policy"] for s in summaries) + " |"]
    out.append("|---|" + "---:|" * len(summaries))
    for label, cells in rows:
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def to_json(summaries: Sequence[dict[str, Any]], meta: dict[str, Any] | None = None) -> str:
    """JSON document of the summaries (and optional metadata)."""
    return json.dumps({"meta": meta or {}, "runs": list(summaries)}, indent=2, sort_keys=True)


# -- plots --------------------------------------------------------------------------------
def _smooth(series: Series, bins: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``series`` in ``bins`` equal time bins (s, value); empty bins dropped."""
    if not series.t_ns:
        return np.zeros(0), np.zeros(0)
    t = np.asarray(series.t_ns, dtype=np.float64) / 1e9
    v = np.asarray(series.value, dtype=np.float64)
    edges = np.linspace(t.min(), t.max() + 1e-9, bins + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    sums = np.bincount(idx, weights=v, minlength=bins)
    cnt = np.bincount(idx, minlength=bins)
    ok = cnt > 0
    centres = (edges[:-1] + edges[1:]) / 2
    return centres[ok], sums[ok] / cnt[ok]


def _plot_ttft_cdf(plt: Any, results: Sequence[SimResult], path: Path) -> None:
    """TTFT CDF per tier present in ``results`` (s, log x) into ``path``."""
    bounds = results[0].tier_bounds
    n_tiers = len(bounds) + 1
    present = [
        t
        for t in range(n_tiers)
        if any(
            (np.searchsorted(np.asarray(bounds), r.input_tokens, side="right") == t).any()
            for r in results
        )
    ]
    fig, axes = plt.subplots(1, max(1, len(present)), figsize=(4.2 * max(1, len(present)), 3.6),
                             squeeze=False)
    for ax, t in zip(axes[0], present, strict=False):
        for r in results:
            tiers = np.searchsorted(np.asarray(bounds), r.input_tokens, side="right")
            sel = (tiers == t) & (r.first_token_ns >= 0)
            vals = np.sort((r.first_token_ns[sel] - r.arrival_ns[sel]) / 1e9)
            if vals.size:
                ax.plot(vals, np.arange(1, vals.size + 1) / vals.size, label=r.policy)
        ax.set_xscale("log")
        ax.set_title(f"TTFT CDF, tier {tier_label(bounds, t)}")
        ax.set_xlabel("TTFT (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_series(plt: Any, results: Sequence[SimResult], name: str,
                 getters: tuple[tuple[str, str], ...], path: Path) -> None:
    """One panel per (stage, SimResult series attribute) over virtual time into ``path``."""
    fig, axes = plt.subplots(1, len(getters), figsize=(4.6 * len(getters), 3.4),
                             squeeze=False)
    for ax, (stage, get) in zip(axes[0], getters, strict=True):
        for r in results:
            series: Series = getattr(r, get)
            x, y = _smooth(series)
            if x.size:
                ax.plot(x, y, label=r.policy, linewidth=1)
        ax.set_title(f"{stage} {name} (max/mean)" if name == "imbalance"
                     else f"{stage} moe_lb")
        ax.set_xlabel("virtual time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_runs(results: Sequence[SimResult], out_dir: Path, prefix: str = "") -> list[Path]:
    """Write TTFT CDF per tier, imbalance over time and moe_lb over time as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if not results:
        return written
    path = out_dir / f"{prefix}ttft_cdf.png"
    _plot_ttft_cdf(plt, results, path)
    written.append(path)
    panels: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
        ("imbalance", (("prefill", "prefill_imbalance"), ("decode", "decode_imbalance"),
                       ("VE", "ve_imbalance"))),
        ("moe_lb", (("prefill", "prefill_moe_lb"), ("decode", "decode_moe_lb"))),
    )
    for name, getters in panels:
        path = out_dir / f"{prefix}{name}.png"
        _plot_series(plt, results, name, getters, path)
        written.append(path)
    return written
