"""Overload benchmark: does the daemon stay responsive at ten times its sustainable load?

The daemon runs as a separate process (``fulcrum serve`` with a temporary config), so that
its CPU and memory are its own; the load generator and a health probe run here, each on
their own connections. Phases:

1. *idle*: health-check latency with nothing else running;
2. *sustainable*: closed-loop VE placements of 256 images each (PlaceImages +
   ReleaseImages pairs: heavy for the daemon, light for the client, so that one Python
   client can overload it). The daemon's capacity C is one core divided by its CPU time
   per pair; the no-op Ping is measured the same way, for the ratio;
3. *10x*: open-loop arrivals at 10 C over several connections, with every call's final
   code counted. Health latency is probed throughout.

Memory is the daemon's resident set (VmRSS) before, at peak and after the load stopped.
Run alone: ``.venv/bin/python benchmarks/bench_overload.py [--quick]``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from grpc_health.v1 import health_pb2

from fulcrum.client import FulcrumClient
from fulcrum.v1 import (
    decode_pb2,
    diagnostics_pb2,
    expert_pb2,
    fleet_pb2,
    prefill_pb2,
    vision_pb2,
)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import md_table, percentiles, progress  # noqa: E402

LOCAL = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
#: Images per PlaceImages call of the overload phases (1280 x 800 screenshots).
IMAGES = 256
_IMAGES = [vision_pb2.Image(width=1280, height=800, patch_size=16)] * IMAGES
#: Client deadline (s) of each call of the 10x phase; it also bounds the drain after it.
DEADLINE_S = 5.0
#: How the daemon is started (experiments may wrap it).
DAEMON_CMD: list[str] = ["-m", "fulcrum.cli"]
#: Generator processes of the 10x phase (1 = in this process, over 4 connections).
GENERATOR_PROCS = 1
#: Closed-loop calls refused with a retry hint (and retried after it), one counter per run.
CLOSED_LOOP_SHED = [0]
#: Extra server.admission and server settings (experiments).
ADMISSION_EXTRA: dict[str, Any] = {}
SERVER_EXTRA: dict[str, Any] = {}


async def _vision_pair(c: FulcrumClient, rid: str, timeout: float | None = None) -> None:
    await c.vision.PlaceImages(
        vision_pb2.PlaceImagesRequest(request_id=rid, images=_IMAGES), timeout=timeout
    )
    await c.vision.ReleaseImages(vision_pb2.ReleaseImagesRequest(request_id=rid),
                                 timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DaemonProcess:
    """``fulcrum serve`` in a subprocess with a temporary configuration."""

    def __init__(
        self, tmp: Path, max_placements: int, metrics: bool = False, admission: bool = True
    ) -> None:
        self.port = _free_port()
        self.metrics_port = _free_port() if metrics else 0
        self.config: dict[str, Any] = {
            "server": {"host": "127.0.0.1", "port": self.port, "seed": 1, "grace_period_s": 5,
                       "admission": {"enabled": admission, **ADMISSION_EXTRA},
                       **SERVER_EXTRA},
            "metrics": {"enabled": metrics, "port": self.metrics_port},
            "logging": {"level": "warning", "format": "json"},
            "fleet": {"heartbeat_timeout_ms": 600_000},
            "decode": {"max_placements": max_placements},
            "vision": {"max_images_per_request": IMAGES},
        }
        path = self.path = tmp / "fulcrum.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self.log = (tmp / "daemon.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, *DAEMON_CMD, "serve", "--config", str(path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.address = f"127.0.0.1:{self.port}"

    def reload(self, decode_max_placements: int) -> None:
        """Rewrite the configuration with another decode bound and send SIGHUP."""
        self.config["decode"]["max_placements"] = decode_max_placements
        self.path.write_text(yaml.safe_dump(self.config))
        self.proc.send_signal(signal.SIGHUP)

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The daemon's /metrics as {(sample, labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        return {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(text)
            for x in family.samples
        }

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, lab), v in self.scrape().items() if n == name and want <= set(lab))

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with FulcrumClient(self.address, timeout_s=1.0, options=LOCAL) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}")
                try:
                    reply = await c.health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("daemon did not become ready")
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.log.close()


_PROBE = r"""
import asyncio, json, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

