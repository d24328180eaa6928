"""A pretend prefill engine (one DP group) and an entrypoint, driving a running daemon.

Start the daemon with ``make run`` in one terminal, then in another::

    .venv/bin/python examples/prefill_engine.py --target localhost:50051

and watch ``curl -s localhost:9464/metrics | grep -E '^fulcrum_prefill_'``.

What it plays, with the SDK's public API only (``fulcrum.client``):

* a **prefill engine** of ``--dp-ranks`` ranks (:class:`PrefillEngineLoop`): it
  registers, pulls with the documented quota (``sum over ranks of max(0, horizon -
  rank load)``, the horizon from the daemon's reply), acknowledges each batch, plans each
  step's chunks with the daemon's cost model, "runs" the step (sleeps its predicted time
  times ``--time-scale``, with some noise), reports measured step times, and registers
  again after a daemon restart;
* an **entrypoint** that submits ``--rate`` prefill requests per second
  (``submit_prefill``, 1K to ``--max-tokens`` tokens, some with a cached prefix) and counts where they ran.

Seeded (``--seed``); stops after ``--seconds`` (0 = until Ctrl-C) and deregisters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import sys
from collections.abc import Callable

import grpc

from fulcrum.client import FulcrumClient
from fulcrum.client.planner import StepPlan
from fulcrum.client.prefill import PrefillEngineLoop, submit_prefill


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="localhost:50051", help="daemon gRPC address")
    p.add_argument("--id", default="prefill-0", help="member id of the engine")
    p.add_argument("--dp-ranks", type=int, default=4, help="DP ranks of the engine")
    p.add_argument("--rate", type=float, default=4.0, help="requests submitted per second")
    p.add_argument("--max-tokens", type=int, default=15_000,
                   help="longest prompt submitted, tokens (above 16K a request belongs to "
                   "another tier: run more engines, see examples/README.md)")
    p.add_argument("--time-scale", type=float, default=0.05,
                   help="wall time of a step per predicted ns (0.05: 20x faster than a GPU)")
    p.add_argument("--seconds", type=float, default=0.0, help="run time (0 = until Ctrl-C)")
    p.add_argument("--seed", type=int, default=7, help="random seed")
    return p.parse_args(argv)


async def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, int]:
    """Play the engine and the entrypoint; returns counters (for tests)."""
    rng = random.Random(args.seed)
    counts = {"submitted": 0, "ok": 0, "ours": 0, "failed": 0}

    async def run_step(plan: StepPlan) -> float:
        await asyncio.sleep(plan.step_ns * args.time_scale / 1e9)
        return plan.step_ns * rng.uniform(0.95, 1.1)  # "measured" on the GPUs

    async with FulcrumClient(args.target) as client:
        engine = PrefillEngineLoop(
            client, args.id, args.dp_ranks, run_step,
            on_event=lambda kind, detail: log(f"{args.id}: {kind}: {detail}")
            if kind in ("registered", "reregistered", "batch", "rejected") else None,
        )
        await engine.register()
        stop = asyncio.Event()  # the entrypoint stops first, the engine after its work
        engine_stop = asyncio.Event()
        ids = itertools.count()
        pending: set[asyncio.Task[None]] = set()

        async def one(rid: str, total: int, cached: int) -> None:
            try:
                placed = await submit_prefill(client, rid, total, cached, max_wait_ms=10_000)
                counts["ok"] += 1
                counts["ours"] += placed.engine_id == args.id
            except grpc.aio.AioRpcError as err:
                counts["failed"] += 1
                log(f"{rid}: {err.code().name}: {err.details()}")

        async def entrypoint() -> None:
            while not stop.is_set():
                total = int(min(args.max_tokens, max(1_000, rng.lognormvariate(8.5, 0.8))))
                cached = rng.choice((0, 0, total // 2))
                counts["submitted"] += 1
                task = asyncio.ensure_future(one(f"{args.id}-req-{next(ids)}", total, cached))
                pending.add(task)
                task.add_done_callback(pending.discard)
                await asyncio.sleep(rng.expovariate(args.rate))

        loop_task = asyncio.ensure_future(engine.run(engine_stop))
        entry_task = asyncio.ensure_future(entrypoint())
        try:
            if args.seconds:
                await asyncio.sleep(args.seconds)
            else:
                await asyncio.Event().wait()
        finally:
            stop.set()
            await entry_task
            if pending:  # let what was submitted finish (the engine still runs)
                await asyncio.wait(pending, timeout=15)
            engine_stop.set()
            await loop_task
            await engine.close()
        counts.update({f"engine_{k}": v for k, v in engine.counts.items()})
        log(f"{args.id}: {counts['ok']} of {counts['submitted']} submits ran "
            f"({counts['ours']} here), {engine.counts['steps']} steps")
    return counts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
