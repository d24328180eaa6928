"""Settings of the prefill balancer (``prefill:`` section)."""

from __future__ import annotations

import itertools
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fulcrum.config.base import Section
from fulcrum.core.cost import DEFAULT_COST_MODEL, DEFAULT_STEP_BUDGET_NS, MAX_CHUNK_TOKENS
from fulcrum.core.prefill.affinity import (
    DEFAULT_BLOCK_TOKENS,
    MAX_CAPACITY_BLOCKS,
    MAX_REQUEST_BLOCKS,
)
from fulcrum.core.prefill.rules import DEFAULT as DEFAULT_RULES
from fulcrum.core.prefill.rules import RULE_SETS, rules_by_name
from fulcrum.core.prefill.tiers import (
    DEFAULT_BACKLOG_ROUNDS,
    DEFAULT_HYSTERESIS,
    DEFAULT_TIER_BOUNDS,
)

_S = 1_000_000_000  # ns per second


class CostModelSettings(Section):
    """Coefficients of ``cost(q, c) = a*q*(c + q/2) + b*q + k`` in nanoseconds
    (``q`` tokens computed in the step, ``c`` prefix already computed). Defaults are our
    estimate for a DeepSeek-V3-like prefill at EP4DP4; fit yours with ``fulcrum fit-cost``."""

    a: float = Field(
        DEFAULT_COST_MODEL.a, ge=0, le=1e6, description="attention coefficient, ns per token^2"
    )
    b: float = Field(
        DEFAULT_COST_MODEL.b, ge=0, le=1e12, description="linear + MoE coefficient, ns per token"
    )
    k: float = Field(
        DEFAULT_COST_MODEL.k, ge=0, le=1e12, description="fixed overhead of one step, ns"
    )


class RefitSettings(Section):
    """Online refit of the cost model from the step times engines report."""

    enabled: bool = Field(True, description="refit the cost model from reported step times")
    window_samples: int = Field(
        4096, ge=16, le=1_000_000, description="samples kept for the refit (newest win)"
    )
    min_samples: int = Field(
        64, ge=3, le=1_000_000, description="samples needed before a refit is attempted"
    )
    period_s: float = Field(30.0, gt=0, le=86_400, description="time between refits, seconds")
    adopt_margin: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="adopt a refit only when its p90 relative error is lower than the "
        "current model's on the same samples by this fraction",
    )
    max_samples_per_report: int = Field(
        4096, ge=1, le=1_000_000, description="largest number of samples in one report"
    )

    @model_validator(mode="after")
    def _min_fits_window(self) -> RefitSettings:
        if self.min_samples > self.window_samples:
            raise ValueError("min_samples: must be <= window_samples")
        return self


