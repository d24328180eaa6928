"""Caller authorisation: identities, roles, bound ids and member kinds; the input guard.
(Transport security, TLS and mutual TLS, is :mod:`fulcrum.service.transport`.)

Authorisation (``interceptors``, when ``security.auth.enabled``): a caller's identity is
the name of its bearer token (``authorization: Bearer <token>`` metadata, tokens from
``auth.tokens_file``) or else the first SAN entry, then subject CN, of its client
certificate that names a configured identity. Each identity has a role:

- ``entrypoint`` places requests (prefill Submit, decode and VE placement);
- ``engine`` registers, heartbeats, pulls and reports, but only for the ids bound to its
  identity (``auth.identities.<name>.ids``, fnmatch globs): the acting id is the request
  field named in :data:`METHOD_RULES`; and it registers fleet members only of the kinds
  bound to it (``auth.identities.<name>.kinds``): an engine credential of prefill engines
  cannot register a decode instance;
- ``admin`` may call everything (list members, force a rebalance, internals).

Health checking and reflection stay open. A method missing from :data:`METHOD_RULES`
(for example one added later) is admin-only: the table fails closed. Denials end
UNAUTHENTICATED (no or unknown token, no identity) or PERMISSION_DENIED (role or bound id),
are counted in ``fulcrum_auth_denials_total`` and logged with the method, reason and
identity name, never a token. ``fleet`` members of every kind (prefill engines, decode
instances, VE machines) use the ``engine`` role.

Input guard (always on): request bytes that do not parse as the method's message are
answered INVALID_ARGUMENT (gRPC itself would answer UNKNOWN), after authentication, and
counted in ``fulcrum_rpc_malformed_requests_total``. A request message larger than
``server.max_message_bytes`` is answered RESOURCE_EXHAUSTED naming the bound, with a
``retry-after-ms`` trailer, without being parsed (gRPC's own receive limit is set to twice
the bound, so that such messages reach this guard; beyond twice the bound gRPC refuses
them itself: RESOURCE_EXHAUSTED "Received message larger than max", no trailer).

Reload: identities, tokens and ``auth.enabled`` are swapped on SIGHUP by reference.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Final

import grpc
import structlog

from fulcrum.config import Settings
from fulcrum.config.security import SecuritySettings, read_tokens
from fulcrum.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from fulcrum.metrics import RPC_REQUESTS
from fulcrum.metrics.security import (
    AUTH_ALLOWED,
    AUTH_DENIALS,
    AUTH_ENABLED,
    AUTH_IDENTITIES,
    MALFORMED,
)
from fulcrum.service.admission import handler_started
from fulcrum.service.app import App
from fulcrum.service.errors import RETRY_AFTER_KEY
from fulcrum.service.streams import drain
from fulcrum.service.wrap import Behavior, is_exempt, method_labels, rewrap, run_behavior

log = structlog.get_logger(__name__)

ENTRYPOINT: Final = "entrypoint"
ENGINE: Final = "engine"
ADMIN: Final = "admin"
ROLES: Final = (ENTRYPOINT, ENGINE, ADMIN)

@dataclass(frozen=True, slots=True)
class Rule:
    """Who may call one method: ``roles`` (admin is always allowed), and for engines the
    request field that names the id they act for (``None`` = no id to check)."""

    roles: frozenset[str]
    id_field: str | None = None
    #: The request's oneof whose set field names the member kind acted on (Register).
    kind_oneof: str | None = None


def _rule(*roles: str, id_field: str | None = None, kind_oneof: str | None = None) -> Rule:
    return Rule(frozenset((*roles, ADMIN)), id_field, kind_oneof)


_ANY = _rule(ENTRYPOINT, ENGINE)
_ADMIN_ONLY = _rule()

#: Full method name -> rule. Every method of every Fulcrum service is listed; anything
#: else (other than health and reflection) is admin-only.
METHOD_RULES: Final[dict[str, Rule]] = {
    # diagnostics: any authenticated caller
    "/fulcrum.v1.DiagnosticsService/Ping": _ANY,
    "/fulcrum.v1.DiagnosticsService/PingStream": _ANY,
    # fleet: members act for themselves; listing is admin's
    "/fulcrum.v1.FleetService/Register": _rule(
        ENGINE, id_field="member_id", kind_oneof="shape"
    ),
    "/fulcrum.v1.FleetService/Heartbeat": _rule(ENGINE, id_field="member_id"),
    "/fulcrum.v1.FleetService/Deregister": _rule(ENGINE, id_field="member_id"),
    "/fulcrum.v1.FleetService/ListMembers": _ADMIN_ONLY,
    # prefill: the entrypoint submits, engines pull and report for their own engine id
    "/fulcrum.v1.PrefillBalancerService/Submit": _rule(ENTRYPOINT),
    "/fulcrum.v1.PrefillBalancerService/Pull": _rule(ENGINE, id_field="engine_id"),
    "/fulcrum.v1.PrefillBalancerService/Ack": _rule(ENGINE, id_field="engine_id"),
    "/fulcrum.v1.PrefillBalancerService/ReportStepTimes": _rule(ENGINE, id_field="engine_id"),
    "/fulcrum.v1.PrefillBalancerService/GetCostModel": _ANY,
    # decode and VE placement: the entrypoint
    "/fulcrum.v1.DecodeBalancerService/PlaceDecode": _rule(ENTRYPOINT),
    "/fulcrum.v1.DecodeBalancerService/ReleaseDecode": _rule(ENTRYPOINT),
    "/fulcrum.v1.DecodeBalancerService/PlaceDecodeStream": _rule(ENTRYPOINT),
    # the decode table's load per instance and GPU: an operator's read, like ListMembers
    "/fulcrum.v1.DecodeBalancerService/GetDecodeLoad": _ADMIN_ONLY,
    "/fulcrum.v1.VisionBalancerService/PlaceImages": _rule(ENTRYPOINT),
    "/fulcrum.v1.VisionBalancerService/ReleaseImages": _rule(ENTRYPOINT),
    "/fulcrum.v1.VisionBalancerService/PlaceImagesStream": _rule(ENTRYPOINT),
    # a VE machine may read the balancer's view of itself
    "/fulcrum.v1.VisionBalancerService/GetMachineLoad": _rule(ENGINE, id_field="machine_id"),
    # EPLB: engines of a group act for its group id; forcing a rebalance is admin's
    "/fulcrum.v1.ExpertBalancerService/RegisterGroup": _rule(ENGINE, id_field="group_id"),
    "/fulcrum.v1.ExpertBalancerService/DeregisterGroup": _rule(ENGINE, id_field="group_id"),
    "/fulcrum.v1.ExpertBalancerService/ReportLoad": _rule(ENGINE, id_field="group_id"),
    "/fulcrum.v1.ExpertBalancerService/GetMap": _rule(ENGINE, id_field="group_id"),
    "/fulcrum.v1.ExpertBalancerService/WatchMaps": _rule(ENGINE, id_field="group_id"),
    "/fulcrum.v1.ExpertBalancerService/Rebalance": _ADMIN_ONLY,
    "/fulcrum.v1.ExpertBalancerService/GetGroupStatus": _ADMIN_ONLY,
}


def rule_for(method: str) -> Rule | None:
    """The rule of a full method name; ``None`` for open methods (health, reflection)."""
    if is_exempt(method):
        return None
    return METHOD_RULES.get(method, _ADMIN_ONLY)


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller. ``source`` is ``certificate`` or ``token``."""

    name: str
    role: str
    ids: tuple[str, ...]
    source: str
    #: Member kinds it may register (``prefill_engine``, ``decode_instance``,
    #: ``vision_machine``).
    kinds: frozenset[str] = frozenset()

    def may_act_for(self, member_id: str) -> bool:
        """True if this identity may act for ``member_id`` (admin: any id)."""
        if self.role == ADMIN:
            return True
        return any(fnmatchcase(member_id, pattern) for pattern in self.ids)

    def may_register(self, kind: str) -> bool:
        """True if this identity may register a member of ``kind`` (admin: any kind)."""
        return self.role == ADMIN or kind in self.kinds


