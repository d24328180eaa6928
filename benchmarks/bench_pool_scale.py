"""The cache-aware pick against the size of the decode pool, through the real daemon.

A fresh daemon (``fulcrum serve``, its own process, every default but the scrape, which
is off because the pool's addresses serve nothing) has a static pool of ``n`` decode
endpoints (engines of 8 DP ranks); the gateway's HTTP picker (``gateway.authz_http_port``,
the mode ``fulcrum gateway`` runs) is asked for one pick at a time on one kept-alive
connection, as Envoy's ext_authz would: an OpenAI completion whose 3,000-character prompt
is one of 64 conversations, so the prefix index fills and matches as picks go. Every pick
counts, the first ones on a cold index too. Figures: round-trip time of one pick (the
HTTP exchange on loopback and the daemon's decision, placement and bookkeeping) at
p50, p99 and max, and the first pick's (the index gets its endpoints then).

Run alone: ``.venv/bin/python benchmarks/bench_pool_scale.py [--quick] [--baseline-src
DIR]`` (``DIR``: the ``src`` of another tree, run in the same run as one more row per
size).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pragma: no cover - direct execution
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import _free_port, _process  # noqa: E402
from benchmarks.common import md_table  # noqa: E402

SIZES = (64, 1024, 4096)


def _config(n: int, http_port: int, grpc_port: int) -> dict[str, object]:
    engines = [
        {"id": f"e{i}", "host": f"10.{i // 250}.{i % 250}.1",
         "ports": list(range(8000, 8000 + min(8, n - 8 * i)))}
        for i in range((n + 7) // 8)
    ]
    return {
        "server": {"host": "127.0.0.1", "port": _free_port()},
        "metrics": {"enabled": False},
        "gateway": {"enabled": True, "port": grpc_port, "health_port": _free_port(),
                    "authz_http_port": http_port, "scrape": {"enabled": False},
                    "pool": {"decode": engines}},
    }


async def _picks(port: int, picks: int) -> list[float]:
    from fulcrum.gateway.testing import HttpClient

    rng = random.Random(3)
    convs = ["".join(rng.choice("abcdefgh ") for _ in range(3000)) for _ in range(64)]
    client = HttpClient("127.0.0.1", port)
    out = []
    try:
        for i in range(picks):
            body = {"model": "m", "prompt": f"{convs[i % 64]} turn {i}", "max_tokens": 64}
            t0 = time.perf_counter()
            r = await client.request("POST", "/v1/completions", json.dumps(body).encode())
            out.append(time.perf_counter() - t0)
            if r.status != 200:
                raise RuntimeError(f"pick {i} answered {r.status}: {r.body[:200]!r}")
    finally:
        await client.close()
    return out


def measure(n: int, picks: int, src: str | None = None) -> list[float]:
    """Round-trip times of ``picks`` sequential picks (s) at ``n`` endpoints."""
    http_port, grpc_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fulcrum.yaml"
        path.write_text(yaml.safe_dump(_config(n, http_port, grpc_port)))
        args = [sys.executable, "-m", "fulcrum.cli", "serve", "--config", str(path)]
        with _process(args, http_port, "fulcrum", src):
            return asyncio.run(_picks(http_port, picks))


def report(quick: bool, baseline_src: str | None = None) -> str:
    picks = 300 if quick else 1500
    rows = []
    for n in SIZES:
        for name, src in (("Fulcrum", None), ("baseline tree", baseline_src)):
            if name != "Fulcrum" and src is None:
                continue
            ms = np.array(measure(n, picks, src)) * 1e3
            rows.append([f"{n:,}", name, f"{np.percentile(ms, 50):.2f}",
                         f"{np.percentile(ms, 99):.2f}", f"{ms.max():.2f}", f"{ms[0]:.2f}"])
    table = md_table(["endpoints", "tree", "p50 (ms)", "p99 (ms)", "max (ms)", "first pick (ms)"],
                     rows)
    return (
        "### The pick against the pool's size\n\n"
        f"A fresh daemon per row, its defaults (scrape off), {picks} sequential picks over "
        "its HTTP picker, 64 conversations of 3,000 characters.\n\n"
        f"{table}\n\n"
        "Command: `.venv/bin/python benchmarks/bench_pool_scale.py [--baseline-src DIR]` "
        "(or `make bench`).\n"
    )


def run(quick: bool) -> str:
    """``make bench`` entry."""
    return report(quick)


if __name__ == "__main__":
    flag = "--baseline-src"
    base = sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else None
    print(report("--quick" in sys.argv, base))
