"""A request's tenant, priority and TTFT deadline from its HTTP headers (issue 23).

Follows the Gateway API Inference Extension's conventions (header names configurable in
``gateway.tenancy``):

======================================  =========================================
header                                  field (SubmitRequest, PlaceDecodeRequest)
======================================  =========================================
``x-gateway-inference-fairness-id``     ``tenant`` (absent: the default class)
``x-gateway-inference-objective``       ``priority`` = ``gateway.tenancy.objectives``
                                        [objective name] (absent or unknown: 0)
``x-slo-ttft-ms``                       ``ttft_slo_ms`` (absent: the class default)
======================================  =========================================

A header whose value cannot be used is *ignored*: the field keeps its default and the
request goes on (never a 400 for a tenancy header); each ignored header is one
:class:`Ignored` (role and reason), counted in ``fulcrum_gateway_tenancy_headers_ignored``
by :func:`count_ignored`. :func:`parse` itself is pure; :func:`classify` turns an
ext_proc header map into the daemon's class (the picker's hook).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from envoy.config.core.v3 import base_pb2

from fulcrum.config.tenancy import GatewayTenancySettings
from fulcrum.core.tenants import DEFAULT_CLASS, MAX_TTFT_SLO_MS, RequestClass, TenantPolicy
from fulcrum.errors import InvalidArgument
from fulcrum.metrics import tenants as tm

if TYPE_CHECKING:
    from fulcrum.service.tenants import Tenancy as ServiceTenancy

#: Roles of the headers (the bounded ``header`` label of the ignored counter).
FAIRNESS: Final = "fairness_id"
OBJECTIVE: Final = "objective"
TTFT: Final = "ttft_slo_ms"
#: Milliseconds: ASCII digits, optionally a fraction.
_MS_RE: Final = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,9})?$")


@dataclass(frozen=True, slots=True)
class Ignored:
    """One header ignored: its ``role`` (:data:`FAIRNESS`, :data:`OBJECTIVE`,
    :data:`TTFT`) and ``reason`` (one of ``metrics.tenants.HEADER_REASONS``)."""

    role: str
    reason: str


@dataclass(frozen=True, slots=True)
class Tenancy:
    """What the headers say: ``tenant`` ("" = default class), ``priority`` (higher
    first), ``ttft_slo_ms`` (ms; None = none given), and the headers ``ignored``."""

    tenant: str = ""
    priority: int = 0
    ttft_slo_ms: int | None = None
    ignored: tuple[Ignored, ...] = field(default=())


#: Headers say nothing (or every one was ignored).
NONE: Final = Tenancy()


def _values(headers: Iterable[tuple[str, str]], names: dict[str, str]) -> dict[str, list[str]]:
    """Values of the wanted headers by role, in order (names compared lower case)."""
    out: dict[str, list[str]] = {}
    for key, value in headers:
        role = names.get(key.lower())
        if role is not None:
            out.setdefault(role, []).append(value.strip(" \t"))
    return out


def _one(values: list[str] | None) -> str | None:
    """The header's single value; a repeated header with differing values is malformed
    (None and the caller records it), the same value twice counts once."""
    if not values:
        return None
    return values[0] if len(set(values)) == 1 else None


def _tenant(value: str, policy: TenantPolicy) -> str | Ignored:
    if len(value) > policy.max_tenant_length:
        return Ignored(FAIRNESS, "too_long")
    if not value.isprintable():
        return Ignored(FAIRNESS, "malformed")
    return value


def _priority(value: str, s: GatewayTenancySettings, policy: TenantPolicy) -> int | Ignored:
    prio = s.objectives.get(value)
    if prio is None:
        return Ignored(OBJECTIVE, "unknown_objective")
    if not policy.min_priority <= prio <= policy.max_priority:
        return Ignored(OBJECTIVE, "out_of_range")
    return prio


def _ttft(value: str) -> int | Ignored:
    """A positive number of milliseconds (digits, optionally a fraction, rounded up)."""
    if not _MS_RE.match(value):
        return Ignored(TTFT, "malformed")
    ms = math.ceil(float(value))
    if not 1 <= ms <= MAX_TTFT_SLO_MS:
        return Ignored(TTFT, "out_of_range")
    return ms


def header_roles(settings: GatewayTenancySettings) -> dict[str, str]:
    """The tenancy headers (lower-case names, as the settings require) and their roles
    (:data:`FAIRNESS`, :data:`OBJECTIVE`, :data:`TTFT`)."""
    return {
        settings.fairness_header: FAIRNESS,
        settings.objective_header: OBJECTIVE,
        settings.ttft_header: TTFT,
    }


def parse(
    headers: Iterable[tuple[str, str]], settings: GatewayTenancySettings, policy: TenantPolicy
) -> Tenancy:
    """The class the request's ``headers`` (name, value) ask for, under the tenancy
    ``settings`` and the daemon's tenants ``policy`` (priority range, tenant length)."""
    found = _values(headers, header_roles(settings))
    ignored: list[Ignored] = []
    tenant, priority, ttft = "", 0, None
    for role, values in found.items():
        value = _one(values)
        if value is None:
            ignored.append(Ignored(role, "malformed"))
            continue
        if not value:  # an empty header says nothing
            continue
        got: str | int | Ignored
        if role == FAIRNESS:
            got = _tenant(value, policy)
        elif role == OBJECTIVE:
            got = _priority(value, settings, policy)
        else:
            got = _ttft(value)
        if isinstance(got, Ignored):
            ignored.append(got)
        elif role == FAIRNESS:
            tenant = str(got)
        elif role == OBJECTIVE:
            priority = int(got)
        else:
            ttft = int(got)
    if not ignored and not tenant and priority == 0 and ttft is None:
        return NONE
    return Tenancy(tenant, priority, ttft, tuple(ignored))


def count_ignored(t: Tenancy) -> None:
    """Count each ignored header of ``t`` (event loop)."""
    for ig in t.ignored:
        tm.HEADER_IGNORED.labels(ig.role, ig.reason).inc()


def _text(h: base_pb2.HeaderValue) -> str:
    """A header's value as text; bytes that are not UTF-8 give a value every rule
    refuses (a control character), so the header is ignored and counted."""
    if not h.raw_value:
        return str(h.value)
    try:
        return bytes(h.raw_value).decode("utf-8")
    except UnicodeDecodeError:
        return "\x00"


def classify(
    tenancy: ServiceTenancy | None,
    settings: GatewayTenancySettings,
    headers: Iterable[base_pb2.HeaderValue],
) -> RequestClass:
    """The class of a request from its ext_proc request headers (all of them, or only
    the tenancy ones), through the daemon's tenant table (``tenancy``; None: the default
    class). Ignored headers are counted; never raises on a header."""
    if tenancy is None:
        return DEFAULT_CLASS
    if isinstance(headers, list | tuple) and not headers:
        return tenancy.default  # no tenancy header: what parse gives, without parsing
    t = parse(((h.key, _text(h)) for h in headers), settings, tenancy.table.policy)
    count_ignored(t)
    if t.tenant == "" and t.priority == 0 and t.ttft_slo_ms is None:
        return tenancy.default
    try:
        return tenancy.resolve(t.tenant, t.priority, t.ttft_slo_ms)
    except InvalidArgument:  # pragma: no cover - parse keeps every field in range
        return tenancy.default
