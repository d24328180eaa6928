"""Durable EPLB maps: written to etcd before they apply, served by the next leader at the
same version with the same map, refused when too large for etcd, and a deposed leader's
write fails (the election key's create revision is checked)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import aetcd.rpc as rpc
import grpc
import pytest

from fulcrum.config import parse_settings
from fulcrum.errors import Unavailable
from fulcrum.ha.etcd import EtcdElector
from fulcrum.ha.gate import Gate
from fulcrum.ha.harness import DaemonProcess, EtcdProcess
from fulcrum.ha.maps import EtcdMaps
from tests.ha.helpers import get_map, pair, rebalanced, register
from tests.polling import until, until_sync


def test_new_leader_serves_the_same_versions_and_continues(
    daemons: Callable[..., DaemonProcess],
) -> None:
    leader, standby = pair(daemons)
    register(leader, "g1")
    register(leader, "g2")
    assert rebalanced(leader, "g1", seed=1) == 2
    before = {g: get_map(leader, g) for g in ("g1", "g2")}
    assert before["g2"][0] == 1
    leader.signal(signal.SIGKILL)
    until_sync(lambda: standby.health() == "SERVING", "standby took over", 30, 0.05)
    after = {g: get_map(standby, g) for g in ("g1", "g2")}
    assert after == before
    assert rebalanced(standby, "g1", seed=7) == 3  # continues from the version it had
    third = daemons("c")
    standby.signal(signal.SIGKILL)
    until_sync(lambda: third.health() == "SERVING", "third daemon took over", 30, 0.05)
    assert get_map(third, "g1")[0] == 3


def test_map_over_etcd_request_limit_is_refused_at_register(
    daemons: Callable[..., DaemonProcess],
) -> None:
    leader, _ = pair(daemons, server={"max_message_bytes": 128 << 20})
    with pytest.raises(grpc.RpcError) as info:  # 300 x 1024 slots: 1.6 MB as stored
        register(leader, "big", num_layers=300, num_experts=1024, ep_size=8)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "etcd's request limit" in (info.value.details() or "")
    with pytest.raises(grpc.RpcError) as missing:
        get_map(leader, "big")
    assert missing.value.code() is grpc.StatusCode.NOT_FOUND  # nothing half-applied


async def test_deposed_leader_write_fails(etcd: EtcdProcess) -> None:
    settings = parse_settings({"ha": {
        "backend": "etcd", "election_key": "/fulcrum-test/deposed", "lease_ttl_s": 10,
        "renew_deadline_s": 8, "retry_period_s": 0.05,
        "etcd": {"endpoints": [etcd.endpoint]}}}).ha
    gates = [Gate(lambda serving, reason: None) for _ in range(2)]
    a = EtcdElector(settings, "a:1", gates[0], None)
    b = EtcdElector(settings, "b:1", gates[1], None)
    ta = asyncio.ensure_future(a.run())
    await until(lambda: a.leading, "a leads", 20)
    tb = asyncio.ensure_future(b.run())
    maps = EtcdMaps(a, settings.election_key)
    put = rpc.RequestOp(request_put=rpc.PutRequest(key=maps.prefix + b"x", value=b"1"))
    await a.guarded([put])  # a leads: written
    ta.cancel()  # a stops renewing; its lease is revoked behind its back (as if expired)
    channel = grpc.aio.insecure_channel(etcd.endpoint)
    await rpc.LeaseStub(channel).LeaseRevoke(rpc.LeaseRevokeRequest(ID=a._lease), timeout=5)
    await until(lambda: b.leading, "b leads", 20)
    assert a.leading and gates[0].ok()  # a does not know yet: its gate is still open
    late = rpc.RequestOp(request_put=rpc.PutRequest(key=maps.prefix + b"x", value=b"2"))
    with pytest.raises(Unavailable, match="deposed"):
        await a.guarded([late])
    assert not gates[0].ok()  # the failed write closed a's gate at once
    reply = await rpc.KVStub(channel).Range(rpc.RangeRequest(key=maps.prefix + b"x"))
    assert reply.kvs[0].value == b"1"
    tb.cancel()
    await b.resign()
    await channel.close()
