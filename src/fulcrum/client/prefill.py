"""Typed async helpers of the prefill balancer for the entrypoint and for engines.

* :func:`submit_prefill` -- the entrypoint's call: resolves when an engine has
  acknowledged the request, with the engine, DP rank, tier, predicted cost (ns) and time
  waited (ns). Idempotent: retrying the same id and lengths returns the same outcome.
* :class:`PrefillEngine` -- the engine side: pull batches by remaining quota, acknowledge
  them (a pulled batch is leased; only acknowledged requests are the engine's to run),
  keep one queue per DP rank (FIFO per priority band, higher bands first) in a
  :class:`~fulcrum.client.planner.ChunkPlanner` that
  sizes chunks with the daemon's cost model (refreshed when its version changes), and
  report measured step times for the online refit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from fulcrum.client import FulcrumClient
from fulcrum.client.planner import ChunkPlanner, CostModel, PrefillTask, StepPlan
from fulcrum.core.prefill.bands import rank_band, split_band
from fulcrum.core.prefill.batch import quota_ns as quota_ns
from fulcrum.v1 import fleet_pb2
from fulcrum.v1 import prefill_pb2 as pb


@dataclass(frozen=True, slots=True)
class PrefillPlacement:
    """Where a submitted prefill request went (ns for cost and wait)."""

    engine_id: str
    dp_rank: int
    tier: int
    tier_name: str
    predicted_cost_ns: int
    waited_ns: int


async def submit_prefill(
    client: FulcrumClient,
    request_id: str,
    total_tokens: int,
    cached_tokens: int = 0,
    *,
    max_wait_ms: int = 0,
    timeout_s: float | None = None,
    block_hashes: Sequence[int] = (),
) -> PrefillPlacement:
    """Submit a prefill request and wait until an engine acknowledges it.

    Raises ``grpc.aio.AioRpcError`` with DEADLINE_EXCEEDED (no engine in time),
    RESOURCE_EXHAUSTED (tier queue full), ALREADY_EXISTS (another request uses this id),
    INVALID_ARGUMENT or UNAVAILABLE (no live engine, or draining: retry after the
    ``retry-after-ms`` trailer). A retry with the same id and lengths is safe: it returns
    the original outcome instead of a second delivery.
    """
    reply = await client.prefill.Submit(
        pb.SubmitRequest(
            request_id=request_id,
            total_tokens=total_tokens,
            cached_tokens=cached_tokens,
            max_wait_ms=max_wait_ms,
            block_hashes=block_hashes,
        ),
        timeout=timeout_s,
    )
    return PrefillPlacement(
        engine_id=reply.engine_id,
        dp_rank=reply.dp_rank,
        tier=reply.tier,
        tier_name=reply.tier_name,
        predicted_cost_ns=reply.predicted_cost_ns,
        waited_ns=reply.waited_ns,
    )


#: The most held requests a registration may declare (the daemon's bound).
MAX_HELD = 16_384


@dataclass(frozen=True, slots=True)
class PulledBatch:
    """A pulled and acknowledged batch: the tier it came from, its requests (FIFO; only
    those the daemon confirmed are the engine's to run) and ``rejected``, the ids whose
    lease had already ended (the engine must not run them)."""

    tier: int
    tier_name: str
    requests: tuple[pb.PulledRequest, ...]
    quota_ns: int
    rejected: tuple[str, ...] = ()


class PrefillEngine:
    """One prefill engine (DP group) of ``dp_ranks`` ranks, registered as ``engine_id``."""

    def __init__(
        self, client: FulcrumClient, engine_id: str, incarnation: int, dp_ranks: int
    ) -> None:
        self._client = client
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.model_version = 0
        self.step_quota_ns = 0
        self.planner = ChunkPlanner(dp_ranks)
        #: The tier, horizon and step budget of the last pull reply.
        self.last_assignment: fleet_pb2.PrefillAssignment | None = None
        #: Accepted requests as pulled: id -> (DP rank, total tokens, cached tokens).
        self.accepted: dict[str, tuple[int, int, int]] = {}
        #: Finished ones, remembered :attr:`remember_s` seconds: id -> (when, as pulled).
        self.finished: dict[str, tuple[float, tuple[int, int, int]]] = {}
        #: How long a finished request is still declared (seconds; longer than a failover).
        self.remember_s = 30.0

    def held(self, now_s: float | None = None) -> list[fleet_pb2.HeldPrefillRequest]:
        """The accepted requests this engine still runs or ran in the last
        :attr:`remember_s` seconds, as pulled (newest last, at most :data:`MAX_HELD`):
        declared when the engine registers again (a failover or a daemon restart), so that
        a retried Submit of one gets this engine instead of running twice (its submitter
        may never have heard the old daemon's answer). ``now_s``: monotonic seconds."""
        now = time.monotonic() if now_s is None else now_s
        queued = {t.request_id for r in range(self.planner.n_ranks)
                  for t in self.planner.queue(r)}
        for k in [k for k in self.accepted if k not in queued]:
            self.finished[k] = (now, self.accepted.pop(k))
        self.finished = {k: v for k, v in self.finished.items()
                         if now - v[0] < self.remember_s}
        rows = [*(v for _, v in self.finished.values()), *self.accepted.values()]
        keys = [*self.finished, *self.accepted]
        return [fleet_pb2.HeldPrefillRequest(request_id=k, dp_rank=r, total_tokens=t,
                                             cached_tokens=c)
                for k, (r, t, c) in list(zip(keys, rows, strict=True))[-MAX_HELD:]]

    async def refresh_model(self) -> CostModel:
        """Fetch the cost model in force and plan with it from now on."""
        cm = await self._client.prefill.GetCostModel(
            pb.GetCostModelRequest(engine_id=self.engine_id)
        )
        model = CostModel(cm.a, cm.b, cm.k)
        self.planner.model = model
        self.planner.cap = cm.max_chunk_tokens
        self.model_version = cm.version
        self.step_quota_ns = cm.step_quota_ns
        return model

    def rank_loads_ns(self) -> list[int]:
        """Outstanding load of each rank (ns): predicted cost of what it still has queued."""
        model = self.planner.model
        return [
            sum(model.cost_ns(t.need, t.computed) for t in self.planner.queue(r))
            for r in range(self.planner.n_ranks)
        ]

    async def pull(
        self,
        remaining_quota_ns: int,
        *,
        max_wait_ms: int = 0,
        max_requests: int = 0,
    ) -> PulledBatch:
        """Pull a batch (long poll) and acknowledge it at once (:meth:`ack`): the
        requests the daemon confirms join their ranks' queues (FIFO within a band,
        higher bands first); the pull reports each band's work ahead per rank."""
        if self.model_version == 0:
            await self.refresh_model()
        bands = self.planner.band_loads()  # the lowest band's row is the whole load
        reply = await self._client.prefill.Pull(
            pb.PullRequest(
                engine_id=self.engine_id,
                incarnation=self.incarnation,
                remaining_quota_ns=remaining_quota_ns,
                rank_loads_ns=bands[min(bands)] if bands else [0] * self.planner.n_ranks,
                max_wait_ms=max_wait_ms,
                max_requests=max_requests,
                band_rank_loads=[
                    pb.BandRankLoads(priority=prio, boosted=up, rank_loads_ns=row)
                    for band, row in bands.items()
                    for prio, up in (split_band(band),)
                ],
            )
        )
        if reply.HasField("assignment"):
            self.last_assignment = reply.assignment
        rejected: set[str] = set()
        if reply.requests and reply.lease_ms:
            rejected = set(await self.ack([r.request_id for r in reply.requests]))
        accepted = tuple(r for r in reply.requests if r.request_id not in rejected)
        for r in accepted:
            self.planner.add(
                r.dp_rank, PrefillTask(r.request_id, int(r.cached_tokens), int(r.total_tokens),
                                       rank_band(int(r.priority), r.boosted))
            )
            self.accepted[r.request_id] = (
                int(r.dp_rank), int(r.total_tokens), int(r.cached_tokens))
        if reply.cost_model_version != self.model_version:
            await self.refresh_model()
        return PulledBatch(
            reply.tier, reply.tier_name, accepted,
            sum(int(r.predicted_cost_ns) for r in accepted), tuple(sorted(rejected)),
        )

    async def ack(self, request_ids: Sequence[str]) -> list[str]:
        """Acknowledge leased requests; returns the ids refused (lease ended: the request
        went elsewhere or its submitter left), which the engine must not run."""
        reply = await self._client.prefill.Ack(
            pb.AckRequest(
                engine_id=self.engine_id,
                incarnation=self.incarnation,
                request_ids=list(request_ids),
            )
        )
        return list(reply.rejected_request_ids)

    def step(self, budgets_ns: Sequence[float] | None = None) -> StepPlan:
        """Plan and commit one prefill step; ``budgets_ns`` per rank (default: the daemon's
        step quota on every rank). The MIN across ranks applies."""
        if budgets_ns is None:
            budgets_ns = [float(self.step_quota_ns)] * self.planner.n_ranks
        return self.planner.step(budgets_ns)

    async def report(self, samples: Sequence[tuple[int, int, int]]) -> int:
        """Report measured ``(q, c, ns)`` step samples; returns how many were accepted."""
        reply = await self._client.prefill.ReportStepTimes(
            pb.ReportStepTimesRequest(
                engine_id=self.engine_id,
                samples=[pb.StepSample(q=q, c=c, measured_ns=ns) for q, c, ns in samples],
            )
        )
        return int(reply.accepted)


StepRunner = Callable[[StepPlan], Awaitable[float]]
"""Runs one planned step on the GPUs; returns its measured time (ns)."""


class PrefillEngineLoop:
    """A complete prefill engine loop on the public API: register, pull with the
    documented quota (:func:`quota_ns`) and acknowledge, plan each step with the cost
    model, run it (``run_step``, e.g. the real forward pass), report measured step times,
    and register again when the daemon forgot the engine (NOT_FOUND / FAILED_PRECONDITION,
    e.g. after a daemon restart). Pulls quote the incarnation, so they are the engine's
    heartbeats (a parked pull keeps it alive).

    ``on_event(kind, detail)`` hears ``registered``, ``batch``, ``rejected``, ``step``,
    ``reregistered``.
    """

    def __init__(
        self,
        client: FulcrumClient,
        engine_id: str,
        dp_ranks: int,
        run_step: StepRunner,
        *,
        step_quota_ns: int = 0,
        max_wait_ms: int = 1_000,
        report_every_steps: int = 16,
        on_event: Callable[[str, str], None] | None = None,
    ) -> None:
        self._client = client
        self.engine_id = engine_id
        self.dp_ranks = dp_ranks
        self.step_quota_ns = step_quota_ns
        self._run_step = run_step
        self._max_wait_ms = max_wait_ms
        self._report_every = max(1, report_every_steps)
        self._on_event = on_event or (lambda kind, detail: None)
        self.engine: PrefillEngine | None = None
        self.horizon_ns = 0
        self.tier_name = ""
        self.samples: list[tuple[int, int, int]] = []
        self.counts = {"batches": 0, "requests": 0, "rejected": 0, "steps": 0,
                       "registrations": 0}

    async def register(self) -> None:
        """Register (again): a new incarnation, the tier's horizon and step budget."""
        old = self.engine
        held = old.held() if old is not None else []
        reply = await self._client.fleet.Register(fleet_pb2.RegisterRequest(
            member_id=self.engine_id,
            prefill_engine=fleet_pb2.PrefillEngineShape(
                dp_ranks=self.dp_ranks, step_quota_ns=self.step_quota_ns, held=held),
        ))
        self.engine = PrefillEngine(self._client, self.engine_id, int(reply.incarnation),
                                    self.dp_ranks)
        if old is not None:  # what it had acknowledged is still its own to run (declared)
            self.engine.planner = old.planner
            self.engine.accepted = old.accepted
            self.engine.finished = old.finished
        self._adopt(reply.prefill)
        self.counts["registrations"] += 1
        self._on_event("registered" if old is None else "reregistered",
                       f"incarnation {reply.incarnation}, tier {self.tier_name or '-'}, "
                       f"horizon {self.horizon_ns / 1e9:g} s")

    def _adopt(self, a: fleet_pb2.PrefillAssignment) -> None:
        if a.tier_horizon_ns:
            self.horizon_ns = int(a.tier_horizon_ns)
            self.tier_name = a.tier_name

    async def run_once(self) -> None:
        """One pull (with acknowledgement) and, when there is work, one step."""
        if self.engine is None:
            await self.register()
        eng = self.engine
        assert eng is not None
        has_work = any(eng.rank_loads_ns())
        quota = quota_ns(self.horizon_ns, eng.rank_loads_ns())
        try:
            batch = await eng.pull(quota, max_wait_ms=0 if has_work else self._max_wait_ms)
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                await self.register()
                return
            raise
        if eng.last_assignment is not None:
            self._adopt(eng.last_assignment)
        if batch.requests:
            self.counts["batches"] += 1
            self.counts["requests"] += len(batch.requests)
            self._on_event("batch", f"{len(batch.requests)} requests from {batch.tier_name}")
        if batch.rejected:
            self.counts["rejected"] += len(batch.rejected)
            self._on_event("rejected", ", ".join(batch.rejected))
        if not any(eng.rank_loads_ns()):
            return
        plan = eng.step()
        measured = int(await self._run_step(plan))
        self.counts["steps"] += 1
        for chunks in plan.chunks:
            if len(chunks) == 1:  # a rank's step of one chunk is one clean (q, c, ns) sample
                self.samples.append((chunks[0].tokens, chunks[0].start, max(1, measured)))
        if self.counts["steps"] % self._report_every == 0 and self.samples:
            await eng.report(self.samples[-4096:])
            self.samples.clear()
        self._on_event("step", f"{plan.step_ns / 1e6:.1f} ms planned, {measured / 1e6:.1f} ms")

    async def run(self, stop: asyncio.Event) -> None:
        """Loop until ``stop`` is set; UNAVAILABLE (restart, drain) is retried with backoff."""
        backoff = 0.05
        while not stop.is_set():
            try:
                await self.run_once()
                backoff = 0.05
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    async def close(self) -> None:
        """Deregister (what it holds unacknowledged goes elsewhere)."""
        if self.engine is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._client.fleet.Deregister(fleet_pb2.DeregisterRequest(
                    member_id=self.engine_id, incarnation=self.engine.incarnation))