async def main(address, period_s):
    lat, fail = [], {}
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        req = health_pb2.HealthCheckRequest()
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        stop = asyncio.ensure_future(reader.read())
        while not stop.done():
            t0 = time.perf_counter()
            try:
                await stub.Check(req, timeout=5)
                lat.append(time.perf_counter() - t0)
            except grpc.aio.AioRpcError as err:
                fail[err.code().name] = fail.get(err.code().name, 0) + 1
            await asyncio.wait([stop], timeout=period_s)
    print(json.dumps({"latencies": lat, "failures": fail}))

asyncio.run(main(sys.argv[1], float(sys.argv[2])))
"""


class Probe:
    """Health checks every ``period_s`` from a separate process (as a kubelet probes), so
    that the load generator's own event loop does not delay them; latencies in s."""

    def __init__(self, address: str, period_s: float = 0.02) -> None:
        self.address = address
        self.period_s = period_s
        self.failures: dict[str, int] = {}
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _PROBE, self.address, str(self.period_s),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )

    async def stop(self) -> list[float]:
        assert self._proc is not None
        out, _ = await self._proc.communicate(b"")
        result = json.loads(out.decode())
        self.failures = dict(result["failures"])
        return [float(x) for x in result["latencies"]]


async def _closed_loop(
    workers: int, duration_s: float, op: Callable[[int], Awaitable[None]]
) -> float:
    """Ops per second of ``workers`` loops each calling ``op`` back to back."""
    counter = itertools.count()
    done = 0
    stop_at = time.perf_counter() + duration_s
    shed_retries = CLOSED_LOOP_SHED

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            try:
                await op(next(counter))
            except grpc.aio.AioRpcError as err:  # shed: retry after the hint, as clients do
                hint = dict(err.trailing_metadata() or ()).get("retry-after-ms")
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or hint is None:
                    raise
                shed_retries[0] += 1
                await asyncio.sleep(int(hint) / 1000)
                continue
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return done / (time.perf_counter() - t0)


async def _open_loop(
    rate: float, duration_s: float, clients: list[FulcrumClient], max_outstanding: int
) -> tuple[float, collections.Counter[str], int]:
    """Arrivals at ``rate`` per second for ``duration_s`` (each a place + release pair on a
    round-robin connection); returns the offered rate achieved, the final codes and how
    many arrivals the generator itself shed (more than ``max_outstanding`` in flight)."""
    codes: collections.Counter[str] = collections.Counter()
    outstanding: set[asyncio.Task[None]] = set()
    shed = 0
    ids = itertools.count()

    async def one(c: FulcrumClient, i: int) -> None:
        try:
            await _vision_pair(c, f"o-{i}", timeout=DEADLINE_S)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as err:
            hint = dict(err.trailing_metadata() or ()).get("retry-after-ms")
            codes[err.code().name + ("+retry-after-ms" if hint else "")] += 1

    t0 = time.perf_counter()
    sent = 0
    while (now := time.perf_counter() - t0) < duration_s:
        due = int(now * rate) - sent
        for _ in range(max(0, due)):
            sent += 1
            if len(outstanding) >= max_outstanding:
                shed += 1
                continue
            i = next(ids)
            task = asyncio.ensure_future(one(clients[i % len(clients)], i))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
        await asyncio.sleep(0.001)
    offered = sent / (time.perf_counter() - t0)
    if outstanding:
        await asyncio.gather(*outstanding, return_exceptions=True)
    return offered, codes, shed


