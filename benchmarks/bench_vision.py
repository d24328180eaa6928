"""VE balancer benchmark: core cost per decision, daemon throughput, memory per placement.

``run(quick)`` returns a markdown section. Figures:

* core: microseconds per ``select`` at 64, 512 and 4,096 GPUs (8 GPUs per machine),
  each policy, without and with a per-GPU capacity (the capacity filter's cost);
* daemon: PlaceImages (one screenshot) per second, unary and streamed, each as a ratio
  to the no-op Ping / PingStream measured in the same run, same concurrency;
* memory per placement held by the daemon's table (tracemalloc);
* fill imbalance (max/mean patches in flight) of each policy after 1,024 images.

Run alone: ``.venv/bin/python benchmarks/bench_vision.py [--quick]``.
"""

from __future__ import annotations

import asyncio
import sys
import time
import timeit
import tracemalloc
from pathlib import Path

import numpy as np

from fulcrum.client import FulcrumClient
from fulcrum.config.vision import VisionSettings
from fulcrum.core.types import Member, MemberKind, VisionMachineShape
from fulcrum.core.vision.base import VisionPolicy, place_many
from fulcrum.core.vision.fleet import MachineSpec, VisionFleet, VisionTopology, imbalance
from fulcrum.core.vision.patches import patches
from fulcrum.core.vision.registry import make_policy, policy_names
from fulcrum.state.vision import ImageRequest, VisionState
from fulcrum.testing import running_server
from fulcrum.v1 import fleet_pb2 as fpb
from fulcrum.v1 import vision_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pragma: no cover - direct execution
    sys.path.insert(0, str(ROOT))

from benchmarks.common import paired_rates, stream_all  # noqa: E402

GPUS_PER_MACHINE = 8
SCREENSHOT = patches(1280, 800, 16)


