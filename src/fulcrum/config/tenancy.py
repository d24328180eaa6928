"""Settings of the gateway's tenancy headers (``gateway.tenancy``; issue 23).

The endpoint picker reads a request's class from headers, following the Gateway API
Inference Extension's conventions: ``x-gateway-inference-fairness-id`` is the tenant
(fairness id), ``x-gateway-inference-objective`` names an InferenceObjective whose
priority this section lists (``objectives``: the picker runs without a Kubernetes API, so
the objectives' priorities are configured here; an unknown objective is priority 0, as
in the extension), and ``x-slo-ttft-ms`` is the TTFT deadline in milliseconds. A
malformed value is ignored (the field keeps its default) and counted in
``fulcrum_gateway_tenancy_headers_ignored``. Every key is reloadable.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from fulcrum.config.base import Section

#: A Kubernetes object name (RFC 1123 subdomain): an InferenceObjective's metadata.name.
_OBJECTIVE_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
#: An HTTP header name, lower case (HTTP/2 and Envoy hand them over lower case).
_HEADER_RE = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]{1,128}$")


class GatewayTenancySettings(Section):
    """Which headers carry a request's tenant, priority and TTFT deadline."""

    objectives: dict[str, int] = Field(
        default_factory=dict,
        max_length=4096,
        description="InferenceObjective name -> priority (higher first; within "
        "tenants.min_priority..max_priority, else the header is ignored and counted); an "
        "objective not listed is priority 0",
    )
    fairness_header: str = Field(
        "x-gateway-inference-fairness-id",
        description="header naming the tenant (fairness id); absent: the default class",
    )
    objective_header: str = Field(
        "x-gateway-inference-objective",
        description="header naming the request's InferenceObjective (its priority comes "
        "from objectives)",
    )
    ttft_header: str = Field(
        "x-slo-ttft-ms",
        description="header carrying the TTFT deadline, milliseconds (a positive number; "
        "a fraction rounds up); absent: the tenant class's default",
    )

    @field_validator("objectives")
    @classmethod
    def _objectives(cls, value: dict[str, int]) -> dict[str, int]:
        for name, prio in value.items():
            if not _OBJECTIVE_RE.match(name):
                raise ValueError(f"{name!r}: must be a Kubernetes object name "
                                 "(lower case RFC 1123 subdomain, at most 253 characters)")
            if not -1000 <= prio <= 1000:
                raise ValueError(f"{name!r}: priority must be in [-1000, 1000], got {prio}")
        return value

    @field_validator("fairness_header", "objective_header", "ttft_header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not _HEADER_RE.match(value):
            raise ValueError("must be a lower-case HTTP header name (1 to 128 token "
                             "characters)")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> GatewayTenancySettings:
        names = (self.fairness_header, self.objective_header, self.ttft_header)
        if len(set(names)) != len(names):
            raise ValueError("fairness_header, objective_header and ttft_header must differ")
        return self


def band_reserve_field() -> Any:
    """``<table>.band_reserve`` (decode, vision): lower bands are shed first as the
    fleet fills (see :mod:`fulcrum.core.tenant_caps`)."""
    return Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="fraction of the fleet's capacity (requests or KV/patches, the fuller) "
        "kept from sheddable classes (tenants.*.sheddable, tenants.sheddable_priorities): "
        "the lowest band is refused past 1 - band_reserve full, higher bands later "
        "(0 = off; no class is sheddable by default)",
    )
