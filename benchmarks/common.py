"""Shared helpers of the benchmark modules: timing, percentiles, formatting, machine info.

Every ``benchmarks/bench_<name>.py`` exposes ``run(quick: bool) -> str`` returning a
markdown section; :mod:`benchmarks.run` collects them into ``BENCHMARKS.md``.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def progress(message: str) -> None:
    """One progress line on stderr (``make bench`` shows it; BENCHMARKS.md does not).

    Prefixed with the wall-clock time (UTC, ``HH:MM:SS``) so that a slow phase stands out
    in a long run; flushed at once.
    """
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    sys.stderr.write(f"[bench {stamp}]   {message}\n")
    sys.stderr.flush()


def best_of(fn: Callable[[], object], *, repeat: int = 5, number: int = 1) -> float:
    """Best (smallest) wall time of ``repeat`` runs of ``number`` calls, in s per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Result of ``fn()`` and its wall time (s)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (s), all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def percentiles(samples: Sequence[float], qs: Sequence[float] = (50, 99)) -> list[float]:
    """Percentiles ``qs`` of ``samples`` (NaN when empty)."""
    if not samples:
        return [float("nan")] * len(qs)
    return [float(x) for x in np.percentile(np.asarray(samples, dtype=np.float64), qs)]


def ratio(value: float, reference: float) -> str:
    """``value / reference`` as ``"0.83x"`` ("-" when undefined)."""
    if not reference or reference != reference or value != value:
        return "-"
    return f"{value / reference:.2f}x"


def fmt_rate(per_s: float) -> str:
    """Calls or items per second with thousands separators."""
    return f"{per_s:,.0f}"


def fmt_us(seconds: float) -> str:
    """Seconds as microseconds with 1 decimal."""
    return f"{seconds * 1e6:,.1f}"


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds with 2 decimals."""
    return f"{seconds * 1e3:,.2f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; the first column left-aligned, the others right-aligned."""
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    out.extend("| " + " | ".join(str(c) for c in row) + " |" for row in rows)
    return "\n".join(out)


def machine() -> str:
    """CPU model, logical cores, Python and OS, one line."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{model}, {os.cpu_count()} logical cores, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )
