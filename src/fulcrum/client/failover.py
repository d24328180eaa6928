"""Several targets behind one client: follow the leader, fail over on UNAVAILABLE.

With ``ha.backend: etcd`` one daemon of a pool leads and the others stand by; a standby
answers every ``fulcrum.v1`` call UNAVAILABLE with an ``x-fulcrum-leader: host:port``
trailer. :class:`Targets` keeps the channel of each target and the one believed to lead;
:class:`FailoverStub` is a service stub whose unary calls go to that target and move on:

* **A standby's refusal** (the ``x-fulcrum-leader`` trailer is present): a standby refuses
  before reading the request, so the call goes again, whatever the method, to the leader
  the trailer names (at once the first time), or, when the value is empty or names the
  target itself, after a backoff to the next target not lost lately (or the same one).
  (The daemon sends no trailer at all while it knows no leader: that counts as below.)
* **Any other UNAVAILABLE** (connection refused or reset, a daemon draining) may have been
  processed. The next call goes to the next target; this one is tried again there only
  when the method is idempotent (:data:`IDEMPOTENT_METHODS`: Submit by its request id,
  heartbeats, registrations, acknowledgements, reads) and the client has several targets
  (with one target the channel's own gRPC retry policy applies, as before). Placements
  (PlaceDecode, PlaceImages), releases, Pull (it leases a batch), ReportLoad,
  ReportStepTimes and Rebalance are never repeated: the caller sees UNAVAILABLE and decides.
* **UNAVAILABLE with a ``retry-after-ms`` trailer** and no leader trailer is the leader's
  own answer (e.g. no live prefill engine): returned to the caller unchanged.

Attempts back off from ``first_backoff_s`` doubling to ``max_backoff_s`` (with jitter) and
stop at ``max_attempts`` or at the call's deadline, which bounds all attempts together.
Streams are not repeated either; how one ended (standby refusal, lost connection) still
moves the client to the leader or the next target for the calls that follow.

A target that did not answer is skipped, and a trailer naming it is not followed, for
one second (:class:`Targets`): until a killed leader's lease ends the standby still
names it, and calls wait on the standby rather than bounce between the two.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

__all__ = [
    "IDEMPOTENT_METHODS",
    "LEADER_KEY",
    "FailoverPolicy",
    "FailoverStub",
    "Targets",
    "leader_hint",
]

#: Trailer of a standby's UNAVAILABLE naming the leader (``host:port``; empty when none).
LEADER_KEY = "x-fulcrum-leader"
_RETRY_AFTER_KEY = "retry-after-ms"

#: Methods repeated on another target after an UNAVAILABLE that may have been processed:
#: the same request twice has the effect of once.
IDEMPOTENT_METHODS: frozenset[str] = frozenset(
    {
        "/fulcrum.v1.DiagnosticsService/Ping",
        "/fulcrum.v1.FleetService/Register",  # the last incarnation answered is the one
        "/fulcrum.v1.FleetService/Heartbeat",
        "/fulcrum.v1.FleetService/ListMembers",
        "/fulcrum.v1.PrefillBalancerService/Submit",  # by request id
        "/fulcrum.v1.PrefillBalancerService/Ack",  # a repeated ack of a held request is fine
        "/fulcrum.v1.PrefillBalancerService/GetCostModel",
        "/fulcrum.v1.DecodeBalancerService/GetDecodeLoad",
        "/fulcrum.v1.VisionBalancerService/GetMachineLoad",
        "/fulcrum.v1.ExpertBalancerService/RegisterGroup",  # idempotent with the same shape
        "/fulcrum.v1.ExpertBalancerService/GetMap",
        "/fulcrum.v1.ExpertBalancerService/GetGroupStatus",
        "/grpc.health.v1.Health/Check",
    }
)

#: Leaders learned from trailers beyond the configured targets (each holds a channel).
MAX_LEARNED_TARGETS = 8
_MAX_TARGET_CHARS = 255
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "[::]", "::", "[::0]"})


def leader_hint(trailers: Any) -> str | None:
    """The ``x-fulcrum-leader`` trailer of a standby's refusal (``trailers``: the
    call's trailing metadata): ``None`` when the call was not refused by a standby, ``""``
    when the standby knows no leader, else ``host:port``. A malformed value, or one no
    client can dial (a wildcard listen address such as ``0.0.0.0:50051``), counts as
    ``""``."""
    for key, value in trailers or ():
        if key == LEADER_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            text = text.strip()
            host = text.rpartition(":")[0]
            ok = 0 < len(text) <= _MAX_TARGET_CHARS and bool(host) and " " not in text
            return text if ok and host not in _WILDCARD_HOSTS else ""
    return None


def _has_retry_after(trailers: Any) -> bool:
    return any(key == _RETRY_AFTER_KEY for key, _ in trailers or ())


class Targets:
    """The targets of one client, a channel for each (opened on first use) and the one
    believed to lead (``current``). Leaders named by trailers join the rotation, at most
    :data:`MAX_LEARNED_TARGETS` of them. A target that did not answer is *lost* for
    ``lost_s`` seconds (``clock``: seconds): trailers naming it are not followed and
    moves skip it, so that a standby still naming a dead leader (until its lease ends)
    does not bounce calls between the two. Changes are compare-and-set on the target a
    failed call used, so a burst of calls failing together moves the client once."""

    def __init__(
        self,
        targets: Sequence[str],
        open_channel: Callable[[str], Any],
        lost_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not targets:
            raise ValueError("targets: at least one target is needed")
        self.targets: list[str] = list(dict.fromkeys(targets))
        self.configured = len(self.targets)
        self._open = open_channel
        self._channels: dict[str, Any] = {}
        self._lost_at: dict[str, float] = {}  # one entry per target at most: bounded
        self._lost_s = lost_s
        self._clock = clock
        self.current = self.targets[0]
        #: How many times ``current`` changed (a failover, seen from this client).
        self.switches = 0

    def channel(self, target: str | None = None) -> Any:
        """The channel of ``target`` (default: the current one), opened on first use."""
        target = self.current if target is None else target
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = self._open(target)
        return ch

    def is_lost(self, target: str) -> bool:
        """Whether ``target`` failed to answer within the last ``lost_s`` seconds."""
        at = self._lost_at.get(target)
        return at is not None and self._clock() - at < self._lost_s

    def follow(self, standby: str, leader: str) -> bool:
        """A standby at ``standby`` named ``leader``: make it current. False when it is
        not followed: the standby itself, a target lost lately, or one learned target
        too many."""
        if leader == standby or self.is_lost(leader):
            return False
        if leader not in self.targets:
            if len(self.targets) - self.configured >= MAX_LEARNED_TARGETS:
                return False
            self.targets.append(leader)
        if self.current == standby:
            self._switch(leader)
        return True

    def refused(self, standby: str) -> None:
        """A standby answered with no leader to follow: move to the next target not lost
        lately, or stay (the standby at least answers; it may lead soon)."""
        if self.current == standby:
            nxt = self._next(standby, skip_lost=True)
            if nxt is not None:
                self._switch(nxt)

    def lost(self, target: str) -> None:
        """``target`` did not answer as a leader (connection lost, draining): note it and
        move to the next target, preferring one not lost lately."""
        self._lost_at[target] = self._clock()
        if self.current == target:
            nxt = self._next(target, skip_lost=True) or self._next(target, skip_lost=False)
            if nxt is not None:
                self._switch(nxt)

    def _next(self, after: str, skip_lost: bool) -> str | None:
        n, i = len(self.targets), self.targets.index(after)
        for k in range(1, n):
            t = self.targets[(i + k) % n]
            if not (skip_lost and self.is_lost(t)):
                return t
        return None

    def _switch(self, target: str) -> None:
        self.current = target
        self.switches += 1

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()


class FailoverPolicy:
    """Bounds of the attempts of one call (seconds; ``max_attempts`` counts the first)."""

    def __init__(
        self,
        max_attempts: int = 16,
        first_backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        if max_attempts < 1 or first_backoff_s < 0 or max_backoff_s < first_backoff_s:
            raise ValueError("failover: need max_attempts >= 1, 0 <= first <= max backoff")
        self.max_attempts = max_attempts
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self._rng = rng or random.Random()

    def backoff_s(self, attempt: int) -> float:
        """Pause before attempt ``attempt`` (2 = the first repeat): exponential, jittered
        to 50-100 % so that clients failing over together do not arrive together."""
        base = min(self.max_backoff_s, self.first_backoff_s * 2.0 ** max(0, attempt - 2))
        return base * (0.5 + 0.5 * self._rng.random())


class FailoverStub:
    """A service stub over :class:`Targets`: ``stub.Method(request, timeout=...)`` as on a
    generated stub. Unary calls return an awaitable that fails over (see the module
    doc); streaming calls return the current target's call object."""

    def __init__(
        self,
        stub_class: Callable[[Any], Any],
        service: ServiceDescriptor,
        targets: Targets,
        policy: FailoverPolicy,
        default_timeout_s: float,
    ) -> None:
        self._stub_class = stub_class
        self._prefix = f"/{service.full_name}/"
        self._streaming = {
            m.name for m in service.methods if m.client_streaming or m.server_streaming
        }
        self._targets = targets
        self._policy = policy
        self._timeout_s = default_timeout_s
        self._stubs: dict[str, Any] = {}
        self._watchers: set[asyncio.Task[None]] = set()

    def _stub(self, target: str) -> Any:
        stub = self._stubs.get(target)
        if stub is None:
            stub = self._stubs[target] = self._stub_class(self._targets.channel(target))
        return stub

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method: Callable[..., Any]
        if name in self._streaming:
            method = self._streaming_method(name)
        elif hasattr(self._stub(self._targets.current), name):
            repeatable = (
                self._prefix + name in IDEMPOTENT_METHODS and self._targets.configured > 1
            )

            def method(request: Any, *, timeout: float | None = None, **kw: Any) -> Any:
                return self._unary(name, repeatable, request, timeout, kw)

        else:
            raise AttributeError(name)
        self.__dict__[name] = method  # made once: the next lookups are plain attributes
        return method

    def _streaming_method(self, name: str) -> Callable[..., Any]:
        def start(*args: Any, **kw: Any) -> Any:
            target = self._targets.current
            call = getattr(self._stub(target), name)(*args, **kw)
            call.add_done_callback(lambda c: self._watch_end(c, target))
            return call

        return start

    def _watch_end(self, call: Any, target: str) -> None:
        task = asyncio.ensure_future(self._learn_from_stream(call, target))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _learn_from_stream(self, call: Any, target: str) -> None:
        if await call.code() != grpc.StatusCode.UNAVAILABLE:
            return
        self._learn(target, leader_hint(await call.trailing_metadata()))

    def _learn(self, target: str, hint: str | None) -> bool:
        """Move the targets after an UNAVAILABLE from ``target`` (``hint``: its leader
        trailer, see :func:`leader_hint`); True when the call now follows a leader."""
        if hint is None:
            self._targets.lost(target)
            return False
        if hint and self._targets.follow(target, hint):
            return True
        self._targets.refused(target)
        return False

    async def _unary(
        self, name: str, repeatable: bool, request: Any, timeout: float | None,
        kw: dict[str, Any],
    ) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._timeout_s if timeout is None else timeout)
        followed = False
        for attempt in range(1, self._policy.max_attempts + 1):
            target = self._targets.current
            left = deadline - loop.time()
            try:
                return await getattr(self._stub(target), name)(
                    request, timeout=max(left, 0.001), **kw
                )
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                trailers = err.trailing_metadata()
                hint = leader_hint(trailers)
                if hint is None and _has_retry_after(trailers):
                    raise  # the leader's own answer: retry later, as it says
                now_following = self._learn(target, hint)
                if attempt == self._policy.max_attempts or (hint is None and not repeatable):
                    raise
                # the first redirect to a named leader goes at once; the rest back off
                at_once = now_following and not followed
                pause = 0.0 if at_once else self._policy.backoff_s(attempt)
                followed = followed or now_following
                if loop.time() + pause >= deadline:
                    raise
                await asyncio.sleep(pause)
        raise AssertionError("unreachable: the last attempt returns or raises")