class Denied(Exception):
    """An authorisation refusal: status code, reason label and caller-facing message."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        #: Name of the identity refused ("" when none was established).
        self.who = ""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authorizer:
    """Identity table (from settings and the tokens file). Reloadable; holds token
    digests only."""

    def __init__(self, settings: SecuritySettings) -> None:
        self.enabled = False
        self._identities: dict[str, tuple[str, tuple[str, ...], frozenset[str]]] = {}
        self._tokens: dict[bytes, str] = {}
        self.apply(settings)

    def apply(self, settings: SecuritySettings) -> None:
        """Take a (validated) security section; re-reads the tokens file."""
        auth = settings.auth
        tokens: dict[bytes, str] = {}
        if auth.enabled and auth.tokens_file:
            tokens = {_digest(t): name for t, name in read_tokens(auth.tokens_file).items()}
        self._identities = {
            name: (ident.role, tuple(ident.ids), frozenset(ident.kinds))
            for name, ident in auth.identities.items()
        }
        self._tokens = tokens
        self.enabled = auth.enabled
        AUTH_ENABLED.set(1 if auth.enabled else 0)
        for role in ROLES:
            AUTH_IDENTITIES.labels(role).set(
                sum(1 for r, _, _ in self._identities.values() if r == role)
            )

    def _named(self, name: str, source: str) -> Identity | None:
        entry = self._identities.get(name)
        if entry is None:
            return None
        return Identity(name, entry[0], entry[1], source, entry[2])

    def identify(
        self, metadata: Iterable[tuple[str, Any]] | None, auth_context: dict[str, list[bytes]]
    ) -> Identity:
        """The caller's identity, or :class:`Denied` (UNAUTHENTICATED)."""
        for key, value in metadata or ():
            if key != "authorization":
                continue
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Denied(
                    grpc.StatusCode.UNAUTHENTICATED, "bad_token",
                    "authorization: expected 'Bearer <token>'",
                )
            name = self._tokens.get(_digest(token.strip()))
            ident = self._named(name, "token") if name is not None else None
            if ident is None:
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "bad_token", "unknown token")
            return ident
        names = [
            *auth_context.get("x509_subject_alternative_name", ()),
            *auth_context.get("x509_common_name", ()),
        ]
        for raw in names:
            ident = self._named(raw.decode("utf-8", "replace"), "certificate")
            if ident is not None:
                return ident
        if names:
            denied = Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                "unknown_identity",
                "the client certificate names no configured identity",
            )
            denied.who = names[-1].decode("utf-8", "replace")[:128]  # the subject CN
            raise denied
        raise Denied(
            grpc.StatusCode.UNAUTHENTICATED,
            "no_identity",
            "no credentials: present a client certificate or 'authorization: Bearer <token>'",
        )

    @staticmethod
    def authorize_role(ident: Identity, method: str, rule: Rule) -> None:
        """Raise :class:`Denied` (PERMISSION_DENIED) unless the role may call ``method``."""
        if ident.role not in rule.roles:
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                "role",
                f"role {ident.role} may not call {method.rsplit('/', 1)[-1]}",
            )

    @staticmethod
    def authorize_id(ident: Identity, rule: Rule, request: Any) -> None:
        """Raise :class:`Denied` (PERMISSION_DENIED) unless ``ident`` may act for the id
        the request names in ``rule.id_field``."""
        if rule.id_field is None or ident.role == ADMIN:
            return
        value = getattr(request, rule.id_field, None)
        if not isinstance(value, str) or not ident.may_act_for(value):
            denied = Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                "bound_id",
                f"{rule.id_field}: identity {ident.name} may not act for this id",
            )
            denied.who = ident.name
            raise denied
        if rule.kind_oneof is not None:
            kind = request.WhichOneof(rule.kind_oneof)
            # no kind at all: the service answers INVALID_ARGUMENT naming the field
            if kind is not None and not ident.may_register(kind):
                denied = Denied(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "kind",
                    f"{rule.kind_oneof}: identity {ident.name} may not register a {kind} "
                    f"(it may register: {', '.join(sorted(ident.kinds)) or 'no kind'})",
                )
                denied.who = ident.name
                raise denied


