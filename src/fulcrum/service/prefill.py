"""PrefillBalancerService: submit by the entrypoint, pull by engines, step-time reports.

Thin: validate -> convert -> call :class:`fulcrum.state.prefill.PrefillState` -> reply.
"""

from __future__ import annotations

import hashlib

import grpc
import structlog

from fulcrum.config import Settings
from fulcrum.core.prefill.bands import rank_band
from fulcrum.core.types import MemberKind, PrefillEngineShape
from fulcrum.errors import InvalidArgument, NotFound
from fulcrum.service.app import App
from fulcrum.service.errors import require_id
from fulcrum.service.tenants import tenancy_of
from fulcrum.state.prefill import Batch, PrefillState, wait_ns
from fulcrum.v1 import fleet_pb2
from fulcrum.v1 import prefill_pb2 as pb
from fulcrum.v1 import prefill_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["PrefillBalancerService"].full_name
log = structlog.get_logger(__name__)

#: Margin kept under ``server.max_call_s`` so that a long wait ends with our own status.
_CALL_MARGIN_NS = 500_000_000


def submitter_of(context: grpc.aio.ServicerContext) -> str:
    """Who submits, for the per-submitter retention bound: the client certificate's
    name, else a digest of its bearer token, else the peer's host (without the port, so
    reconnecting does not make a new submitter)."""
    auth: dict[str, list[bytes]] = context.auth_context() or {}
    for key in ("x509_subject_alternative_name", "x509_common_name"):
        names = auth.get(key)
        if names:
            return "cert:" + bytes(names[-1]).decode("utf-8", "replace")[:128]
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            raw = value if isinstance(value, bytes) else str(value).encode()
            return "token:" + hashlib.sha256(raw).hexdigest()[:16]
    peer = context.peer() or ""
    return "peer:" + peer.rsplit(":", 1)[0][:128]


