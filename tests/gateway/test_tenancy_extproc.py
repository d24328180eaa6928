"""Tenancy headers through the ext_proc protocol on a real gRPC channel (no Envoy): the
class reaches the decode table (a tenant's cap refuses with 429), and a malformed header
is ignored (the request is still picked) and counted."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from fulcrum.gateway.testing import wait_for
from fulcrum.state.decode import DecodeState
from fulcrum.state.tenant_filter import TenantFilter
from fulcrum.testing import running_server
from tests.gateway.test_extproc import (
    ADDRS,
    Stream,
    body_msg,
    dest,
    headers_msg,
    overrides,
    with_stub,
)
from tests.gateway.test_prefill import PREFILL, pd_overrides, prompt
from tests.service.test_server import scrape

TENANTS = {"tenants": {"classes": {"capped": {"decode_max_concurrency": 1}},
                       "sheddable_priorities": [-1]},
           "gateway": {"tenancy": {"objectives": {"critical": 2, "batch": -1}}}}


def with_headers(**headers: str) -> ep.ProcessingRequest:
    req = headers_msg(eos=True)
    for key, value in headers.items():
        req.request_headers.headers.headers.append(
            base_pb2.HeaderValue(key=key.replace("_", "-"), raw_value=value.encode()))
    return req


def tenant_filter(state: DecodeState) -> TenantFilter:  # type: ignore[type-arg]
    (f,) = [f for f in state.filters if isinstance(f, TenantFilter)]
    return f


async def test_fairness_id_reaches_the_decode_cap_and_bad_headers_are_ignored() -> None:
    over = overrides()
    over["gateway"]["tenancy"] = TENANTS["gateway"]["tenancy"]  # type: ignore[index]
    async with running_server({**over, "tenants": TENANTS["tenants"]}) as gw:
        state: DecodeState = gw.app.components["decode"]
        ch, stub = await with_stub(gw)
        async with ch:
            first = Stream(stub)
            await first.send(with_headers(x_gateway_inference_fairness_id="capped",
                                          x_gateway_inference_objective="critical"))
            assert dest(await first.recv(), "request_headers") in ADDRS
            assert tenant_filter(state).counts.held("capped")[0] == 1
            # the tenant's cap (1 decode request): the second is answered 429
            second = Stream(stub)
            await second.send(with_headers(x_gateway_inference_fairness_id="capped"))
            refused = await second.recv()
            assert refused.immediate_response.status.code == 429
            # malformed deadline and unknown objective: ignored, counted, still picked
            third = Stream(stub)
            await third.send(with_headers(x_slo_ttft_ms="soon",
                                          x_gateway_inference_objective="nope"))
            assert dest(await third.recv(), "request_headers") in ADDRS
            m = scrape(gw)
            assert m[("fulcrum_gateway_tenancy_headers_ignored_total",
                      (("header", "ttft_slo_ms"), ("reason", "malformed")))] >= 1
            assert m[("fulcrum_gateway_tenancy_headers_ignored_total",
                      (("header", "objective"), ("reason", "unknown_objective")))] >= 1
            assert m[("fulcrum_tenant_shed_total", (("balancer", "decode"),
                      ("reason", "cap"), ("tenant", "capped")))] >= 1
            for s in (first, second, third):
                await s.close()
            await wait_for(lambda: state.held == 0, what="released")
            assert tenant_filter(state).counts.held("capped") == (0, 0)


async def test_pd_sheddable_objective_past_its_deadline_is_shed_at_prefill() -> None:
    over = pd_overrides(PREFILL)
    over["gateway"]["tenancy"] = TENANTS["gateway"]["tenancy"]  # type: ignore[index]
    async with running_server({**over, "tenants": TENANTS["tenants"]}) as pd:
        ch, stub = await with_stub(pd)
        labels = (("balancer", "prefill"), ("reason", "deadline"), ("tenant", "default"))
        before = scrape(pd).get(("fulcrum_tenant_shed_total", labels), 0.0)
        async with ch:
            s = Stream(stub)
            req = with_headers(x_gateway_inference_objective="batch", x_slo_ttft_ms="1")
            req.request_headers.end_of_stream = False
            await s.send(req)
            await s.send(body_msg(prompt(1000), True))
            r = await s.recv()
            assert r.immediate_response.status.code == 429  # priority -1 is sheddable
            await s.close()
            await wait_for(lambda: pd.gateway.picker.in_flight == 0, what="released")
        assert scrape(pd)[("fulcrum_tenant_shed_total", labels)] == before + 1
