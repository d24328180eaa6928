"""Load reporters for decode instances, VE machines and EP groups (public API only).

* :class:`DecodeLoadReporter` -- registers a decode instance (per-GPU capacity) and
  heartbeats each GPU's observed load (requests running, KV tokens held) at the interval
  the daemon advises; re-registers on its own after a lapse or a daemon restart.
* :class:`VisionLoadReporter` -- the same for a vision-encoder machine (patches in flight
  per GPU).
* :class:`ExpertLoadReporter` -- keeps an EP group registered, accumulates the per-step
  expert load of the engine (tokens per logical expert, shape ``(num_layers,
  num_experts)``) into a window, reports it every ``report_every_steps`` steps as a raw
  little-endian ``Tensor`` (``bytes``), and watches the group's map: each new map is
  handed to ``on_map`` and later reports name its version.

Everything goes through the gRPC API (:class:`~fulcrum.client.FulcrumClient`), so these
classes double as a reference for clients in other languages (docs/protocol.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from fulcrum.client import FulcrumClient, MemberSession
from fulcrum.v1 import expert_pb2, fleet_pb2

#: Status codes after which a report is tried again later with the same window.
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# -- decode instances and VE machines ------------------------------------------------------


class _LoadReporter:
    """A fleet member whose heartbeats carry the latest load set by the engine."""

    def __init__(self, client: FulcrumClient, request: fleet_pb2.RegisterRequest) -> None:
        self.session = MemberSession(client, request, self._fill)
        # One heartbeat at a time: two concurrent ones that both find the member forgotten
        # would both register, and the second registration would replace the first.
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def member_id(self) -> str:
        return self.session.member_id

    @property
    def incarnation(self) -> int:
        """Incarnation of the current registration (0 before the first)."""
        return self.session.incarnation

    @property
    def registrations(self) -> int:
        """Registrations so far (grows by one on every re-registration)."""
        return self.session.registrations

    def _fill(self, request: fleet_pb2.HeartbeatRequest) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        """Register, then heartbeat in the background at the advised interval."""
        async with self._lock:
            await self.session.register()
        self._task = asyncio.ensure_future(self._run())

    async def report_now(self) -> None:
        """Send one heartbeat with the current load now (re-registering if the daemon has
        forgotten this member). Raises ``grpc.aio.AioRpcError`` on other failures, e.g.
        INVALID_ARGUMENT for a load that breaks a bound."""
        async with self._lock:
            if self.session.incarnation == 0:
                await self.session.register()
            before = self.session.registrations
            await self.session.heartbeat()
            if self.session.registrations != before:
                # It registered again (the daemon had forgotten it): the load of that
                # heartbeat was not taken, so send it under the new incarnation.
                await self.session.heartbeat()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.session.interval_s)
            with contextlib.suppress(grpc.aio.AioRpcError):  # unreachable: next interval
                await self.report_now()

    async def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating; by default leave the fleet at once (planned departure)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        async with self._lock:
            await self.session.stop(deregister)


class DecodeLoadReporter(_LoadReporter):
    """One decode instance: ``gpus`` is ``(max_concurrency, max_kv_tokens)`` per GPU, in
    GPU order. Call :meth:`set_load` whenever a GPU's figures change (cheap, no I/O)."""

    def __init__(
        self, client: FulcrumClient, instance_id: str, gpus: Sequence[tuple[int, int]]
    ) -> None:
        if not gpus:
            raise ValueError("gpus: need at least one GPU")
        shape = fleet_pb2.DecodeInstanceShape(
            gpus=[
                fleet_pb2.DecodeGpuCapacity(max_concurrency=c, max_kv_tokens=kv)
                for c, kv in gpus
            ]
        )
        super().__init__(
            client, fleet_pb2.RegisterRequest(member_id=instance_id, decode_instance=shape)
        )
        self._concurrency = [0] * len(gpus)
        self._kv_tokens = [0] * len(gpus)

    @property
    def gpus(self) -> int:
        return len(self._concurrency)

    def set_load(self, gpu: int, concurrency: int, kv_tokens: int) -> None:
        """Requests running on GPU ``gpu`` and the KV tokens it holds (including the growth
        from generated tokens); sent with the next heartbeat."""
        if not 0 <= gpu < self.gpus:
            raise IndexError(f"gpu: must be in [0, {self.gpus})")
        if concurrency < 0 or kv_tokens < 0:
            raise ValueError("concurrency and kv_tokens must be >= 0")
        self._concurrency[gpu] = concurrency
        self._kv_tokens[gpu] = kv_tokens

    def loads(self) -> list[tuple[int, int]]:
        """``(concurrency, kv_tokens)`` per GPU, as the next heartbeat will send them."""
        return list(zip(self._concurrency, self._kv_tokens, strict=True))

    def _fill(self, request: fleet_pb2.HeartbeatRequest) -> None:
        request.decode_instance.CopyFrom(
            fleet_pb2.DecodeInstanceLoad(
                gpus=[
                    fleet_pb2.DecodeGpuLoad(concurrency=c, kv_tokens=kv)
                    for c, kv in zip(self._concurrency, self._kv_tokens, strict=True)
                ]
            )
        )


