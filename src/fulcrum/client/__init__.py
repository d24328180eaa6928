"""Typed async clients for every Fulcrum service.

``FulcrumClient`` opens a channel per target with a default deadline on every call (a
client interceptor sets it when the caller gives none) and exposes one typed stub per
service. With one target it retries on UNAVAILABLE through gRPC's own retry policy
(service config), as before; with several (a pool under ``ha.backend: etcd``) it follows
the standby's leader trailer or moves to the next target (:mod:`fulcrum.client.failover`).
``MemberSession`` registers a fleet member, heartbeats it and re-registers on its own when
the daemon has forgotten it (after a restart, a lapse or a failover).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fulcrum.client.failover import FailoverPolicy, FailoverStub, Targets
from fulcrum.v1 import (
    decode_pb2_grpc,
    diagnostics_pb2_grpc,
    expert_pb2_grpc,
    fleet_pb2,
    fleet_pb2_grpc,
    prefill_pb2_grpc,
    vision_pb2_grpc,
)

_RETRY_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


class _DefaultDeadline(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, timeout_s: float) -> None:
        self._timeout = timeout_s

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        if details.timeout is None:
            details = details._replace(timeout=self._timeout)
        return await continuation(details, request)


class FulcrumClient:
    """A typed stub per service over one target or several. Use as ``async with``.

    ``target`` is one ``host:port`` (or any gRPC target) or a sequence of them: the
    daemons of one pool under ``ha.backend: etcd``. Calls go to the target believed to
    lead; a standby's refusal (UNAVAILABLE with an ``x-fulcrum-leader`` trailer) sends
    them to the leader it names, and a lost target to the next one, as
    :mod:`fulcrum.client.failover` describes (which calls are repeated and which are not).
    ``failover`` bounds the attempts of one call; ``timeout_s`` (seconds) is the default
    deadline of a call, all its attempts included.
    """

    # One stub per service (FailoverStub, typed as the generated async stubs).
    diagnostics: diagnostics_pb2_grpc.DiagnosticsServiceAsyncStub
    fleet: fleet_pb2_grpc.FleetServiceAsyncStub
    prefill: prefill_pb2_grpc.PrefillBalancerServiceAsyncStub
    decode: decode_pb2_grpc.DecodeBalancerServiceAsyncStub
    vision: vision_pb2_grpc.VisionBalancerServiceAsyncStub
    expert: expert_pb2_grpc.ExpertBalancerServiceAsyncStub
    health: Any

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout_s: float = 10.0,
        credentials: grpc.ChannelCredentials | None = None,
        metadata_token: str | None = None,
        options: list[tuple[str, Any]] | None = None,
        failover: FailoverPolicy | None = None,
    ) -> None:
        targets = [target] if isinstance(target, str) else list(target)
        if credentials is not None and metadata_token is not None:
            call_creds = grpc.access_token_call_credentials(metadata_token)
            credentials = grpc.composite_channel_credentials(credentials, call_creds)
        opts = _channel_options(several=len(targets) > 1, extra=options or [])
        interceptors = [_DefaultDeadline(timeout_s)]

        def open_channel(t: str) -> grpc.aio.Channel:
            if credentials is not None:
                return grpc.aio.secure_channel(
                    t, credentials, options=opts, interceptors=interceptors
                )
            return grpc.aio.insecure_channel(t, options=opts, interceptors=interceptors)

        self._targets = Targets(targets, open_channel)
        self._targets.channel()  # open the first one now, as before
        self.timeout_s = timeout_s
        policy = failover or FailoverPolicy()

        def stub(cls: Callable[[Any], Any], package: str = "fulcrum.v1") -> Any:
            name = f"{package}.{cls.__name__.removesuffix('Stub')}"  # e.g. fulcrum.v1.FleetService
            service = descriptor_pool.Default().FindServiceByName(name)
            return FailoverStub(cls, service, self._targets, policy, timeout_s)

        for attr, cls in (
            ("diagnostics", diagnostics_pb2_grpc.DiagnosticsServiceStub),
            ("fleet", fleet_pb2_grpc.FleetServiceStub),
            ("prefill", prefill_pb2_grpc.PrefillBalancerServiceStub),
            ("decode", decode_pb2_grpc.DecodeBalancerServiceStub),
            ("vision", vision_pb2_grpc.VisionBalancerServiceStub),
            ("expert", expert_pb2_grpc.ExpertBalancerServiceStub),
        ):
            setattr(self, attr, stub(cls))
        self.health = stub(health_pb2_grpc.HealthStub, "grpc.health.v1")

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel of the target believed to lead (for raw calls; they do not fail
        over)."""
        return self._targets.channel()

    @property
    def targets(self) -> tuple[str, ...]:
        """The configured targets, then the leaders learned from trailers."""
        return tuple(self._targets.targets)

    @property
    def leader(self) -> str:
        """The target calls go to now."""
        return self._targets.current

    @property
    def failovers(self) -> int:
        """How many times calls moved to another target."""
        return self._targets.switches

    async def close(self) -> None:
        await self._targets.close()

    async def __aenter__(self) -> FulcrumClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _channel_options(several: bool, extra: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Channel options. One target keeps gRPC's own retry on UNAVAILABLE (service
    config); with several, :class:`FailoverStub` decides (a standby's refusal retried on
    the same channel would only delay the move to the leader)."""
    retry: list[tuple[str, Any]] = [] if several else [("grpc.service_config", _RETRY_CONFIG)]
    return [
        *retry,
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        # Reconnect within ~2 s after a daemon restart (gRPC's default backs off to 2 min).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        *extra,
    ]


async def check_health(
    target: str,
    service: str = "",
    timeout_s: float = 3.0,
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
) -> str:
    """Health status name of ``service`` at ``target`` ("SERVING", "NOT_SERVING", ...);
    a connection failure or error gives the gRPC status name instead."""
    async with FulcrumClient(
        target, timeout_s=timeout_s, credentials=credentials, metadata_token=token
    ) as client:
        try:
            reply = await client.health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as err:
            return str(err.code().name)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class MemberSession:
    """Keeps one fleet member registered: heartbeats at the advised interval, and
    re-registers (new incarnation) when the daemon answers NOT_FOUND or
    FAILED_PRECONDITION. ``load_fn`` may fill the heartbeat's load. ``client`` is a
    :class:`FulcrumClient` or the target(s) to make one from (closed by :meth:`stop`).

    A failover (``ha.backend: etcd``) is handled as a restart: the client sends the
    heartbeat to the new leader, which does not know the member and answers NOT_FOUND,
    and the session registers there and resends its load.

    Re-registration is single-flight: heartbeats that find the member forgotten at the
    same time share one Register (a second one would replace the first incarnation and
    lose what the daemon placed on it meanwhile), and a heartbeat refused for an
    incarnation that has since been replaced does not register again. Right after a
    re-registration the session sends the load at once under the new incarnation (the
    refused heartbeat's load was not taken; until then the daemon would count the member
    idle)."""

    def __init__(
        self,
        client: FulcrumClient | str | Sequence[str],
        register_request: fleet_pb2.RegisterRequest,
        load_fn: Callable[[fleet_pb2.HeartbeatRequest], None] | None = None,
    ) -> None:
        #: A client made here from targets is the session's own: :meth:`stop` closes it.
        self._owns_client = not isinstance(client, FulcrumClient)
        self._client = client if isinstance(client, FulcrumClient) else FulcrumClient(client)
        self._register = register_request
        self._load_fn = load_fn
        self.incarnation = 0
        self.interval_s = 1.0
        self.registrations = 0
        #: The load of the last heartbeat that carried one (resent after a re-register).
        self._last_load: fleet_pb2.HeartbeatRequest | None = None
        self._registering: asyncio.Future[int] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def member_id(self) -> str:
        return self._register.member_id

    @property
    def client(self) -> FulcrumClient:
        """The client the session calls through (given, or made from its targets)."""
        return self._client

    async def register(self) -> int:
        """Register (or join the registration already under way); returns the incarnation.
        After a re-registration the last load is sent at once with the new incarnation."""
        if self._registering is None:
            fut = asyncio.ensure_future(self._register_once())
            self._registering = fut

            def done(_f: asyncio.Future[int]) -> None:
                if self._registering is fut:
                    self._registering = None

            fut.add_done_callback(done)
        # shielded: one caller giving up does not cancel the registration the others share
        return await asyncio.shield(self._registering)

    async def _register_once(self) -> int:
        reply = await self._client.fleet.Register(self._register)
        again = self.registrations > 0
        self.incarnation = reply.incarnation
        self.interval_s = reply.heartbeat_interval_ms / 1000
        self.registrations += 1
        if again:
            await self._resend_load()
        return self.incarnation

    async def _resend_load(self) -> None:
        """One heartbeat under the new incarnation with the current load (``load_fn``), or
        the last load sent; best effort: the periodic heartbeat follows anyway."""
        request = fleet_pb2.HeartbeatRequest(
            member_id=self.member_id, incarnation=self.incarnation
        )
        if self._load_fn is not None:
            self._load_fn(request)
        elif self._last_load is not None:
            request.MergeFrom(self._last_load)
            request.incarnation = self.incarnation
        if request.WhichOneof("load") is None:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._client.fleet.Heartbeat(request)

    async def heartbeat(self) -> None:
        """One heartbeat; re-registers when the daemon no longer knows this incarnation
        (at most once for heartbeats that find it forgotten together)."""
        incarnation = self.incarnation
        request = fleet_pb2.HeartbeatRequest(member_id=self.member_id, incarnation=incarnation)
        if self._load_fn is not None:
            self._load_fn(request)
        if request.WhichOneof("load") is not None:
            self._last_load = request
        try:
            await self._client.fleet.Heartbeat(request)
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise
            if self.incarnation != incarnation:
                return  # another heartbeat already registered again (and sent the load)
            await self.register()

    async def _run(self) -> None:
        while True:
            try:
                if self.incarnation == 0:
                    await self.register()
                else:
                    await self.heartbeat()
            except grpc.aio.AioRpcError:
                pass  # daemon unreachable: try again next interval
            await asyncio.sleep(self.interval_s)

    async def start(self) -> None:
        await self.register()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if deregister and self.incarnation:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._client.fleet.Deregister(
                    fleet_pb2.DeregisterRequest(
                        member_id=self.member_id, incarnation=self.incarnation
                    )
                )
        if self._owns_client:
            await self._client.close()
