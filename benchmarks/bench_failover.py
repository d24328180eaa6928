"""Failover benchmark: a real etcd and two daemons on loopback (``ha.backend: etcd``, the
default ``lease_ttl_s`` 3 and ``renew_deadline_s`` 2), under prefill Submit + Pull + ack
load and decode placements; the leader is killed (SIGKILL) N times and restarted as the
standby each time, then frozen (SIGSTOP) past its TTL once and thawed.

Figures:
- failover time: from the kill to the standby's health SERVING (polled every 10 ms),
  p50 / p99 / max over the N kills, against ``lease_ttl_s`` + 1 s;
- submits: every Submit is retried with the same id (following ``x-fulcrum-leader`` or
  the other address on UNAVAILABLE) until it returns OK; acknowledged submits never
  delivered to an engine (lost), and ids an engine was handed more than once;
- EPLB: two groups, one rebalanced before each kill; versions and maps served by the new
  leader against those of the old one;
- fencing: both daemons' health polled every 50 ms for the whole run, samples in which
  both were SERVING; and placements answered OK by the frozen leader after its thaw;
- cost when off: PlaceDecode / Ping latency ratio on a daemon with ``ha.backend: none``
  and on the HA leader, interleaved in the same run.

Run alone: ``.venv/bin/python benchmarks/bench_failover.py [--quick]`` (needs ``etcd``,
Debian's etcd-server).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # pragma: no cover - direct execution
    sys.path.insert(0, str(ROOT))

from benchmarks.common import md_table, percentiles, progress  # noqa: E402
from fulcrum.ha.harness import DaemonProcess, EtcdProcess, ha_config  # noqa: E402
from fulcrum.v1 import decode_pb2 as decpb  # noqa: E402
from fulcrum.v1 import decode_pb2_grpc as dec_grpc  # noqa: E402
from fulcrum.v1 import diagnostics_pb2 as dpb  # noqa: E402
from fulcrum.v1 import diagnostics_pb2_grpc as d_grpc  # noqa: E402
from fulcrum.v1 import expert_pb2 as epb  # noqa: E402
from fulcrum.v1 import expert_pb2_grpc as e_grpc  # noqa: E402
from fulcrum.v1 import fleet_pb2 as fpb  # noqa: E402
from fulcrum.v1 import fleet_pb2_grpc as f_grpc  # noqa: E402
from fulcrum.v1 import prefill_pb2 as ppb  # noqa: E402
from fulcrum.v1 import prefill_pb2_grpc as p_grpc  # noqa: E402

TTL_S = 3
#: An engine of the bench declares what it pulled this long ago, as PrefillEngineLoop
#: declares what it runs or ran in the last ``remember_s`` (30 s) (seconds).
HOLD_S = 30.0
KEY = "/fulcrum-bench/failover/leader"
STUBS: dict[str, Any] = {"fleet": f_grpc.FleetServiceStub,
                         "prefill": p_grpc.PrefillBalancerServiceStub,
                         "decode": dec_grpc.DecodeBalancerServiceStub,
                         "expert": e_grpc.ExpertBalancerServiceStub,
                         "diag": d_grpc.DiagnosticsServiceStub}
EXTRA = {"fleet": {"heartbeat_timeout_ms": 3_600_000}}
LAYERS, EXPERTS, EP = 4, 16, 4


class Follower:
    """Calls the leader among ``addresses``: on UNAVAILABLE it goes to the address in the
    ``x-fulcrum-leader`` trailer, else the next one, and retries (bounded)."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.current = 0
        self._stubs: dict[str, dict[str, Any]] = {}
        self.unavailable = 0
        self.shed = 0

    def stub(self, kind: str) -> Any:
        addr = self.addresses[self.current]
        if addr not in self._stubs:
            ch = grpc.aio.insecure_channel(addr)
            self._stubs[addr] = {k: make(ch) for k, make in STUBS.items()}
        return self._stubs[addr][kind]

    def _follow(self, err: grpc.aio.AioRpcError) -> None:
        self.unavailable += 1
        leader = dict(err.trailing_metadata() or ()).get("x-fulcrum-leader")
        if isinstance(leader, str) and leader in self.addresses:
            self.current = self.addresses.index(leader)
        else:
            self.current = (self.current + 1) % len(self.addresses)

    async def call(self, kind: str, method: str, request: Any, timeout: float = 10.0,
                   on_error: Callable[[grpc.aio.AioRpcError], Awaitable[bool]] | None = None
                   ) -> Any:
        last = ""
        for _ in range(2000):  # about 40 s of retries at most
            try:
                return await getattr(self.stub(kind), method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                last = f"{err.code().name}: {err.details()}"
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self._follow(err)
                elif (err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                      and (err.details() or "").startswith("server: busy")):
                    self.shed += 1  # admission control: retry after its hint
                elif on_error is None or not await on_error(err):
                    raise
            await asyncio.sleep(0.02)
        raise TimeoutError(f"{kind}.{method}: no leader answered (last: {last})")


async def register_decode(f: Follower) -> None:
    """Two decode instances of 8 GPUs on the leader."""
    gpus = [fpb.DecodeGpuCapacity(max_concurrency=1_000_000, max_kv_tokens=1 << 39)] * 8
    for i in range(2):
        await f.call("fleet", "Register", fpb.RegisterRequest(
            member_id=f"dec-{i}", decode_instance=fpb.DecodeInstanceShape(gpus=gpus)))


class Load:
    """Submitters, engines (Pull + ack) and a decode placer against the pair."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.stop = asyncio.Event()
        self.acked: set[str] = set()
        self.delivered: collections.Counter[str] = collections.Counter()
        self.placements = 0
        self._ids = itertools.count()

    async def submitter(self) -> None:
        f = Follower(self.addresses)
        while not self.stop.is_set():
            rid = f"r{next(self._ids)}"
            await f.call("prefill", "Submit", ppb.SubmitRequest(
                request_id=rid, total_tokens=2048, cached_tokens=0), timeout=15)
            self.acked.add(rid)

    async def engine(self, name: str, done: asyncio.Event) -> None:
        f = Follower(self.addresses)
        inc = 0
        acks: list[str] = []
        # what it pulled in the last HOLD_S seconds it runs or ran: declared when it
        # registers again (a new leader), so a retried Submit of one is not handed out twice
        running: dict[str, tuple[float, fpb.HeldPrefillRequest]] = {}
        while not done.is_set() or acks:
            if inc == 0:
                now = time.monotonic()
                held = [h for t, h in running.values() if now - t < HOLD_S]
                reg = await f.call("fleet", "Register", fpb.RegisterRequest(
                    member_id=name, prefill_engine=fpb.PrefillEngineShape(
                        dp_ranks=4, step_quota_ns=1_000_000_000, held=held)))
                inc = int(reg.incarnation)
            addr = f.current
            try:
                reply = await f.stub("prefill").Pull(ppb.PullRequest(
                    engine_id=name, incarnation=inc, remaining_quota_ns=1 << 50,
                    rank_loads_ns=[0, 0, 0, 0], max_wait_ms=50, max_requests=4,
                    ack_request_ids=acks), timeout=5)
            except grpc.aio.AioRpcError as err:
                if err.code() in (grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED):
                    f._follow(err)
                if f.current != addr or err.code() in (grpc.StatusCode.NOT_FOUND,
                                                        grpc.StatusCode.FAILED_PRECONDITION):
                    inc = 0  # a new leader: register again (as after a restart)
                acks = []  # the old leader's leases are gone with it
                await asyncio.sleep(0.02)
                continue
            acks = [r.request_id for r in reply.requests]
            self.delivered.update(acks)
            now = time.monotonic()
            running = {k: v for k, v in running.items() if now - v[0] < HOLD_S}
            for r in reply.requests:
                running[r.request_id] = (now, fpb.HeldPrefillRequest(
                    request_id=r.request_id, dp_rank=r.dp_rank, total_tokens=r.total_tokens,
                    cached_tokens=r.cached_tokens))

    async def placer(self) -> None:
        f = Follower(self.addresses)
        await register_decode(f)

        async def again(err: grpc.aio.AioRpcError) -> bool:
            await register_decode(f)  # a new leader knows no member yet
            return True

        k = 0
        while not self.stop.is_set():
            k += 1
            await f.call("decode", "PlaceDecode", decpb.PlaceDecodeRequest(
                request_id=f"d{k}", kv_tokens=2000), on_error=again)
            self.placements += 1
            try:
                await f.call("decode", "ReleaseDecode", decpb.ReleaseDecodeRequest(
                    request_id=f"d{k}"))
            except grpc.aio.AioRpcError as err:  # placed on the leader that died
                if err.code() is not grpc.StatusCode.NOT_FOUND:
                    raise


async def _health(addr: str, channels: dict[str, Any], timeout: float = 0.2) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if addr not in channels:
        channels[addr] = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(addr))
    try:
        reply = await channels[addr].Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.aio.AioRpcError:
        return "DOWN"
    return "SERVING" if reply.status == health_pb2.HealthCheckResponse.SERVING else "NOT"


class Pair:
    """Two daemon slots on loopback; a killed one is started again (as the standby)."""

    def __init__(self, etcd: EtcdProcess, directory: Path) -> None:
        self.cfg = ha_config(etcd.endpoint, KEY, TTL_S, 2.0, **EXTRA)
        self.cfg["ha"]["retry_period_s"] = 0.25
        self.dir = directory
        self.procs = [DaemonProcess(self.cfg, directory, f"d{i}") for i in range(2)]
        self.serial = 2
        self.channels: dict[str, Any] = {}
        self.both = 0
        self.samples = 0

    def restart(self, i: int) -> None:
        self.procs[i].stop()
        self.serial += 1
        cfg = dict(self.cfg)
        cfg["server"] = {**cfg["server"], "port": int(self.procs[i].address.split(":")[1])}
        self.procs[i] = DaemonProcess(cfg, self.dir, f"d{self.serial}")

    async def leader(self, timeout_s: float = 30) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if await _health(p.address, self.channels) == "SERVING":
                    return i
            await asyncio.sleep(0.01)
        raise TimeoutError("no leader")

    async def watch(self, stop: asyncio.Event) -> None:
        """Both healths every 50 ms; counts samples with two SERVING."""
        while not stop.is_set():
            h = await asyncio.gather(*(_health(p.address, self.channels)
                                       for p in self.procs))
            self.samples += 1
            self.both += h.count("SERVING") >= 2
            await asyncio.sleep(0.05)


def _tensor(a: np.ndarray[Any, Any]) -> epb.Tensor:
    arr = np.ascontiguousarray(a)
    return epb.Tensor(dtype=arr.dtype.name, shape=list(arr.shape), data=arr.tobytes())


async def _maps(f: Follower) -> dict[str, tuple[int, bytes]]:
    out = {}
    for gid in ("g1", "g2"):
        m = (await f.call("expert", "GetMap", epb.GetMapRequest(group_id=gid))).map
        out[gid] = (int(m.version), bytes(m.physical_to_logical.data))
    return out


async def _rebalance(f: Follower, seed: int) -> None:
    """Report a load of a new popularity on g1 and force a rebalance (a new version)."""
    version = (await f.call("expert", "GetMap", epb.GetMapRequest(group_id="g1"))).map.version
    pop = np.random.default_rng(seed).lognormal(0.0, 1.5, size=(LAYERS, EXPERTS))
    load = np.random.default_rng(seed + 1).poisson(pop * 500).astype(np.int64)
    step = seed * 10
    await f.call("expert", "ReportLoad", epb.ReportLoadRequest(
        group_id="g1", map_version=version, step_begin=step, step_end=step + 10,
        load=_tensor(load)))
    await f.call("expert", "Rebalance", epb.RebalanceRequest(group_id="g1"), timeout=30)


async def _failovers(pair: Pair, n: int) -> dict[str, Any]:
    addrs = [p.address for p in pair.procs]
    load = Load(addrs)
    f = Follower(addrs)
    for gid in ("g1", "g2"):
        await f.call("expert", "RegisterGroup", epb.RegisterGroupRequest(
            group_id=gid, role=epb.GROUP_ROLE_PREFILL, ep_size=EP, gpus_per_node=8,
            num_layers=LAYERS, num_experts=EXPERTS, window_steps=20, period_steps=100_000,
            expert_bytes=1 << 20))
    stop_watch, engines_done = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(load.submitter()) for _ in range(4)]
    tasks.append(asyncio.create_task(load.placer()))
    engines = [asyncio.create_task(load.engine(f"eng-{i}", engines_done)) for i in range(2)]
    watcher = asyncio.create_task(pair.watch(stop_watch))
    times: list[float] = []
    maps_same = 0
    for k in range(n):
        progress(f"failover: kill {k + 1}/{n}")
        lead = await pair.leader()
        await _rebalance(f, seed=k + 1)
        before = await _maps(f)
        t0 = time.monotonic()
        pair.procs[lead].signal(signal.SIGKILL)
        other = pair.procs[1 - lead]
        while await _health(other.address, pair.channels, 0.1) != "SERVING":
            if time.monotonic() - t0 > 60:
                raise TimeoutError("the standby did not take over")
            await asyncio.sleep(0.01)
        times.append(time.monotonic() - t0)
        maps_same += await _maps(f) == before
        await asyncio.to_thread(pair.restart, lead)
    frozen_ok = await _freeze(pair)
    load.stop.set()
    await asyncio.gather(*tasks)
    engines_done.set()
    await asyncio.gather(*engines)
    stop_watch.set()
    await watcher
    return {"times": times, "maps_same": maps_same, "frozen_ok": frozen_ok,
            "acked": len(load.acked), "lost": len(load.acked - set(load.delivered)),
            "twice": sum(1 for c in load.delivered.values() if c > 1),
            "placements": load.placements, "both": pair.both, "samples": pair.samples}


async def _freeze(pair: Pair) -> int:
    """SIGSTOP the leader past its TTL, thaw it; placements it then answers OK."""
    progress("failover: freeze the leader past its TTL")
    lead = await pair.leader()
    frozen, other = pair.procs[lead], pair.procs[1 - lead]
    frozen.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    while await _health(other.address, pair.channels, 0.1) != "SERVING":
        if time.monotonic() - t0 > 60:
            frozen.signal(signal.SIGCONT)
            raise TimeoutError("the standby did not take over from the frozen leader")
        await asyncio.sleep(0.01)
    await asyncio.sleep(1.0)  # well past the TTL
    frozen.signal(signal.SIGCONT)
    stub = dec_grpc.DecodeBalancerServiceStub(grpc.aio.insecure_channel(frozen.address))
    answered = 0
    for i in range(20):
        try:
            await stub.PlaceDecode(decpb.PlaceDecodeRequest(request_id=f"z{i}", kv_tokens=1),
                                   timeout=1)
            answered += 1
        except grpc.aio.AioRpcError:
            pass
    await asyncio.to_thread(frozen.p.wait, 30)
    await asyncio.to_thread(pair.restart, lead)
    return answered


async def _cost(none: DaemonProcess, leader: DaemonProcess, calls: int) -> dict[str, float]:
    """Median per-round ratio PlaceDecode / Ping latency on each daemon, interleaved."""
    out: dict[str, list[float]] = {"none": [], "etcd": []}
    for d in (none, leader):
        await register_decode(Follower([d.address]))
    for _ in range(5):
        for name, d in (("none", none), ("etcd", leader)):
            ch = grpc.aio.insecure_channel(d.address)
            ping, dec = d_grpc.DiagnosticsServiceStub(ch), dec_grpc.DecodeBalancerServiceStub(ch)
            t = time.perf_counter()
            for _ in range(calls):
                await ping.Ping(dpb.PingRequest())
            t_ping = time.perf_counter() - t
            t = time.perf_counter()
            for i in range(calls):
                rid = f"c{name}{i}"
                await dec.PlaceDecode(decpb.PlaceDecodeRequest(request_id=rid, kv_tokens=2000))
                await dec.ReleaseDecode(decpb.ReleaseDecodeRequest(request_id=rid))
            out[name].append((time.perf_counter() - t) / 2 / t_ping)
            await ch.close()
    return {k: statistics.median(v) for k, v in out.items()}


async def _bench(quick: bool) -> dict[str, Any]:
    n = 3 if quick else 10
    etcd = EtcdProcess()
    with tempfile.TemporaryDirectory(prefix="fulcrum-failover-") as tmp:
        pair = Pair(etcd, Path(tmp))
        none_cfg = {"server": {"port": 0}, "metrics": {"port": 0}, "logging": {"format": "json"},
                    **EXTRA}
        none = DaemonProcess(none_cfg, Path(tmp), "none")
        try:
            progress("failover: cost of ha.backend none vs etcd (ratio to Ping)")
            lead = await pair.leader()
            cost = await _cost(none, pair.procs[lead], 200 if quick else 1000)
            none.stop()
            out = await _failovers(pair, n)
            out["cost"] = cost
        finally:
            none.stop()
            for p in pair.procs:
                p.stop()
            etcd.stop()
    return out


def run(quick: bool) -> str:
    """The markdown section (see the module docstring)."""
    r = asyncio.run(_bench(quick))
    times = r["times"]
    p50, p99 = percentiles(times)
    n = len(times)
    cmd = ".venv/bin/python benchmarks/bench_failover.py" + (" --quick" if quick else "")
    rows = [
        ["failover time (kill -9 -> standby SERVING), s",
         f"p50 {p50:.2f}, p99 {p99:.2f}, max {max(times):.2f} over {n}",
         f"<= {TTL_S + 1} s (lease_ttl_s + 1)", "met" if p99 <= TTL_S + 1 else "missed"],
        ["acknowledged submits lost", f"{r['lost']} of {r['acked']}", "0",
         "met" if r["lost"] == 0 else "missed"],
        ["request ids handed to an engine twice", str(r["twice"]), "0",
         "met" if r["twice"] == 0 else "missed"],
        ["EPLB groups served at the same version and map", f"{r['maps_same']} of {n} kills",
         "all", "met" if r["maps_same"] == n else "missed"],
        ["health samples with two SERVING (every 50 ms)", f"{r['both']} of {r['samples']}",
         "0", "met" if r["both"] == 0 else "missed"],
        ["placements answered OK by the thawed leader", f"{r['frozen_ok']} of 20", "0",
         "met" if r["frozen_ok"] == 0 else "missed"],
        ["PlaceDecode+Release / Ping, ha.backend none", f"{r['cost']['none']:.2f}x", "-", "-"],
        ["PlaceDecode+Release / Ping, HA leader (etcd)", f"{r['cost']['etcd']:.2f}x", "-",
         "-"],
    ]
    lines = [
        "### Failover",
        "",
        f"Command: `{cmd}`. A real etcd (Debian's etcd-server, one member) and two daemons "
        f"on loopback, `ha.backend: etcd`, `lease_ttl_s` {TTL_S}, `renew_deadline_s` 2, "
        "`retry_period_s` 0.25. Load throughout: 4 submitters (Submit, retried with the same "
        "id on UNAVAILABLE, following `x-fulcrum-leader`), 2 prefill engines (Pull with "
        "acknowledgements, registering again on the new leader), one decode placer "
        f"(PlaceDecode + ReleaseDecode). {n} times: rebalance EPLB group g1 (a new "
        "version), kill -9 the leader, time until the standby's health is SERVING, compare "
        "both groups' maps, start the killed daemon again (it joins as the standby). Then "
        "the leader is frozen (SIGSTOP) until the standby serves plus 1 s, thawed, and sent "
        "20 placements at once. Both healths are polled every 50 ms all along. "
        f"{r['placements']} placements and {r['acked']} acknowledged submits in all. "
        "Cost rows: the median over 5 interleaved rounds of (PlaceDecode + ReleaseDecode "
        "mean latency / 2) / Ping mean latency, one caller, on a daemon with "
        "`ha.backend: none` and on the HA leader.",
        "",
        md_table(["figure", "measured", "aim", ""], rows),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(run("--quick" in sys.argv[1:]))
