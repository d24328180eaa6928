"""Prometheus collectors of the vision-encoder (VE) balancer, on :data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``policy`` is a registered VE policy name, ``outcome`` and
``reason`` come from fixed sets, ``machine`` is bounded by the fleet's member bound and
``gpu`` series by ``vision.metrics_gpu_series``: per-GPU patches in flight are exported
for every GPU while the VE fleet has at most that many GPUs, else for that many most
loaded GPUs; per-machine sums and the balancer's summaries are always exported.

Everything derived at scrape time (:data:`SCRAPE`) is read from the VE table's
published snapshots by the collector all placement tables share
(:mod:`fulcrum.metrics.placement`).
"""

from __future__ import annotations

from prometheus_client import Counter

from fulcrum.metrics import REGISTRY
from fulcrum.metrics.placement import (
    SnapshotSource,
    Spec,
    TableMetrics,
    loss_counters,
    table_collector,
)

#: LOST counts images (a request keeps its images on other machines).
EXPIRATIONS, LOST = loss_counters(
    "vision",
    "Placed requests whose lease ran out before they were released.",
    "fulcrum_vision_lost_placements",
    "Placed images lost because their VE machine left, by reason (deregistered, lapsed, "
    "replaced).",
)
LOST_IMAGES = LOST
EXPIRED_IMAGES = Counter(
    "fulcrum_vision_expired_images",
    "Images freed by lease expiry.",
    registry=REGISTRY,
)

_BY_POLICY = ("policy",)

SCRAPE = table_collector(
    TableMetrics(
        per_gpu=(
            Spec(
                "gauge", "fulcrum_vision_gpu_patches_in_flight",
                "Image patches in flight on each VE GPU (last report plus placements since, "
                "minus releases); every GPU up to vision.metrics_gpu_series GPUs, else the "
                "most loaded ones.", ("machine", "gpu"),
            ),
        ),
        per_member=(
            Spec(
                "gauge", "fulcrum_vision_machine_patches_in_flight",
                "Image patches in flight on all GPUs of each VE machine.", ("machine",),
            ),
        ),
        gpus=Spec("gauge", "fulcrum_vision_gpus", "VE GPUs in placement (all machines)."),
        imbalance=Spec(
            "gauge", "fulcrum_vision_imbalance",
            "Max over mean of patches in flight across live VE GPUs (1.0 = perfect), "
            "by the policy in force.", _BY_POLICY,
        ),
        held=Spec(
            "gauge", "fulcrum_vision_placements_held",
            "Placed requests held (not yet released or expired).",
        ),
        placements=Spec(
            "counter", "fulcrum_vision_placements",
            "PlaceImages requests (unary or streamed), by policy and outcome (placed, "
            "invalid_argument, already_exists, resource_exhausted).", ("policy", "outcome"),
        ),
        units=(
            Spec(
                "counter", "fulcrum_vision_images_placed",
                "Images placed on VE GPUs, by policy.", _BY_POLICY,
            ),
            Spec(
                "counter", "fulcrum_vision_patches_placed",
                "Image patches placed on VE GPUs, by policy.", _BY_POLICY,
            ),
        ),
        releases=Spec(
            "counter", "fulcrum_vision_releases",
            "ReleaseImages requests (unary or streamed), by outcome (released, "
            "invalid_argument, not_found).", ("outcome",),
        ),
        rank=lambda v: v[0],
    )
)


def set_source(source: SnapshotSource) -> None:
    """Make ``source`` (the daemon's VE snapshot publisher; held weakly) feed the
    scrape-time gauges."""
    SCRAPE.set_source(source)
