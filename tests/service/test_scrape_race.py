"""One owner for state: /metrics scrapes from other threads during placement storms.

Two threads scrape /metrics over real HTTP, back to back, while the event loop serves
decode and vision placement and release storms through real gRPC, with members joining
and leaving meanwhile. Every scrape must answer 200 with a parseable exposition and no
negative load; every call must get OK or a documented refusal (never INTERNAL); after
the storm, once everything is released, the tables are exactly back at zero and the
last scrape shows it. (Before the fix, the vision collector rebuilt state in the scrape
thread: about 60% of scrapes answered 500 and the state drifted negative.)
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.client import FulcrumClient
from fulcrum.service.looplag import INTERVAL_S, LagMonitor
from fulcrum.service.server import Daemon
from fulcrum.state.decode import DecodeState
from fulcrum.state.vision import VisionState
from fulcrum.testing import running_server
from fulcrum.v1 import decode_pb2 as dpb
from fulcrum.v1 import fleet_pb2 as fpb
from fulcrum.v1 import vision_pb2 as vpb
from tests.polling import until

LOAD_SERIES = (
    "fulcrum_decode_gpu_concurrency",
    "fulcrum_decode_gpu_kv_tokens",
    "fulcrum_decode_instance_concurrency",
    "fulcrum_vision_gpu_patches_in_flight",
    "fulcrum_vision_machine_patches_in_flight",
    "fulcrum_decode_placements_held",
    "fulcrum_vision_placements_held",
)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}


@dataclass
class Scraper:
    """Scrapes /metrics back to back in a thread until ``stop`` is set."""

    url: str
    stop: threading.Event
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    negatives: list[str] = field(default_factory=list)
    last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def run(self) -> None:
        while not self.stop.is_set():
            self.once()
        self.once()  # one more after the storm: the final state

    def once(self) -> None:
        try:
            with urllib.request.urlopen(self.url, timeout=30) as resp:
                status = resp.status
                text = resp.read().decode()
        except urllib.error.HTTPError as err:
            self.failures.append(f"HTTP {err.code}")
            return
        except Exception as err:  # every failure is a finding
            self.failures.append(repr(err))
            return
        if status != 200:
            self.failures.append(f"HTTP {status}")
            return
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                samples[key] = s.value
                if s.name in LOAD_SERIES and s.value < 0:
                    self.negatives.append(f"{s.name}{s.labels} = {s.value}")
        self.last = samples
        self.ok += 1


async def _register(client: FulcrumClient, prefix: str, i: int, kind: str) -> int:
    if kind == "decode":
        gpus = [fpb.DecodeGpuCapacity(max_concurrency=32, max_kv_tokens=400_000)] * 8
        request = fpb.RegisterRequest(
            member_id=f"{prefix}{i}", decode_instance=fpb.DecodeInstanceShape(gpus=gpus)
        )
    else:
        request = fpb.RegisterRequest(
            member_id=f"{prefix}{i}",
            vision_machine=fpb.VisionMachineShape(gpus=4, max_patches_in_flight=40_000),
        )
    return int((await client.fleet.Register(request)).incarnation)


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def test_concurrent_scrapes_during_placement_storms() -> None:
    # No heartbeats in this test: members must not lapse during the storm.
    async with running_server({"fleet": {"heartbeat_timeout_ms": 3_600_000}}) as daemon:
        await _storm(daemon)


async def _storm(daemon: Daemon) -> None:
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    stop = threading.Event()
    scrapers = [Scraper(url, stop) for _ in range(2)]
    threads = [threading.Thread(target=s.run, daemon=True) for s in scrapers]
    codes: dict[grpc.StatusCode, int] = {}

    def count(code: grpc.StatusCode) -> None:
        codes[code] = codes.get(code, 0) + 1

    async with FulcrumClient(daemon.address, timeout_s=30.0) as client:
        for i in range(4):
            await _register(client, "dec-", i, "decode")
            await _register(client, "ve-", i, "vision")
        for t in threads:
            t.start()

        async def decode_worker(w: int, rounds: int) -> None:
            for r in range(rounds):
                ids = [f"d{w}-{r}-{k}" for k in range(8)]
                for k, rid in enumerate(ids):
                    count(await _code(client.decode.PlaceDecode(
                        dpb.PlaceDecodeRequest(request_id=rid, kv_tokens=1_000 + 97 * k)
                    )))
                for rid in ids:
                    count(await _code(client.decode.ReleaseDecode(
                        dpb.ReleaseDecodeRequest(request_id=rid)
                    )))

        async def vision_worker(w: int, rounds: int) -> None:
            image = vpb.Image(width=640, height=480)
            for r in range(rounds):
                ids = [f"v{w}-{r}-{k}" for k in range(8)]
                for rid in ids:
                    count(await _code(client.vision.PlaceImages(
                        vpb.PlaceImagesRequest(request_id=rid, images=[image, image])
                    )))
                for k, rid in enumerate(ids):
                    count(await _code(client.vision.ReleaseImages(
                        vpb.ReleaseImagesRequest(request_id=rid)
                    )))
                    count(await _code(client.vision.GetMachineLoad(
                        vpb.GetMachineLoadRequest(machine_id=f"ve-{k % 4}")
                    )))

        async def churn(rounds: int) -> None:
            """Members join and leave during the storm (their placements are lost)."""
            for r in range(rounds):
                kind = "decode" if r % 2 else "vision"
                prefix = "dec-x" if kind == "decode" else "ve-x"
                inc = await _register(client, prefix, r, kind)
                count(await _code(client.fleet.Deregister(
                    fpb.DeregisterRequest(member_id=f"{prefix}{r}", incarnation=inc)
                )))

        # Storm rounds until both scrapers have scraped repeatedly during the storm
        # (a condition, not a sleep).
        storms = 0
        while storms < 3 or min(s.ok for s in scrapers) < 5:
            await asyncio.gather(
                *(decode_worker(w, 4) for w in range(4)),
                *(vision_worker(w, 4) for w in range(4)),
                churn(6),
            )
            storms += 1
            assert storms < 200, "scrapers made no progress"
        stop.set()
        for t in threads:
            await asyncio.to_thread(t.join, 60)
            assert not t.is_alive(), "a scraper did not stop within 60 s"

    for s in scrapers:
        assert s.failures == []
        assert s.negatives == []
    assert set(codes) <= ALLOWED, codes
    assert codes.get(grpc.StatusCode.OK, 0) > 0

    decode = daemon.app.components["decode"]
    vision = daemon.app.components["vision"]
    assert isinstance(decode, DecodeState) and isinstance(vision, VisionState)
    assert len(list(decode.gpu_loads())) == 32 and len(vision.machine_ids()) == 4
    assert decode.held == 0 and vision.held == 0
    assert all(c == 0 and k == 0 for _, _, c, k in decode.gpu_loads())
    assert all(p == 0 for _, _, p in vision.gpu_loads())
    for machine_id in vision.machine_ids():
        loads, _, images = vision.machine_load(machine_id)
        assert loads == [0] * len(loads) and images == 0
    decode.view.check()
    # The last scrape (after the storm) shows the state exactly at zero.
    last = scrapers[0].last
    for name in LOAD_SERIES:
        values = [v for (n, _), v in last.items() if n == name]
        assert values and all(v == 0 for v in values), name


async def test_scrape_is_bounded_at_scale() -> None:
    """Per-GPU series are bounded by metrics_gpu_series; per-member sums always exported."""
    overrides = {"decode": {"metrics_gpu_series": 16}, "vision": {"metrics_gpu_series": 8}}
    async with (
        running_server(overrides) as daemon,
        FulcrumClient(daemon.address, timeout_s=30.0) as client,
    ):
        for i in range(6):
            await _register(client, "dec-", i, "decode")  # 48 GPUs
            await _register(client, "ve-", i, "vision")  # 24 GPUs
        for k in range(3):
            await client.decode.PlaceDecode(
                dpb.PlaceDecodeRequest(request_id=f"r{k}", kv_tokens=10_000)
            )
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=30
            ).read().decode()
        )
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert len(fams["fulcrum_decode_gpu_concurrency"].samples) == 16
    assert len(fams["fulcrum_vision_gpu_patches_in_flight"].samples) == 8
    assert len(fams["fulcrum_decode_instance_concurrency"].samples) == 6
    assert len(fams["fulcrum_vision_machine_patches_in_flight"].samples) == 6
    assert fams["fulcrum_decode_gpus"].samples[0].value == 48
    # The three loaded GPUs are among the exported ones.
    loaded = [s for s in fams["fulcrum_decode_gpu_concurrency"].samples if s.value > 0]
    assert sum(s.value for s in loaded) == 3
    assert sum(s.value for s in fams["fulcrum_decode_instance_concurrency"].samples) == 3


async def test_event_loop_lag_histogram_sees_a_stall(daemon: Daemon) -> None:
    """A deliberate 120 ms stall of the loop shows as a lag of at least 70 ms (the stall
    minus the probe's 50 ms period), in the monitor and in the exported histogram."""
    monitor = daemon.app.components["loop_lag"]
    assert isinstance(monitor, LagMonitor)
    start = monitor.samples
    await until(lambda: monitor.samples >= start + 2, "the lag probe runs", period_s=0)
    time.sleep(0.12)  # a handler holding the loop
    seen = monitor.samples
    await until(lambda: monitor.samples != seen, "a probe sample after the stall",
                period_s=0)
    assert monitor.max_s >= 0.12 - INTERVAL_S
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=30
        ).read().decode()
    )
    [fam] = [f for f in text_string_to_metric_families(text)
             if f.name == "fulcrum_event_loop_lag_seconds"]
    buckets = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert buckets["+Inf"] > buckets["0.05"]  # at least one wake-up 50 ms late or more