class VisionLoadReporter(_LoadReporter):
    """One VE machine of ``gpus`` GPUs (one encoder each), at most
    ``max_patches_in_flight`` patches per GPU (0 = unlimited)."""

    def __init__(
        self,
        client: FulcrumClient,
        machine_id: str,
        gpus: int,
        max_patches_in_flight: int = 0,
    ) -> None:
        if gpus < 1:
            raise ValueError("gpus: need at least one GPU")
        shape = fleet_pb2.VisionMachineShape(gpus=gpus, max_patches_in_flight=max_patches_in_flight)
        super().__init__(
            client, fleet_pb2.RegisterRequest(member_id=machine_id, vision_machine=shape)
        )
        self._patches = [0] * gpus

    @property
    def gpus(self) -> int:
        return len(self._patches)

    def set_load(self, gpu: int, patches_in_flight: int) -> None:
        """Image patches in flight on GPU ``gpu``; sent with the next heartbeat."""
        if not 0 <= gpu < self.gpus:
            raise IndexError(f"gpu: must be in [0, {self.gpus})")
        if patches_in_flight < 0:
            raise ValueError("patches_in_flight: must be >= 0")
        self._patches[gpu] = patches_in_flight

    def loads(self) -> list[int]:
        """Patches in flight per GPU, as the next heartbeat will send them."""
        return list(self._patches)

    def _fill(self, request: fleet_pb2.HeartbeatRequest) -> None:
        request.vision_machine.CopyFrom(
            fleet_pb2.VisionMachineLoad(patches_in_flight=self._patches)
        )


# -- EP groups ---------------------------------------------------------------------------


def to_tensor(array: npt.ArrayLike) -> expert_pb2.Tensor:
    """A numpy array as a ``Tensor``: dtype name, shape, raw little-endian C-order bytes."""
    a = np.asarray(array)
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    return expert_pb2.Tensor(dtype=a.dtype.name, shape=list(a.shape), data=a.tobytes())


def from_tensor(tensor: expert_pb2.Tensor) -> npt.NDArray[Any]:
    """The numpy array of a ``Tensor`` (read-only view of its bytes)."""
    dtype = np.dtype(tensor.dtype).newbyteorder("<")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(tuple(tensor.shape))


@dataclass(frozen=True, slots=True)
class ExpertMapArrays:
    """One map version as arrays (int32): ``physical_to_logical`` (layers, physical),
    ``replica_counts`` (layers, experts), ``logical_to_physical`` (layers, experts,
    max_replicas, padded with -1). Slot ``s`` lives on GPU ``s // slots_per_gpu``."""

    version: int
    physical_to_logical: npt.NDArray[Any]
    replica_counts: npt.NDArray[Any]
    logical_to_physical: npt.NDArray[Any]
    slots_per_gpu: int
    ep_size: int
    algorithm: str

    @classmethod
    def from_pb(cls, m: expert_pb2.ExpertMap) -> ExpertMapArrays:
        return cls(
            version=m.version,
            physical_to_logical=from_tensor(m.physical_to_logical),
            replica_counts=from_tensor(m.replica_counts),
            logical_to_physical=from_tensor(m.logical_to_physical),
            slots_per_gpu=m.slots_per_gpu,
            ep_size=m.ep_size,
            algorithm=m.algorithm,
        )


