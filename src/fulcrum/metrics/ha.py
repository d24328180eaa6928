"""Prometheus collectors of high availability (leader election), on
:data:`fulcrum.metrics.REGISTRY`. Every daemon, leader or standby, keeps its own."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from fulcrum.metrics import REGISTRY

LEADER = Gauge(
    "fulcrum_ha_leader",
    "1 while this daemon is the leader and serves fulcrum.v1, else 0 (standby, fenced, "
    "or etcd unreachable). Always 1 with ha.backend none.",
    registry=REGISTRY,
)
TRANSITIONS = Counter(
    "fulcrum_ha_transitions",
    "Changes of this daemon's role, by the role entered (leader, standby).",
    ["role"],
    registry=REGISTRY,
)
FENCED = Counter(
    "fulcrum_ha_fenced",
    "Times the leader stopped serving because its lease was not renewed within "
    "ha.renew_deadline_s (or was found lost).",
    registry=REGISTRY,
)
ETCD_ERRORS = Counter(
    "fulcrum_ha_etcd_errors",
    "Failed etcd requests, by operation (lease, campaign, keepalive, put, get).",
    ["op"],
    registry=REGISTRY,
)
DURABLE_WRITES = Counter(
    "fulcrum_ha_durable_writes",
    "Leader-guarded etcd writes of EPLB maps, by outcome (ok, deposed, failed).",
    ["outcome"],
    registry=REGISTRY,
)
