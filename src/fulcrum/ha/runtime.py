"""HA wired into one daemon (``ha.backend`` other than ``none``): the gate, the elector,
the interceptor, health, metrics and the transition log lines.

Health with HA: ``""``, ``readiness`` and every fulcrum.v1 service are SERVING only while
the gate is open (the leader); ``liveness`` is SERVING on any healthy daemon, standby
included, so that a liveness probe does not restart a standby. ``fulcrum_ha_leader`` is
1 on the leader. Each transition is logged once (event ``ha_role``).

A daemon that led and then lost its lease (frozen or cut off past the TTL, another daemon
may have served since) holds stale soft state: it logs ``ha_leadership_lost`` and exits
with status 1, and its supervisor (Kubernetes) starts it again, as a standby.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from fulcrum.config import Settings
from fulcrum.ha import tls
from fulcrum.ha.elector import Elector
from fulcrum.ha.etcd import EtcdElector
from fulcrum.ha.gate import Gate
from fulcrum.ha.interceptor import HaInterceptor
from fulcrum.ha.maps import EtcdMaps
from fulcrum.metrics import ha as m

log = structlog.get_logger(__name__)

LIVENESS = "liveness"
READINESS = "readiness"


class Ha:
    """See the module docstring. Built before the server (the interceptor), bound to the
    health servicer and the advertised address once the port is known."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings.ha
        self.gate = Gate(self._changed)
        creds = tls.credentials(self.settings.etcd.tls)  # TlsError: one line, at start
        self.elector = EtcdElector(self.settings, "", self.gate, creds)
        self.maps = EtcdMaps(self.elector, self.settings.election_key)
        self.elector.on_lost = self._lost
        self._health: Any = None
        self._names: list[str] = []
        self._eplb: Any = None
        self._prefill: Any = None
        self._tasks: set[asyncio.Future[None]] = set()
        #: Called with an exit status to stop the daemon (set by the server).
        self.stop: Callable[[int], None] | None = None
        m.LEADER.set(0)

    @property
    def backend(self) -> Elector:
        """The election backend, as the protocol a Kubernetes Lease backend would also
        implement (mypy checks that the etcd one does)."""
        return self.elector

    def interceptor(self) -> HaInterceptor:
        return HaInterceptor(self.gate)

    def bind(self, health: Any, names: list[str], advertise: str, eplb: Any,
             prefill: Any = None) -> None:
        """Attach health (``names``: the gated service names), the address, the
        EPLB state whose maps are made durable and the prefill state whose pulls wait
        ``adopt_grace_ms`` after an election."""
        self._health = health
        self._names = [*names, "", READINESS]
        address = self.settings.advertise or advertise
        host = address.rpartition(":")[0].strip("[]")
        if host in ("0.0.0.0", "::", ""):
            log.warning("ha_advertise_wildcard", advertise=address,
                        hint="set ha.advertise (or server.host) to an address clients can "
                        "reach: standbys name it in x-fulcrum-leader")
        self.elector.set_advertise(address)
        self._eplb = eplb
        self._prefill = prefill
        if eplb is not None:
            eplb.durable = self.maps
        self.elector.on_elected = self._elected

    def gated(self, service: str) -> bool:
        """Whether a health name follows the gate (everything but ``liveness``)."""
        return service != LIVENESS

    async def _elected(self) -> None:
        if self._eplb is not None:
            self._eplb.adopt(await self.maps.load())
        if self._prefill is not None:
            self._prefill.hold(self.settings.adopt_grace_ms)

    def _changed(self, serving: bool, reason: str) -> None:
        role = "leader" if serving else "standby"
        m.LEADER.set(1 if serving else 0)
        m.TRANSITIONS.labels(role).inc()
        if not serving and reason.endswith("(fenced)"):
            m.FENCED.inc()
        log.info("ha_role", role=role, reason=reason, leader=self.gate.leader or None,
                 key=self.settings.election_key)
        if self._health is not None:
            task = asyncio.ensure_future(self._set_health(serving))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _set_health(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self._names:
            if self.gate.serving != serving:
                return  # changed again meanwhile: the newer task sets it
            await self._health.set(name, status)

    def _lost(self, reason: str) -> None:
        m.FENCED.inc()
        log.error("ha_leadership_lost", reason=reason, key=self.settings.election_key,
                  action="exiting (status 1): this daemon's soft state may be stale; a "
                  "restart comes back as a standby")
        if self.stop is not None:
            self.stop(1)

    async def resign(self) -> None:
        await self.elector.resign()