#: Called with every new map version (the engine moves its expert weights, then returns).
MapCallback = Callable[[ExpertMapArrays], Awaitable[None] | None]


class ExpertLoadReporter:
    """The load reporter of one EP group (typically EP rank 0, after its all-reduce of the
    expert counters).

    * :meth:`record` adds one step's tokens per logical expert (shape ``(num_layers,
      num_experts)``, any integer or float dtype, values >= 0) to the window; every
      ``report_every_steps`` steps the window is sent (``ReportLoad``) as an int64 or
      float64 ``Tensor`` over the step range ``[step_begin, step_end)``.
    * A watch (``WatchMaps``) follows the group's map. A new version is handed to
      ``on_map``. Steps accumulated while the previous map was in force are still
      reported, under the version the window began with (the daemon counts reports
      measured under the previous version, since loads are per logical expert); a window
      older than that is dropped (counted in :attr:`dropped_steps`).
    * While the daemon is unreachable (UNAVAILABLE, DEADLINE_EXCEEDED) :meth:`record`
      keeps accumulating and counts :attr:`failed_reports`; the next report covers every
      step since the last accepted one.
    * After a daemon restart without a snapshot the group is unknown (NOT_FOUND): the
      reporter registers it again, same shape, with the map the engines run as
      ``initial_map``, and carries on. Steps are numbered by the reporter from
      ``first_step``; pass the engine's own monotonic step counter when a restarted
      reporter must continue a range the daemon restored from its snapshot.
    """

    def __init__(
        self,
        client: FulcrumClient,
        register: expert_pb2.RegisterGroupRequest,
        *,
        report_every_steps: int = 10,
        on_map: MapCallback | None = None,
        first_step: int = 0,
    ) -> None:
        if report_every_steps < 1:
            raise ValueError("report_every_steps: must be >= 1")
        self._client = client
        self._register = register
        self.report_every_steps = report_every_steps
        self._on_map = on_map
        self.shape: expert_pb2.GroupShape | None = None
        self.map_version = 0
        self.current_map: ExpertMapArrays | None = None
        self._window: npt.NDArray[Any] | None = None
        self._window_begin = first_step
        #: Map version in force when the pending window began (reported under it).
        self._window_version = 0
        self._next_step = first_step
        self.reports = 0
        self.dropped_steps = 0
        self.failed_reports = 0
        self.registrations = 0
        self.last_reply: expert_pb2.ReportLoadResponse | None = None
        self._watch: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._map_seen = asyncio.Condition()

    @property
    def group_id(self) -> str:
        return self._register.group_id

    @property
    def pending_steps(self) -> int:
        """Steps recorded but not yet reported."""
        return self._next_step - self._window_begin

    async def register(self) -> expert_pb2.RegisterGroupResponse:
        """Register the group (idempotent with the same shape) and adopt its map version."""
        request = self._register
        if self.current_map is not None:
            # The daemon may have forgotten the group (restart without a snapshot): tell it
            # the map the engines run now, so it does not assume the identity map.
            request = expert_pb2.RegisterGroupRequest()
            request.CopyFrom(self._register)
            request.initial_map.CopyFrom(to_tensor(self.current_map.physical_to_logical))
        reply: expert_pb2.RegisterGroupResponse = await self._client.expert.RegisterGroup(
            request
        )
        self.shape = reply.shape
        self.registrations += 1
        if reply.map_version != self.map_version:
            await self._adopt_version(reply.map_version)
        return reply

    async def start(self) -> None:
        """Register and start watching the map."""
        await self.register()
        self._watch = asyncio.ensure_future(self._watch_loop())

    async def stop(self, flush: bool = True) -> None:
        """Stop watching; by default report the steps still pending first."""
        if flush and self.pending_steps:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.flush()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    # -- load ------------------------------------------------------------------------------

    async def record(
        self, tokens_per_expert: npt.ArrayLike
    ) -> expert_pb2.ReportLoadResponse | None:
        """Add one step's load (tokens routed to each logical expert, shape ``(num_layers,
        num_experts)``); reports the window when it holds ``report_every_steps`` steps and
        returns that report's reply (else ``None``)."""
        load = np.asarray(tokens_per_expert)
        if self.shape is not None:
            want = (self.shape.num_layers, self.shape.num_experts)
            if load.shape != want:
                raise ValueError(f"tokens_per_expert: shape must be {want}, got {load.shape}")
        if load.size and load.min() < 0:
            raise ValueError("tokens_per_expert: values must be >= 0")
        acc = np.int64 if load.dtype.kind in "iub" else np.float64
        if self._window is None:
            self._window = np.zeros(load.shape, dtype=acc)
            self._window_version = self.map_version
        elif self._window.dtype != acc and acc is np.float64:
            self._window = self._window.astype(np.float64)
        self._window += load
        self._next_step += 1
        if self.pending_steps >= self.report_every_steps:
            try:
                return await self.flush()
            except grpc.aio.AioRpcError as err:
                if err.code() not in _TRANSIENT:
                    raise
                self.failed_reports += 1  # keep the window; the next step tries again
        return None

    async def flush(self) -> expert_pb2.ReportLoadResponse | None:
        """Report the pending window now (``None`` when nothing is pending or the window
        was dropped because the map changed)."""
        async with self._lock:
            if self._window is None or self.pending_steps == 0:
                return None
            if self.map_version == 0:
                await self.register()
            request = expert_pb2.ReportLoadRequest(
                group_id=self.group_id,
                map_version=self._window_version or self.map_version,
                step_begin=self._window_begin,
                step_end=self._next_step,
                load=to_tensor(self._window),
            )
            reply: expert_pb2.ReportLoadResponse
            try:
                reply = await self._client.expert.ReportLoad(request)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    # The daemon forgot the group (restart without snapshot): register
                    # again (with the map in force here) and report the window under it.
                    await self.register()
                    if self.pending_steps == 0:
                        return None
                    request.map_version = self.map_version
                    reply = await self._client.expert.ReportLoad(request)
                elif err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Another map is in force, or the range overlaps a restored one: these
                    # steps cannot be reported. Catch up with the map and start afresh.
                    got = await self._client.expert.GetMap(
                        expert_pb2.GetMapRequest(group_id=self.group_id)
                    )
                    self._clear_window(dropped=True)
                    await self._adopt(got.map)
                    return None
                else:
                    raise
            self._clear_window(dropped=False)
            self.reports += 1
            self.last_reply = reply
            if reply.map_version != self.map_version:
                await self._adopt_version(reply.map_version)
            return reply

    def _clear_window(self, *, dropped: bool) -> None:
        if dropped:
            self.dropped_steps += self.pending_steps
        self._window = None
        self._window_begin = self._next_step

    # -- maps ------------------------------------------------------------------------------

    async def wait_for_version(self, version: int) -> ExpertMapArrays:
        """Wait until a map of at least ``version`` has been handed to ``on_map``."""
        async with self._map_seen:
            await self._map_seen.wait_for(
                lambda: self.current_map is not None and self.current_map.version >= version
            )
        assert self.current_map is not None
        return self.current_map

    async def _adopt_version(self, version: int) -> None:
        got = await self._client.expert.GetMap(
            expert_pb2.GetMapRequest(group_id=self.group_id, version=version)
        )
        await self._adopt(got.map)

    async def _adopt(self, m: expert_pb2.ExpertMap) -> None:
        """Put a map in force on this side: hand it to the engine, report under it."""
        if self.current_map is not None and m.version == self.current_map.version:
            self.map_version = m.version
            return
        arrays = ExpertMapArrays.from_pb(m)
        if self._on_map is not None:
            result = self._on_map(arrays)
            if result is not None:
                await result
        self.map_version = m.version
        self.current_map = arrays
        async with self._map_seen:
            self._map_seen.notify_all()

    async def _watch_loop(self) -> None:
        """Follow WatchMaps; reconnect with backoff, re-register after NOT_FOUND."""
        backoff = 0.1
        while True:
            try:
                call = self._client.expert.WatchMaps(
                    expert_pb2.WatchMapsRequest(group_id=self.group_id), timeout=None
                )
                async for reply in call:
                    backoff = 0.1
                    if reply.map.version != self.map_version or self.current_map is None:
                        async with self._lock:
                            await self._adopt(reply.map)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        async with self._lock:
                            await self.register()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
