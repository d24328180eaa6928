"""Issue 22 row 14: 500 WatchMaps watchers, then cancelled, give their memory back."""

from __future__ import annotations

import asyncio
import gc
import signal
from pathlib import Path

import yaml

from fulcrum.client import FulcrumClient
from fulcrum.testing import running_server
from fulcrum.v1 import expert_pb2 as pb
from tests.service.test_daemon_process import Proc, metric_value
from tests.service.test_eplb import state

BIG = pb.RegisterGroupRequest(
    group_id="big", role=pb.GROUP_ROLE_DECODE, ep_size=64, num_layers=58, num_experts=384,
    expert_bytes=1,
)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _watch_then_cancel(c: FulcrumClient, n: int) -> None:
    calls = [c.expert.WatchMaps(pb.WatchMapsRequest(group_id="big")) for _ in range(n)]
    for call in calls:
        assert (await call.read()).map.version == 1
    for call in calls:
        call.cancel()


async def test_cancelled_watchers_leave_nothing_behind() -> None:
    overrides = {"eplb": {"max_watchers_per_group": 1000}}
    async with running_server(overrides) as d, FulcrumClient(d.address) as c:
        await c.expert.RegisterGroup(BIG)
        await _watch_then_cancel(c, 500)
        group = state(d).groups["big"]
        for _ in range(1000):
            if group.watchers == 0:
                break
            await asyncio.sleep(0.01)
        assert group.watchers == 0
        assert not group.changed._waiters  # type: ignore[attr-defined]
        gc.collect()
        alive = [o for o in gc.get_objects()
                 if type(o).__name__ == "async_generator" and "WatchMaps" in o.__qualname__]
        assert alive == []


async def test_a_daemon_gives_the_memory_of_500_watchers_back(tmp_path: Path) -> None:
    cfg = tmp_path / "fulcrum.yaml"
    cfg.write_text(yaml.safe_dump({
        "server": {"port": 0, "grace_period_s": 5}, "metrics": {"port": 0},
        "logging": {"format": "json"}, "eplb": {"max_watchers_per_group": 1000},
    }))
    proc = Proc(cfg)
    try:
        async with FulcrumClient(proc.address) as c:
            await c.expert.RegisterGroup(BIG)
            base = _rss_mib(proc.p.pid)
            calls = [c.expert.WatchMaps(pb.WatchMapsRequest(group_id="big")) for _ in range(500)]
            for call in calls:
                await call.read()
            peak = _rss_mib(proc.p.pid)
            assert peak - base > 60  # the replies really were held (about 0.3 MiB each)
            for call in calls:
                call.cancel()
            kept = peak - base
            for _ in range(1500):  # poll with a deadline: RSS after the trim
                kept = _rss_mib(proc.p.pid) - base
                if kept < 0.25 * (peak - base):
                    break
                await asyncio.sleep(0.01)
            assert kept < 0.25 * (peak - base), (base, peak, kept)
            assert metric_value(proc.metrics_port, "fulcrum_memory_trims_total", {}) >= 1
        proc.p.send_signal(signal.SIGTERM)
        proc.rest(timeout=20)
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
            proc.p.wait()
    assert proc.p.returncode == 0