_GENERATOR = r"""
import asyncio, collections, itertools, json, sys, time
import grpc
sys.path.insert(0, sys.argv[5])
from benchmarks.bench_overload import _vision_pair, DEADLINE_S, LOCAL
from fulcrum.client import FulcrumClient

async def main(address, rate, duration_s, tag):
    clients = [FulcrumClient(address, timeout_s=10.0, options=[*LOCAL, ("fulcrum.conn", k)])
               for k in range(2)]
    codes = collections.Counter()
    outstanding = set()
    sent = 0

    async def one(c, i):
        try:
            await _vision_pair(c, f"{tag}-{i}", timeout=DEADLINE_S)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as err:
            hint = dict(err.trailing_metadata() or ()).get("retry-after-ms")
            codes[err.code().name + ("+retry-after-ms" if hint else "")] += 1

    t0 = time.perf_counter()
    while (now := time.perf_counter() - t0) < duration_s:
        for _ in range(max(0, int(now * rate) - sent)):
            sent += 1
            task = asyncio.ensure_future(one(clients[sent % 2], sent))
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
        await asyncio.sleep(0.002)
    offered = sent / (time.perf_counter() - t0)
    await asyncio.gather(*outstanding, return_exceptions=True)
    print(json.dumps({"offered": offered, "codes": codes}))

asyncio.run(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
"""


async def _open_loop_procs(
    address: str, rate: float, duration_s: float, procs: int
) -> tuple[float, collections.Counter[str], int]:
    """:func:`_open_loop` from ``procs`` generator processes (``rate / procs`` each), so
    that the generator is not the bottleneck; same return values."""
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", _GENERATOR, address, str(rate / procs), str(duration_s),
            f"p{k}", str(ROOT), stdout=asyncio.subprocess.PIPE,
        )
        for k in range(procs)
    ]
    codes: collections.Counter[str] = collections.Counter()
    offered = 0.0
    for child in children:
        out, _ = await child.communicate()
        result = json.loads(out.decode())
        offered += float(result["offered"])
        codes.update(result["codes"])
    return offered, codes, 0


async def measure(quick: bool, admission: bool = True) -> dict[str, Any]:
    # Long enough for a few hundred health probes per phase (one every 20 ms).
    phase_s = 1.5 if quick else 4.0
    max_placements = 2_000
    out: dict[str, Any] = {"admission": admission}
    with tempfile.TemporaryDirectory() as tmpdir:
        daemon = DaemonProcess(Path(tmpdir), max_placements, admission=admission)
        try:
            await daemon.wait_ready()
            out["rss_start"] = daemon.rss_bytes()
            async with FulcrumClient(daemon.address, timeout_s=10.0) as c:
                for i in range(8):
                    await c.fleet.Register(fleet_pb2.RegisterRequest(
                        member_id=f"ve-{i}",
                        vision_machine=fleet_pb2.VisionMachineShape(
                            gpus=8, max_patches_in_flight=1 << 40)))
                probe = Probe(daemon.address)
                progress("overload: idle")
                await probe.start()
                await asyncio.sleep(phase_s / 2)  # idle: probes only
                out["idle"] = await probe.stop()

                async def ping(_: int) -> None:
                    await c.diagnostics.Ping(diagnostics_pb2.PingRequest())

                async def pair(i: int) -> None:
                    await _vision_pair(c, f"s-{i}")

                workers = 16
                progress("overload: sustainable load")
                out["ping_rate"] = await _closed_loop(workers, phase_s / 2, ping)
                await probe.start()
                cpu0, t0 = daemon.cpu_seconds(), time.perf_counter()
                out["pair_rate"] = await _closed_loop(workers, phase_s, pair)
                elapsed = time.perf_counter() - t0
                out["sustained"] = await probe.stop()
                cpu = daemon.cpu_seconds() - cpu0
                out["cpu_sustained"] = cpu / elapsed
                # the daemon's own capacity: one core divided by its CPU time per pair
                out["capacity"] = out["pair_rate"] * elapsed / max(cpu, 1e-9)
                out["rss_sustained"] = daemon.rss_bytes()

                clients = [FulcrumClient(daemon.address, timeout_s=10.0,
                                         options=[*LOCAL, ("fulcrum.conn", k)])
                           for k in range(4)]
                peak = 0

                async def sample_rss() -> None:
                    nonlocal peak
                    while True:
                        peak = max(peak, daemon.rss_bytes())
                        await asyncio.sleep(0.1)

                sampler = asyncio.ensure_future(sample_rss())
                progress(f"overload: 10x ({10 * out['capacity']:,.0f} pairs/s offered)")
                await probe.start()
                cpu0, t0 = daemon.cpu_seconds(), time.perf_counter()
                target = 10 * out["capacity"]
                if GENERATOR_PROCS > 1:
                    offered, codes, shed = await _open_loop_procs(
                        daemon.address, target, phase_s, GENERATOR_PROCS)
                else:
                    offered, codes, shed = await _open_loop(target, phase_s, clients, 20_000)
                out["overload"] = await probe.stop()
                out["probe_failures"] = dict(probe.failures)
                out["cpu_overload"] = (daemon.cpu_seconds() - cpu0) / (time.perf_counter() - t0)
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
                out.update(target=target, offered=offered, codes=dict(codes), shed=shed,
                           rss_peak=peak)
                for k in clients:
                    await k.close()
                # the table is empty again: every placement was released or refused
                # (calls left waiting by the 10x phase may still shed it: retry after the hint)
                for attempt in range(20):
                    try:
                        await _vision_pair(c, f"final-{attempt}")
                        break
                    except grpc.aio.AioRpcError as err:
                        hint = dict(err.trailing_metadata() or ()).get("retry-after-ms")
                        if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or hint is None:
                            raise
                        await asyncio.sleep(int(hint) / 1000)
            out["rss_end"] = daemon.rss_bytes()
        finally:
            daemon.stop()
    return out


