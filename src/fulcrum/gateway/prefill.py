"""Prefill/decode disaggregation behind the gateway: the prefill engine and rank of each
request, chosen by the prefill balancer, passed in ``x-prefiller-host-port``.

Engines behind a gateway (vLLM, SGLang with llm-d's decode-side sidecar) do not run
Fulcrum's engine loop, so they cannot pull. The daemon pulls on their behalf: one puller
task per pool engine calls the prefill balancer's own ``pull`` (same queues, tiers,
engine choice by most remaining quota, least-loaded rank) with figures from its own
accounting of what it sent and what finished:

- a rank's load (ns) = the predicted cost (the prefill cost model in force) of every
  request delivered to that rank whose prefill has not finished. A prefill counts as
  finished when the request's response headers come back (the decode side has produced
  its first token, so its prefill is done) or, at the latest, when the request ends
  (response end, client gone, stream broken);
- the engine's remaining quota (ns) = ``dp_ranks * step_quota_ns * queue_steps`` minus
  the sum of its rank loads (never below 0): the engine may have ``queue_steps`` steps'
  worth of predicted prefill work outstanding. An idle engine (no load) still takes one
  oversize request alone, as for engines that pull themselves.

A pull that finds nothing long-polls for ``pull_wait_ms`` and is then made again with the
current figures (a prefill that finished meanwhile raises the remaining quota).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from fulcrum.config.gateway import GatewaySettings, PoolEngine
from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass
from fulcrum.core.types import Member, PrefillEngineShape
from fulcrum.errors import FailedPrecondition, NotFound, Unavailable
from fulcrum.gateway.adapter import PrefillAdapter
from fulcrum.state.fleet import Fleet

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Engine:
    config: PoolEngine
    member: Member | None = None
    loads_ns: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Sent:
    engine_id: str
    rank: int
    cost_ns: int


class PrefillProxy:
    """Static prefill engines: fleet registration, pulls on their behalf, accounting."""

    def __init__(
        self,
        fleet: Fleet,
        adapter: PrefillAdapter,
        engines: list[PoolEngine],
        settings: GatewaySettings,
        clock: Callable[[], int],
    ) -> None:
        self._fleet = fleet
        self._adapter = adapter
        self._settings = settings
        self._clock = clock
        self._engines = {e.id: _Engine(e, None, [0] * len(e.ports)) for e in engines}
        self._sent: dict[str, _Sent] = {}
        #: (engine_id, rank) -> "ip:port" of the prefill rank.
        self.addresses = {(e.id, r): a for e in engines for r, a in enumerate(e.addresses())}
        self._tasks: list[asyncio.Task[None]] = []

    def apply_settings(self, settings: GatewaySettings) -> None:
        self._settings = settings

    # -- fleet -----------------------------------------------------------------------------

    def _register(self, eng: _Engine, now_ns: int) -> None:
        shape = PrefillEngineShape(dp_ranks=len(eng.config.ports))
        eng.member, _ = self._fleet.register(eng.config.id, shape, now_ns)
        eng.loads_ns = [0] * len(eng.config.ports)
        for rid in [r for r, s in self._sent.items() if s.engine_id == eng.config.id]:
            del self._sent[rid]
        log.info("gateway_prefill_engine_registered", engine_id=eng.config.id)

    def start(self, now_ns: int) -> None:
        """Register the engines and start one puller per engine (on the event loop)."""
        for eng in self._engines.values():
            self._register(eng, now_ns)
        loop = asyncio.get_running_loop()
        for engine_id in self._engines:
            self._tasks.append(loop.create_task(self._puller(engine_id), name=f"pull-{engine_id}"))

    def keep_alive(self, now_ns: int) -> None:
        """Heartbeat every engine on its behalf; re-register one that lapsed."""
        for eng in self._engines.values():
            try:
                if eng.member is None:
                    raise NotFound("not registered")
                self._fleet.heartbeat(eng.config.id, eng.member.incarnation, None, now_ns)
            except (NotFound, FailedPrecondition):
                self._register(eng, now_ns)

    async def stop(self, now_ns: int) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        for eng in self._engines.values():
            if eng.member is not None:
                with contextlib.suppress(NotFound, FailedPrecondition):
                    self._fleet.deregister(eng.config.id, eng.member.incarnation, now_ns)

    # -- accounting ------------------------------------------------------------------------

    def remaining_ns(self, engine_id: str) -> int:
        """The engine's remaining quota (ns) by this module's accounting."""
        eng = self._engines[engine_id]
        budget = (
            len(eng.config.ports) * self._adapter.step_quota_ns * self._settings.prefill.queue_steps
        )
        return max(0, budget - sum(eng.loads_ns))

    def loads_ns(self, engine_id: str) -> list[int]:
        """Outstanding predicted prefill work of each rank (ns)."""
        return list(self._engines[engine_id].loads_ns)

    def finished(self, request_id: str) -> None:
        """The request's prefill is done (or the request ended): its cost leaves its rank."""
        sent = self._sent.pop(request_id, None)
        if sent is None:
            return
        eng = self._engines.get(sent.engine_id)
        if eng is not None and sent.rank < len(eng.loads_ns):
            eng.loads_ns[sent.rank] = max(0, eng.loads_ns[sent.rank] - sent.cost_ns)

    @property
    def outstanding(self) -> int:
        """Requests delivered whose prefill has not finished."""
        return len(self._sent)

    async def _puller(self, engine_id: str) -> None:
        eng = self._engines[engine_id]
        while True:
            member = eng.member
            if member is None:  # pragma: no cover - registered at start
                await asyncio.sleep(0.1)
                continue
            if self._adapter.draining:
                return
            wait_s = self._settings.prefill.pull_wait_ms / 1000
            wait_ns = self._settings.prefill.pull_wait_ms * 1_000_000
            started = asyncio.get_running_loop().time()
            try:
                batch = await self._adapter.pull(
                    engine_id,
                    member.incarnation,
                    self.remaining_ns(engine_id),
                    list(eng.loads_ns),
                    wait_ns,
                )
            except (NotFound, FailedPrecondition):
                # Lapsed or replaced: the keep-alive re-registers it; pull again then.
                await asyncio.sleep(self._settings.prefill.pull_wait_ms / 1000)
                continue
            except Unavailable:  # pragma: no cover - draining
                return
            if eng.member is not member:
                continue  # re-registered meanwhile: the batch was accounted to the old one
            for item in batch.items:
                self._sent[item.request_id] = _Sent(engine_id, item.dp_rank, item.predicted_cost_ns)
                eng.loads_ns[item.dp_rank] += item.predicted_cost_ns
            if not batch.items:
                # An empty pull that did not wait (full by our accounting, or no tier yet):
                # wait out the poll here, so that the loop never spins.
                left = started + wait_s - asyncio.get_running_loop().time()
                if left > 0:
                    await asyncio.sleep(left)

    # -- the picker's side -----------------------------------------------------------------

    async def place(self, request_id: str, prompt_tokens: int,
                    cls: RequestClass = DEFAULT_CLASS) -> str:
        """Submit the request's prefill and wait for a pull; returns the prefill rank's
        ``ip:port``. Raises the prefill balancer's errors (DeadlineExceeded when no engine
        took it in ``gateway.prefill.wait_ms``, ResourceExhausted, InvalidArgument,
        Unavailable)."""
        wait_ns = self._settings.prefill.wait_ms * 1_000_000
        delivery = await self._adapter.submit(request_id, max(1, prompt_tokens), wait_ns, cls)
        return self.addresses[(delivery.engine_id, delivery.dp_rank)]
