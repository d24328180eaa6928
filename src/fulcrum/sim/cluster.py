"""Cluster model of the simulator, loadable from YAML (``--cluster FILE``).

Defaults describe a realistic mid-size disaggregated deployment of a DeepSeek-V3-like
MoE model on H800-class GPUs (our decision; the published guide gives no cluster size):

* **prefill**: 8 engines, each an EP4DP4 group (4 DP ranks) -> 32 GPUs. A rank's step
  time is the cost model of ``fulcrum.core.cost`` (``a = 2 ns/token^2, b = 56 us/token,
  k = 5 ms``); the group moves at its slowest rank; step budget
  ``compute_quota_limit`` = 1 s, each rank proposing the time of the work it holds
  (at least ``step_floor_fraction`` = 0.1 of the limit; core ``rank_budget``) and the
  MIN applying; at most 32,768 tokens per rank per step. Engines
  belong to tiers ``<16K, 16K-64K, 64K-256K, >=256K`` re-split every ``round_s`` = 1 s
  by the round's demand (the daemon's rule: quota that joined the tier + still-queued
  quota / ``backlog_rounds``), and at once when work arrives
  for a tier without an engine. Cost model, step budget, chunk cap, tier bounds,
  per-batch quota caps (8/32/128/512 s, each above the cost of the tier's largest fresh
  request: a fresh 256K-token prompt costs 83 s), backlog rounds and hysteresis are the
  daemon's own defaults (``fulcrum.config.prefill.PrefillSettings``), read from there.
  The prefill balancer is the daemon's own object
  (:class:`fulcrum.core.prefill.balancer.PrefillBalancer`), fleet cold at t = 0. A
  simulated engine pulls after each of its steps with its remaining quota -- the sum
  over its ranks of ``max(0, horizon - outstanding)``, per-tier ``horizon_s``
  2/8/30/120 s -- and its rank loads. Push baselines see the ranks' load through their
  own sends plus reports each engine sends after every step, ``report_staleness_s`` =
  0.05 s old when the router reads them.
* **decode**: 4 instances of EP8DP8 (32 GPUs), per-GPU step
  ``d0 + d1 * concurrency + d2 * total_kv`` with ``d0 = 10 ms``, ``d1 = 50 us/request``,
  ``d2 = 10 ns/KV token`` (MLA KV of about 40 KB/token read at about 4 TB/s); at most
  256 requests and 2M KV tokens per GPU.
* **vision**: 2 VE machines x 8 GPUs; an image takes ``v0 + v1 * patches`` =
  2 ms + 5 us/patch (a 1280x800 screenshot, 4,000 patches, takes 22 ms); one image at a
  time per GPU, FIFO.
* **experts**: 384 routed experts, top-8, popularity log-normal with ``skew`` = 1.0
  (std of log-popularity) drifting as an Ornstein-Uhlenbeck process with time constant
  ``drift_tau_s`` = 300 s; modelled on ``layers`` = 4 representative MoE layers. EPLB
  window/period/redundancy follow SPEC section 6 (prefill N = 100, M = 1,000, 4
  redundant slots per GPU; decode N = 1,000, M = 10,000, 1 per GPU). The MoE share of a
  step (``moe_fraction`` of the linear term) is stretched by ``moe_lb``.
* **cache**: shared KV store of 100,000 blocks of 512 tokens (51M tokens), LRU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fulcrum.config.decode import DecodeSettings
from fulcrum.config.prefill import PrefillSettings
from fulcrum.config.tenants import TenantsSettings
from fulcrum.core.prefill.chunks import DEFAULT_FLOOR_FRACTION
from fulcrum.sim.baselines import DEFAULT_STALENESS_NS

#: The daemon's prefill defaults: the simulator models the same balancer, not a copy.
_DAEMON = PrefillSettings()


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


#: Keys the simulator's cluster YAML used to spell differently: old -> (section key,
#: daemon key, factor). An old key is translated (times the factor) to the daemon's key.
_OLD_PREFILL: Final[dict[str, tuple[str, float]]] = {
    "step_budget_ns": ("step_quota_ns", 1.0),
    "horizon_s": ("tier_horizon_ns", 1e9),
    "batch_cap_s": ("tier_batch_cap_ns", 1e9),
    "round_s": ("round_period_ms", 1e3),
    "min_tier_dwell_s": ("min_tier_dwell_ms", 1e3),
}
_OLD_COST: Final = {"cost_a": "a", "cost_b": "b", "cost_k": "k"}
_OLD_CACHE: Final[dict[str, tuple[str, float]]] = {
    "mode": ("cache_model", 1.0),
    "affinity_max_wait_s": ("affinity_max_wait_ms", 1e3),
}


def _scaled(v: Any, factor: float) -> Any:
    """An old value in the daemon key's unit: seconds to ns truncate (as the simulator
    converted them), seconds to ms round; a name stays a name."""
    if isinstance(v, str):
        return v
    if isinstance(v, list | tuple):
        return [_scaled(x, factor) for x in v]
    return int(v * factor) if factor != 1e3 else round(v * factor)


def _translate(raw: dict[str, Any], table: dict[str, tuple[str, float]],
               into: dict[str, Any]) -> None:
    """Move the old keys of ``raw`` to their daemon names in ``into`` (old keys win)."""
    for old, (new, factor) in table.items():
        if old in raw:
            into[new] = _scaled(raw.pop(old), factor)


class PrefillCluster(PrefillSettings):
    """Prefill engines (DP groups) and the prefill balancer's knobs: every key of the
    daemon's ``prefill:`` section (:class:`fulcrum.config.prefill.PrefillSettings`, same
    names, same defaults, same checks) plus the simulator's engine model."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    engines: int = Field(8, ge=1)
    ranks_per_engine: int = Field(4, ge=1)
    step_floor_fraction: float = Field(DEFAULT_FLOOR_FRACTION, ge=0, le=1)
    moe_fraction: float = Field(0.6, ge=0, le=1)
    report_staleness_s: float = Field(DEFAULT_STALENESS_NS / 1e9, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        _translate(raw, _OLD_PREFILL, raw)
        cost = {_OLD_COST[k]: raw.pop(k) for k in list(raw) if k in _OLD_COST}
        if cost:
            base = raw.get("cost_model") or {}
            raw["cost_model"] = {**dict(base), **cost}
        return raw

    @property
    def n_ranks(self) -> int:
        """Prefill GPUs (DP ranks) in the cluster."""
        return self.engines * self.ranks_per_engine

    # A read-only view under the simulator's former name (seconds), for old callers.
    @property
    def batch_cap_s(self) -> tuple[float, ...]:
        """``tier_batch_cap_ns`` in seconds."""
        return tuple(c / 1e9 for c in self.tier_batch_cap_ns)


#: The daemon's ``decode.step_time`` section type (built from the policy's dataclass).
_STEP_TIME = DecodeSettings.model_fields["step_time"].annotation


class DecodeCluster(DecodeSettings):
    """Decode instances (EP groups) and the per-GPU step model, plus every key of the
    daemon's ``decode:`` section (:class:`fulcrum.config.decode.DecodeSettings`: same
    names, defaults and checks; ``dual.*`` reaches the simulated ``dual`` policy). The
    policy itself is the policy set's; ``step_time.*`` left unset, the ``step_time``
    policy is given the simulated GPUs' own step model (``d0_ns``, ``d1_ns``, ``d2_ns``):
    the baseline gets every advantage."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    #: None (the default here): the ``step_time`` policy is given the simulated model.
    step_time: _STEP_TIME | None = None  # type: ignore[valid-type]
    instances: int = Field(2, ge=1)
    gpus_per_instance: int = Field(16, ge=1)
    d0_ns: float = Field(10_000_000.0, ge=0)
    d1_ns: float = Field(50_000.0, ge=0)
    d2_ns: float = Field(10.0, ge=0)
    max_concurrency: int = Field(256, ge=1)
    max_kv_tokens: int = Field(2_000_000, ge=1)
    moe_fraction: float = Field(0.5, ge=0, le=1)

    @property
    def n_gpus(self) -> int:
        """Decode GPUs in the cluster."""
        return self.instances * self.gpus_per_instance

    def sim_params(self) -> dict[str, float]:
        """The decode policies' parameters by key (each policy takes the keys it
        declares): ``dual.*`` as configured; ``step_time.*`` as configured, else the
        simulated step model."""
        st = self.step_time
        step = (st.model_dump() if st is not None
                else {"d0_ns": self.d0_ns, "d1_ns": self.d1_ns, "d2_ns": self.d2_ns})
        dual = self.__dict__["dual"]  # a section built from the policy's dataclass
        return {**dual.model_dump(), **step}


class VisionCluster(_Section):
    """Vision-encoder machines and the per-image time model."""

    machines: int = Field(2, ge=1)
    gpus_per_machine: int = Field(8, ge=1)
    v0_ns: float = Field(2_000_000.0, ge=0)
    v1_ns: float = Field(5_000.0, ge=0)

    @property
    def n_gpus(self) -> int:
        """VE GPUs in the cluster."""
        return self.machines * self.gpus_per_machine


class ExpertModel(_Section):
    """Expert popularity, its drift, and the EPLB cadence per role."""

    n_logical: int = Field(384, ge=1)
    top_k: int = Field(8, ge=1)
    layers: int = Field(4, ge=1)
    skew: float = Field(1.0, ge=0)
    drift_tau_s: float = Field(300.0, gt=0)
    prefill_redundant_per_gpu: int = Field(4, ge=0)
    prefill_window_steps: int = Field(100, ge=1)
    prefill_period_steps: int = Field(1_000, ge=1)
    decode_redundant_per_gpu: int = Field(1, ge=0)
    decode_window_steps: int = Field(1_000, ge=1)
    decode_period_steps: int = Field(10_000, ge=1)


class CacheModel(_Section):
    """Prefix-cache store (LRU) of ``capacity_blocks`` blocks. Under ``prefill.cache_model``
    ``global`` one pool; under ``per_engine`` each prefill engine caches
    ``capacity_blocks / engines`` blocks and Fulcrum routes by prefix affinity with the
    fairness bound ``prefill.affinity_max_wait_ms`` (the daemon's keys; the former
    ``cache.mode`` and ``cache.affinity_max_wait_s`` are translated to them)."""

    capacity_blocks: int | None = Field(100_000, ge=0)


class Cluster(_Section):
    """The whole simulated deployment."""

    @model_validator(mode="before")
    @classmethod
    def _old_cache_names(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or not isinstance(raw.get("cache"), dict):
            return raw
        cache = dict(raw["cache"])
        if not any(k in cache for k in _OLD_CACHE):
            return raw
        prefill = dict(raw.get("prefill") or {})
        _translate(cache, _OLD_CACHE, prefill)
        return {**raw, "cache": cache, "prefill": prefill}

    prefill: PrefillCluster = PrefillCluster()
    decode: DecodeCluster = DecodeCluster()
    vision: VisionCluster = VisionCluster()
    experts: ExpertModel = ExpertModel()
    cache: CacheModel = CacheModel()
    #: The daemon's own ``tenants:`` section (weights, caps, sheddable classes; issue 23).
    tenants: TenantsSettings = TenantsSettings()

    def with_overrides(self, **sections: dict[str, Any]) -> Cluster:
        """A copy with some fields of some sections replaced (validated)."""
        raw = self.model_dump()
        for name, fields in sections.items():
            raw[name] = {**raw[name], **fields}
        return Cluster.model_validate(raw)


def load_cluster(path: Path | None) -> Cluster:
    """The cluster of a YAML file (missing keys take the defaults); defaults when None."""
    if path is None:
        return Cluster()
    with path.open() as fh:
        raw = yaml.safe_load(fh) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a mapping")
    return Cluster.model_validate(raw)


def dump_cluster(cluster: Cluster) -> str:
    """The cluster as YAML (round-trips through :func:`load_cluster`)."""
    return yaml.safe_dump(cluster.model_dump(mode="json"), sort_keys=False)
