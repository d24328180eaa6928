"""Settings of tenants, priorities and deadlines (``tenants:`` section; issue 23).

The daemon and the simulator (``fulcrum simulate --cluster``) read the same section.
``to_policy()`` gives the core form (:class:`fulcrum.core.tenants.TenantPolicy`).
Every key is reloadable except ``max_tenants`` (restart-only: it bounds a table).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from fulcrum.config.base import RESTART_ONLY, Section
from fulcrum.core import tenants as core

_MS = 1_000_000  # ns per ms


class TenantClassSettings(Section):
    """One tenant class: its fair-share weight and optional caps (None: no cap)."""

    weight: float = Field(
        1.0, gt=0, le=1e6,
        description="share of contended prefill compute relative to other tenants "
        "(weights 3 and 1 give 0.75 / 0.25 of the fleet's prefill ns when both saturate)",
    )
    compute_cap: float | None = Field(
        None, gt=0, le=1,
        description="most of the fleet's prefill compute this tenant may take, a fraction "
        "of the fleet's prefill ns over tenants.cap_window_ms (null: no cap)",
    )
    sheddable: bool = Field(
        False,
        description="refuse at once (RESOURCE_EXHAUSTED, retry-after-ms) a request whose "
        "predicted TTFT (queued work ahead plus its own cost) misses its deadline",
    )
    ttft_slo_ms: int | None = Field(
        None, ge=1, le=core.MAX_TTFT_SLO_MS,
        description="TTFT deadline of a request that gives none, ms (null: none)",
    )
    decode_max_concurrency: int | None = Field(
        None, ge=1, le=100_000_000, description="decode requests held at once (null: no cap)"
    )
    decode_max_kv_tokens: int | None = Field(
        None, ge=1, le=1 << 50, description="KV its decode requests hold, tokens (null: no cap)"
    )
    vision_max_concurrency: int | None = Field(
        None, ge=1, le=100_000_000,
        description="image requests placed on VEs at once (null: no cap)",
    )

    def to_spec(self) -> core.TenantSpec:
        """The core form of this class."""
        return core.TenantSpec(
            weight=self.weight,
            compute_cap=self.compute_cap,
            sheddable=self.sheddable,
            ttft_slo_ns=None if self.ttft_slo_ms is None else self.ttft_slo_ms * _MS,
            decode_max_concurrency=self.decode_max_concurrency,
            decode_max_kv_tokens=self.decode_max_kv_tokens,
            vision_max_concurrency=self.vision_max_concurrency,
        )


class TenantsSettings(Section):
    """Tenants (fairness ids), priority bands and deadlines.

    A request names its tenant (a string) and priority (a small int, higher first); an
    unconfigured tenant takes the ``default`` class's parameters under its own fairness
    id, until ``max_tenants`` distinct tenants are tracked; later ones are folded into
    the default tenant and counted."""

    classes: dict[str, TenantClassSettings] = Field(
        default_factory=dict,
        description="configured tenants, tenant string -> class ('default' and 'other' "
        "are reserved)",
    )
    default: TenantClassSettings = Field(
        default_factory=lambda: TenantClassSettings(),
        description="class of requests with no tenant or an unconfigured one",
    )
    max_tenants: int = Field(
        core.DEFAULT_MAX_TENANTS, ge=1, le=1_000_000,
        description="distinct tenants tracked (configured ones included); a further one is "
        "folded into the default class and counted (needs a restart)",
        json_schema_extra=RESTART_ONLY,
    )
    max_tenant_length: int = Field(
        core.DEFAULT_MAX_TENANT_LENGTH, ge=1, le=4096,
        description="longest tenant string, characters; longer is INVALID_ARGUMENT",
    )
    min_priority: int = Field(
        core.DEFAULT_MIN_PRIORITY, ge=-1000, le=0,
        description="lowest accepted priority (higher is served first; default 0)",
    )
    max_priority: int = Field(
        core.DEFAULT_MAX_PRIORITY, ge=0, le=1000,
        description="highest accepted priority; outside the range is INVALID_ARGUMENT",
    )
    sheddable_priorities: list[int] = Field(
        default_factory=list, max_length=2001,
        description="priority bands whose requests are sheddable whatever their tenant "
        "(default: none; a class is also sheddable by its own 'sheddable')",
    )
    starvation_bound_ms: int = Field(
        core.DEFAULT_STARVATION_BOUND_NS // _MS, ge=1, le=86_400_000,
        description="longest a lower priority band's oldest request waits behind higher "
        "bands before it is served first, ms",
    )
    cap_window_ms: int = Field(
        core.DEFAULT_CAP_WINDOW_NS // _MS, ge=1, le=86_400_000,
        description="window over which a tenant's served compute is measured (its "
        "compute_cap, and whether it is under its fair share), ms",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TenantsSettings:
        try:
            self.to_policy()
        except ValueError as err:
            raise ValueError(str(err)) from None
        return self

    def to_policy(self) -> core.TenantPolicy:
        """The core form of the section."""
        return core.TenantPolicy(
            classes={k: v.to_spec() for k, v in self.classes.items()},
            default=self.default.to_spec(),
            max_tenants=self.max_tenants,
            max_tenant_length=self.max_tenant_length,
            min_priority=self.min_priority,
            max_priority=self.max_priority,
            sheddable_priorities=frozenset(self.sheddable_priorities),
            starvation_bound_ns=self.starvation_bound_ms * _MS,
            cap_window_ns=self.cap_window_ms * _MS,
        )
