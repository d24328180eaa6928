"""A whole gateway stack on loopback: daemon (EPP on), four recording upstreams, real Envoy
from deploy/envoy/envoy.yaml with free ports."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fulcrum.config import with_overrides
from fulcrum.gateway.adapter import Placement
from fulcrum.gateway.server import Gateway
from fulcrum.gateway.testing import (
    EnvoyProcess,
    HttpResponse,
    Upstream,
    http_request,
    render_envoy_config,
    start_envoy,
    upstreams,
    wait_for,
)
from fulcrum.service.server import Daemon
from fulcrum.state.decode import DecodeState
from fulcrum.testing import running_server, test_settings


class Candidates:
    """Stand-in for the decode adapter (:class:`fulcrum.gateway.adapter.DecodeAdapter`)
    as the cache-aware picker sees it: ``n`` endpoints ``10.0.0.1:8000``, ... on decode
    slots ``0..n-1``, every one a candidate at equal load. Tests move endpoints by
    changing ``addrs`` and bumping ``generation``."""

    def __init__(self, n: int) -> None:
        self.slots = np.arange(n, dtype=np.int64)
        self.addrs = [f"10.0.0.{i + 1}:8000" for i in range(n)]
        self.keys = np.zeros(n, dtype=np.int64)
        self.scrape_listeners: list[object] = []
        self.address_listeners: list[object] = []
        self.generation = 0

    def candidates(self, _kv: int, _subset: object) -> tuple[object, list[str], object]:
        return self.slots, self.addrs, self.keys

    def addresses(self) -> list[str]:
        return list(self.addrs)


@dataclass
class Stack:
    daemon: Daemon
    gateway: Gateway
    ups: list[Upstream]
    envoy: EnvoyProcess
    picks: list[tuple[str, Placement]] = field(default_factory=list)
    releases: list[tuple[str, str]] = field(default_factory=list)

    @property
    def decode(self) -> DecodeState:
        state: DecodeState = self.daemon.app.components["decode"]
        return state

    def upstream(self, address: str) -> Upstream:
        port = int(address.rsplit(":", 1)[1])
        return next(u for u in self.ups if u.port == port)

    def address(self, u: Upstream) -> str:
        return f"127.0.0.1:{u.port}"

    async def post(
        self, path: str, obj: Any, headers: dict[str, str] | None = None
    ) -> HttpResponse:
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        return await http_request(self.envoy.port, "POST", path, body, headers)

    async def wait_released(self, request_id: str) -> str:
        """Poll until ``request_id`` is released; returns the release reason."""
        await wait_for(
            lambda: any(r == request_id for r, _ in self.releases), what=f"{request_id} released"
        )
        return next(why for r, why in self.releases if r == request_id)

    def received_total(self) -> int:
        return sum(len(u.received) for u in self.ups)


def pool_overrides(ports: list[int], **engine: Any) -> dict[str, Any]:
    return {"pool": {"decode": [{"id": "d0", "host": "127.0.0.1", "ports": ports, **engine}]}}


@contextlib.asynccontextmanager
async def gateway_stack(
    overrides: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    *,
    gateway: dict[str, Any] | None = None,
    failure_mode_allow: bool = True,
    subset_from_header: bool = False,
    request_body_mode: str = "FULL_DUPLEX_STREAMED",
    with_pool: bool = True,
    lean: bool = False,
    unary: bool = False,
    http: bool = False,
) -> AsyncIterator[Stack]:
    async with upstreams(4) as ups:
        ports = [u.port for u in ups]
        gw = {
            "enabled": True,
            "port": 0,
            "health_port": 0,
            **pool_overrides(ports, **(engine or {})),
        }
        if http:  # the HTTP picker on any free port
            gw["authz_http_port"] = 0
        if not with_pool:
            gw["pool"] = {"decode": []}
        extra = dict(gateway or {})
        pool = {**gw["pool"], **extra.pop("pool", {})}
        gw.update(extra, pool=pool)
        settings = with_overrides(test_settings(overrides), {"gateway": gw})
        async with running_server(settings=settings) as daemon:
            g = daemon.gateway
            assert g is not None
            env = await start_envoy(
                render_envoy_config(
                    g.port,
                    ports,
                    failure_mode_allow=failure_mode_allow,
                    subset_from_header=subset_from_header,
                    request_body_mode=request_body_mode,
                    lean=lean,
                    unary=unary,
                    http_authz_port=g.http_port if http else None,
                )
            )
            st = Stack(daemon, g, ups, env)
            g.picker.pick_hooks.append(lambda r, p: st.picks.append((r, p)))
            g.picker.release_hooks.append(lambda r, why: st.releases.append((r, why)))
            try:
                yield st
            finally:
                env.stop()


async def line_with(proc: asyncio.subprocess.Process, word: str, seen: list[str],
                    timeout_s: float = 60.0) -> str:
    """The first line of ``proc``'s stdout containing ``word`` (bounded: at most 500
    lines, ``timeout_s`` per line); fails with the output seen when it never comes."""
    assert proc.stdout is not None
    for _ in range(500):
        raw = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        if not raw:
            break
        seen.append(raw.decode())
        if word in seen[-1]:
            return seen[-1]
    raise AssertionError(f"no {word!r} in output: {''.join(seen)[-2000:]}")
