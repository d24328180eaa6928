"""Settings of the gateway's cache-aware picks (``gateway.cache``), for engines that serve
prefill and decode with a prefix cache each (no prefill pool).

When on, the picker chooses among the endpoints the decode policy's filter leaves (KV room,
a free concurrency slot, the subset hint) the one with the least predicted time to first
token: its outstanding prefill work plus ``cost(q, c)`` of the request there, ``c`` the
prompt tokens its prefix cache is believed to hold (:mod:`fulcrum.core.prefix_cost`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fulcrum.config.base import RESTART_ONLY, Section
from fulcrum.config.prefill import CostModelSettings, RefitSettings


class KvEventsSettings(Section):
    """vLLM KV cache events (ZMQ) into the prefix index; see docs/cache-aware.md."""

    enabled: bool = Field(
        False,
        description="bind a ZMQ SUB socket for vLLM's KV events (engines: --kv-events-config "
        "with enable_kv_cache_events true, publisher zmq, endpoint tcp://GATEWAY:PORT, "
        "topic = the engine's ip:port)",
        json_schema_extra=RESTART_ONLY,
    )
    endpoint: str = Field(
        "tcp://127.0.0.1:5557",
        pattern=r"^(tcp|ipc)://.+",
        description="ZMQ endpoint the gateway binds (tcp://HOST:PORT; port 0 picks one)",
        json_schema_extra=RESTART_ONLY,
    )


class CacheSettings(Section):
    """Cache-aware endpoint picks by predicted time to first token."""

    enabled: bool = Field(
        True,
        description="pick by least predicted time to first token with a per-engine prefix "
        "index (engines that serve prefill and decode; ignored with a prefill pool; "
        "false: decode.policy alone picks)",
        json_schema_extra=RESTART_ONLY,
    )
    block_tokens: int = Field(
        32,
        ge=1,
        le=4096,
        description="tokens per block of the prefix index (text blocks are block_tokens x "
        "gateway.chars_per_token characters)",
        json_schema_extra=RESTART_ONLY,
    )
    index_blocks: int | None = Field(
        None,
        ge=0,
        le=1 << 22,
        description="blocks the index keeps per endpoint; null = the engine's KV cache "
        "(scraped vllm:cache_config_info, else the pool's max_kv_tokens) / block_tokens, "
        "at most max_index_blocks",
    )
    max_index_blocks: int = Field(
        65_536,
        ge=1,
        le=1 << 22,
        description="upper bound of one endpoint's index, blocks (memory: ~200 bytes each)",
    )
    cost_model: CostModelSettings = Field(
        default_factory=lambda: CostModelSettings(),
        description="the cost model of every engine's predicted TTFT (ns); the starting "
        "point of the online refit",
    )
    refit: RefitSettings = Field(
        default_factory=lambda: RefitSettings(period_s=10.0),
        description="online refit of the cost model from the TTFT the gateway observes "
        "(pick to first response body chunk of streamed requests picked alone on their "
        "endpoint; in the unary and HTTP Envoy modes the access log's time to first body "
        "byte); the lean mode sends no response message and learns nothing",
    )
    learn_per: Literal["endpoint", "engine", "all"] = Field(
        "endpoint",
        description="refit one cost model per endpoint (ip:port), per engine (a pool entry: "
        "its DP ranks together, one engine class) or one for all endpoints; per endpoint or "
        "engine, one with no refit of its own yet uses a model refitted on all samples",
        json_schema_extra=RESTART_ONLY,
    )
    kv_events: KvEventsSettings = Field(
        default_factory=lambda: KvEventsSettings(),
        description="vLLM KV cache events: cache resets and evictions reach the index",
    )
    shared_steps: bool = Field(
        True,
        description="the engines batch waiting prompts into one step (continuous "
        "batching: vLLM, SGLang): a request queued behind predicted work shares that "
        "step's fixed overhead (the cost model's k), so it adds cost - k, not cost",
    )
    recompute_weight: float = Field(
        1.0,
        ge=0.0,
        le=100.0,
        description="a pick is scored by its predicted TTFT plus this weight x the "
        "prefill work it adds for the prefix it recomputes (the best holder's hit, priced on "
        "that endpoint's own model), "
        "ns per ns: 1 = a request leaves the endpoint holding its prefix only when the "
        "wait it saves exceeds the recompute it adds; 0 = least predicted TTFT alone",
    )
    share_hot_prefixes: bool = Field(
        True,
        description="a move's recompute charge is divided by 1 + the requests in flight "
        "whose prompts contain the prefix the best holder holds: a second copy of a "
        "prefix many requests use at once (a shared system prompt) serves the next ones too; "
        "a conversation's own history pays the charge whole; and a prefix that requests in "
        "flight go on from with other text counts as held by every candidate, when those "
        "requests (the new one too) exceed its holders' share of all in flight",
    )
    emit_scores: bool = Field(
        False,
        description="log one line per pick with every candidate's predicted TTFT and hit "
        "tokens (like llm-d's --emit-endpoint-scores; verbose)",
    )
