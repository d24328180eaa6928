"""A pretend decode instance and its EP group, driving a running Fulcrum daemon.

Start the daemon with ``make run`` in one terminal, then in another::

    .venv/bin/python examples/decode_instance.py --target localhost:50051

and watch ``curl -s localhost:9464/metrics | grep -E 'fulcrum_(decode|eplb)_'``.

What it plays, with the SDK's public API only (``fulcrum.client``):

* a **decode instance** of ``--gpus`` GPUs (:class:`DecodeLoadReporter`): it heartbeats
  each GPU's requests and KV tokens as they change;
* an **entrypoint** that places ``--rate`` requests per second on the decode fleet
  (``PlaceDecode``) and releases each one when its generation ends (``ReleaseDecode``);
  the requests placed on this instance run here, one token per step per request;
* the instance's **EP group** (:class:`ExpertLoadReporter`): every step routes each
  running request's token through every MoE layer to experts of a skewed popularity,
  records the step and reports the window every ``--report-every`` steps; each new
  expert map from the daemon is printed (a real engine would move expert weights).

Seeded (``--seed``); stops after ``--steps`` steps (0 = until Ctrl-C), deregisters and
releases what it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
from dataclasses import dataclass

import grpc
import numpy as np

from fulcrum.client import FulcrumClient
from fulcrum.client.reporters import DecodeLoadReporter, ExpertLoadReporter, ExpertMapArrays
from fulcrum.v1 import decode_pb2, expert_pb2


@dataclass
class Running:
    """A request decoding on one of our GPUs (tokens)."""

    request_id: str
    gpu: int
    kv_tokens: int
    tokens_left: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="localhost:50051", help="daemon gRPC address")
    p.add_argument("--id", default="decode-0", help="member id of the instance and EP group")
    p.add_argument("--gpus", type=int, default=4, help="decode GPUs of the instance")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests per GPU")
    p.add_argument("--max-kv-tokens", type=int, default=400_000, help="KV tokens per GPU")
    p.add_argument("--rate", type=float, default=20.0, help="requests placed per second")
    p.add_argument("--step-ms", type=float, default=20.0, help="one decode step, ms")
    p.add_argument("--steps", type=int, default=0, help="steps to run (0 = until Ctrl-C)")
    p.add_argument("--layers", type=int, default=8, help="MoE layers")
    p.add_argument("--experts", type=int, default=64, help="routed experts per layer")
    p.add_argument("--report-every", type=int, default=20, help="steps per ReportLoad")
    p.add_argument("--period-steps", type=int, default=400, help="EPLB rebalance period M")
    p.add_argument("--seed", type=int, default=1, help="random seed")
    return p.parse_args(argv)


async def run(args: argparse.Namespace, log: object = print) -> dict[str, int]:
    """Play the instance for ``args.steps`` steps; returns counters (for tests)."""
    say = log if callable(log) else print
    rng = np.random.default_rng(args.seed)
    popularity = rng.lognormal(0.0, 1.0, size=(args.layers, args.experts))
    popularity /= popularity.sum(axis=1, keepdims=True)
    counts = {"placed": 0, "ours": 0, "released": 0, "refused": 0, "maps": 0}

    def on_map(m: ExpertMapArrays) -> None:
        counts["maps"] += 1
        say(f"expert map v{m.version} ({m.algorithm}): {m.ep_size} GPUs x "
            f"{m.slots_per_gpu} slots per layer")

    async with FulcrumClient(args.target, timeout_s=5.0) as client:
        instance = DecodeLoadReporter(
            client, args.id, [(args.max_concurrency, args.max_kv_tokens)] * args.gpus
        )
        group = ExpertLoadReporter(
            client,
            expert_pb2.RegisterGroupRequest(
                group_id=args.id,
                role=expert_pb2.GROUP_ROLE_DECODE,
                ep_size=args.gpus,
                num_layers=args.layers,
                num_experts=args.experts,
                window_steps=max(args.period_steps // 2, 1),
                period_steps=args.period_steps,
                expert_bytes=44 << 20,
            ),
            report_every_steps=args.report_every,
            on_map=on_map,
        )
        await instance.start()
        await group.start()
        say(f"{args.id}: registered {args.gpus} decode GPUs (incarnation "
            f"{instance.incarnation}) and EP group {args.id} with {args.target}")
        running: dict[str, Running] = {}
        ids = itertools.count()
        step_s = args.step_ms / 1000
        arrivals = 0.0
        observed = 1.0
        try:
            for step in itertools.count():
                if args.steps and step >= args.steps:
                    break
                # Entrypoint: place the requests that arrived during this step.
                arrivals += args.rate * step_s
                while arrivals >= 1:
                    arrivals -= 1
                    rid = f"{args.id}-r{next(ids)}"
                    prompt = int(rng.integers(256, 8192))
                    try:
                        placed = await client.decode.PlaceDecode(
                            decode_pb2.PlaceDecodeRequest(request_id=rid, kv_tokens=prompt)
                        )
                    except grpc.aio.AioRpcError as err:
                        counts["refused"] += 1
                        say(f"place refused: {err.code().name}: {err.details()}")
                        continue
                    counts["placed"] += 1
                    if placed.instance_id == args.id:
                        counts["ours"] += 1
                        running[rid] = Running(
                            rid, placed.gpu_index, prompt, int(rng.integers(16, 512))
                        )
                    else:  # another instance's request: this demo does not run it
                        with contextlib.suppress(grpc.aio.AioRpcError):
                            await client.decode.ReleaseDecode(
                                decode_pb2.ReleaseDecodeRequest(request_id=rid)
                            )
                # Decode step: one token per running request; finished ones are released.
                tokens = np.zeros(args.gpus, dtype=np.int64)
                for r in list(running.values()):
                    r.kv_tokens += 1
                    r.tokens_left -= 1
                    tokens[r.gpu] += 1
                    if r.tokens_left <= 0:
                        del running[r.request_id]
                        with contextlib.suppress(grpc.aio.AioRpcError):  # expired: fine
                            await client.decode.ReleaseDecode(
                                decode_pb2.ReleaseDecodeRequest(request_id=r.request_id)
                            )
                        counts["released"] += 1
                for gpu in range(args.gpus):
                    mine = [r for r in running.values() if r.gpu == gpu]
                    instance.set_load(gpu, len(mine), sum(r.kv_tokens for r in mine))
                # MoE routing of this step's tokens: tokens per logical expert per layer.
                n = int(tokens.sum())
                load = np.stack([rng.multinomial(n, popularity[layer])
                                 for layer in range(args.layers)])
                reply = await group.record(load)
                if reply is not None:
                    if reply.rebalanced:
                        say(f"step {step}: rebalanced; moe_lb observed under the previous "
                            f"map: {observed:.3f} (1.0 = perfect)")
                    observed = reply.observed_moe_lb
                await asyncio.sleep(step_s)
        finally:
            for rid in list(running):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await client.decode.ReleaseDecode(
                        decode_pb2.ReleaseDecodeRequest(request_id=rid)
                    )
            await group.stop()
            await instance.stop()
    counts["reports"] = group.reports
    counts["map_version"] = group.map_version
    say(f"{args.id}: done {counts}")
    return counts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(run(args))
    except KeyboardInterrupt:
        return 0
    except grpc.aio.AioRpcError as err:
        print(f"daemon at {args.target}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
