"""Registered endpoints: decode instances that give a serving address per GPU (DP rank)
when they register are routed to by the gateway, through a real Envoy."""

from __future__ import annotations

import grpc
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.gateway.testing import wait_for
from fulcrum.v1 import fleet_pb2 as fpb
from tests.gateway.helpers import gateway_stack


def shape(addresses: list[str]) -> fpb.DecodeInstanceShape:
    return fpb.DecodeInstanceShape(
        gpus=[
            fpb.DecodeGpuCapacity(max_concurrency=8, max_kv_tokens=100_000, serving_address=a)
            for a in addresses
        ]
    )


async def test_registered_addresses_are_routed_to_and_forgotten_on_leave() -> None:
    # No static pool: only registered GPUs are routable.
    async with gateway_stack(with_pool=False) as st:
        app = st.daemon.app
        ups = st.ups
        r = await st.post("/v1/completions", {"prompt": "a"})
        assert r.status == 503
        async with FulcrumClient(st.daemon.address, timeout_s=10.0) as client:
            # Refused registrations change nothing and name the field.
            for bad, field in (
                (["127.0.0.1:1", ""], "gpus[1].serving_address"),
                (["localhost:80"], "gpus[0].serving_address"),
                (["127.0.0.1:0"], "gpus[0].serving_address"),
                (["127.0.0.1:5", "127.0.0.1:5"], "serving_address"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.fleet.Register(
                        fpb.RegisterRequest(member_id="bad", decode_instance=shape(bad))
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field in (err.value.details() or "")
            assert app.fleet.count() == 0
            # An instance without addresses is not routable by the gateway.
            await client.fleet.Register(
                fpb.RegisterRequest(member_id="plain", decode_instance=shape(["", ""]))
            )
            assert (await st.post("/v1/completions", {"prompt": "a"})).status == 503
            addrs = [st.address(u) for u in ups[2:]]
            reply = await client.fleet.Register(
                fpb.RegisterRequest(member_id="reg", decode_instance=shape(addrs))
            )
            for _ in range(4):
                r = await st.post("/v1/completions", {"prompt": "b" * 40, "max_tokens": 2})
                assert r.status == 200
                assert st.picks[-1][1].address in addrs
                assert st.picks[-1][1].gpu[0] == "reg"
            assert not ups[0].received and not ups[1].received
            await wait_for(lambda: st.decode.held == 0, what="released")
            await client.fleet.Deregister(
                fpb.DeregisterRequest(member_id="reg", incarnation=reply.incarnation)
            )
            assert (await st.post("/v1/completions", {"prompt": "a"})).status == 503
            assert len(app.components["serving_addresses"]) == 0