class _LogLimiter:
    """At most ``per_s`` denial log lines per second; the rest are counted, not logged."""

    def __init__(self, per_s: int = 20) -> None:
        self._per_s = per_s
        self._window = 0
        self._count = 0
        self.suppressed = 0

    def allow(self) -> bool:
        now = int(time.monotonic())
        if now != self._window:
            self._window, self._count = now, 0
        self._count += 1
        if self._count > self._per_s:
            self.suppressed += 1
            return False
        return True


class _Malformed:
    """What the lenient deserializer returns for bytes that do not parse."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class _Oversized:
    """What the lenient deserializer returns for a message over the size bound."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


_MALFORMED_MESSAGE = "request: not a valid protobuf message of this method's type"
#: Retry hint of an oversized message, ms (the caller must split or shrink it).
OVERSIZE_RETRY_AFTER_MS: Final = 1000


def _oversize_message(size: int, limit: int) -> str:
    return f"request: {size} bytes is over server.max_message_bytes={limit}; send less per call"


def _lenient(
    deserializer: Callable[[bytes], Any] | None, max_bytes: int
) -> Callable[[bytes], Any] | None:
    """Wrap a request deserializer so that malformed bytes yield :class:`_Malformed`
    instead of an exception (which grpc would turn into UNKNOWN), and a message over
    ``max_bytes`` yields :class:`_Oversized` without being parsed."""
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        if len(raw) > max_bytes:
            return _Oversized(len(raw))
        try:
            return deserializer(raw)
        except Exception as err:  # any parse failure is the caller's fault
            return _Malformed(type(err).__name__)

    return parse


class GuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The outermost interceptor. On every call it refuses malformed request bytes with
    INVALID_ARGUMENT (grpc itself would answer UNKNOWN), and, while
    ``security.auth.enabled``, authenticates and authorises the caller (see the module
    docstring). It is always installed, so that a reload can turn authorisation on."""

    def __init__(self, authorizer: Authorizer, max_message_bytes: int) -> None:
        self._auth = authorizer
        self._limiter = _LogLimiter()
        self._max_bytes = max_message_bytes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        method: str = details.method
        rule = rule_for(method)
        deserializer = _lenient(handler.request_deserializer, self._max_bytes)

        def wrap(behavior: Behavior, request_streaming: bool, response_streaming: bool
                 ) -> Behavior:
            if request_streaming:
                return self._client_stream(method, rule, behavior)
            return self._one_request(method, rule, behavior)

        return rewrap(handler, wrap, deserializer)

    # -- checks -------------------------------------------------------------------------

    def _record(self, method: str, denied: Denied, context: grpc.aio.ServicerContext) -> None:
        service, name = method_labels(method)
        AUTH_DENIALS.labels(service, name, denied.code.name, denied.reason).inc()
        RPC_REQUESTS.labels(service, name, denied.code.name).inc()
        if self._limiter.allow():
            log.warning(
                "call_denied",
                method=method,
                code=denied.code.name,
                reason=denied.reason,
                identity=denied.who,
                peer=context.peer(),
                suppressed=self._limiter.suppressed,
            )

    def _admit(self, method: str, rule: Rule, context: grpc.aio.ServicerContext) -> Identity:
        """Identify and check the role; raises :class:`Denied`."""
        ident = self._auth.identify(context.invocation_metadata(), context.auth_context())
        try:
            self._auth.authorize_role(ident, method, rule)
        except Denied as denied:
            denied.who = ident.name
            raise
        AUTH_ALLOWED.labels(ident.role, ident.source).inc()
        return ident

    async def _deny(
        self, method: str, denied: Denied, context: grpc.aio.ServicerContext
    ) -> None:
        self._record(method, denied, context)
        await context.abort(denied.code, denied.message)

    async def _malformed(self, method: str, context: grpc.aio.ServicerContext) -> None:
        service, name = method_labels(method)
        MALFORMED.labels(service, name).inc()
        RPC_REQUESTS.labels(service, name, grpc.StatusCode.INVALID_ARGUMENT.name).inc()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED_MESSAGE)

    async def _oversized(
        self, method: str, size: int, context: grpc.aio.ServicerContext
    ) -> None:
        service, name = method_labels(method)
        RPC_REQUESTS.labels(service, name, grpc.StatusCode.RESOURCE_EXHAUSTED.name).inc()
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            _oversize_message(size, self._max_bytes),
            trailing_metadata=((RETRY_AFTER_KEY, str(OVERSIZE_RETRY_AFTER_MS)),),
        )

    async def _pre(
        self, method: str, rule: Rule | None, request: Any, context: grpc.aio.ServicerContext
    ) -> None:
        """Checks of a call with one request message (aborts on refusal): identity and
        role first (an unauthenticated caller learns nothing else), then the bytes, then
        the id the request acts for."""
        ident: Identity | None = None
        if rule is not None and self._auth.enabled:
            try:
                ident = self._admit(method, rule, context)
            except Denied as denied:
                await self._deny(method, denied, context)
                return
        if isinstance(request, _Malformed):
            await self._malformed(method, context)
        if isinstance(request, _Oversized):
            await self._oversized(method, request.size, context)
        if ident is not None and rule is not None:
            try:
                self._auth.authorize_id(ident, rule, request)
            except Denied as denied:
                await self._deny(method, denied, context)

    def _one_request(self, method: str, rule: Rule | None, behavior: Behavior
                     ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        """The wrapper of a call with one request message (unary or server-streaming)."""

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            handler_started()
            await self._pre(method, rule, request, context)
            return await run_behavior(behavior, request, context)

        return wrapped

    def _client_stream(
        self,
        method: str,
        rule: Rule | None,
        behavior: Behavior,
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        auth = self._auth

        async def checked(
            requests: AsyncIterator[Any],
            ident: Identity | None,
            context: grpc.aio.ServicerContext,
        ) -> AsyncIterator[Any]:
            async for item in requests:
                # Each refusal drains what the client still sends first, so that it sees
                # this code and not INTERNAL (see fulcrum.service.streams.drain).
                if isinstance(item, _Malformed):
                    service, name = method_labels(method)
                    MALFORMED.labels(service, name).inc()
                    await drain(requests)
                    raise InvalidArgument("request", "not a valid protobuf message")
                if isinstance(item, _Oversized):
                    await drain(requests)
                    raise ResourceExhausted(
                        _oversize_message(item.size, self._max_bytes), OVERSIZE_RETRY_AFTER_MS
                    )
                if ident is not None and rule is not None:
                    try:
                        auth.authorize_id(ident, rule, item)
                    except Denied as denied:
                        self._record(method, denied, context)
                        await drain(requests)
                        raise PermissionDenied(denied.message) from None
                yield item

        async def wrapped(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            handler_started()
            ident: Identity | None = None
            if rule is not None and auth.enabled:
                try:
                    ident = self._admit(method, rule, context)
                except Denied as denied:
                    await drain(requests)  # so that the client sees this code
                    await self._deny(method, denied, context)
                    return None
                if rule.id_field is None or ident.role == ADMIN:
                    ident = None  # nothing to check per message
            return await run_behavior(behavior, checked(requests, ident, context), context)

        return wrapped


# -- wiring (called by server.build) ---------------------------------------------------


def interceptors(settings: Settings, app: App) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors that authenticate and authorise callers (run before the shell's)."""
    authorizer = Authorizer(settings.security)
    app.components["security"] = authorizer

    def reload(new: Settings) -> None:
        sec = new.security
        try:
            authorizer.apply(sec)
        except ValueError as err:  # the tokens file changed under us
            log.error("auth_reload_refused", problem=str(err))
            return
        log.info(
            "auth_reloaded",
            enabled=sec.auth.enabled,
            identities=len(sec.auth.identities),
        )

    app.reload_hooks.append(reload)
    if settings.security.auth.enabled:
        log.info(
            "auth_enabled",
            identities=len(settings.security.auth.identities),
            tokens_file=bool(settings.security.auth.tokens_file),
        )
        if settings.security.plaintext:
            log.warning("bearer_tokens_over_plaintext", hint="configure security.tls")
    return [GuardInterceptor(authorizer, settings.server.max_message_bytes)]
