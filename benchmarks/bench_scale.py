"""Scale benchmark: the daemon at its configured bounds, through real gRPC.

The daemon runs as its own process (``python -m fulcrum.cli serve``) with its defaults
apart from long heartbeat timeouts (members here heartbeat once) and large placement
tables; the client registers, from a cold fleet, ``fleet.max_members`` = 4,096 members:
2,048 decode instances of 64 GPUs (131,072 decode GPUs), 1,024 VE machines of 8 GPUs and
1,024 prefill engines of 8 DP ranks, then 64 EPLB groups of 58 layers x 256 experts
(``RegisterGroup``), then one heartbeat with a full load report from every decode
instance and VE machine. It then measures PlaceDecode throughput (unary and streamed)
as a ratio to Ping / PingStream in the same run (paired rounds,
:func:`benchmarks.common.paired_rates`), and scrapes /metrics.

Loop lag is the daemon's own ``fulcrum_event_loop_lag_seconds`` histogram (a probe
sleeping 10 ms at a time, ``server.loop_lag_probe_ms: 10`` instead of the default 50,
:mod:`fulcrum.service.looplag`), read from /metrics before and
after each phase: p99 is interpolated in the buckets; "max" is the upper bound of the
highest non-empty bucket. Aims: loop lag max under 20 ms; PlaceDecode at least 0.8x Ping;
/metrics under 2 MiB and 100 ms of loop time.

Run alone: ``.venv/bin/python benchmarks/bench_scale.py [--quick]`` (quick: 512 members,
8 groups).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pragma: no cover - direct execution
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    md_table,
    paired_rates,
    percentiles,
    progress,
    stream_all,
    wait_healthy,
)
from fulcrum.client import FulcrumClient  # noqa: E402
from fulcrum.v1 import decode_pb2 as dpb  # noqa: E402
from fulcrum.v1 import expert_pb2 as epb  # noqa: E402
from fulcrum.v1 import fleet_pb2 as fpb  # noqa: E402

DECODE_GPUS = 64
VE_GPUS = 8
PREFILL_RANKS = 8
LAYERS, EXPERTS = 58, 256
#: Bytes of one expert's weights (DeepSeek-V3: 3 matrices of 7168 x 2048 at 1 byte).
EXPERT_BYTES = 3 * 7168 * 2048
CONCURRENCY = 16

Buckets = dict[float, float]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def daemon_process(
    extra: dict[str, dict[str, object]] | None = None,
) -> Iterator[tuple[str, int, int]]:
    """The daemon in a child process; yields (gRPC address, metrics port, pid).
    ``extra``: settings merged into each section of the config (its other benches)."""
    port, mport = _free_port(), _free_port()
    cfg = {
        # The probe at 10 ms, not the default 50: the loop-lag aim is about 20 ms stalls,
        # which a 50 ms probe sees only when one of its wake-ups falls in them.
        "server": {"host": "127.0.0.1", "port": port, "seed": 7, "loop_lag_probe_ms": 10},
        "metrics": {"enabled": True, "host": "127.0.0.1", "port": mport},
        "logging": {"level": "error", "format": "json"},
        "decode": {"max_placements": 10_000_000},
        "fleet": {"heartbeat_timeout_ms": 3_600_000},  # one heartbeat per member here
    }
    for section, values in (extra or {}).items():
        cfg[section] = {**cfg.get(section, {}), **values}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fulcrum.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = subprocess.Popen(
            [sys.executable, "-m", "fulcrum.cli", "serve", "--config", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=tmp,
        )
        address = f"127.0.0.1:{port}"
        try:
            wait_healthy(proc, address)
            yield address, mport, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def scrape(mport: int) -> tuple[str, float]:
    """(/metrics text, wall seconds of the GET)."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    return text, time.perf_counter() - t0


def lag_buckets(text: str) -> Buckets:
    """Cumulative counts of ``fulcrum_event_loop_lag_seconds`` by upper bound (s)."""
    out: Buckets = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "fulcrum_event_loop_lag_seconds":
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    out[float(s.labels["le"])] = s.value
    return out


