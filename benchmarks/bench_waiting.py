"""Many waiting engines: a burst handed out by the daemon while its prefill fleet long-polls.

Issue 21 measured one dispatch in the core (``bench_prefix.py``); this is what an operator
sees. The daemon runs in its own process (:func:`benchmarks.bench_scale.daemon_process`)
with per-engine prefix caches (``prefill.cache_model: per_engine``, what prefix affinity
needs) and otherwise its defaults. From a cold fleet, the client registers ``N`` prefill
engines of 8 DP ranks; each long-polls ``Pull`` (idle ranks, acknowledging each batch in
its next pull, as the engine kit does). Then, one burst after the other, 64 ``Submit``
calls at once:

* **cold**: 64 conversations' first turns (8 blocks each, nobody holds any);
* **held**: the same conversations' second turns (16 blocks, their first 8 held by the
  engine that ran the first turn: each waits for its holder).

Figures per ``N``: the wall time of the ``N`` Registers (one after the other, from a cold
fleet); wall ms from the first Submit sent to the last one resolved, and the
daemon's event-loop lag over the burst (its ``fulcrum_event_loop_lag_seconds``, probe at
10 ms: max is the highest non-empty bucket's bound). The same run at ``N`` = 8 is the
baseline: the ratio is what the waiting engines cost. Run alone:
``.venv/bin/python benchmarks/bench_waiting.py [--quick]`` (quick: 8 and 256 engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pragma: no cover - direct execution
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_scale import daemon_process, lag_buckets, lag_summary, scrape  # noqa: E402
from benchmarks.common import md_table, progress  # noqa: E402
from fulcrum.client import FulcrumClient  # noqa: E402
from fulcrum.v1 import fleet_pb2 as fpb  # noqa: E402
from fulcrum.v1 import prefill_pb2 as pb  # noqa: E402

S = 1_000_000_000
RANKS = 8
BURST = 64
BLOCK_TOKENS = 512  # the daemon's default prefill.block_tokens
CONFIG = {"prefill": {"cache_model": "per_engine"}}


def turn(conv: int, n: int) -> pb.SubmitRequest:
    """Turn ``n`` (1 or 2) of conversation ``conv``: 8 blocks per turn, chained."""
    hashes = [conv * 1_000 + k + 1 for k in range(8 * n)]
    return pb.SubmitRequest(request_id=f"c{conv}t{n}", total_tokens=len(hashes) * BLOCK_TOKENS,
                            block_hashes=hashes, max_wait_ms=30_000)


async def _burst(c: FulcrumClient, reqs: list[pb.SubmitRequest], mport: int,
                 ) -> tuple[float, float, float, dict[str, str]]:
    """Submit ``reqs`` at once; (wall s, loop lag p99 s, max s, request -> engine)."""
    before = lag_buckets(scrape(mport)[0])
    t0 = time.perf_counter()
    got = await asyncio.gather(*(c.prefill.Submit(r) for r in reqs))
    wall = time.perf_counter() - t0
    _, p99, top = lag_summary(before, lag_buckets(scrape(mport)[0]))
    return wall, p99, top, {r.request_id: g.engine_id for r, g in zip(reqs, got, strict=True)}


def fleet_bursts(n: int) -> dict[str, float]:
    """One daemon, ``n`` waiting engines, the two bursts (see module docstring)."""
    with daemon_process(CONFIG) as (address, mport, _):
        return asyncio.run(_bursts(n, address, mport))


async def _bursts(n: int, address: str, mport: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with contextlib.AsyncExitStack() as stack:
        # A channel per 256 engines (the daemon allows 1,024 streams per connection; real
        # engines have a connection each), and one for the entrypoint's Submits.
        c, *chans = [await stack.enter_async_context(FulcrumClient(
            address, timeout_s=120.0, options=[("grpc.use_local_subchannel_pool", 1)]))
            for _ in range(1 + -(-n // 256))]
        incs: dict[str, int] = {}
        t0 = time.perf_counter()
        for i in range(n):
            reply = await c.fleet.Register(fpb.RegisterRequest(
                member_id=f"p{i:05d}",
                prefill_engine=fpb.PrefillEngineShape(dp_ranks=RANKS)))
            incs[f"p{i:05d}"] = reply.incarnation
        out["register_s"] = time.perf_counter() - t0
        stop = asyncio.Event()
        parked = asyncio.Semaphore(0)

        async def engine(i: int, eid: str) -> None:
            acks: list[str] = []
            while not stop.is_set():
                call = chans[i // 256].prefill.Pull(pb.PullRequest(
                    engine_id=eid, incarnation=incs[eid], remaining_quota_ns=100 * S,
                    rank_loads_ns=[0] * RANKS, max_wait_ms=30_000,
                    ack_request_ids=acks))
                parked.release()
                got = await call
                acks = [r.request_id for r in got.requests]

        loops = [asyncio.ensure_future(engine(i, e)) for i, e in enumerate(incs)]
        for _ in incs:  # every engine's first pull sent
            await parked.acquire()
        await asyncio.sleep(max(1.0, n / 1_000))  # let them park (a bench, not a test)
        firsts = [turn(k, 1) for k in range(BURST)]
        wall, p99, top, where = await _burst(c, firsts, mport)
        out |= {"cold_ms": wall * 1e3, "cold_lag_p99_ms": p99 * 1e3,
                "cold_lag_max_ms": top * 1e3}
        seconds = [turn(k, 2) for k in range(BURST)]
        wall, p99, top, where2 = await _burst(c, seconds, mport)
        same = sum(where[f"c{k}t1"] == where2[f"c{k}t2"] for k in range(BURST))
        out |= {"held_ms": wall * 1e3, "held_lag_p99_ms": p99 * 1e3,
                "held_lag_max_ms": top * 1e3, "held_on_holder": same / BURST}
        stop.set()
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    await asyncio.sleep(0.1)  # let gRPC's poller see its channels closed before the loop
    return out


def run(quick: bool) -> str:
    sizes = (8, 256) if quick else (8, 1_024, 4_096)
    got: dict[int, dict[str, float]] = {}
    for n in sizes:
        progress(f"waiting: {n} engines long-polling, two bursts of {BURST}")
        got[n] = fleet_bursts(n)
    base = got[sizes[0]]
    rows = []
    for n in sizes:
        g = got[n]
        rows.append([
            f"{n:,}",
            f"{g['cold_ms']:,.0f} ({g['cold_ms'] / base['cold_ms']:.1f}x)",
            f"{g['cold_lag_max_ms']:.0f}",
            f"{g['held_ms']:,.0f} ({g['held_ms'] / base['held_ms']:.1f}x)",
            f"{g['held_lag_max_ms']:.0f}",
            f"{g['held_on_holder']:.2f}",
            f"{g['register_s']:.1f}",
        ])
    table = md_table(["waiting engines", "cold burst, ms (vs 8)", "loop lag max, ms",
                      "held burst, ms (vs 8)", "loop lag max, ms",
                      "second turns on the first's engine", "registering them, s"], rows)
    return (
        "### Many waiting engines (prefill, through the daemon)\n\n"
        f"{BURST} Submits at once into a fleet of idle engines long-polling `Pull`, "
        "per-engine caches (`prefill.cache_model: per_engine`), from a cold fleet; "
        "cold: first turns nobody holds; held: the same conversations' second turns. "
        "The 8-engine run is the baseline of the same run. "
        "Command: `.venv/bin/python benchmarks/bench_waiting.py`.\n\n" + table + "\n"
    )


if __name__ == "__main__":  # pragma: no cover
    print(run("--quick" in sys.argv))