# -- soak ---------------------------------------------------------------------------------


async def _until(stop: asyncio.Event, period_s: float) -> bool:
    """Wait ``period_s`` or until ``stop``; True while the soak goes on."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=period_s)
    return not stop.is_set()


async def soak(quick: bool) -> dict[str, Any]:
    """Engines join and leave, prefill submits and pulls, decode and VE placements and
    releases, expert-load reports and SIGHUP reloads, all at once for a bounded time;
    RSS is sampled, and every request is accounted for at the end."""
    # Long enough for ~15 SIGHUP reloads and ~30 member churns (full mode).
    duration_s = 8.0 if quick else 30.0
    out: dict[str, Any] = {"duration_s": duration_s}
    counts: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmpdir:
        daemon = DaemonProcess(Path(tmpdir), 5_000, metrics=True)
        try:
            await daemon.wait_ready()
            stop = asyncio.Event()
            ids = itertools.count()
            async with FulcrumClient(daemon.address, timeout_s=10.0) as c:

                async def register(name: str) -> int:
                    if name.startswith("engine"):
                        shape: dict[str, Any] = {
                            "prefill_engine": fleet_pb2.PrefillEngineShape(dp_ranks=2)}
                    elif name.startswith("decode"):
                        shape = {"decode_instance": fleet_pb2.DecodeInstanceShape(gpus=[
                            fleet_pb2.DecodeGpuCapacity(max_concurrency=256,
                                                        max_kv_tokens=1 << 30)] * 4)}
                    else:
                        shape = {"vision_machine": fleet_pb2.VisionMachineShape(
                            gpus=4, max_patches_in_flight=1 << 30)}
                    reply = await c.fleet.Register(
                        fleet_pb2.RegisterRequest(member_id=name, **shape))
                    return int(reply.incarnation)

                incarnations = {n: await register(n) for n in
                                ("engine-0", "engine-1", "decode-0", "decode-1", "ve-0")}

                async def churn() -> None:  # one member leaves and comes back, in turn
                    names = ["engine-1", "decode-1"]
                    k = 0
                    while await _until(stop, 1.0):
                        name = names[k % 2]
                        k += 1
                        with contextlib.suppress(grpc.aio.AioRpcError):
                            await c.fleet.Deregister(fleet_pb2.DeregisterRequest(
                                member_id=name, incarnation=incarnations[name]))
                            counts["left"] += 1
                        incarnations[name] = await register(name)
                        counts["joined"] += 1

                async def puller(name: str) -> None:
                    while not stop.is_set():
                        try:
                            # A leased pull, acknowledged at once as the kit's engine
                            # does (a submit resolves on the acknowledgement).
                            reply = await c.prefill.Pull(prefill_pb2.PullRequest(
                                engine_id=name, incarnation=incarnations[name],
                                remaining_quota_ns=10**12, rank_loads_ns=[0, 0],
                                max_wait_ms=100))
                            if reply.requests:
                                await c.prefill.Ack(prefill_pb2.AckRequest(
                                    engine_id=name, incarnation=incarnations[name],
                                    request_ids=[r.request_id for r in reply.requests]))
                            counts["pulled"] += len(reply.requests)
                        except grpc.aio.AioRpcError:
                            await asyncio.sleep(0.01)

                async def submitter() -> None:
                    while not stop.is_set():
                        counts["submitted"] += 1
                        try:
                            await c.prefill.Submit(prefill_pb2.SubmitRequest(
                                request_id=f"p-{next(ids)}", total_tokens=3000,
                                cached_tokens=1000, max_wait_ms=2000))
                            counts["submit_ok"] += 1
                        except grpc.aio.AioRpcError as err:
                            counts[f"submit_{err.code().name}"] += 1

                async def decoder() -> None:
                    while not stop.is_set():
                        rid = f"d-{next(ids)}"
                        try:
                            await c.decode.PlaceDecode(decode_pb2.PlaceDecodeRequest(
                                request_id=rid, kv_tokens=5000))
                        except grpc.aio.AioRpcError as err:
                            counts[f"decode_{err.code().name}"] += 1
                            continue
                        counts["decode_placed"] += 1
                        try:
                            await c.decode.ReleaseDecode(
                                decode_pb2.ReleaseDecodeRequest(request_id=rid))
                            counts["decode_released"] += 1
                        except grpc.aio.AioRpcError as err:  # NOT_FOUND: lost with its instance
                            counts[f"decode_release_{err.code().name}"] += 1

                async def imager() -> None:
                    while not stop.is_set():
                        rid = f"v-{next(ids)}"
                        try:
                            await c.vision.PlaceImages(vision_pb2.PlaceImagesRequest(
                                request_id=rid,
                                images=[vision_pb2.Image(width=1280, height=800,
                                                         patch_size=16)]))
                            await c.vision.ReleaseImages(
                                vision_pb2.ReleaseImagesRequest(request_id=rid))
                            counts["images"] += 1
                        except grpc.aio.AioRpcError as err:
                            counts[f"vision_{err.code().name}"] += 1

                async def reporter() -> None:
                    rng = np.random.default_rng(3)
                    reply = await c.expert.RegisterGroup(expert_pb2.RegisterGroupRequest(
                        group_id="soak", role=expert_pb2.GROUP_ROLE_DECODE, ep_size=4,
                        num_layers=2, num_experts=16, expert_bytes=1 << 20,
                        window_steps=100, period_steps=200))
                    version, step = reply.map_version, 0
                    while await _until(stop, 0.02):
                        load = rng.integers(0, 1000, (2, 16), dtype=np.int64)
                        try:
                            r = await c.expert.ReportLoad(expert_pb2.ReportLoadRequest(
                                group_id="soak", map_version=version, step_begin=step,
                                step_end=step + 10,
                                load=expert_pb2.Tensor(dtype="int64", shape=[2, 16],
                                                       data=load.tobytes())))
                            version, step = r.map_version, step + 10
                            counts["reports"] += 1
                            counts["rebalances"] += int(r.rebalanced)
                        except grpc.aio.AioRpcError as err:
                            counts[f"report_{err.code().name}"] += 1
                            step += 10

                async def reloader() -> None:
                    k = 0
                    while await _until(stop, 2.0):
                        k += 1
                        daemon.reload(5_000 + (k % 2) * 1_000)
                        counts["reloads_sent"] += 1

                rss: list[tuple[float, int]] = []

                async def sampler() -> None:
                    t0 = time.perf_counter()
                    while True:
                        rss.append((time.perf_counter() - t0, daemon.rss_bytes()))
                        if not await _until(stop, 0.5):
                            return

                tasks = [asyncio.ensure_future(x) for x in (
                    churn(), puller("engine-0"), puller("engine-1"), submitter(), submitter(),
                    decoder(), decoder(), imager(), reporter(), reloader(), sampler())]
                progress(f"overload: soak for {duration_s:.0f} s")
                await asyncio.sleep(duration_s)
                stop.set()
                await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
                # accounting: nothing queued or held, one outcome per submit
                out["queued"] = await asyncio.to_thread(
                    daemon.total, "fulcrum_prefill_queue_depth")
                out["decode_held"] = await asyncio.to_thread(
                    daemon.total, "fulcrum_decode_placements_held")
                out["vision_held"] = await asyncio.to_thread(
                    daemon.total, "fulcrum_vision_placements_held")
                out["reloads_applied"] = await asyncio.to_thread(
                    daemon.total, "fulcrum_config_reloads_total", outcome="applied")
                out["internal"] = await asyncio.to_thread(
                    daemon.total, "fulcrum_rpc_requests_total", code="INTERNAL") + (
                    await asyncio.to_thread(daemon.total, "fulcrum_rpc_requests_total",
                                            code="UNKNOWN"))
            out["rss"] = rss
            out["counts"] = dict(counts)
        finally:
            daemon.stop()
    return out


def soak_section(r: dict[str, Any], quick: bool) -> str:
    mib = 1024 * 1024
    rss = [b for _, b in r["rss"]]
    quarter = max(1, len(rss) // 4)
    first, last = sum(rss[:quarter]) / quarter, sum(rss[-quarter:]) / quarter
    c = r["counts"]
    ended = sum(v for k, v in c.items() if k.startswith("submit_"))
    rows = [
        ["duration", f"{r['duration_s']:.0f} s"],
        ["members joined / left (churn)", f"{c.get('joined', 0)} / {c.get('left', 0)}"],
        ["prefill submitted / ended (OK + refused)",
         f"{c.get('submitted', 0):,} / {ended:,} (OK {c.get('submit_ok', 0):,}; pulled "
         f"{c.get('pulled', 0):,})"],
        ["decode placed / released / lost with their instance",
         f"{c.get('decode_placed', 0):,} / {c.get('decode_released', 0):,} / "
         f"{c.get('decode_release_NOT_FOUND', 0):,}"],
        ["images placed and released", f"{c.get('images', 0):,}"],
        ["expert-load reports / rebalances",
         f"{c.get('reports', 0):,} / {c.get('rebalances', 0)}"],
        ["SIGHUP reloads sent / applied",
         f"{c.get('reloads_sent', 0)} / {r['reloads_applied']:.0f}"],
        ["left at the end: queued / decode held / VE held",
         f"{r['queued']:.0f} / {r['decode_held']:.0f} / {r['vision_held']:.0f}"],
        ["calls ended INTERNAL or UNKNOWN", f"{r['internal']:.0f}"],
        ["daemon RSS first quarter / last quarter / max",
         f"{first / mib:.1f} / {last / mib:.1f} / {max(rss) / mib:.1f} MiB"],
    ]
    other = {k: v for k, v in c.items() if k.startswith(("submit_", "decode_", "vision_",
                                                          "report_")) and not k.endswith(
        ("_ok", "_placed", "_released"))}
    cmd = "python benchmarks/run.py --only overload" + (" --quick" if quick else "")
    if GENERATOR_PROCS > 1:
        cmd = f"python benchmarks/bench_overload.py --procs {GENERATOR_PROCS}" + (
            " --quick" if quick else "")
    return "\n".join([
        "### Soak: churn, placements, reports and reloads together",
        "",
        md_table(["figure", "value"], rows),
        "",
        f"Other final codes: {other or 'none'}. Command: `{cmd}`",
        "",
    ])


def _ms(xs: list[float]) -> tuple[str, str, str]:
    p50, p99 = percentiles(xs, (50, 99))
    return f"{p50 * 1e3:.2f}", f"{p99 * 1e3:.2f}", f"{max(xs) * 1e3:.2f}" if xs else "-"


def run(quick: bool) -> str:
    # the baseline (admission control off) is measured in the same run
    off = asyncio.run(measure(quick, admission=False))
    on = asyncio.run(measure(quick, admission=True))
    on["baseline_codes"] = off["codes"]
    on["baseline_offered"] = off["offered"]
    return overload_section(on, quick) + "\n" + soak_section(asyncio.run(soak(quick)), quick)


def _answered(codes: dict[str, int]) -> float:
    """Fraction of calls the daemon answered itself: OK, or refused with retry-after-ms."""
    total = sum(codes.values()) or 1
    return sum(n for k, n in codes.items() if k == "OK" or k.endswith("+retry-after-ms")) / total


def _transport(codes: dict[str, int]) -> float:
    """Fraction of calls that ended in gRPC's transport without an answer of ours."""
    total = sum(codes.values()) or 1
    return sum(n for k, n in codes.items() if k in ("CANCELLED", "DEADLINE_EXCEEDED")) / total


