"""ExpertBalancerService (EPLB): expert load in, expert-to-GPU maps out.

Thin: validate ids, convert protobuf <-> numpy (``Tensor`` = dtype + shape + raw bytes,
decoded with ``numpy.frombuffer``), call :class:`EplbState`, reply. A rebalance (periodic,
when a report completes M steps, or forced by the admin call) runs the core algorithm in
a worker thread so the event loop keeps serving; one rebalance per group at a time (the
group's lock is kept while held, across a deregistration). The result is committed only
onto the same registration (generation) at the same version, after validation.

Repeated fields are bounds-checked before conversion (a Tensor's rank and dimensions,
``load_values``' length); encoded map replies come from a bounded LRU cache
(``eplb.reply_cache_bytes``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import structlog

from fulcrum.config import Settings
from fulcrum.core.eplb import RebalanceResult, rebalance
from fulcrum.core.eplb.validate import InvalidMap
from fulcrum.core.eplb.window import window_variance
from fulcrum.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from fulcrum.metrics import eplb as m
from fulcrum.service import memory
from fulcrum.service.app import App
from fulcrum.service.errors import MAX_U64, require_id
from fulcrum.state.eplb import EplbState, GroupSpec, MapVersion, RebalanceJob
from fulcrum.units import MAX_U32
from fulcrum.v1 import expert_pb2 as pb
from fulcrum.v1 import expert_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["ExpertBalancerService"].full_name
log = structlog.get_logger(__name__)

#: Accepted ``Tensor.dtype`` names -> little-endian numpy dtypes.
DTYPES = {"int64": "<i8", "int32": "<i4", "float32": "<f4", "float64": "<f8"}
_ROLES = {pb.GROUP_ROLE_PREFILL: "prefill", pb.GROUP_ROLE_DECODE: "decode"}
_ROLE_PB = {v: k for k, v in _ROLES.items()}


def tensor_to_array(
    t: pb.Tensor, name: str, want: tuple[int, ...] | None = None
) -> npt.NDArray[np.generic]:
    """Decode a Tensor (no copy): InvalidArgument naming ``name`` when malformed.

    The shape (a repeated field) is bounds-checked before anything is converted: rank at
    most 8 (exactly ``len(want)`` when ``want`` is given), every dimension <= 2^32 - 1 and
    equal to ``want``'s."""
    if t.dtype not in DTYPES:
        raise InvalidArgument(f"{name}.dtype", f"must be one of {', '.join(DTYPES)}")
    rank = len(t.shape)
    if want is not None and rank != len(want):
        raise InvalidArgument(f"{name}.shape", f"must have {len(want)} dimensions, got {rank}")
    if rank > 8:
        raise InvalidArgument(f"{name}.shape", f"must have at most 8 dimensions, got {rank}")
    shape = tuple(int(d) for d in t.shape)
    if any(d > MAX_U32 for d in shape):
        raise InvalidArgument(f"{name}.shape", "dimensions must be in [0, 2^32-1]")
    if want is not None and shape != want:
        raise InvalidArgument(f"{name}.shape", f"must be {list(want)}, got {list(shape)}")
    dt = np.dtype(DTYPES[t.dtype])
    need = math.prod(shape) * dt.itemsize
    if len(t.data) != need:
        raise InvalidArgument(
            f"{name}.data",
            f"has {len(t.data)} bytes; shape {list(shape)} of {t.dtype} needs {need}",
        )
    return np.frombuffer(t.data, dtype=dt).reshape(shape)


def array_to_tensor(a: npt.NDArray[np.generic], dtype: str = "int32") -> pb.Tensor:
    """Encode an array as a Tensor of ``dtype``."""
    arr = np.ascontiguousarray(a, dtype=DTYPES[dtype])
    return pb.Tensor(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())


