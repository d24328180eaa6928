"""Where the picker's endpoints come from: the static pool, kept in the fleet by the daemon.

Each pool engine is registered in the fleet as a decode instance with one GPU per DP rank
(``max_concurrency`` and ``max_kv_tokens`` per rank), so the decode balancer follows it
like any registered instance. Engines behind a gateway never call Fulcrum, so the daemon
heartbeats them on their behalf (every half heartbeat timeout) and re-registers one that
lapsed anyway (a stalled loop). With scraping on, a heartbeat carries the load read from
the engine's own metrics (:mod:`fulcrum.gateway.scrape`), which replaces the GPU's figures
in the decode view exactly as an engine's own report would.
"""

from __future__ import annotations

import contextlib

import structlog

from fulcrum.config.gateway import PoolEngine
from fulcrum.core.types import DecodeInstanceLoad, DecodeInstanceShape, Member
from fulcrum.errors import FailedPrecondition, InvalidArgument, NotFound
from fulcrum.gateway import metrics as gm
from fulcrum.gateway.adapter import DecodeAdapter, GpuKey
from fulcrum.state.fleet import Fleet

log = structlog.get_logger(__name__)


class StaticPool:
    """The static decode engines: fleet registration, keep-alive, address table."""

    def __init__(self, fleet: Fleet, engines: list[PoolEngine]) -> None:
        self._fleet = fleet
        self._engines = {e.id: e for e in engines}
        self._members: dict[str, Member] = {}
        #: (instance_id, rank) -> "ip:port"; shared with the adapter (same dict object).
        self.addresses: dict[GpuKey, str] = {}
        self.adapter: DecodeAdapter | None = None
        for e in engines:
            for rank, addr in enumerate(e.addresses()):
                self.addresses[(e.id, rank)] = addr
        gm.ENDPOINTS.set(len(self.addresses))

    @property
    def engines(self) -> list[PoolEngine]:
        return list(self._engines.values())

    def _register(self, engine: PoolEngine, now_ns: int) -> None:
        n = len(engine.ports)
        shape = DecodeInstanceShape(
            max_concurrency=(engine.max_concurrency,) * n,
            max_kv_tokens=(engine.max_kv_tokens,) * n,
        )
        member, _replaced = self._fleet.register(engine.id, shape, now_ns)
        self._members[engine.id] = member
        if self.adapter is not None:
            self.adapter.addresses_changed(engine.id)
        log.info("gateway_pool_engine_registered", engine_id=engine.id, ranks=n)

    def start(self, now_ns: int) -> None:
        """Register every pool engine (at daemon start)."""
        for engine in self._engines.values():
            self._register(engine, now_ns)

    def keep_alive(self, now_ns: int) -> None:
        """Heartbeat every pool engine without load; re-register one that lapsed."""
        for engine_id in self._engines:
            self.report(engine_id, None, now_ns)

    def report(self, engine_id: str, load: DecodeInstanceLoad | None, now_ns: int) -> None:
        """Heartbeat one engine on its behalf (with a scraped load, or none)."""
        member = self._members.get(engine_id)
        engine = self._engines[engine_id]
        if member is None:
            self._register(engine, now_ns)
            member = self._members[engine_id]
        try:
            self._fleet.heartbeat(engine_id, member.incarnation, load, now_ns)
        except (NotFound, FailedPrecondition):
            log.warning("gateway_pool_engine_lapsed", engine_id=engine_id)
            self._register(engine, now_ns)
            if load is not None:
                self._fleet.heartbeat(engine_id, self._members[engine_id].incarnation, load, now_ns)
        except InvalidArgument as err:
            log.warning("gateway_pool_load_refused", engine_id=engine_id, error=str(err))

    def stop(self, now_ns: int) -> None:
        """Deregister the pool engines (daemon stop)."""
        for engine_id, member in list(self._members.items()):
            with contextlib.suppress(NotFound, FailedPrecondition):
                self._fleet.deregister(engine_id, member.incarnation, now_ns)
        self._members.clear()