class PrefillSettings(Section):
    """The prefill balancer: tiers, pull by compute quota, least-loaded rank, chunk size.

    SPEC sections 2-3: requests are tiered by total context length, engines pull by
    remaining compute quota (ns), each request goes to its engine's least-loaded DP rank,
    and engines size chunks with the cost model."""

    cost_model: CostModelSettings = Field(default_factory=lambda: CostModelSettings())
    refit: RefitSettings = Field(default_factory=lambda: RefitSettings())
    step_quota_ns: int = Field(
        DEFAULT_STEP_BUDGET_NS,
        ge=1_000_000,
        le=3600 * _S,
        description="compute_quota_limit: time budget of one prefill step, ns (default for "
        "engines that register without one)",
    )
    max_chunk_tokens: int = Field(
        MAX_CHUNK_TOKENS, ge=1, le=1 << 20, description="largest chunk of one step, tokens"
    )
    tier_bounds: list[int] = Field(
        default_factory=lambda: list(DEFAULT_TIER_BOUNDS),
        min_length=1,
        max_length=15,
        description="ascending tier bounds on total context length, tokens "
        "(n bounds make n+1 tiers; needs a restart)",
        json_schema_extra={"restart_only": True},
    )
    tier_horizon_ns: list[int] = Field(
        default_factory=list,
        description="horizon of each tier, ns (one entry per tier, shortest first; empty = "
        "2/8/30/120 s for four tiers, else a quarter of each tier's batch cap): how much "
        "queued work one DP rank of an engine of that tier may hold; an engine offers "
        "remaining_quota_ns = sum over its ranks of max(0, horizon - rank load)",
    )
    tier_batch_cap_ns: list[int] = Field(
        default_factory=lambda: [8 * _S, 32 * _S, 128 * _S, 512 * _S],
        min_length=1,
        description="per-batch quota cap of each tier, ns (one entry per tier, shortest "
        "first; each above the cost of a fresh prompt at its tier's upper bound, so only "
        "outliers run alone); a single request above the cap is served alone by an idle engine. "
        "Under the default rules it is also the tier's time scale: an engine with room takes "
        "from the tier whose head waited longest for its cap, a longer tier's work only "
        "within a quarter of its own tier's cap",
    )
    max_batch_requests: int = Field(
        256, ge=1, le=100_000, description="largest number of requests in one pulled batch"
    )
    max_queued_per_tier: int = Field(
        10_000, ge=1, le=10_000_000, description="queue bound of each tier, requests"
    )
    max_total_tokens: int = Field(
        16 * 1024 * 1024,
        ge=1,
        le=1 << 40,
        description="longest accepted context, tokens (longer requests are refused)",
    )
    submit_wait_ms: int = Field(
        30_000, ge=1, le=3_600_000, description="default time a submit waits for an engine, ms"
    )
    max_submit_wait_ms: int = Field(
        55_000, ge=1, le=3_600_000, description="longest time a submit may ask to wait, ms"
    )
    pull_wait_ms: int = Field(
        1_000, ge=0, le=3_600_000, description="default long-poll time of an empty pull, ms"
    )
    max_pull_wait_ms: int = Field(
        30_000, ge=0, le=3_600_000, description="longest long-poll time a pull may ask, ms"
    )
    lease_ms: int = Field(
        5_000,
        ge=1,
        le=3_600_000,
        description="lease of a pulled batch, ms: requests not acknowledged by their engine "
        "within it go back to the head of their tier and are delivered elsewhere",
    )
    retention_ms: int = Field(
        300_000,
        ge=0,
        le=86_400_000,
        description="how long an acknowledged request's outcome is kept, ms: a re-submit of "
        "the same id and lengths within it gets that outcome instead of a second delivery",
    )
    max_retained: int = Field(
        100_000,
        ge=0,
        le=10_000_000,
        description="bound of the retained-outcome table, requests: outcomes are never "
        "evicted before retention_ms; a new submit past the bound is refused "
        "RESOURCE_EXHAUSTED with retry-after-ms (size it as acks/s x retention_ms / 1000)",
    )
    max_retained_per_submitter: int = Field(
        50_000,
        ge=0,
        le=10_000_000,
        description="most retained outcomes of one submitter (its mTLS or token identity, "
        "else its host), requests: one client's flood fills only its own share",
    )
    no_engine_retry_after_ms: int = Field(
        1_000,
        ge=1,
        le=3_600_000,
        description="retry-after-ms hint of a submit refused UNAVAILABLE because no live "
        "prefill engine is registered, ms",
    )
    round_period_ms: int = Field(
        1_000, ge=1, le=3_600_000, description="period of engine redistribution rounds, ms"
    )
    backlog_rounds: float = Field(
        DEFAULT_BACKLOG_ROUNDS,
        ge=1,
        le=1e9,
        description="a tier's demand in a round is the quota that arrived plus its queued "
        "quota spread over this many rounds (1 = all of the backlog at once)",
    )
    rules: str | list[str | dict[str, dict[str, Any] | None]] = Field(
        DEFAULT_RULES,
        # The README's config reference is generated from this description (README.md is
        # not ours to regenerate): a rule list ({name: {parameters}} entries, one rule per
        # kind) is documented in docs/prefill-rules.md.
        description="balancing rule set: 'default' (the rules the simulator measured best, "
        "see BENCHMARKS.md) or 'published' (the letter of the published design)",
    )
    min_tier_dwell_ms: int = Field(
        2_000,
        ge=0,
        le=3_600_000,
        description="an engine a round moved to another tier stays there at least this "
        "long before a round may move it again, ms (0 = no minimum); joins, leaves and "
        "tiers left without an engine redistribute regardless",
    )
    hysteresis: float = Field(
        DEFAULT_HYSTERESIS,
        ge=0,
        le=1_000,
        description="keep the current engine split while every tier is within this many "
        "engines of its proportional share",
    )

    # -- prefix affinity (issue 15; see fulcrum.core.prefill.affinity) -------------------
    cache_model: Literal["global", "per_engine"] = Field(
        "global",
        description="KV-cache model of this prefill pool: 'global' (one pool every engine "
        "loads from; submits give cached_tokens) or 'per_engine' (each engine caches its "
        "own prefixes; submits give block_hashes and work goes to the engine holding the "
        "longest prefix, within affinity_max_wait_ms; needs a restart: submitters send "
        "block hashes or cached tokens by it)",
        json_schema_extra={"restart_only": True},
    )
    block_tokens: int = Field(
        DEFAULT_BLOCK_TOKENS,
        ge=1,
        le=1 << 20,
        description="tokens per KV block of the block hashes (needs a restart: clients "
        "hash with it)",
        json_schema_extra={"restart_only": True},
    )
    engine_cache_blocks: int = Field(
        20_000,
        ge=0,
        le=MAX_CAPACITY_BLOCKS,
        description="prefix-cache capacity of each engine, blocks (sizes the per-engine "
        "LRU of the prefix index, about 100 bytes per block and engine)",
    )
    affinity_max_wait_ms: int = Field(
        2_000,
        ge=0,
        le=3_600_000,
        description="fairness bound of prefix affinity in the shortest tier, ms (a longer "
        "tier's scales with its batch cap: tier_batch_cap_ns[t] / tier_batch_cap_ns[0] "
        "times this, 2/8/32/128 s by default): a request waits for the engine holding its "
        "prefix at most this long, and once a tier's head waited this long pulls are FIFO "
        "again",
    )
    max_block_hashes_in_flight: int = Field(
        2_000_000,
        ge=1,
        le=1 << 30,
        description="most block hashes all prefill requests in flight may carry together "
        "(about 40 bytes each): a submit past it is refused RESOURCE_EXHAUSTED",
    )
    max_block_hashes: int = Field(
        MAX_REQUEST_BLOCKS,
        ge=1,
        le=MAX_REQUEST_BLOCKS,
        description="most block hashes one submit may carry",
    )

    def horizons_ns(self) -> list[int]:
        """The horizon of each tier (ns): ``tier_horizon_ns``, or its default."""
        if self.tier_horizon_ns:
            return list(self.tier_horizon_ns)
        if len(self.tier_batch_cap_ns) == 4:
            return [2 * _S, 8 * _S, 30 * _S, 120 * _S]
        return [max(1, c // 4) for c in self.tier_batch_cap_ns]

    @model_validator(mode="after")
    def _consistent(self) -> PrefillSettings:
        bounds = self.tier_bounds
        if bounds[0] <= 0 or any(x >= y for x, y in itertools.pairwise(bounds)):
            raise ValueError("tier_bounds: must be strictly ascending and > 0")
        if len(self.tier_batch_cap_ns) != len(bounds) + 1:
            raise ValueError(
                f"tier_batch_cap_ns: must have {len(bounds) + 1} entries (one per tier)"
            )
        if self.tier_horizon_ns and len(self.tier_horizon_ns) != len(bounds) + 1:
            raise ValueError(
                f"tier_horizon_ns: must have {len(bounds) + 1} entries (one per tier)"
            )
        if any(h <= 0 for h in self.tier_horizon_ns):
            raise ValueError("tier_horizon_ns: must be > 0")
        if any(c <= 0 for c in self.tier_batch_cap_ns):
            raise ValueError("tier_batch_cap_ns: must be > 0")
        if self.submit_wait_ms > self.max_submit_wait_ms:
            raise ValueError("submit_wait_ms: must be <= max_submit_wait_ms")
        if self.pull_wait_ms > self.max_pull_wait_ms:
            raise ValueError("pull_wait_ms: must be <= max_pull_wait_ms")
        return self

    @field_validator("rules")
    @classmethod
    def _rules(cls, v: str | list[str | dict[str, dict[str, Any] | None]]) -> Any:
        if isinstance(v, str) and v not in RULE_SETS:
            raise ValueError(f"rules: must be one of {', '.join(RULE_SETS)} or a rule list")
        rules_by_name(v)  # ValueError naming the bad entry (index and rule)
        return v