def lag_summary(before: Buckets, after: Buckets) -> tuple[int, float, float]:
    """(samples, p99 s, max s as the highest non-empty bucket's bound) between scrapes."""
    bounds = sorted(after)
    cum = [after[b] - before.get(b, 0.0) for b in bounds]
    total = cum[-1] if cum else 0.0
    if total <= 0:
        return 0, float("nan"), float("nan")
    target = 0.99 * total
    p99 = float("nan")
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, cum, strict=True):
        if c >= target:
            hi = b if b != float("inf") else prev_b
            p99 = prev_b + (hi - prev_b) * ((target - prev_c) / max(c - prev_c, 1e-12))
            break
        prev_b, prev_c = b, c
    top = 0.0
    last = 0.0
    for b, c in zip(bounds, cum, strict=True):
        if c > last:
            top = b
        last = c
    return int(total), p99, top


async def timed_calls(
    calls: list[Callable[[], Awaitable[object]]], concurrency: int
) -> tuple[list[float], float]:
    """Run ``calls`` with ``concurrency`` callers; (latencies s, wall s)."""
    lat: list[float] = []
    it = iter(calls)

    async def worker() -> None:
        for call in it:
            t0 = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, time.perf_counter() - t0


def _q(samples: list[float]) -> list[str]:
    """p50, p99 and max of ``samples`` (s) in ms."""
    p50, p99 = percentiles(samples, (50, 99))
    return [_ms(p50), _ms(p99), _ms(max(samples) if samples else float("nan"))]


