"""Prometheus collectors of prefix affinity (issue 15), on :data:`fulcrum.metrics.REGISTRY`.

Labels are bounded: ``engine`` is a registered prefill engine id (at most the fleet's
member bound; a leaving engine's series are removed), ``tier`` a tier name, ``decision``
one of ``affinity_hit`` / ``fairness_override``. Plain values set on the event loop by
:mod:`fulcrum.state.prefix` (no callback reads live state from the scrape thread).

Block hit ratio = ``hit_blocks_total / lookup_blocks_total`` (per engine or per tier): of
the blocks of the requests an engine took, the leading ones it was believed to hold.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from fulcrum.metrics import REGISTRY

ENGINE_HIT_BLOCKS = Counter(
    "fulcrum_prefill_prefix_engine_hit_blocks",
    "Prefix blocks of the requests an engine took that it held, by engine.",
    ["engine"],
    registry=REGISTRY,
)
ENGINE_LOOKUP_BLOCKS = Counter(
    "fulcrum_prefill_prefix_engine_lookup_blocks",
    "Prefix blocks of the requests an engine took, by engine.",
    ["engine"],
    registry=REGISTRY,
)
TIER_HIT_BLOCKS = Counter(
    "fulcrum_prefill_prefix_tier_hit_blocks",
    "Prefix blocks of the requests taken from a tier that their engine held, by tier.",
    ["tier"],
    registry=REGISTRY,
)
TIER_LOOKUP_BLOCKS = Counter(
    "fulcrum_prefill_prefix_tier_lookup_blocks",
    "Prefix blocks of the requests taken from a tier, by tier.",
    ["tier"],
    registry=REGISTRY,
)
DECISIONS = Counter(
    "fulcrum_prefill_affinity_decisions",
    "Prefix affinity decisions: requests taken by an engine holding part of their prefix "
    "(affinity_hit), pulls that went FIFO because the head waited past the fairness "
    "bound (fairness_override) and pulls that went to another tier than the source "
    "rule's for a request the engine alone holds the longest prefix of (holder_tier).",
    ["decision"],
    registry=REGISTRY,
)
INDEX_BLOCKS = Gauge(
    "fulcrum_prefill_prefix_index_blocks",
    "Blocks held in the prefix index, all engines.",
    registry=REGISTRY,
)
