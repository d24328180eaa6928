"""A pair on a real etcd: one leader serves, the standby refuses with the leader's address
and reports NOT_SERVING everywhere but ``liveness``."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import grpc
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.ha.harness import DaemonProcess
from fulcrum.v1 import diagnostics_pb2, diagnostics_pb2_grpc
from tests.polling import until_sync


def leader_gauge(d: DaemonProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "fulcrum_ha_leader":
            return float(fam.samples[0].value)
    raise AssertionError("fulcrum_ha_leader not exported")


def ping(d: DaemonProcess) -> grpc.RpcError | None:
    stub = diagnostics_pb2_grpc.DiagnosticsServiceStub(d.channel)
    try:
        stub.Ping(diagnostics_pb2.PingRequest(), timeout=5)
    except grpc.RpcError as err:
        return err
    return None


def pair(daemons: Callable[..., DaemonProcess]) -> tuple[DaemonProcess, DaemonProcess]:
    """Two daemons; returns (leader, standby) once one of them serves."""
    a = daemons("a")
    b = daemons("b")
    until_sync(lambda: "SERVING" in (a.health(), b.health()), "a leader elected", 20)
    return (a, b) if a.health() == "SERVING" else (b, a)


def test_standby_refuses_with_leader_trailer_and_health(
    daemons: Callable[..., DaemonProcess],
) -> None:
    leader, standby = pair(daemons)
    assert ping(leader) is None
    err = ping(standby)
    assert err is not None and err.code() is grpc.StatusCode.UNAVAILABLE
    trailer = dict(err.trailing_metadata() or ())
    assert trailer["x-fulcrum-leader"] == leader.address
    for name in ("", "readiness", "fulcrum.v1.FleetService", "fulcrum.v1.PrefillBalancerService"):
        assert standby.health(name) == "NOT_SERVING", name
        assert leader.health(name) == "SERVING", name
    assert standby.health("liveness") == "SERVING"
    assert leader.health("liveness") == "SERVING"
    assert leader_gauge(leader) == 1.0
    assert leader_gauge(standby) == 0.0
    assert [e["role"] for e in leader.events("ha_role")] == ["leader"]
    assert standby.events("ha_role") == []  # never changed role: nothing to log


def test_sigterm_resigns_and_the_standby_takes_over(
    daemons: Callable[..., DaemonProcess],
) -> None:
    leader, standby = pair(daemons)
    leader.signal(15)
    assert leader.p.wait(timeout=30) == 0
    until_sync(lambda: standby.health() == "SERVING", "standby took over", 20)
    assert ping(standby) is None
    assert leader.event("ha_resigned") is not None