def table_work(quick: bool) -> str:
    """CPU time per event in the daemon's decode and VE tables (in-process, no gRPC):
    thread CPU time, so that the shared machine's other work does not count."""
    import numpy as np

    from fulcrum.config.decode import DecodeSettings
    from fulcrum.config.vision import VisionSettings
    from fulcrum.core.types import (
        DecodeInstanceLoad,
        DecodeInstanceShape,
        Member,
        MemberKind,
        VisionMachineShape,
    )
    from fulcrum.state.decode import DecodeState
    from fulcrum.state.vision import ImageRequest, VisionState

    clock = time.thread_time
    rows: list[list[str]] = []
    scale = 8 if quick else 1
    for n_inst, gpus in ((2048 // scale, 64), (256 // scale, 1024)):
        st = DecodeState(DecodeSettings(max_placements=10_000_000), np.random.default_rng(0))
        pending: list[Callable[[], None]] = []
        st.set_schedule(pending.append)  # publish as the daemon does: once per iteration

        def flush(pending: list[Callable[[], None]] = pending) -> float:
            t0 = clock()
            for cb in pending:
                cb()
            pending.clear()
            return clock() - t0

        shape = DecodeInstanceShape((1_000,) * gpus, (1 << 30,) * gpus)
        joins, pubs = [], []
        members = []
        for i in range(n_inst):
            m = Member(f"dec-{i:05d}", MemberKind.DECODE_INSTANCE, i + 1, shape, 0)
            members.append(m)
            t0 = clock()
            st.on_join(m, 0)
            joins.append(clock() - t0)
            pubs.append(flush())
        total = n_inst * gpus
        rows.append([f"decode join ({gpus} GPUs; fleet to {total:,} GPUs)", *_q(joins)])
        load = DecodeInstanceLoad((3,) * gpus, (30_000,) * gpus)
        beats = []
        for m in members[: min(512, n_inst)]:
            t0 = clock()
            st.validate_load(m, load)
            st.on_load(m, load, 0)
            beats.append(clock() - t0)
            flush()
        rows.append([f"decode heartbeat with load ({gpus} GPUs, {total:,} in all)", *_q(beats)])
        places, releases = [], []
        for k in range(2_000):
            t0 = clock()
            st.place(f"r{k}", 100_000 if k % 10 == 0 else 2_000, 0)
            places.append(clock() - t0)
            pubs.append(flush())
        for k in range(2_000):
            t0 = clock()
            st.release(f"r{k}", 0)
            releases.append(clock() - t0)
            flush()
        rows.append([f"PlaceDecode in the table ({total:,} GPUs, dual)", *_q(places)])
        rows.append([f"ReleaseDecode in the table ({total:,} GPUs)", *_q(releases)])
        rows.append([f"metrics snapshot publication ({total:,} GPUs)", *_q(pubs)])
        churn = []
        for i, m in enumerate(members[: min(256, n_inst)]):
            t0 = clock()
            st.on_leave(m, "deregistered", 0)
            again = Member(m.member_id, m.kind, 10_000 + i, m.shape, 0)
            st.on_join(again, 0)
            churn.append(clock() - t0)
            flush()
        rows.append([f"decode leave + rejoin ({gpus} GPUs, {total:,} in all)", *_q(churn)])
        if gpus == 64:
            from prometheus_client import generate_latest

            from fulcrum.metrics import REGISTRY

            vs = VisionState(VisionSettings(), np.random.default_rng(1))
            vjoins = []
            for i in range(1024 // scale):
                t0 = clock()
                vs.on_join(
                    Member(f"ve-{i:05d}", MemberKind.VISION_MACHINE, i + 1,
                           VisionMachineShape(gpus=8, max_patches_in_flight=0), 0),
                    0,
                )
                vjoins.append(clock() - t0)
            rows.append([f"VE join (8 GPUs; fleet to {8 * 1024 // scale:,} GPUs)", *_q(vjoins)])
            vplace = []
            for k in range(2_000):
                t0 = clock()
                vs.place(f"v{k}", [ImageRequest(1280, 800)], 0)
                vplace.append(clock() - t0)
            rows.append(["PlaceImages in the table (one 1280x800 image)", *_q(vplace)])
            st.publisher.publish()
            t0 = clock()
            text = generate_latest(REGISTRY)
            took = clock() - t0
            rows.append(
                [f"/metrics collect + format in the scrape thread ({len(text) / 2**20:.2f} MiB)",
                 _ms(took), "", ""]
            )
    return md_table(["event (CPU time of the thread)", "p50 (ms)", "p99 (ms)", "max (ms)"], rows)


def _ms(x: float) -> str:
    if x != x:
        return "-"
    return f"{x * 1e3:,.1f}" if x >= 0.01 else f"{x * 1e3:.3f}"


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def paired_cpu(
    pid: int, rounds: int, phases: dict[str, Callable[[], Awaitable[int]]]
) -> dict[str, tuple[float, float]]:
    """Run each phase once per round, in an order rotating between rounds; returns per
    phase (median calls/s, median daemon CPU per call in s)."""
    import statistics

    names = list(phases)
    got: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            c0, t0 = _cpu_s(pid), time.perf_counter()
            calls = await phases[name]()
            t1, c1 = time.perf_counter(), _cpu_s(pid)
            got[name].append((calls / (t1 - t0), (c1 - c0) / calls))
    return {
        n: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v))
        for n, v in got.items()
    }


async def measure(address: str, mport: int, pid: int, quick: bool) -> dict[str, object]:
    scale = 8 if quick else 1
    n_decode, n_ve, n_prefill = 2048 // scale, 1024 // scale, 1024 // scale
    n_groups = 8 if quick else 64
    phases: list[tuple[str, int, float, float]] = []
    out: dict[str, object] = {"members": n_decode + n_ve + n_prefill, "groups": n_groups}
    first = last = lag_buckets(scrape(mport)[0])

    def phase_end(name: str) -> None:
        nonlocal last
        now = lag_buckets(scrape(mport)[0])
        phases.append((name, *lag_summary(last, now)))
        last = now

    async with FulcrumClient(address, timeout_s=120.0) as c:
        gpus = [fpb.DecodeGpuCapacity(max_concurrency=1_000, max_kv_tokens=1 << 30)] * DECODE_GPUS
        decode_shape = fpb.DecodeInstanceShape(gpus=gpus)
        ve_shape = fpb.VisionMachineShape(gpus=VE_GPUS)
        pre_shape = fpb.PrefillEngineShape(dp_ranks=PREFILL_RANKS)
        reqs: list[tuple[str, fpb.RegisterRequest]] = []
        for i in range(max(n_decode, n_ve, n_prefill)):  # kinds interleaved
            if i < n_decode:
                reqs.append(("decode", fpb.RegisterRequest(
                    member_id=f"dec-{i:05d}", decode_instance=decode_shape)))
            if i < n_ve:
                reqs.append(("vision", fpb.RegisterRequest(
                    member_id=f"ve-{i:05d}", vision_machine=ve_shape)))
            if i < n_prefill:
                reqs.append(("prefill", fpb.RegisterRequest(
                    member_id=f"pre-{i:05d}", prefill_engine=pre_shape)))
        incarnations: dict[str, int] = {}
        by_kind: dict[str, list[float]] = {"decode": [], "vision": [], "prefill": []}

        def register(kind: str, req: fpb.RegisterRequest) -> Callable[[], Awaitable[object]]:
            async def call() -> None:
                t0 = time.perf_counter()
                reply = await c.fleet.Register(req)
                by_kind[kind].append(time.perf_counter() - t0)
                incarnations[req.member_id] = reply.incarnation

            return call

        progress(f"scale: registering {len(reqs)} members")
        lat, wall = await timed_calls([register(k, r) for k, r in reqs], CONCURRENCY)
        out["register"] = (len(lat), wall, percentiles(lat, (50, 99)), {
            k: percentiles(v, (99,))[0] for k, v in by_kind.items()})
        phase_end("Register 4,096 members" if not quick else "Register members")

        progress(f"scale: registering {n_groups} EPLB groups of {LAYERS} x {EXPERTS}")
        groups = [
            epb.RegisterGroupRequest(
                group_id=f"g{i:03d}", role=epb.GROUP_ROLE_DECODE, ep_size=64,
                num_layers=LAYERS, num_experts=EXPERTS, period_steps=1 << 30,
                expert_bytes=EXPERT_BYTES,
            )
            for i in range(n_groups)
        ]
        lat, wall = await timed_calls(
            [(lambda g=g: c.expert.RegisterGroup(g)) for g in groups], 4
        )
        out["groups_lat"] = percentiles(lat, (50, 99))
        phase_end(f"RegisterGroup x {n_groups}")

        progress("scale: one loaded heartbeat per decode instance and VE machine")
        hb: list[Callable[[], Awaitable[object]]] = []
        load = fpb.DecodeInstanceLoad(
            gpus=[fpb.DecodeGpuLoad(concurrency=3, kv_tokens=30_000)] * DECODE_GPUS
        )
        for i in range(n_decode):
            mid = f"dec-{i:05d}"
            req = fpb.HeartbeatRequest(
                member_id=mid, incarnation=incarnations[mid], decode_instance=load)
            hb.append(lambda req=req: c.fleet.Heartbeat(req))
        ve_load = fpb.VisionMachineLoad(patches_in_flight=[100] * VE_GPUS)
        for i in range(n_ve):
            mid = f"ve-{i:05d}"
            req = fpb.HeartbeatRequest(
                member_id=mid, incarnation=incarnations[mid], vision_machine=ve_load)
            hb.append(lambda req=req: c.fleet.Heartbeat(req))
        lat, wall = await timed_calls(hb, CONCURRENCY)
        out["heartbeat"] = percentiles(lat, (50, 99))
        phase_end("Heartbeat with load (decode, VE)")

        progress("scale: PlaceDecode vs Ping (paired rounds)")
        workers, per_worker, rounds = 8, (40 if quick else 80), 7
        unary: list[list[dpb.PlaceDecodeRequest]] = []
        stream: list[list[dpb.PlaceDecodeStreamRequest]] = []

        def kv_of(k: int) -> int:
            return 100_000 if k % 10 == 0 else 2_000

        def build(r: int) -> None:
            unary[:] = [[dpb.PlaceDecodeRequest(request_id=f"u{r}-{w}-{k}", kv_tokens=kv_of(k))
                         for k in range(per_worker)] for w in range(workers)]
            stream[:] = [[dpb.PlaceDecodeStreamRequest(
                sequence=k,
                place=dpb.PlaceDecodeRequest(request_id=f"s{r}-{w}-{k}", kv_tokens=kv_of(k)))
                for k in range(per_worker)] for w in range(workers)]

        async def place(w: int) -> None:
            for request in unary[w]:
                await c.decode.PlaceDecode(request)

        async def place_stream(w: int) -> None:
            await stream_all(c.decode.PlaceDecodeStream, stream[w])

        out["rates"] = await paired_rates(
            c, workers=workers, per_worker=per_worker, rounds=rounds, place=place,
            place_stream=place_stream, before_round=build, after_round=lambda: None,
        )
        progress("scale: daemon CPU per call, PlaceDecode vs Ping")
        from fulcrum.v1 import diagnostics_pb2 as dipb

        n_cpu = 1_200 if quick else 2_400
        counter = iter(range(1 << 30))

        async def many(make: Callable[[], Awaitable[object]]) -> int:
            async def one(_: int) -> None:
                for _ in range(n_cpu // workers):
                    await make()

            await asyncio.gather(*(one(w) for w in range(workers)))
            return n_cpu // workers * workers

        ping_req = dipb.PingRequest()

        async def cpu_ping() -> int:
            return await many(lambda: c.diagnostics.Ping(ping_req))

        async def cpu_place() -> int:
            return await many(lambda: c.decode.PlaceDecode(dpb.PlaceDecodeRequest(
                request_id=f"c{next(counter)}", kv_tokens=2_000)))

        out["cpu"] = await paired_cpu(pid, 5, {"ping": cpu_ping, "place": cpu_place})
        phase_end("PlaceDecode / Ping rounds")

        progress("scale: /metrics")
        sizes, times = [], []
        for _ in range(3):
            text, took = await asyncio.to_thread(scrape, mport)
            sizes.append(len(text.encode()))
            times.append(took)
        out["metrics"] = (max(sizes), min(times), max(times))
        phase_end("/metrics scrapes x 3")
    out["phases"] = phases
    out["overall"] = lag_summary(first, last)
    return out


def run(quick: bool) -> str:
    progress("scale: CPU per event in the tables (in-process)")
    from fulcrum.logs import configure as configure_logs

    configure_logs("warning")
    work = table_work(quick)
    with daemon_process() as (address, mport, pid):
        r = asyncio.run(measure(address, mport, pid, quick))
    n_reg, wall, (p50, p99), per_kind = r["register"]  # type: ignore[misc]
    rates = r["rates"]
    assert isinstance(rates, dict)
    size, t_min, t_max = r["metrics"]  # type: ignore[misc]
    rows = [
        [name, f"{n:,}", _ms(p99), f"<= {_ms(top)}"]
        for name, n, p99_, top in r["phases"]  # type: ignore[attr-defined]
        for p99 in [p99_]
    ]
    n_all, p99_all, top_all = r["overall"]  # type: ignore[misc]
    rows.append(["**whole run**", f"{n_all:,}", _ms(p99_all), f"<= {_ms(top_all)}"])
    lag_table = md_table(["phase", "lag samples", "loop lag p99 (ms)", "loop lag max (ms)"], rows)
    g50, g99 = r["groups_lat"]  # type: ignore[misc]
    h50, h99 = r["heartbeat"]  # type: ignore[misc]
    calls = md_table(
        ["call", "p50 (ms)", "p99 (ms)", "note"],
        [
            ["Register (all kinds)", _ms(p50), _ms(p99),
             f"{n_reg:,} members in {wall:.1f} s, {CONCURRENCY} callers"],
            ["Register, decode instance (64 GPUs)", "", _ms(per_kind["decode"]), ""],
            ["Register, VE machine (8 GPUs)", "", _ms(per_kind["vision"]), ""],
            ["Register, prefill engine (8 ranks)", "", _ms(per_kind["prefill"]), ""],
            [f"RegisterGroup ({LAYERS} x {EXPERTS})", _ms(g50), _ms(g99), "4 callers"],
            ["Heartbeat with per-GPU load", _ms(h50), _ms(h99), ""],
        ],
    )
    rate_table = md_table(
        ["call", "calls/s", "no-op calls/s", "ratio to no-op (median of paired rounds)"],
        [
            ["PlaceDecode (unary)", f"{rates['place']:,.0f}", f"{rates['ping']:,.0f} (Ping)",
             f"{rates['ratio']:.2f}"],
            ["PlaceDecodeStream", f"{rates['place_s']:,.0f}",
             f"{rates['ping_s']:,.0f} (PingStream)", f"{rates['ratio_s']:.2f}"],
        ],
    )
    cpu = r["cpu"]
    assert isinstance(cpu, dict)
    (ping_rate, ping_cpu), (place_rate, place_cpu) = cpu["ping"], cpu["place"]
    cpu_table = md_table(
        ["call", "calls/s (median)", "daemon CPU per call (us, median)", "note"],
        [
            ["Ping", f"{ping_rate:,.0f}", f"{ping_cpu * 1e6:,.0f}", ""],
            ["PlaceDecode", f"{place_rate:,.0f}", f"{place_cpu * 1e6:,.0f}",
             f"CPU-bound throughput ratio to Ping: {ping_cpu / place_cpu:.2f}"],
        ],
    )
    cmd = ".venv/bin/python benchmarks/bench_scale.py" + (" --quick" if quick else "")
    members = r["members"]
    groups = r["groups"]
    return f"""### Scale

The daemon (own process, its defaults; long heartbeat timeouts, large placement table) at
its configured bounds, from a cold fleet, through real gRPC on loopback: {members:,}
members ({members // 2:,} decode instances x {DECODE_GPUS} GPUs, {members // 4:,} VE machines
x {VE_GPUS} GPUs, {members // 4:,} prefill engines x {PREFILL_RANKS} ranks), {groups} EPLB
groups of {LAYERS} layers x {EXPERTS} experts, one loaded heartbeat per decode instance
and VE machine; then PlaceDecode against Ping on that fleet, then /metrics. Loop lag is
the daemon's own `fulcrum_event_loop_lag_seconds` (probe every 10 ms, set for this run;
the default is 50), differenced between phases; p99 interpolated in the buckets, max =
bound of the highest non-empty bucket. Aims: loop lag max under 20 ms; PlaceDecode >=
0.8x Ping; /metrics under 2 MiB and 100 ms of loop time.

{lag_table}

{calls}

{rate_table}

The same two calls alternated in 5 rounds of {2400 if not quick else 1200:,} calls each, with the
daemon's own CPU time per call (`/proc/<pid>/stat`): on a shared machine the CPU per call
is steadier than calls/s, and the daemon's throughput when CPU-bound is its inverse.

{cpu_table}

/metrics at full scale: {size / 2**20:.2f} MiB, {t_min * 1e3:,.0f}-{t_max * 1e3:,.0f} ms
per scrape (client wall time; the loop's share is the lag of the /metrics phase above).

Work per event in the decode and VE tables at the same scale (in-process, no gRPC;
thread CPU time, so the shared machine's other work is not counted; joins include the
arrays' doubling, leaves the compaction when due). Before this change a decode join
rebuilt the whole view: 148 ms per join at 256 instances x 1,024 GPUs.

{work}

Command: `{cmd}`; machine: {os.cpu_count()} cores, shared.
"""


if __name__ == "__main__":
    print(run("--quick" in sys.argv))
