"""Prometheus collectors of the decode balancer, on :data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``policy`` is a registered decode policy name, ``branch`` is one
of the branch labels the policy declares in the registry (dual: "short", "long") or "",
``outcome`` and ``reason`` come from fixed sets, ``decode_instance`` is bounded by the
fleet's member bound and ``gpu`` series by ``decode.metrics_gpu_series``: per-GPU gauges
are exported for every GPU while the decode fleet has at most that many GPUs, else for
that many most loaded GPUs (most requests, then most KV); per-instance sums and the
balancer's summaries are always exported. Series of an instance disappear with it.

Scrape-time families: :data:`SCRAPE`, the placement tables' collector
(:mod:`fulcrum.metrics.placement`) over the decode table's published snapshots.
"""

from __future__ import annotations

from fulcrum.metrics.placement import (
    SnapshotSource,
    Spec,
    TableMetrics,
    loss_counters,
    table_collector,
)

EXPIRATIONS, LOST = loss_counters(
    "decode",
    "Placements whose lease ran out before they were released.",
    "fulcrum_decode_lost_placements",
    "Placements lost because their decode instance left, by reason (deregistered, lapsed, "
    "replaced).",
)

_INSTANCE = ("decode_instance",)
_GPU = ("decode_instance", "gpu")

SCRAPE = table_collector(
    TableMetrics(
        per_gpu=(
            Spec(
                "gauge", "fulcrum_decode_gpu_concurrency",
                "Requests on each decode GPU (last report plus placements since, minus "
                "releases); every GPU up to decode.metrics_gpu_series GPUs, else the most "
                "loaded ones.", _GPU,
            ),
            Spec(
                "gauge", "fulcrum_decode_gpu_kv_tokens",
                "Total KV on each decode GPU, tokens (same GPUs as "
                "fulcrum_decode_gpu_concurrency).", _GPU,
            ),
        ),
        per_member=(
            Spec(
                "gauge", "fulcrum_decode_instance_concurrency",
                "Requests on all GPUs of each decode instance.", _INSTANCE,
            ),
            Spec(
                "gauge", "fulcrum_decode_instance_kv_tokens",
                "Total KV on all GPUs of each decode instance, tokens.", _INSTANCE,
            ),
        ),
        gpus=Spec("gauge", "fulcrum_decode_gpus", "Decode GPUs in placement (all instances)."),
        imbalance=Spec(
            "gauge", "fulcrum_decode_imbalance",
            "Max over mean across decode GPUs (1.0 = perfect), by dimension "
            "(concurrency, kv_tokens) and the policy in force.", ("policy", "dimension"),
        ),
        dimensions=("concurrency", "kv_tokens"),
        held=Spec(
            "gauge", "fulcrum_decode_placements_held",
            "Placements held (not yet released, expired or lost).",
        ),
        placements=Spec(
            "counter", "fulcrum_decode_placements",
            "PlaceDecode calls (unary or streamed), by policy, branch (the policy's "
            "declared branch, e.g. dual's short or long, or empty) and outcome (placed, "
            "invalid_argument, already_exists, resource_exhausted).",
            ("policy", "branch", "outcome"),
        ),
        releases=Spec(
            "counter", "fulcrum_decode_releases",
            "ReleaseDecode calls (unary or streamed), by outcome (released, "
            "invalid_argument, not_found).", ("outcome",),
        ),
        # Rank by requests, then KV (< 2^20 and < 2^40: see core.decode.view).
        rank=lambda v: v[0] * (1 << 40) + v[1],
    )
)


def set_source(source: SnapshotSource) -> None:
    """Make ``source`` (the daemon's decode snapshot publisher; held weakly) feed the
    scrape-time gauges."""
    SCRAPE.set_source(source)
