"""Fencing: a leader frozen (SIGSTOP) past its lease TTL never answers as leader once the
standby leads, and a leader cut off from etcd stops serving (health, calls, open
streams) before its lease can expire."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import grpc

from fulcrum.ha.harness import DaemonProcess, EtcdProcess
from fulcrum.v1 import expert_pb2 as epb
from tests.ha.helpers import expert, pair, ping, register, roles
from tests.polling import until_sync


class Overlaps:
    """Samples both daemons' health (every 50 ms while polled) and counts samples in
    which both are SERVING."""

    def __init__(self, a: DaemonProcess, b: DaemonProcess) -> None:
        self.a, self.b = a, b
        self.samples = 0
        self.both = 0

    def sample(self) -> tuple[str, str]:
        ha, hb = self.a.health(timeout_s=0.2), self.b.health(timeout_s=0.2)
        self.samples += 1
        self.both += ha == "SERVING" and hb == "SERVING"
        return ha, hb


def test_frozen_leader_never_answers_as_leader_after_thaw(
    daemons: Callable[..., DaemonProcess],
) -> None:
    leader, standby = pair(daemons)
    watch = Overlaps(leader, standby)
    leader.signal(signal.SIGSTOP)
    try:
        until_sync(lambda: watch.sample()[1] == "SERVING", "standby took over", 30, 0.05)
    finally:
        leader.signal(signal.SIGCONT)
    err = ping(leader)  # at once after the thaw: refused, never answered
    assert err is not None and err.code() is grpc.StatusCode.UNAVAILABLE
    until_sync(lambda: watch.sample() != ("", "") and leader.p.poll() is not None,
               "the thawed leader exits", 30, 0.05)
    assert leader.p.returncode == 1
    assert leader.event("ha_leadership_lost") is not None
    assert watch.both == 0, f"{watch.both} of {watch.samples} samples had two leaders"
    assert ping(standby) is None


def test_leader_cut_off_from_etcd_is_fenced_and_closes_streams(
    etcd: EtcdProcess, daemons: Callable[..., DaemonProcess],
) -> None:
    leader, standby = pair(daemons)
    register(leader, "g1")
    stream = expert(leader).WatchMaps(epb.WatchMapsRequest(group_id="g1"), timeout=60)
    first = next(stream)
    assert first.map.version == 1
    ended: list[grpc.RpcError] = []

    def drain() -> None:
        try:
            for _ in stream:
                pass
        except grpc.RpcError as err:
            ended.append(err)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    etcd.pause()
    try:
        until_sync(lambda: leader.health() == "NOT_SERVING", "leader fenced", 30, 0.05)
        reader.join(timeout=30)
        assert ended and ended[0].code() is grpc.StatusCode.UNAVAILABLE
        err = ping(leader)
        assert err is not None and err.code() is grpc.StatusCode.UNAVAILABLE
        assert leader.health("liveness") == "SERVING"
        until_sync(lambda: leader.event("ha_etcd_unreachable") is not None,
                   "one line saying etcd is unreachable", 30)
        seen = roles(leader)
        assert seen[0] == "leader" and seen[-1] == "standby"
        assert "fenced" in leader.events("ha_role")[-1]["reason"]
    finally:
        etcd.resume()
    watch = Overlaps(leader, standby)
    until_sync(lambda: "SERVING" in watch.sample(), "a leader again after etcd is back",
               30, 0.05)
    assert watch.both == 0
