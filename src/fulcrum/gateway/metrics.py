"""Collectors of the gateway endpoint picker (updated on the event loop as things happen).

Labels are bounded: outcome, HTTP status code, release reason, scrape outcome.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from fulcrum.metrics import REGISTRY

#: Outcomes of a pick (label values of ``fulcrum_gateway_picks``).
PICK_OUTCOMES = ("picked", "no_endpoint", "shed", "bad_request", "too_large")
#: Why a held placement ended.
RELEASE_REASONS = ("response_end", "stream_closed", "not_held")
#: Why a stream was refused before or instead of a pick (``fulcrum_gateway_refused``).
REFUSE_REASONS = ("out_of_order", "streams", "pending_bytes", "body_timeout", "too_deep")
#: HTTP codes the picker answers with an immediate response.
IMMEDIATE_CODES = ("400", "413", "429", "503")

PICKS = Counter(
    "fulcrum_gateway_picks",
    "Endpoint picks by outcome (picked, no_endpoint -> 503, shed -> 429, bad_request -> "
    "400, too_large -> 413).",
    ["policy", "outcome"],
    registry=REGISTRY,
)
RELEASES = Counter(
    "fulcrum_gateway_releases",
    "Placements released by the picker: at the response's end, when the ext_proc stream "
    "closed first (client gone, upstream reset), or not held any more (lease expired).",
    ["reason"],
    registry=REGISTRY,
)
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
PICK_SECONDS = Histogram(
    "fulcrum_gateway_pick_seconds",
    "Time to pick an endpoint once the request body is complete (parse + place), seconds.",
    buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1),
    registry=REGISTRY,
)
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
ENDPOINTS = Gauge(
    "fulcrum_gateway_endpoints",
    "Decode endpoints (ip:port, one per DP rank) the picker may route to.",
    registry=REGISTRY,
)
SCRAPES = Counter(
    "fulcrum_gateway_scrapes",
    "Scrapes of engines' Prometheus endpoints by outcome (ok, error).",
    ["outcome"],
    registry=REGISTRY,
)

for _o in RELEASE_REASONS:
    RELEASES.labels(_o)
for _r in REFUSE_REASONS:
    REFUSED.labels(_r)
for _c in IMMEDIATE_CODES:
    IMMEDIATE.labels(_c)
for _o in ("ok", "error"):
    SCRAPES.labels(_o)