def _topology(n_gpus: int, cap: int) -> VisionTopology:
    return VisionTopology.build(
        [
            MachineSpec(f"ve-{i}", tuple(range(GPUS_PER_MACHINE)), max_patches=cap)
            for i in range(n_gpus // GPUS_PER_MACHINE)
        ]
    )


def core_table(quick: bool) -> str:
    number = 300 if quick else 2_000
    repeat = 3 if quick else 5
    rows = []
    for n_gpus in (64, 512, 4096):
        for cap in (0, 1 << 40):
            fleet = VisionFleet(
                _topology(n_gpus, cap),
                np.random.default_rng(0).integers(0, 50_000, n_gpus).astype(np.int64),
            )
            cells = []
            for name in policy_names():
                policy = make_policy(name)
                rng = np.random.default_rng(1)

                def once(
                    policy: VisionPolicy = policy,
                    rng: np.random.Generator = rng,
                    fleet: VisionFleet = fleet,
                ) -> None:
                    policy.select(fleet, SCREENSHOT, rng)

                # CPU time of this thread: time spent descheduled is not the decision's cost.
                timer = timeit.Timer(once, timer=time.thread_time)
                best = min(timer.repeat(number=number, repeat=repeat)) / number
                cells.append(f"{best * 1e6:.2f}")
            rows.append(f"| {n_gpus:,} | {'yes' if cap else 'no'} | " + " | ".join(cells) + " |")
    head = "| GPUs | capacity set | " + " | ".join(f"{n} (us)" for n in policy_names()) + " |"
    sep = "|---:|:---:|" + "---:|" * len(policy_names())
    return "\n".join([head, sep, *rows])


def memory_per_placement(quick: bool) -> float:
    n = 2_000 if quick else 5_000
    state = VisionState(
        VisionSettings(max_placements=n + 1), np.random.default_rng(0), liveness=None
    )
    for i in range(64):
        state.on_join(
            Member(f"ve-{i}", MemberKind.VISION_MACHINE, 1, VisionMachineShape(8, 0), 0), 0
        )
    shot = [ImageRequest(1280, 800)]
    ids = [f"req-{i:08d}" for i in range(n)]  # ids belong to the caller, not the table
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for request_id in ids:
        state.place(request_id, shot, 0)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / n


def fill_imbalance() -> str:
    rng = np.random.default_rng(5)
    sizes = [patches(1280, 800, 16), patches(1920, 1080, 16), 1_024, 256]
    counts = [int(c) for c in rng.choice(sizes, size=1_024, p=[0.4, 0.1, 0.3, 0.2])]
    cells = []
    for name in policy_names():
        _, fleet = place_many(
            make_policy(name),
            VisionFleet.empty(_topology(128, 0)),
            counts,
            np.random.default_rng(9),
        )
        cells.append(f"{imbalance(fleet):.3f}")
    head = "| " + " | ".join(policy_names()) + " |"
    return "\n".join([head, "|" + "---:|" * len(cells), "| " + " | ".join(cells) + " |"])


async def daemon_rates(quick: bool) -> dict[str, float]:
    """Calls per second and ratios to the no-op, as in
    :func:`benchmarks.common.paired_rates`; requests are built before timing."""
    workers = 8
    per_worker = 25 if quick else 200
    rounds = 3 if quick else 5
    # Machines do not heartbeat during the benchmark: keep them from lapsing.
    overrides = {"fleet": {"heartbeat_timeout_ms": 3_600_000}}
    async with running_server(overrides) as daemon, FulcrumClient(daemon.address) as c:
        for i in range(64):
            await c.fleet.Register(
                fpb.RegisterRequest(
                    member_id=f"ve-{i}", vision_machine=fpb.VisionMachineShape(gpus=8)
                )
            )
        image = pb.Image(width=1280, height=800)
        unary: list[list[pb.PlaceImagesRequest]] = []
        stream: list[list[pb.PlaceImagesStreamRequest]] = []

        def build(r: int) -> None:
            unary[:] = [
                [
                    pb.PlaceImagesRequest(request_id=f"u{r}-{w}-{k}", images=[image])
                    for k in range(per_worker)
                ]
                for w in range(workers)
            ]
            stream[:] = [
                [
                    pb.PlaceImagesStreamRequest(
                        sequence=k,
                        place=pb.PlaceImagesRequest(request_id=f"s{r}-{w}-{k}", images=[image]),
                    )
                    for k in range(per_worker)
                ]
                for w in range(workers)
            ]

        async def place(w: int) -> None:
            for request in unary[w]:
                await c.vision.PlaceImages(request)

        async def place_stream(w: int) -> None:
            await stream_all(c.vision.PlaceImagesStream, stream[w])

        state = daemon.app.components["vision"]
        return await paired_rates(
            c,
            workers=workers,
            per_worker=per_worker,
            rounds=rounds,
            place=place,
            place_stream=place_stream,
            before_round=build,
            after_round=lambda: state.expire(1 << 62),  # empty the table (untimed)
        )


def daemon_table(rates: dict[str, float]) -> str:
    rows = [
        ("PlaceImages (unary)", rates["place"], rates["ping"], "Ping", rates["ratio"]),
        ("PlaceImagesStream", rates["place_s"], rates["ping_s"], "PingStream", rates["ratio_s"]),
    ]
    lines = [
        "| call | calls/s | no-op calls/s | ratio to no-op (median of rounds) |",
        "|---|---:|---:|---:|",
    ]
    for name, rate, base, base_name, ratio in rows:
        lines.append(f"| {name} | {rate:,.0f} | {base:,.0f} ({base_name}) | {ratio:.2f} |")
    return "\n".join(lines)


def run(quick: bool) -> str:
    core = core_table(quick)
    mem = memory_per_placement(quick)
    rates = asyncio.run(daemon_rates(quick))
    fill = fill_imbalance()
    cmd = "make bench" + ("-quick" if quick else "")
    return f"""### Vision-encoder balancer

Core cost per decision (`select` of one 4,000-patch screenshot; thread CPU time, best of repeats;
8 GPUs per machine; random loads). The default `random_machine` touches only the drawn
machine's GPUs; a capacity adds the filter (one vectorised pass only when the drawn
machine is full).

{core}

Through the daemon (client and daemon in one process on loopback, 8 concurrent callers,
one 1280x800 screenshot per call, 64 machines x 8 GPUs; median of rounds):

{daemon_table(rates)}

Memory per placement held (one image, tracemalloc): {mem:,.0f} bytes.

Fill imbalance, max/mean patches in flight after 1,024 mixed images on 16 x 8 GPUs
(nothing released; lumpy images keep greedy placement above 1):

{fill}

Command: `{cmd}` (or `.venv/bin/python benchmarks/bench_vision.py{" --quick" if quick else ""}`).
"""


if __name__ == "__main__":
    print(run("--quick" in sys.argv))