def overload_section(r: dict[str, Any], quick: bool) -> str:
    mib = 1024 * 1024
    health_rows = [
        ["idle", len(r["idle"]), *_ms(r["idle"])],
        [f"sustainable ({r['pair_rate']:,.0f} pairs/s)", len(r["sustained"]), *_ms(r["sustained"])],
        [f"10x offered ({r['offered']:,.0f} pairs/s)", len(r["overload"]), *_ms(r["overload"])],
    ]
    codes = ", ".join(f"{k} {v:,}" for k, v in sorted(r["codes"].items()))
    cmd = "python benchmarks/run.py --only overload" + (" --quick" if quick else "")
    if GENERATOR_PROCS > 1:
        cmd = f"python benchmarks/bench_overload.py --procs {GENERATOR_PROCS}" + (
            " --quick" if quick else "")
    return "\n".join([
        "### Overload: health and memory at ten times the sustainable load",
        "",
        f"Daemon in its own process (`fulcrum serve`); the load is VE place + release pairs "
        f"of {IMAGES} images each; health checks every 20 ms from a third process. The "
        "load generator shares the 2-core machine: the table states the ratio it reached.",
        "",
        md_table(["phase", "health checks", "p50 ms", "p99 ms", "max ms"], health_rows),
        "",
        md_table(
            ["figure", "value"],
            [
                ["sustainable load (closed loop, 16 callers)", f"{r['pair_rate']:,.0f} pairs/s"],
                ["no-op Ping, same callers", f"{r['ping_rate']:,.0f} calls/s"],
                ["pair / Ping ratio", f"{r['pair_rate'] / r['ping_rate']:.2f}"],
                ["daemon CPU at sustainable load", f"{r['cpu_sustained']:.0%} of a core"],
                ["daemon capacity (1 core / CPU per pair)", f"{r['capacity']:,.0f} pairs/s"],
                [f"10x capacity target / offered (open loop, "
                 f"{'4 connections' if GENERATOR_PROCS == 1 else f'{GENERATOR_PROCS} processes'})",
                 f"{r['target']:,.0f} / {r['offered']:,.0f} pairs/s "
                 f"({r['offered'] / r['capacity']:.1f}x the daemon's capacity)"],
                ["daemon CPU under 10x", f"{r['cpu_overload']:.0%} of a core"],
                [f"final codes under 10x ({DEADLINE_S:.0f} s client deadline)", codes],
                ["shed by the generator (>20,000 in flight)", f"{r['shed']:,}"],
                ["calls answered by the daemon (OK, or refused with a retry hint) / ended in "
                 "the transport (CANCELLED, DEADLINE_EXCEEDED)",
                 f"{_answered(r['codes']):.1%} / {_transport(r['codes']):.1%}"],
                *([["same, admission control off (baseline, same run): codes",
                    ", ".join(f"{k} {v:,}" for k, v in sorted(r["baseline_codes"].items()))],
                   ["same, admission control off: answered / transport",
                    f"{_answered(r['baseline_codes']):.1%} / "
                    f"{_transport(r['baseline_codes']):.1%}"]]
                  if "baseline_codes" in r else []),
                ["health-check failures under 10x", str(r["probe_failures"] or "none")],
                ["daemon RSS start / sustainable / peak / end",
                 f"{r['rss_start'] / mib:.0f} / {r['rss_sustained'] / mib:.0f} / "
                 f"{r['rss_peak'] / mib:.0f} / {r['rss_end'] / mib:.0f} MiB"],
            ],
        ),
        "",
        f"Command: `{cmd}`",
        "",
    ])


if __name__ == "__main__":
    if "--procs" in sys.argv:  # the 10x phase from several generator processes
        GENERATOR_PROCS = int(sys.argv[sys.argv.index("--procs") + 1])
    print(run("--quick" in sys.argv))
