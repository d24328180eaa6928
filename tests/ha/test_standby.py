"""A pair on a real etcd: one leader serves, the standby refuses with the leader's address
and reports NOT_SERVING everywhere but ``liveness``; a SIGTERM hands over at once."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from fulcrum.ha.harness import DaemonProcess
from tests.ha.helpers import metric, pair, ping, roles
from tests.polling import until_sync


def test_standby_refuses_with_leader_trailer_and_health(
    daemons: Callable[..., DaemonProcess],
) -> None:
    leader, standby = pair(daemons)
    assert ping(leader) is None
    refusals: list[grpc.RpcError] = []

    def refused_naming_the_leader() -> bool:
        err = ping(standby)
        assert err is not None and err.code() is grpc.StatusCode.UNAVAILABLE
        refusals.append(err)
        return "x-fulcrum-leader" in dict(err.trailing_metadata() or ())

    # the standby learns the leader's address on its first campaign that loses
    until_sync(refused_naming_the_leader, "a refusal naming the leader", 20)
    assert dict(refusals[-1].trailing_metadata() or ())["x-fulcrum-leader"] == leader.address
    for name in ("", "readiness", "fulcrum.v1.FleetService",
                 "fulcrum.v1.PrefillBalancerService"):
        assert standby.health(name) == "NOT_SERVING", name
        assert leader.health(name) == "SERVING", name
    assert standby.health("liveness") == "SERVING"
    assert leader.health("liveness") == "SERVING"
    assert metric(leader, "fulcrum_ha_leader") == 1.0
    assert metric(standby, "fulcrum_ha_leader") == 0.0
    assert roles(leader)[0] == "leader"
    assert roles(standby) == []  # never changed role: nothing to log


def test_sigterm_resigns_and_the_standby_takes_over(
    daemons: Callable[..., DaemonProcess],
) -> None:
    leader, standby = pair(daemons)
    leader.signal(15)
    assert leader.p.wait(timeout=30) == 0
    until_sync(lambda: standby.health() == "SERVING", "standby took over", 20)
    assert ping(standby) is None
    assert leader.event("ha_resigned") is not None
