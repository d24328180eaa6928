"""Prometheus collectors of the prefill balancer, all on :data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``tier`` is a tier name such as ``"<16K"`` or ``"64K-256K"`` (at most
16 tiers), ``outcome`` one of a fixed set, ``coefficient`` one of a, b, k.

One owner for state: every collector here is a plain value that
:mod:`fulcrum.state.prefill` sets on the event loop as the state changes. None has a
callback (``set_function``) or a custom ``collect``, so a scrape, served from
prometheus_client's thread, reads only these values and never the balancer.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from fulcrum.metrics import REGISTRY

#: Seconds, for waits and predicted costs: 1 ms .. 10 min.
_SECONDS = (
    1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_REL = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)

BLOCK_HASHES_HELD = Gauge(
    "fulcrum_prefill_block_hashes_held",
    "Block hashes carried by the prefill requests in flight (queued or leased), hashes; "
    "bounded by prefill.max_block_hashes_in_flight.",
    registry=REGISTRY,
)
RETAINED = Gauge(
    "fulcrum_prefill_retained_outcomes",
    "Acknowledged outcomes kept for idempotent retries, requests; bounded by "
    "prefill.max_retained (see docs/idempotency.md for the sizing rule).",
    registry=REGISTRY,
)
QUEUE_DEPTH = Gauge(
    "fulcrum_prefill_queue_depth",
    "Prefill requests waiting for an engine, by tier.",
    ["tier"],
    registry=REGISTRY,
)
QUEUED_QUOTA = Gauge(
    "fulcrum_prefill_queued_quota_seconds",
    "Predicted compute quota of the queued prefill requests, by tier, seconds.",
    ["tier"],
    registry=REGISTRY,
)
ENGINES = Gauge(
    "fulcrum_prefill_engines",
    "Prefill engines (DP groups) serving each tier this round.",
    ["tier"],
    registry=REGISTRY,
)
DEMAND = Gauge(
    "fulcrum_prefill_quota_demand_seconds",
    "Quota demand of each tier in the last round (submitted + backlog share), seconds.",
    ["tier"],
    registry=REGISTRY,
)
ROUNDS = Counter(
    "fulcrum_prefill_rounds",
    "Engine redistributions, by reason (round, join, leave, orphan).",
    ["reason"],
    registry=REGISTRY,
)
MOVES = Counter(
    "fulcrum_prefill_rebalance_moves",
    "Engines moved from one tier to another by redistributions.",
    registry=REGISTRY,
)
SUBMITS = Counter(
    "fulcrum_prefill_submits",
    "Prefill submits by tier and outcome (delivered = acknowledged by an engine, cancelled, "
    "deadline_exceeded, unavailable, queue_full, no_engine, duplicate = a re-submit "
    "answered with the request's one outcome).",
    ["tier", "outcome"],
    registry=REGISTRY,
)
LEASES = Counter(
    "fulcrum_prefill_leases",
    "Leased requests by how their lease ended: acknowledged, expired (re-queued), "
    "engine_left (re-queued), cancelled (submitter gone or drain), rejected_ack (an "
    "acknowledgement refused: not leased to that engine any more).",
    ["outcome"],
    registry=REGISTRY,
)
LEASED = Gauge(
    "fulcrum_prefill_leased_requests",
    "Requests pulled by an engine and not yet acknowledged.",
    registry=REGISTRY,
)
LEASED_QUOTA = Gauge(
    "fulcrum_prefill_leased_quota_seconds",
    "Predicted quota of leased (pulled, unacknowledged) requests, by tier, seconds.",
    ["tier"],
    registry=REGISTRY,
)
RANK_IMBALANCE = Histogram(
    "fulcrum_prefill_rank_imbalance",
    "max/mean of the DP-rank loads each pull reports (1 = balanced; idle engines and "
    "single-rank engines not observed), by the tier the engine serves.",
    ["tier"],
    buckets=(1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0),
    registry=REGISTRY,
)
BATCH_REQUESTS = Histogram(
    "fulcrum_prefill_batch_requests",
    "Requests per non-empty pulled batch, by tier.",
    ["tier"],
    buckets=_COUNTS,
    registry=REGISTRY,
)
BATCH_QUOTA = Histogram(
    "fulcrum_prefill_batch_quota_seconds",
    "Predicted quota of each non-empty pulled batch, by tier, seconds.",
    ["tier"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
WAIT = Histogram(
    "fulcrum_prefill_wait_seconds",
    "Time from submit to pull of delivered requests, by tier, seconds.",
    ["tier"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
PREDICTED_COST = Histogram(
    "fulcrum_prefill_predicted_cost_seconds",
    "Predicted compute cost of submitted requests, by tier, seconds.",
    ["tier"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
PULLS = Counter(
    "fulcrum_prefill_pulls",
    "Engine pulls by tier and result (batch, empty).",
    ["tier", "result"],
    registry=REGISTRY,
)
HELPED = Counter(
    "fulcrum_prefill_helped_requests",
    "Requests of a tier taken by an engine assigned to another tier (work-conserving "
    "tiers: that tier's head had waited longest for its scale), by the request's tier "
    "and the engine's tier.",
    ["tier", "engine_tier"],
    registry=REGISTRY,
)
BANDED = Counter(
    "fulcrum_prefill_overtaking_requests",
    "Requests taken by an engine whose ranks held lower-band work past the late-binding "
    "horizon, bound by the work ahead of their band (band_rank_loads); they run ahead of "
    "that work on their rank. By the request's tier.",
    ["tier"],
    registry=REGISTRY,
)
PRECEDENCE = Counter(
    "fulcrum_prefill_precedence_requests",
    "Requests taken with fair-share precedence (their tenant under its share, another "
    "tenant's work waiting in their band): they run half a band up on their rank "
    "(PulledRequest.boosted). By the request's tier.",
    ["tier"],
    registry=REGISTRY,
)
COST_REL_ERROR = Histogram(
    "fulcrum_prefill_cost_model_relative_error",
    "|predicted - measured| / measured of reported step times under the model in force.",
    buckets=_REL,
    registry=REGISTRY,
)
COST_REL_ERROR_P90 = Gauge(
    "fulcrum_prefill_cost_model_relative_error_p90",
    "p90 relative error of the model in force on the refit window (last refit).",
    registry=REGISTRY,
)
COST_COEFFICIENT = Gauge(
    "fulcrum_prefill_cost_model_coefficient",
    "Coefficients in force: a (ns/token^2), b (ns/token), k (ns).",
    ["coefficient"],
    registry=REGISTRY,
)
COST_REFITS = Counter(
    "fulcrum_prefill_cost_model_refits",
    "Cost-model refits by result (adopted, kept, skipped).",
    ["result"],
    registry=REGISTRY,
)
COST_SAMPLES = Gauge(
    "fulcrum_prefill_cost_model_window_samples",
    "Step-time samples in the refit window.",
    registry=REGISTRY,
)
