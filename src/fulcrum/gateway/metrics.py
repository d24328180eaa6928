"""Collectors of the gateway endpoint picker.

Labels are bounded: policy (a registered decode policy), outcome, HTTP status code,
release reason, scrape outcome. The per-request figures (picks, releases, pick time) are
plain counts on the event loop (:class:`PickCounts`, a few attribute writes per request);
the scrape reads them from a snapshot the loop publishes when a scrape asks
(:class:`fulcrum.state.placement.Publisher`), as the decode table's families are. The
rest are prometheus_client objects updated as things happen.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterator
from typing import Generic, NamedTuple, TypeVar

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from fulcrum.metrics import REGISTRY
from fulcrum.state.placement import Publisher

F = TypeVar("F")

#: Outcomes of a pick (label values of ``fulcrum_gateway_picks``).
PICK_OUTCOMES = ("picked", "no_endpoint", "shed", "bad_request", "too_large")
#: Why a held placement ended.
RELEASE_REASONS = (
    "response_end", "stream_closed", "not_held", "access_log", "check_cancelled", "expired"
)
#: Why a stream was refused before or instead of a pick (``fulcrum_gateway_refused``).
REFUSE_REASONS = ("out_of_order", "streams", "pending_bytes", "body_timeout", "too_deep")
#: HTTP codes the picker answers with an immediate response.
IMMEDIATE_CODES = ("400", "413", "429", "503")

REFUSED = Counter(
    "fulcrum_gateway_refused",
    "ext_proc streams ended with an immediate response by a stream bound or rule: "
    "out_of_order (a message out of order or a second end of stream, 400), streams "
    "(gateway.max_streams, 429), pending_bytes (gateway.max_pending_bytes, 429), "
    "body_timeout (gateway.max_body_ms, 503), too_deep (JSON nesting, 400).",
    ["reason"],
    registry=REGISTRY,
)
IMMEDIATE = Counter(
    "fulcrum_gateway_immediate_responses",
    "Immediate responses sent to the gateway instead of a destination, by HTTP code.",
    ["code"],
    registry=REGISTRY,
)
SERVED_ELSEWHERE = Counter(
    "fulcrum_gateway_served_elsewhere",
    "Responses served by another endpoint than the primary pick (a fallback or retry).",
    registry=REGISTRY,
)
#: Upper bounds of ``fulcrum_gateway_pick_seconds``' buckets, seconds.
PICK_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)

_PICKS_HELP = (
    "Endpoint picks by outcome (picked, no_endpoint -> 503, shed -> 429, bad_request -> "
    "400, too_large -> 413)."
)
_RELEASES_HELP = (
    "Placements released by the picker: at the response's end, when the ext_proc stream "
    "closed first (client gone, upstream reset), not held any more; unary mode: by the "
    "request's access-log entry (access_log), its Check cancelled after the pick "
    "(check_cancelled), or no entry within gateway.max_hold_s (expired)."
)
_SECONDS_HELP = (
    "Time to pick an endpoint once the request body is complete (parse + place), seconds."
)


class PickFigures(NamedTuple):
    """The counts of :class:`PickCounts` at publication (never written)."""

    picks: tuple[tuple[tuple[str, str], int], ...]
    releases: tuple[tuple[str, int], ...]
    #: Picks timed in each bucket of :data:`PICK_BUCKETS` (not cumulative), then above.
    buckets: tuple[int, ...]
    seconds: float


class PickCounts:
    """The picker's per-request counts (event loop only): picks by (policy, outcome),
    releases by reason, and the pick-time histogram. Each call is a few attribute
    writes; :attr:`publisher` hands the scrape an immutable :class:`PickFigures`."""

    __slots__ = ("__weakref__", "buckets", "picks", "publisher", "releases", "seconds")

    def __init__(self) -> None:
        self.picks: dict[tuple[str, str], int] = {}
        self.releases = dict.fromkeys(RELEASE_REASONS, 0)
        self.buckets = [0] * (len(PICK_BUCKETS) + 1)
        self.seconds = 0.0
        self.publisher: Publisher[PickFigures] = Publisher(self._figures)

    def pick(self, policy: str, outcome: str) -> None:
        """One pick of ``outcome`` (one of :data:`PICK_OUTCOMES`) under ``policy``."""
        key = (policy, outcome)
        self.picks[key] = self.picks.get(key, 0) + 1
        self.publisher.changed()

    def released(self, reason: str) -> None:
        """One release for ``reason`` (one of :data:`RELEASE_REASONS`)."""
        self.releases[reason] += 1
        self.publisher.changed()

    def timed(self, seconds: float) -> None:
        """A pick took ``seconds``."""
        self.buckets[bisect.bisect_left(PICK_BUCKETS, seconds)] += 1
        self.seconds += seconds
        self.publisher.changed()

    def _figures(self) -> PickFigures:
        return PickFigures(tuple(self.picks.items()), tuple(self.releases.items()),
                           tuple(self.buckets), self.seconds)


class FiguresCollector(Collector, Generic[F]):
    """Families built by ``families`` from the figures the current source publishes (a
    :class:`~fulcrum.state.placement.Publisher`, read in the scrape thread; held weakly:
    once its owner is gone, ``families(None)``, every count zero)."""

    def __init__(self, families: Callable[[F | None], Iterator[Metric]]) -> None:
        self.families = families
        self._source: weakref.ReferenceType[Publisher[F]] | None = None

    def set_source(self, publisher: Publisher[F]) -> None:
        self._source = weakref.ref(publisher)

    def describe(self) -> Iterator[Metric]:
        return self.families(None)

    def collect(self) -> Iterator[Metric]:
        publisher = self._source() if self._source is not None else None
        return self.families(None if publisher is None else publisher.fresh())


def _pick_families(f: PickFigures | None) -> Iterator[Metric]:
    """``fulcrum_gateway_picks``, ``_releases`` and ``_pick_seconds``."""
    picks = CounterMetricFamily("fulcrum_gateway_picks", _PICKS_HELP,
                                labels=("policy", "outcome"))
    releases = CounterMetricFamily("fulcrum_gateway_releases", _RELEASES_HELP,
                                   labels=("reason",))
    buckets = f.buckets if f is not None else (0,) * (len(PICK_BUCKETS) + 1)
    for (policy, outcome), n in sorted(f.picks if f is not None else ()):
        picks.add_metric([policy, outcome], float(n))
    released = dict(f.releases) if f is not None else {}
    for reason in RELEASE_REASONS:
        releases.add_metric([reason], float(released.get(reason, 0)))
    seconds = histogram_family("fulcrum_gateway_pick_seconds", _SECONDS_HELP,
                               PICK_BUCKETS, buckets, f.seconds if f is not None else 0.0)
    yield from (picks, releases, seconds)


def histogram_family(
    name: str, doc: str, bounds: tuple[float, ...], counts: tuple[int, ...], total: float
) -> HistogramMetricFamily:
    """A histogram family from plain counts: ``counts[i]`` observations in bucket ``i`` of
    ``bounds`` (upper bounds; not cumulative), then those above the last; ``total``
    their sum."""
    upper = [*map(str, bounds), "+Inf"]
    cumulative, seen = [], 0
    for le, n in zip(upper, counts, strict=True):
        seen += n
        cumulative.append((le, float(seen)))
    return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)


PICK_FIGURES: FiguresCollector[PickFigures] = FiguresCollector(_pick_families)
REGISTRY.register(PICK_FIGURES)

IN_FLIGHT = Gauge(
    "fulcrum_gateway_requests_in_flight",
    "HTTP requests the picker holds a placement for (the picker's table of held "
    "placements, at most one per ext_proc stream).",
    registry=REGISTRY,
)
STREAMS = Gauge(
    "fulcrum_gateway_streams",
    "Open ext_proc streams (one per HTTP request in the gateway).",
    registry=REGISTRY,
)
HTTP_CONNECTIONS = Gauge(
    "fulcrum_gateway_authz_http_connections",
    "HTTP mode: open connections to the HTTP picker (gateway.authz_http_port; Envoy keeps "
    "them alive, a few per worker).",
    registry=REGISTRY,
)
ENDPOINTS = Gauge(
    "fulcrum_gateway_endpoints",
    "Decode endpoints (ip:port, one per DP rank) the picker may route to.",
    registry=REGISTRY,
)
ACCESS_LOG_ENTRIES = Counter(
    "fulcrum_gateway_access_log_entries",
    "Unary mode: Envoy access-log entries received, by outcome (released: the entry's "
    "x-fulcrum-placement was held and is released; unknown: no held placement named).",
    ["outcome"],
    registry=REGISTRY,
)
ACCESS_LOG_TTFT = Counter(
    "fulcrum_gateway_access_log_ttft",
    "Unary and HTTP modes: the time to first response body byte in released entries "
    "(the fulcrum_ttft_us tag), by outcome (read: handed to the cost-model learner; "
    "missing: no value, the bootstrap does not log it or no body came; malformed: not "
    "whole microseconds up to an hour, ignored).",
    ["outcome"],
    registry=REGISTRY,
)
SCRAPES = Counter(
    "fulcrum_gateway_scrapes",
    "Scrapes of engines' Prometheus endpoints by outcome (ok, error).",
    ["outcome"],
    registry=REGISTRY,
)

for _r in REFUSE_REASONS:
    REFUSED.labels(_r)
for _c in IMMEDIATE_CODES:
    IMMEDIATE.labels(_c)
for _o in ("released", "unknown"):
    ACCESS_LOG_ENTRIES.labels(_o)
for _o in ("read", "missing", "malformed"):
    ACCESS_LOG_TTFT.labels(_o)
for _o in ("ok", "error"):
    SCRAPES.labels(_o)
