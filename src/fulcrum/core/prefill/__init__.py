"""Pure prefill balancer: tier -> engine -> DP rank -> chunk size (SPEC section 3).

Each level is one policy module with a ``NAME``; the registries below map the names used
in YAML configuration to the policy functions. Unknown names raise ValueError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, TypeVar

from fulcrum.core.prefill import batch, chunks, ranks, tiers

T = TypeVar("T")

TIER_POLICIES: Final[Mapping[str, Callable[..., object]]] = {tiers.NAME: tiers.allocate}
ENGINE_POLICIES: Final[Mapping[str, Callable[..., object]]] = {batch.NAME: batch.select_batch}
RANK_POLICIES: Final[Mapping[str, Callable[..., object]]] = {ranks.NAME: ranks.assign_ranks}
CHUNK_POLICIES: Final[Mapping[str, Callable[..., object]]] = {chunks.NAME: chunks.plan_step}


def lookup(registry: Mapping[str, T], name: str) -> T:
    """The policy registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"policy: unknown name {name!r} (known: {known})") from None


__all__ = [
    "CHUNK_POLICIES",
    "ENGINE_POLICIES",
    "RANK_POLICIES",
    "TIER_POLICIES",
    "batch",
    "chunks",
    "lookup",
    "ranks",
    "tiers",
]
