"""Admission control: answer RESOURCE_EXHAUSTED with a retry hint while the daemon can
still answer, instead of letting calls queue until gRPC's transport times them out.

Every call (health and reflection excepted) belongs to one method class:

- ``control``: what keeps the fleet alive and engines busy (fleet Register, Heartbeat and
  Deregister, prefill Pull, ReportStepTimes and GetCostModel, EPLB group calls, VE machine
  load, the releases of placements, which only free capacity, and the no-op Ping);
- ``placement``: the entrypoint's placements (prefill Submit, PlaceDecode, PlaceImages and
  their streams);
- ``admin``: listings, forced rebalances, group status.

Four signals:

1. *queue wait*: calls that arrived (their first interceptor ran) but whose handler has
   not started, because gRPC is still receiving their message or the loop has not got to
   them. Under overload calls pile up there, before any handler runs: that is where they
   used to time out (CANCELLED / DEADLINE_EXCEEDED with no answer of ours). While the
   oldest such call has waited longer than ``server.admission.shed_wait_ms``, new
   *placement* calls are refused *on arrival*, before their message is read (the refusal
   is sent from a client-streaming handler that never reads the request). A call whose
   caller gives up before its handler runs stops counting when gRPC ends its task (and in
   any case after four times that bound);
2. *abandoned calls*: calls can also queue inside gRPC before any Python code sees them
   (measured: beyond capacity calls reach the first interceptor with most of their
   deadline spent) and their callers give up there. When more than 10% of the calls that
   left the queue in the last 100 ms window (and at least 8) were abandoned by their
   callers before their handler ran, new placement calls are refused on arrival for the
   next window;
3. *loop lateness*: the daemon's loop-lag probe (:mod:`fulcrum.service.looplag`, one
   wake-up every 50 ms) measures how late the event loop runs (smoothed: once the loop
   catches up it halves every :data:`LAG_HALF_LIFE_S`, whatever the probe's period);
   above the same bound placement calls are refused on arrival too;
4. a bound on concurrent calls per class (``server.admission.max_<class>``), checked when
   the handler starts.

Signals 1 to 3 act once :meth:`Admission.watch` has joined the probe (``fulcrum serve``
does with the daemon; in-process daemons built by tests shed by concurrency only unless
the test sets ``load_shedding``).

Control and admin calls are refused only by their concurrency bound: health checks,
heartbeats, pulls and releases keep their latency because refused placements cost almost
no loop time.

A refusal ends RESOURCE_EXHAUSTED with ``retry-after-ms`` (at least
``server.admission.retry_after_ms``, and at least twice the measured wait) and is counted
in ``fulcrum_rpc_shed_total{class, reason}`` (reason: queue_wait, abandoned, loop_lag,
concurrency). Every setting is reloadable.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Final

from fulcrum.config.server import AdmissionSettings
from fulcrum.metrics import RPC_SHED

if TYPE_CHECKING:
    from fulcrum.service.looplag import LagMonitor

CONTROL: Final = "control"
PLACEMENT: Final = "placement"
ADMIN: Final = "admin"
CLASSES: Final = (CONTROL, PLACEMENT, ADMIN)

_PLACEMENT_METHODS: Final = frozenset({
    "/fulcrum.v1.PrefillBalancerService/Submit",
    "/fulcrum.v1.DecodeBalancerService/PlaceDecode",
    "/fulcrum.v1.DecodeBalancerService/PlaceDecodeStream",
    "/fulcrum.v1.VisionBalancerService/PlaceImages",
    "/fulcrum.v1.VisionBalancerService/PlaceImagesStream",
})
_ADMIN_METHODS: Final = frozenset({
    "/fulcrum.v1.FleetService/ListMembers",
    "/fulcrum.v1.DecodeBalancerService/GetDecodeLoad",
    "/fulcrum.v1.ExpertBalancerService/Rebalance",
    "/fulcrum.v1.ExpertBalancerService/GetGroupStatus",
})

#: Window of the share of abandoned calls, seconds.
WINDOW_S: Final = 0.1
#: Above this share of calls abandoned before their handler (last window), placements are
#: shed: callers time out in gRPC's queue in front of the handlers.
ABANDONED_SHARE: Final = 0.1
#: ... and at least this many calls were abandoned in it (no shedding on a few cancels).
ABANDONED_MIN: Final = 8
#: A waiting call stops counting after this many times ``shed_wait_ms`` (its caller gave
#: up before its handler ran).
FORGET_AFTER: Final = 4
#: Half-life of the smoothed loop lateness once the loop catches up, seconds (the decay of
#: the former 10 ms probe, kept when the probe's period changed to 50 ms).
LAG_HALF_LIFE_S: Final = 0.01


def class_of(method: str) -> str:
    """The method class of a full method name (``/package.Service/Method``)."""
    if method in _PLACEMENT_METHODS:
        return PLACEMENT
    if method in _ADMIN_METHODS:
        return ADMIN
    return CONTROL


class Admission:
    """Concurrent calls per class and the loop's lateness. Touched only on the loop."""

    def __init__(
        self, settings: AdmissionSettings, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        """``clock``: seconds, the clock of the ``now_s`` arguments (``time.perf_counter``;
        tests pass a fake one to decide the 100 ms windows)."""
        self.settings = settings
        self._clock = clock
        self.in_flight: dict[str, int] = dict.fromkeys(CLASSES, 0)
        #: Smoothed lateness of the event loop, seconds.
        self.lag_s = 0.0
        #: Factor applied to :attr:`lag_s` per probe sample (set by :meth:`watch`).
        self._lag_decay = 0.5
        #: Shed by load (queue wait, loop lateness): on once :meth:`watch` is called
        #: (``fulcrum serve`` starts it; in-process test daemons shed by concurrency only
        #: unless a test turns it on).
        self.load_shedding = False
        #: Share of calls abandoned by their callers before their handler started, in the
        #: last complete window.
        self.abandoned_share = 0.0
        self._window_started = 0
        self._window_abandoned = 0
        self._window_end = 0.0
        #: Calls that arrived and whose handler has not started: token -> arrival (s).
        self.waiting: OrderedDict[int, float] = OrderedDict()
        self._tokens = itertools.count(1)
        self._limits = self._limits_of(settings)

    @staticmethod
    def _limits_of(s: AdmissionSettings) -> dict[str, int]:
        return {CONTROL: s.max_control, PLACEMENT: s.max_placement, ADMIN: s.max_admin}

    def apply_settings(self, settings: AdmissionSettings) -> None:
        """Take reloaded settings (every key applies at once)."""
        self.settings = settings
        self._limits = self._limits_of(settings)

    def oldest_wait_s(self, now_s: float) -> float:
        """How long the oldest call still waiting for its handler has waited, seconds
        (calls older than FORGET_AFTER x shed_wait_ms are forgotten)."""
        forget = FORGET_AFTER * self.settings.shed_wait_ms / 1000
        waiting = self.waiting
        while waiting:
            token, arrived = next(iter(waiting.items()))
            if now_s - arrived <= forget:
                return now_s - arrived
            del waiting[token]
        return 0.0

    def _hint(self, late_s: float) -> int:
        return max(self.settings.retry_after_ms, int(2000 * late_s))

    def arrive(self, cls: str, now_s: float) -> tuple[int, int | None]:
        """A call of ``cls`` arrived (``now_s``: ``time.perf_counter()``). Returns its
        token (pass it to :meth:`started`) and None, or 0 and the retry hint (ms) of its
        refusal."""
        s = self.settings
        if s.enabled and cls == PLACEMENT and self.load_shedding:
            reason = None
            late_s = self.oldest_wait_s(now_s)
            if late_s * 1000 > s.shed_wait_ms:
                reason = "queue_wait"
            elif self.abandoned_share > ABANDONED_SHARE and now_s < self._window_end + WINDOW_S:
                reason = "abandoned"
            elif self.lag_s * 1000 > s.shed_wait_ms:
                reason, late_s = "loop_lag", self.lag_s
            if reason is not None:
                RPC_SHED.labels(cls, reason).inc()
                return 0, self._hint(late_s)
        token = next(self._tokens)
        self.waiting[token] = now_s
        return token, None

    def started(self, token: int) -> None:
        """The handler of the call with ``token`` starts."""
        if self.waiting.pop(token, None) is not None:
            self._count(abandoned=False)

    def ended(self, token: int) -> None:
        """The task of the call with ``token`` ended (if its handler never started, its
        caller gave up while it waited: counted as abandoned)."""
        if self.waiting.pop(token, None) is not None:
            self._count(abandoned=True)

    def _count(self, *, abandoned: bool) -> None:
        now = self._clock()
        if now >= self._window_end:
            n = self._window_started + self._window_abandoned
            enough = self._window_abandoned >= ABANDONED_MIN
            self.abandoned_share = self._window_abandoned / n if enough else 0.0
            self._window_started = self._window_abandoned = 0
            self._window_end = now + WINDOW_S
        if abandoned:
            self._window_abandoned += 1
        else:
            self._window_started += 1

    def admit(self, cls: str) -> int | None:
        """Count a call of ``cls`` in when its handler starts, or return the retry hint
        (ms) of a refusal (its class is at its concurrency bound)."""
        s = self.settings
        if s.enabled and self.in_flight[cls] >= self._limits[cls]:
            RPC_SHED.labels(cls, "concurrency").inc()
            return self._hint(self.lag_s)
        self.in_flight[cls] += 1
        return None

    def release(self, cls: str) -> None:
        self.in_flight[cls] = max(0, self.in_flight[cls] - 1)

    def observe_lag(self, late_s: float) -> None:
        """One lateness sample of the loop-lag probe, seconds."""
        self.lag_s = max(late_s, self.lag_s * self._lag_decay)

    def watch(self, monitor: LagMonitor) -> None:
        """Shed by load from now on, the loop's lateness taken from ``monitor``'s samples
        (the daemon's one probe, :mod:`fulcrum.service.looplag`): the smoothed lateness
        halves every :data:`LAG_HALF_LIFE_S` of the probe's period."""
        self.load_shedding = True
        self._lag_decay = 0.5 ** (monitor.interval_s / LAG_HALF_LIFE_S)
        monitor.listeners.append(self.observe_lag)


#: The admission token of the call the current task serves (set on arrival; the first
#: wrapper that runs when the handler starts, whichever interceptor it belongs to, clears
#: it: a call refused by authorisation or the input guard also stops waiting).
_CURRENT: ContextVar[tuple[Admission, int] | None] = ContextVar(
    "fulcrum_admission_token", default=None
)


def bind(admission: Admission, token: int) -> None:
    """Remember the arriving call's token in the task's context."""
    _CURRENT.set((admission, token))


def handler_started() -> None:
    """The handler of the current task's call starts (idempotent)."""
    entry = _CURRENT.get()
    if entry is not None:
        _CURRENT.set(None)
        entry[0].started(entry[1])
