"""Collectors of the cache-aware picks (``gateway.cache``). Labels are bounded: the rule
that decided (``ttft``: prefix index and load; ``load_only``: a prompt that could not be
parsed or is empty, picked by load alone)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from fulcrum.metrics import REGISTRY

RULES = ("ttft", "load_only")

_TTFT_BUCKETS = (1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

CACHE_PICKS = Counter(
    "fulcrum_gateway_cache_picks",
    "Cache-aware picks by rule: ttft (least predicted time to first token with the prefix "
    "index) or load_only (prompt not parsed or empty: least predicted TTFT without hits).",
    ["rule"],
    registry=REGISTRY,
)
HIT_TOKENS = Counter(
    "fulcrum_gateway_cache_hit_tokens",
    "Prompt tokens the chosen endpoint was believed to hold in its prefix cache, tokens.",
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "fulcrum_gateway_cache_prompt_tokens",
    "Prompt tokens of cache-aware picks (the denominator of the believed hit ratio), tokens.",
    registry=REGISTRY,
)
CHOSEN_TTFT = Histogram(
    "fulcrum_gateway_cache_predicted_ttft_seconds",
    "Predicted time to first token of the chosen endpoint, seconds.",
    buckets=_TTFT_BUCKETS,
    registry=REGISTRY,
)
OTHER_TTFT = Histogram(
    "fulcrum_gateway_cache_best_other_ttft_seconds",
    "Predicted time to first token of the best endpoint not chosen, seconds.",
    buckets=_TTFT_BUCKETS,
    registry=REGISTRY,
)
_PREFIX_COPIES = Counter(
    "fulcrum_gateway_cache_prefix_copies",
    "Cache-aware picks that sent a request where it recomputes a prefix another candidate "
    "held, by charge: shared (requests in flight use that prefix: its recompute charge was "
    "shared among them, gateway.cache.share_hot_prefixes) or full (the wait saved outweighed "
    "the whole charge).",
    ["charge"],
    registry=REGISTRY,
)
INDEX_BLOCKS = Gauge(
    "fulcrum_gateway_prefix_index_blocks",
    "(block, endpoint) entries held by the gateway's prefix index.",
    registry=REGISTRY,
)

OBSERVED_TTFT = Histogram(
    "fulcrum_gateway_cache_observed_ttft_seconds",
    "Time from a cache-aware pick to the first response body chunk of a streamed "
    "response (the observed time to first token), seconds.",
    buckets=_TTFT_BUCKETS,
    registry=REGISTRY,
)
TTFT_SAMPLES = Counter(
    "fulcrum_gateway_cost_samples",
    "Observed first tokens offered to the online cost-model learner: kept; queued (the "
    "request was not alone on its endpoint when picked: not learnt from); dropped (no "
    "computed tokens, or no time).",
    ["result"],
    registry=REGISTRY,
)
COST_REFITS = Counter(
    "fulcrum_gateway_cost_refits",
    "Refits of the gateway's cost model from observed TTFT, by result (adopted, kept, "
    "skipped).",
    ["result"],
    registry=REGISTRY,
)

KV_EVENTS = Counter(
    "fulcrum_gateway_kv_event_batches",
    "vLLM KV event batches received, by result: ok, garbage (not vLLM's format), "
    "unknown_engine (topic names no pool endpoint), gap (sequence number skipped).",
    ["result"],
    registry=REGISTRY,
)

KV_EVENT_SENDERS = Gauge(
    "fulcrum_gateway_kv_event_senders",
    "Engines (KV event topics) heard from, by state: reporting (its batches decode and its "
    "topic is a pool endpoint) or degraded (a bad frame, or a topic naming no pool "
    "endpoint; its index stays approximate). Compare reporting with "
    "fulcrum_gateway_endpoints: an engine missing from it sends no events.",
    ["state"],
    registry=REGISTRY,
)

ENGINE_RESTARTS = Counter(
    "fulcrum_gateway_engine_restarts_total",
    "Engines seen restarted by the scrape (process_start_time_seconds changed): their "
    "prefix index was cleared",
    registry=REGISTRY,
)

#: The picks counter's child per rule, bound once (``labels()`` costs a lookup and a lock
#: per pick).
PICKS_BY_RULE = {_r: CACHE_PICKS.labels(_r) for _r in RULES}
#: The prefix-copies counter's child per charge, bound once.
PREFIX_COPIES = {_c: _PREFIX_COPIES.labels(_c) for _c in ("shared", "full")}
for _r in ("ok", "garbage", "unknown_engine", "gap"):
    KV_EVENTS.labels(_r)
for _r in ("reporting", "degraded"):
    KV_EVENT_SENDERS.labels(_r)
for _r in ("kept", "queued", "dropped"):
    TTFT_SAMPLES.labels(_r)
for _r in ("adopted", "kept", "skipped"):
    COST_REFITS.labels(_r)