class PrefillServicer(pb_grpc.PrefillBalancerServiceServicer):
    """See the proto for the contract of each method."""

    def __init__(self, app: App, state: PrefillState) -> None:
        self._app = app
        self._state = state
        self._tenancy = tenancy_of(app)
        self._max_call_ns = int(app.settings.server.max_call_s * 1e9) - _CALL_MARGIN_NS

    def _cap_wait(self, ns: int, context: grpc.aio.ServicerContext) -> int:
        ns = min(ns, max(0, self._max_call_ns))
        remaining = context.time_remaining()
        if remaining is not None:
            ns = min(ns, max(0, int(remaining * 1e9) - 50_000_000))
        return ns

    async def Submit(
        self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> pb.SubmitResponse:
        request_id = require_id(request.request_id, "request_id")
        s = self._state.settings  # read per call: a reload applies to the next call
        wait = wait_ns(request.max_wait_ms, s.submit_wait_ms, s.max_submit_wait_ms)
        # bounded by the prompt and the table's limit before converting
        self._state.prefix.validate(request.block_hashes, int(request.total_tokens))
        cls = self._tenancy.of(request)  # INVALID_ARGUMENT naming the field, nothing held
        delivery = await self._state.submit(
            request_id,
            int(request.total_tokens),
            int(request.cached_tokens),
            self._cap_wait(wait, context),
            request.block_hashes,
            submitter_of(context),
            cls,
        )
        return pb.SubmitResponse(
            engine_id=delivery.engine_id,
            dp_rank=delivery.dp_rank,
            tier=delivery.tier,
            tier_name=self._state.labels[delivery.tier],
            predicted_cost_ns=delivery.predicted_cost_ns,
            waited_ns=delivery.waited_ns,
        )

    async def Pull(
        self, request: pb.PullRequest, context: grpc.aio.ServicerContext
    ) -> pb.PullResponse:
        require_id(request.engine_id, "engine_id")
        s = self._state.settings
        bound = self._app.settings.fleet.max_gpus_per_member
        if len(request.rank_loads_ns) > bound:  # bounded before anything is converted
            raise InvalidArgument(
                "rank_loads_ns", f"must have at most {bound} entries (one per DP rank)"
            )
        if len(request.ack_request_ids) > s.max_batch_requests:
            raise InvalidArgument(
                "ack_request_ids",
                f"must have at most {s.max_batch_requests} entries (max_batch_requests)",
            )
        bands = self._bands(request, bound)
        wait = wait_ns(request.max_wait_ms, s.pull_wait_ms, s.max_pull_wait_ms)
        batch = await self._state.pull(
            request.engine_id,
            int(request.incarnation),
            int(request.remaining_quota_ns),
            [int(x) for x in request.rank_loads_ns],
            self._cap_wait(wait, context),
            int(request.max_requests),
            lease=not request.ack_on_reply,
            ack_ids=[require_id(x, "ack_request_ids") for x in request.ack_request_ids],
            band_loads=bands,
        )
        return self._reply(batch, request.engine_id)

    def _bands(self, request: pb.PullRequest, ranks_bound: int) -> dict[float, list[int]]:
        """``band_rank_loads`` as a map by rank band (:func:`~fulcrum.core.prefill.bands.
        rank_band`), bounded before anything is converted (entries: two per priority in
        the range; each: the per-member GPU bound); duplicates refused."""
        pol = self._state.balancer.config.tenants
        most = 2 * (pol.max_priority - pol.min_priority + 1)
        if len(request.band_rank_loads) > most:
            raise InvalidArgument("band_rank_loads", f"must have at most {most} entries "
                                  "(two per priority band)")
        out: dict[float, list[int]] = {}
        for b in request.band_rank_loads:
            if len(b.rank_loads_ns) > ranks_bound:
                raise InvalidArgument("band_rank_loads", f"must have at most {ranks_bound} "
                                      "rank entries each (one per DP rank)")
            band = rank_band(int(b.priority), b.boosted)
            if band in out:
                raise InvalidArgument("band_rank_loads", f"priority {b.priority} (boosted "
                                      f"{str(b.boosted).lower()}) appears twice")
            out[band] = [int(x) for x in b.rank_loads_ns]
        return out

    async def Ack(
        self, request: pb.AckRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckResponse:
        require_id(request.engine_id, "engine_id")
        limit = self._state.settings.max_batch_requests
        if len(request.request_ids) > limit:  # bounded before anything is converted
            raise InvalidArgument(
                "request_ids", f"must have at most {limit} entries (max_batch_requests)"
            )
        ids = [require_id(x, "request_ids") for x in request.request_ids]
        reply = self._state.ack(request.engine_id, int(request.incarnation), ids)
        return pb.AckResponse(
            accepted=reply.accepted, rejected_request_ids=list(reply.rejected)
        )

    def _reply(self, batch: Batch, engine_id: str) -> pb.PullResponse:
        st = self._state
        return pb.PullResponse(
            assignment=assignment_pb(st, engine_id),
            tier=max(batch.tier, 0),
            tier_name=st.labels[batch.tier] if batch.tier >= 0 else "",
            requests=[
                pb.PulledRequest(
                    request_id=it.request_id,
                    total_tokens=it.total_tokens,
                    cached_tokens=it.cached_tokens,
                    dp_rank=it.dp_rank,
                    predicted_cost_ns=it.predicted_cost_ns,
                    priority=it.priority,
                    boosted=it.boosted,
                )
                for it in batch.items
            ],
            batch_quota_ns=batch.quota_ns,
            cost_model_version=st.model_version,
            rejected_request_ids=list(batch.rejected),
            lease_ms=batch.lease_ms,
        )

    async def ReportStepTimes(
        self, request: pb.ReportStepTimesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportStepTimesResponse:
        require_id(request.engine_id, "engine_id")
        limit = self._state.settings.refit.max_samples_per_report
        if len(request.samples) > limit:  # bounded before anything is converted
            raise InvalidArgument(
                "samples", f"must have at most {limit} entries (refit.max_samples_per_report)"
            )
        self._state.validate_pull(request.engine_id, 0, ())
        samples = [(int(s.q), int(s.c), int(s.measured_ns)) for s in request.samples]
        accepted = self._state.report_samples(samples)
        return pb.ReportStepTimesResponse(accepted=accepted)

    async def GetCostModel(
        self, request: pb.GetCostModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetCostModelResponse:
        st = self._state
        step_quota_ns = st.settings.step_quota_ns
        if request.engine_id:
            require_id(request.engine_id, "engine_id")
            try:
                engine = self._app.fleet.get_live(request.engine_id, None, self._app.clock())
            except NotFound as err:
                raise NotFound(err.message.replace("member_id:", "engine_id:", 1)) from None
            shape = engine.shape
            if not isinstance(shape, PrefillEngineShape):
                raise InvalidArgument("engine_id", "is not a prefill engine")
            step_quota_ns = shape.step_quota_ns or step_quota_ns
        return pb.GetCostModelResponse(
            a=st.model.a,
            b=st.model.b,
            k=st.model.k,
            version=st.model_version,
            step_quota_ns=step_quota_ns,
            max_chunk_tokens=st.settings.max_chunk_tokens,
        )


def assignment_pb(state: PrefillState, engine_id: str) -> fleet_pb2.PrefillAssignment:
    """The engine's tier, horizon and step budget as sent in Register, Heartbeat and Pull
    replies."""
    a = state.assignment(engine_id)
    return fleet_pb2.PrefillAssignment(
        tier=a.tier, tier_name=a.tier_name, tier_horizon_ns=a.horizon_ns,
        step_quota_ns=a.step_quota_ns,
    )


def register(server: grpc.aio.Server, app: App) -> list[str]:
    """Build the prefill state, follow prefill engines, schedule rounds and refits."""
    settings = app.settings.prefill
    tenancy = tenancy_of(app)  # its reload hook runs before ours: one policy per reload
    state = PrefillState(settings, app.fleet, app.clock, tenancy.table)
    app.fleet.add_listener(MemberKind.PREFILL_ENGINE, state)
    app.components["prefill"] = state
    app.drain_hooks.append(state.drain)

    def reload(new: Settings) -> None:
        state.apply_settings(new.prefill)
        app.periods_changed()  # round_period_ms and refit.period_s apply at once

    def refit(now_ns: int) -> None:
        if state.settings.refit.enabled:  # reloadable: checked at each period
            state.refit(now_ns)

    app.reload_hooks.append(reload)
    app.every(lambda: state.settings.round_period_ms / 1000, state.tick, "prefill-round")
    app.every(lambda: state.settings.refit.period_s, refit, "prefill-refit")
    pb_grpc.add_PrefillBalancerServiceServicer_to_server(PrefillServicer(app, state), server)
    log.debug("prefill_registered", tiers=list(state.labels))
    return [SERVICE]