class ExpertServicer(pb_grpc.ExpertBalancerServiceServicer):
    """Groups, load reports, maps by version, watches, forced rebalances, status."""

    def __init__(self, app: App, state: EplbState) -> None:
        self._app = app
        self._state = state
        self._locks: dict[str, asyncio.Lock] = {}
        #: Group -> error of its last skipped periodic rebalance: a period that stays due
        #: while the rebalance keeps failing the same way is logged once, not per report.
        self._skipped: dict[str, str] = {}
        #: encoded map replies, least recently used first: (group, generation, version)
        self._replies: OrderedDict[tuple[str, int, int], tuple[pb.ExpertMap, int]] = OrderedDict()
        self._reply_bytes = 0

    # -- conversions ---------------------------------------------------------------------

    def _shape(self, group_id: str) -> pb.GroupShape:
        lay = self._state.get(group_id).layout
        return pb.GroupShape(
            ep_size=lay.ep_size,
            gpus_per_node=lay.gpus_per_node,
            num_layers=lay.n_layers,
            num_experts=lay.n_logical,
            num_physical=lay.n_physical,
            slots_per_gpu=lay.slots_per_gpu,
            window_steps=lay.window_steps,
            period_steps=lay.period_steps,
            role=_ROLE_PB[lay.role],
            num_expert_groups=lay.n_groups,
            redundant_per_gpu=lay.redundant_per_gpu,
            expert_bytes=lay.expert_bytes,
        )

    def map_pb(self, group_id: str, mv: MapVersion, generation: int | None = None) -> pb.ExpertMap:
        """The wire form of a version, from a bounded LRU cache (``eplb.reply_cache_bytes``)
        keyed by group, generation and version; ``generation`` None = not cached."""
        key = None if generation is None else (group_id, generation, mv.version)
        if key is not None:
            hit = self._replies.get(key)
            if hit is not None:
                self._replies.move_to_end(key)
                return hit[0]
        out = _encode_map(group_id, mv)
        if key is not None:
            size = out.ByteSize()
            budget = self._state.settings.reply_cache_bytes
            if size <= budget:
                self._replies[key] = (out, size)
                self._reply_bytes += size
                while self._reply_bytes > budget and self._replies:
                    _, (_, dropped) = self._replies.popitem(last=False)
                    self._reply_bytes -= dropped
        return out

    def _forget_replies(self, group_id: str) -> None:
        for key in [k for k in self._replies if k[0] == group_id]:
            self._reply_bytes -= self._replies.pop(key)[1]

    def _current_pb(self, group_id: str, version: int = 0) -> pb.ExpertMap:
        group = self._state.get(group_id)
        return self.map_pb(group_id, self._state.get_map(group_id, version), group.generation)

    def _load(self, request: pb.ReportLoadRequest) -> npt.NDArray[np.float64]:
        lay = self._state.get(request.group_id).layout
        has_tensor = request.HasField("load")
        has_values = len(request.load_values) > 0
        if has_tensor == has_values:
            raise InvalidArgument("load", "exactly one of load and load_values must be set")
        if has_tensor:
            arr = tensor_to_array(request.load, "load", (lay.n_layers, lay.n_logical))
            return arr.astype(np.float64)
        want = lay.n_layers * lay.n_logical
        if len(request.load_values) != want:
            raise InvalidArgument(
                "load_values", f"must hold num_layers x num_experts = {want} values"
            )
        values = np.array(request.load_values, dtype=np.float64)
        return values.reshape(lay.n_layers, lay.n_logical)

    # -- rebalance -----------------------------------------------------------------------

    def _lock(self, group_id: str) -> asyncio.Lock:
        """The group's rebalance lock. It is dropped only when free (deregistration, or
        the end of a rebalance of a group that is gone), so a rebalance still running
        after a deregistration keeps excluding the next registration's rebalances."""
        lock = self._locks.get(group_id)
        if lock is None:
            lock = self._locks[group_id] = asyncio.Lock()
        return lock

    def _drop_lock(self, group_id: str) -> None:
        lock = self._locks.get(group_id)
        if lock is not None and not lock.locked() and group_id not in self._state.groups:
            del self._locks[group_id]
        if group_id not in self._state.groups:
            self._skipped.pop(group_id, None)

    async def _run(
        self, job: RebalanceJob, dry_run: bool
    ) -> tuple[MapVersion | None, RebalanceResult, bool, float]:
        t0 = time.perf_counter()
        try:
            result = await asyncio.to_thread(_compute, job, dry_run)
        except InvalidMap as err:
            m.REBALANCES.labels(job.algorithm, job.trigger, "invalid").inc()
            if job.trigger != "period":  # periodic: ReportLoad logs it once per error
                log.error("eplb_invalid_map_refused", group=job.group_id, error=str(err))
            raise FailedPrecondition(f"rebalance refused: the map is invalid ({err})") from None
        except ValueError as err:
            m.REBALANCES.labels(job.algorithm, job.trigger, "failed").inc()
            if job.trigger != "period":  # periodic: ReportLoad logs it once per error
                log.error("eplb_rebalance_failed", group=job.group_id, error=str(err))
            raise FailedPrecondition(f"rebalance failed: {err}") from None
        seconds = time.perf_counter() - t0
        m.REBALANCE_SECONDS.labels(job.algorithm).observe(seconds)
        if dry_run:
            m.REBALANCES.labels(job.algorithm, job.trigger, "dry_run").inc()
            return None, result, False, seconds
        try:
            out = await self._state.commit(job, result)
        except NotFound:
            m.REBALANCES.labels(job.algorithm, job.trigger, "stale").inc()
            raise
        m.REBALANCES.labels(job.algorithm, job.trigger, out.outcome).inc()
        if out.outcome == "invalid":
            raise FailedPrecondition("rebalance refused: the computed map is invalid")
        return out.version, result, out.outcome == "applied", seconds

    async def _shielded(
        self, job: RebalanceJob, dry_run: bool
    ) -> tuple[MapVersion | None, RebalanceResult, bool, float]:
        """Run a rebalance that completes (and commits) even if the calling RPC is cancelled."""
        task = asyncio.ensure_future(self._run(job, dry_run))
        task.add_done_callback(_consume)
        return await asyncio.shield(task)

    # -- RPCs ----------------------------------------------------------------------------

    async def RegisterGroup(
        self, request: pb.RegisterGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterGroupResponse:
        gid = require_id(request.group_id, "group_id")
        role = _ROLES.get(request.role)
        if role is None:
            raise InvalidArgument("role", "must be GROUP_ROLE_PREFILL or GROUP_ROLE_DECODE")
        spec = GroupSpec(
            group_id=gid,
            role=role,  # type: ignore[arg-type]
            ep_size=request.ep_size,
            gpus_per_node=request.gpus_per_node or 8,
            n_layers=request.num_layers,
            n_logical=request.num_experts,
            n_groups=request.num_expert_groups or 1,
            redundant_per_gpu=(
                request.redundant_per_gpu if request.HasField("redundant_per_gpu") else None
            ),
            window_steps=request.window_steps or None,
            period_steps=request.period_steps or None,
            expert_bytes=request.expert_bytes,
        )
        initial = None
        if request.HasField("initial_map"):
            layout = self._state.make_layout(spec)  # bounds first: the map's size is known
            arr = tensor_to_array(
                request.initial_map, "initial_map", (layout.n_layers, layout.n_physical)
            )
            if arr.dtype.kind != "i":
                raise InvalidArgument("initial_map.dtype", "must be int32 or int64")
            initial = arr.astype(np.int64)
        group, created = await self._state.register(spec, initial)
        return pb.RegisterGroupResponse(
            shape=self._shape(gid), map_version=group.current.version, created=created
        )

    async def DeregisterGroup(
        self, request: pb.DeregisterGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeregisterGroupResponse:
        gid = require_id(request.group_id, "group_id")
        await self._state.deregister(gid)
        self._forget_replies(gid)
        self._drop_lock(gid)
        return pb.DeregisterGroupResponse()

    async def ReportLoad(
        self, request: pb.ReportLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportLoadResponse:
        gid = require_id(request.group_id, "group_id")
        load = self._load(request)
        out = self._state.report(
            gid, request.map_version, request.step_begin, request.step_end, load
        )
        rebalanced = False
        if out.due:
            lock = self._lock(gid)
            if not lock.locked():
                try:
                    async with lock:
                        job = self._state.prepare(gid, None, "period")
                        _, _, rebalanced, _ = await self._shielded(job, dry_run=False)
                    self._skipped.pop(gid, None)
                except (FailedPrecondition, NotFound, Unavailable) as err:
                    # the report itself was accepted; the rebalance waits for next time
                    if self._skipped.get(gid) != str(err):
                        self._skipped[gid] = str(err)
                        log.warning("eplb_periodic_rebalance_skipped", group=gid, error=str(err))
                finally:
                    self._drop_lock(gid)
        group = self._state.groups.get(gid)
        if group is None:
            return pb.ReportLoadResponse(
                map_version=out.map_version, counted_map_version=out.counted_version
            )
        return pb.ReportLoadResponse(
            map_version=group.current.version,
            observed_moe_lb=group.observed_moe_lb,
            rebalanced=rebalanced,
            window_steps=group.window_steps,
            steps_to_rebalance=group.steps_to_rebalance,
            counted_map_version=out.counted_version,
        )

    async def GetMap(
        self, request: pb.GetMapRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetMapResponse:
        gid = require_id(request.group_id, "group_id")
        return pb.GetMapResponse(map=self._current_pb(gid, request.version))

    async def WatchMaps(
        self, request: pb.WatchMapsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchMapsResponse]:
        gid = require_id(request.group_id, "group_id")
        group = self._state.get(gid)
        limit = self._state.settings.max_watchers_per_group
        if group.watchers >= limit:
            raise ResourceExhausted(
                f"group_id: {limit} watchers on {gid!r} (eplb.max_watchers_per_group)",
                retry_after_ms=self._state.settings.retry_after_ms,
            )
        group.watchers += 1
        m.WATCHERS.inc()
        try:
            sent = 0
            while True:
                event = group.changed
                if group.deleted:
                    raise NotFound(f"group_id: {gid!r} was deregistered")
                current = group.current
                if current.version != sent:
                    yield pb.WatchMapsResponse(map=self.map_pb(gid, current, group.generation))
                    sent = current.version
                await event.wait()
        finally:
            group.watchers -= 1
            m.WATCHERS.dec()
            memory.request_trim()  # its reply buffers are freed: give them back

    async def Rebalance(
        self, request: pb.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.RebalanceResponse:
        gid = require_id(request.group_id, "group_id")
        self._state.get(gid)
        try:
            async with self._lock(gid):
                job = self._state.prepare(gid, request.algorithm or None, "admin")
                mv, result, applied, seconds = await self._shielded(job, dry_run=request.dry_run)
        finally:
            self._drop_lock(gid)
        if mv is None:  # dry run: the map that would be put in force
            dry = MapVersion(
                version=0,
                placement=result.placement,
                algorithm=result.algorithm,
                predicted_moe_lb=result.after.overall,
                predicted_before=result.before.overall if result.before else 1.0,
                migration=result.migration,
            )
            wire = self.map_pb(gid, dry)
        else:
            wire = self.map_pb(gid, mv, job.generation)
        return pb.RebalanceResponse(
            map=wire,
            predicted_moe_lb_before=result.before.overall if result.before else 1.0,
            copies_received=result.migration.copies_received if (applied or mv is None) else 0,
            applied=applied,
            compute_seconds=seconds,
        )

    async def GetGroupStatus(
        self, request: pb.GetGroupStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetGroupStatusResponse:
        gid = require_id(request.group_id, "group_id")
        group = self._state.get(gid)
        per_layer = group.observed_per_layer
        return pb.GetGroupStatusResponse(
            shape=self._shape(gid),
            map_version=group.current.version,
            observed_moe_lb=group.observed_moe_lb,
            observed_moe_lb_per_layer=[] if per_layer is None else per_layer.tolist(),
            window_steps=group.window_steps,
            last_step_end=min(group.last_step_end, MAX_U64),
            steps_to_rebalance=group.steps_to_rebalance,
            rebalances=group.rebalances,
            algorithm=self._state.settings.algorithm,
        )


def _encode_map(group_id: str, mv: MapVersion) -> pb.ExpertMap:
    """The wire form of a version."""
    p = mv.placement
    return pb.ExpertMap(
        group_id=group_id,
        version=mv.version,
        physical_to_logical=array_to_tensor(p.phy2log),
        replica_counts=array_to_tensor(p.replica_counts),
        logical_to_physical=array_to_tensor(p.log2phy),
        predicted_moe_lb=mv.predicted_moe_lb,
        slots_changed=mv.migration.slots_changed,
        bytes_moved=mv.migration.bytes_moved,
        copies_received=mv.migration.copies_received,
        algorithm=mv.algorithm,
        ep_size=p.ep_size,
        slots_per_gpu=p.slots_per_gpu,
    )


def _compute(job: RebalanceJob, dry_run: bool) -> RebalanceResult:
    """The worker-thread part of a rebalance: noise estimate and the core algorithm."""
    del dry_run
    var = window_variance(np.stack(job.buckets), job.steps) if len(job.buckets) >= 2 else None
    return rebalance(
        job.algorithm, job.layout, job.loads, job.previous.placement, job.params, load_var=var
    )


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of a shielded rebalance whose caller went away."""
    if not task.cancelled():
        task.exception()


def register(server: grpc.aio.Server, app: App) -> list[str]:
    """Build the EPLB state (restoring its snapshot) and add the servicer."""
    state = EplbState(app.settings.eplb, max_message_bytes=app.settings.server.max_message_bytes)
    app.components["eplb"] = state

    def on_reload(settings: Settings) -> None:
        state.apply_settings(settings.eplb)

    app.reload_hooks.append(on_reload)
    if state.directory is not None:

        async def save_windows() -> None:
            while True:
                interval = state.settings.window_snapshot_interval_s  # reloadable
                await asyncio.sleep(interval if interval > 0 else 1.0)
                if interval > 0:
                    try:
                        await state.save_window()
                    except Exception:
                        log.exception("periodic_job_failed", job="eplb_window_snapshot")

        app.spawn(save_windows(), "eplb_window_snapshot")

        def save_at_drain() -> None:
            state.save_window_now()  # the drain serves no new calls: a blocking write is fine

        app.drain_hooks.append(save_at_drain)
    servicer = ExpertServicer(app, state)
    app.components["eplb_service"] = servicer
    pb_grpc.add_ExpertBalancerServiceServicer_to_server(servicer, server)
    return [SERVICE]
