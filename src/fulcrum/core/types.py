"""Plain data shared by the balancers: fleet members' shapes and observed loads.

Units: tokens for KV lengths, nanoseconds for compute quota, patches for images.
Per-GPU tuples are indexed by the GPU's index inside its member.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MemberKind(enum.Enum):
    """Which balancer a fleet member serves."""

    PREFILL_ENGINE = "prefill_engine"
    DECODE_INSTANCE = "decode_instance"
    VISION_MACHINE = "vision_machine"


@dataclass(frozen=True, slots=True)
class PrefillEngineShape:
    """A prefill engine: one DP group of ``dp_ranks`` GPUs.

    ``step_quota_ns``: budget of one prefill step (compute_quota_limit), ns; 0 = default.
    ``prefix_cache_blocks``: capacity of its own prefix cache, blocks; 0 = default.
    ``prefix_cache_survived``: it re-registers with its prefix cache intact.
    """

    dp_ranks: int
    step_quota_ns: int = 0
    prefix_cache_blocks: int = 0
    prefix_cache_survived: bool = False

    @property
    def gpus(self) -> int:
        return self.dp_ranks


@dataclass(frozen=True, slots=True)
class DecodeInstanceShape:
    """A decode instance; tuples have one entry per GPU (length = number of GPUs).

    ``max_concurrency``: requests per GPU; ``max_kv_tokens``: KV cache per GPU, tokens.
    """

    max_concurrency: tuple[int, ...]
    max_kv_tokens: tuple[int, ...]

    @property
    def gpus(self) -> int:
        return len(self.max_concurrency)


@dataclass(frozen=True, slots=True)
class VisionMachineShape:
    """A vision-encoder machine: ``gpus`` encoders; ``max_patches_in_flight`` per GPU
    (0 = unlimited)."""

    gpus: int
    max_patches_in_flight: int = 0


MemberShape = PrefillEngineShape | DecodeInstanceShape | VisionMachineShape


@dataclass(frozen=True, slots=True)
class DecodeInstanceLoad:
    """Observed load of a decode instance, one entry per GPU: requests and KV tokens."""

    concurrency: tuple[int, ...]
    kv_tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class VisionMachineLoad:
    """Observed load of a VE machine: patches in flight per GPU."""

    patches_in_flight: tuple[int, ...]


MemberLoad = DecodeInstanceLoad | VisionMachineLoad


def kind_of(shape: MemberShape) -> MemberKind:
    """The member kind a shape belongs to."""
    if isinstance(shape, PrefillEngineShape):
        return MemberKind.PREFILL_ENGINE
    if isinstance(shape, DecodeInstanceShape):
        return MemberKind.DECODE_INSTANCE
    return MemberKind.VISION_MACHINE


@dataclass(frozen=True, slots=True)
class Member:
    """One admission of a fleet member. A re-registration is a new ``Member`` with a
    larger ``incarnation``; ``joined_ns`` is on the daemon's monotonic clock."""

    member_id: str
    kind: MemberKind
    incarnation: int
    shape: MemberShape
    joined_ns: int
