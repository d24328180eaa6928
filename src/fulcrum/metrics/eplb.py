"""Prometheus collectors of the expert-parallel load balancer, on :data:`fulcrum.metrics.REGISTRY`.

Every value is set on the event loop as the state changes (plain gauges and counters);
the scrape thread reads only these collectors, never the balancer state.

Labels are bounded: ``group`` is an EP group id (at most ``eplb.max_groups`` of them;
children are removed when the group is deregistered), ``algorithm`` a registered
algorithm name, ``trigger`` and ``outcome`` come from fixed sets.
"""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

from fulcrum.metrics import REGISTRY

#: What started a rebalance.
TRIGGERS = ("period", "admin")
#: How a rebalance ended: a new version, the same map, a dry run, an error in the
#: computation, a map refused by validation (the old one stays), or a result discarded
#: because the group changed meanwhile (another version, or deregistered / re-registered).
OUTCOMES = ("applied", "unchanged", "dry_run", "failed", "invalid", "stale")

GROUPS = Gauge(
    "fulcrum_eplb_groups",
    "EP groups registered.",
    registry=REGISTRY,
)
MOE_LB_OBSERVED = Gauge(
    "fulcrum_eplb_moe_lb_observed",
    "Observed moe_lb (slowest GPU / mean GPU, summed over layers) of the map in force, "
    "over the steps reported since it took effect; 1.0 is perfect.",
    ["group"],
    registry=REGISTRY,
)
MOE_LB_PREDICTED = Gauge(
    "fulcrum_eplb_moe_lb_predicted",
    "Predicted moe_lb at the last rebalance on its window, before (map then in force) and "
    "after (new map).",
    ["group", "when"],
    registry=REGISTRY,
)
MAP_VERSION = Gauge(
    "fulcrum_eplb_map_version",
    "Version of the map in force.",
    ["group"],
    registry=REGISTRY,
)
WINDOW_STEPS = Gauge(
    "fulcrum_eplb_window_steps",
    "Steps held in the statistics window.",
    ["group"],
    registry=REGISTRY,
)
REPORTED_STEPS = Counter(
    "fulcrum_eplb_reported_steps",
    "Steps covered by accepted load reports.",
    ["group"],
    registry=REGISTRY,
)
REBALANCES = Counter(
    "fulcrum_eplb_rebalances",
    "Rebalances, by algorithm, trigger (period, admin) and outcome (applied, unchanged, "
    "dry_run, failed, invalid, stale).",
    ["algorithm", "trigger", "outcome"],
    registry=REGISTRY,
)
SLOTS_CHANGED = Counter(
    "fulcrum_eplb_slots_changed",
    "Physical expert slots whose expert changed in applied rebalances.",
    ["group"],
    registry=REGISTRY,
)
COPIES_RECEIVED = Counter(
    "fulcrum_eplb_copies_received",
    "Expert weight copies GPUs had to receive from another GPU in applied rebalances.",
    ["group"],
    registry=REGISTRY,
)
MOVED_BYTES = Counter(
    "fulcrum_eplb_moved_bytes",
    "Expert weights moved between GPUs by applied rebalances, bytes.",
    ["group"],
    registry=REGISTRY,
)
REBALANCE_SECONDS = Histogram(
    "fulcrum_eplb_rebalance_duration_seconds",
    "Time to compute a new map, seconds.",
    ["algorithm"],
    buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
NOISE_THRESHOLD = Gauge(
    "fulcrum_eplb_noise_threshold",
    "Overall moe_lb gain that the window's sampling noise can explain at the last "
    "rebalance (noise_z standard errors, from the spread of the window's buckets); a new "
    "map is applied only when its predicted gain exceeds it.",
    ["group"],
    registry=REGISTRY,
)
WATCHERS = Gauge(
    "fulcrum_eplb_watchers",
    "Open WatchMaps streams.",
    registry=REGISTRY,
)
SNAPSHOT_WRITES = Counter(
    "fulcrum_eplb_snapshot_writes",
    "Snapshot file writes, by outcome (ok, failed).",
    ["outcome"],
    registry=REGISTRY,
)
MEMORY_TRIMS = Counter(
    "fulcrum_memory_trims",
    "Times freed heap was handed back to the OS (malloc_trim) after streams closed.",
    registry=REGISTRY,
)
SNAPSHOT_CORRUPT = Counter(
    "fulcrum_eplb_snapshot_corrupt",
    "Snapshot files found unreadable at start and moved aside as .corrupt, by file "
    "(map, window, snapshot = a format-1 file).",
    ["file"],
    registry=REGISTRY,
)

_PER_GROUP = (
    MOE_LB_OBSERVED,
    NOISE_THRESHOLD,
    MAP_VERSION,
    WINDOW_STEPS,
    REPORTED_STEPS,
    SLOTS_CHANGED,
    COPIES_RECEIVED,
    MOVED_BYTES,
)


def forget_group(group: str) -> None:
    """Remove every label child of ``group`` (it was deregistered)."""
    for collector in _PER_GROUP:
        with contextlib.suppress(KeyError):
            collector.remove(group)
    for when in ("before", "after"):
        with contextlib.suppress(KeyError):
            MOE_LB_PREDICTED.remove(group, when)
