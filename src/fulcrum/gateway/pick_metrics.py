"""Collectors of the cache-aware picks (``gateway.cache``). Labels are bounded: the rule
that decided (``ttft``: prefix index and load; ``load_only``: a prompt that could not be
parsed or is empty, picked by load alone). The per-pick figures are plain counts on the
event loop (:class:`CacheCounts`), read by the scrape from a snapshot, as the picker's own
(:class:`fulcrum.gateway.metrics.PickCounts`); the rest are prometheus_client objects."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from fulcrum.gateway.metrics import FiguresCollector, histogram_family
from fulcrum.metrics import REGISTRY
from fulcrum.state.placement import Publisher

RULES = ("ttft", "load_only")

TTFT_BUCKETS = (1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

COPY_CHARGES = ("shared", "full")

_PICKS_HELP = (
    "Cache-aware picks by rule: ttft (least predicted time to first token with the prefix "
    "index) or load_only (prompt not parsed or empty: least predicted TTFT without hits)."
)
_HIT_HELP = "Prompt tokens the chosen endpoint was believed to hold in its prefix cache, tokens."
_PROMPT_HELP = (
    "Prompt tokens of cache-aware picks (the denominator of the believed hit ratio), tokens."
)
_CHOSEN_HELP = "Predicted time to first token of the chosen endpoint, seconds."
_OTHER_HELP = "Predicted time to first token of the best endpoint not chosen, seconds."
_COPIES_HELP = (
    "Cache-aware picks that sent a request where it recomputes a prefix another candidate "
    "held, by charge: shared (requests in flight use that prefix: its recompute charge was "
    "shared among them, gateway.cache.share_hot_prefixes) or full (the wait saved outweighed "
    "the whole charge)."
)


class CacheFigures(NamedTuple):
    """The counts of :class:`CacheCounts` at publication (never written)."""

    rules: tuple[int, ...]  # per RULES
    copies: tuple[int, ...]  # per COPY_CHARGES
    hit_tokens: int
    prompt_tokens: int
    #: Predictions (chosen, best other) in each bucket of the TTFT buckets (not
    #: cumulative), then above; and their sums (s).
    chosen: tuple[int, ...]
    chosen_s: float
    other: tuple[int, ...]
    other_s: float


class CacheCounts:
    """The cache-aware picks' per-request figures as plain numbers (event loop only; a few
    writes per pick instead of five prometheus_client updates); the scrape reads an
    immutable :class:`CacheFigures` through :attr:`publisher`, built when it asks."""

    __slots__ = ("__weakref__", "chosen", "chosen_s", "copies", "hit_tokens", "other",
                 "other_s", "prompt_tokens", "publisher", "rules")

    def __init__(self) -> None:
        self.rules = dict.fromkeys(RULES, 0)
        self.copies = dict.fromkeys(COPY_CHARGES, 0)
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.chosen = [0] * (len(TTFT_BUCKETS) + 1)
        self.chosen_s = 0.0
        self.other = [0] * (len(TTFT_BUCKETS) + 1)
        self.other_s = 0.0
        self.publisher: Publisher[CacheFigures] = Publisher(self._figures)

    def picked(self, rule: str, copy: str, hit_tokens: int, prompt_tokens: int,
               chosen_s: float, other_s: float) -> None:
        """One pick: its rule (of :data:`RULES`), its copy charge ("" or one of
        :data:`COPY_CHARGES`), hit and prompt tokens, the predicted TTFT of the chosen
        endpoint and of the best other (s; NaN without another candidate)."""
        self.rules[rule] += 1
        if copy:
            self.copies[copy] += 1
        self.hit_tokens += hit_tokens
        self.prompt_tokens += max(prompt_tokens, 0)
        self.chosen[bisect.bisect_left(TTFT_BUCKETS, chosen_s)] += 1
        self.chosen_s += chosen_s
        if not math.isnan(other_s):
            self.other[bisect.bisect_left(TTFT_BUCKETS, other_s)] += 1
            self.other_s += other_s
        self.publisher.changed()

    def _figures(self) -> CacheFigures:
        return CacheFigures(
            tuple(self.rules.values()), tuple(self.copies.values()), self.hit_tokens,
            self.prompt_tokens, tuple(self.chosen), self.chosen_s, tuple(self.other),
            self.other_s,
        )


def _cache_families(f: CacheFigures | None) -> Iterator[Metric]:
    """The cache-aware picks' families (every count zero without figures)."""
    f = f if f is not None else CacheCounts()._figures()
    picks = CounterMetricFamily("fulcrum_gateway_cache_picks", _PICKS_HELP, labels=["rule"])
    for rule, n in zip(RULES, f.rules, strict=True):
        picks.add_metric([rule], float(n))
    copies = CounterMetricFamily("fulcrum_gateway_cache_prefix_copies", _COPIES_HELP,
                                 labels=["charge"])
    for charge, n in zip(COPY_CHARGES, f.copies, strict=True):
        copies.add_metric([charge], float(n))
    yield from (
        picks,
        CounterMetricFamily("fulcrum_gateway_cache_hit_tokens", _HIT_HELP,
                            value=float(f.hit_tokens)),
        CounterMetricFamily("fulcrum_gateway_cache_prompt_tokens", _PROMPT_HELP,
                            value=float(f.prompt_tokens)),
        histogram_family("fulcrum_gateway_cache_predicted_ttft_seconds", _CHOSEN_HELP,
                         TTFT_BUCKETS, f.chosen, f.chosen_s),
        histogram_family("fulcrum_gateway_cache_best_other_ttft_seconds", _OTHER_HELP,
                         TTFT_BUCKETS, f.other, f.other_s),
        copies,
    )


CACHE_FIGURES: FiguresCollector[CacheFigures] = FiguresCollector(_cache_families)
REGISTRY.register(CACHE_FIGURES)

INDEX_BLOCKS = Gauge(
    "fulcrum_gateway_prefix_index_blocks",
    "(block, endpoint) entries held by the gateway's prefix index.",
    registry=REGISTRY,
)

OBSERVED_TTFT = Histogram(
    "fulcrum_gateway_cache_observed_ttft_seconds",
    "Time from a cache-aware pick to the first response body chunk of a streamed "
    "response (the observed time to first token), seconds.",
    buckets=TTFT_BUCKETS,
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

for _r in ("ok", "garbage", "unknown_engine", "gap"):
    KV_EVENTS.labels(_r)
for _r in ("reporting", "degraded"):
    KV_EVENT_SENDERS.labels(_r)
#: The cost samples counter's child per result, bound once (one per streamed request).
SAMPLES_BY_RESULT = {_r: TTFT_SAMPLES.labels(_r) for _r in ("kept", "queued", "dropped")}
for _r in ("adopted", "kept", "skipped"):
    COST_REFITS.labels(_r)
