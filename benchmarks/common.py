"""Shared helpers of the benchmark modules: timing, percentiles, formatting, machine info.

Every ``benchmarks/bench_<name>.py`` exposes ``run(quick: bool) -> str`` returning a
markdown section; :mod:`benchmarks.run` collects them into ``BENCHMARKS.md``.
"""

from __future__ import annotations

import asyncio
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

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


#: One concurrent caller of a throughput run: ``work(worker_index)`` makes its calls.
Work = Callable[[int], Awaitable[None]]


async def rate(workers: int, per_worker: int, work: Work) -> float:
    """Calls per second of ``workers`` concurrent loops of ``per_worker`` calls each."""
    t0 = time.perf_counter()
    await asyncio.gather(*(work(w) for w in range(workers)))
    return workers * per_worker / (time.perf_counter() - t0)


async def stream_all(call: Callable[[AsyncIterator[Any]], Any], messages: Sequence[Any]) -> int:
    """Send ``messages`` on one bidirectional stream opened by ``call``; read every reply
    (a reply with a non-zero ``code`` field fails the run). Returns the replies read."""

    async def requests() -> AsyncIterator[Any]:
        for message in messages:
            yield message

    n = 0
    async for reply in call(requests()):
        if getattr(reply, "code", 0):
            raise RuntimeError(f"stream reply {n} failed: {reply.message}")
        n += 1
    if n != len(messages):
        raise RuntimeError(f"stream answered {n} of {len(messages)} messages")
    return n


async def paired_rates(
    client: Any,
    *,
    workers: int,
    per_worker: int,
    rounds: int,
    place: Work,
    place_stream: Work,
    before_round: Callable[[int], None],
    after_round: Callable[[], None],
) -> dict[str, float]:
    """Unary and streaming calls against their no-op (Ping / PingStream) on ``client``.

    Each round runs four short phases -- ping, place, ping stream, place stream -- in an
    order that alternates between rounds; ``before_round(r)`` builds the round's requests
    (untimed, as the no-op's are built once) and ``after_round()`` resets the daemon's
    state. Returns the median calls/s of each phase (``ping``, ``place``, ``ping_s``,
    ``place_s``) and the median of the ratios paired within rounds (``ratio``,
    ``ratio_s``): the machine's load drifts, the pairing cancels most of it.
    """
    from fulcrum.v1 import diagnostics_pb2 as dpb

    ping_req = dpb.PingRequest()
    ping_stream_msgs = [dpb.PingStreamRequest()] * per_worker

    async def ping(_: int) -> None:
        for _ in range(per_worker):
            await client.diagnostics.Ping(ping_req)

    async def ping_stream(_: int) -> None:
        await stream_all(client.diagnostics.PingStream, ping_stream_msgs)

    out: dict[str, list[float]] = {k: [] for k in ("ping", "place", "ping_s", "place_s")}
    await rate(workers, 20, ping)  # warm-up
    for r in range(rounds):
        before_round(r)
        pairs: list[tuple[str, Work]] = [
            ("ping", ping),
            ("place", place),
            ("ping_s", ping_stream),
            ("place_s", place_stream),
        ]
        if r % 2:
            pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
        for key, work in pairs:
            out[key].append(await rate(workers, per_worker, work))
        after_round()
    rates = {k: statistics.median(v) for k, v in out.items()}
    rates["ratio"] = statistics.median(
        p / q for p, q in zip(out["place"], out["ping"], strict=True)
    )
    rates["ratio_s"] = statistics.median(
        p / q for p, q in zip(out["place_s"], out["ping_s"], strict=True)
    )
    return rates


def wait_healthy(proc: subprocess.Popen[bytes], address: str, timeout_s: float = 30.0) -> None:
    """Poll a daemon started as ``proc`` until its gRPC health answers SERVING on
    ``address`` (bounded: raise after ``timeout_s``, or at once when it exited)."""
    from fulcrum.client import check_health

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"daemon exited early: {err[-2000:]}")
        try:
            status = asyncio.run(check_health(address, "", timeout_s=1.0))
        except Exception:  # not listening yet
            status = ""
        if status == "SERVING":
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"daemon did not become healthy in {timeout_s:.0f} s")
        time.sleep(0.1)
