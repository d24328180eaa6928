"""Collectors of transport security and authorisation."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fulcrum.metrics import REGISTRY

AUTH_DENIALS = Counter(
    "fulcrum_auth_denials",
    "Calls refused by authorisation, by service, method, status code (UNAUTHENTICATED, "
    "PERMISSION_DENIED) and reason (no_identity, bad_token, unknown_identity, role, "
    "bound_id).",
    ["service", "method", "code", "reason"],
    registry=REGISTRY,
)
AUTH_ALLOWED = Counter(
    "fulcrum_auth_allowed",
    "Calls admitted by authorisation, by role and identity source (certificate, token).",
    ["role", "source"],
    registry=REGISTRY,
)
TLS_ENABLED = Gauge(
    "fulcrum_tls_enabled",
    "1 when the gRPC port serves TLS, 0 when it serves plaintext.",
    registry=REGISTRY,
)
MTLS_ENABLED = Gauge(
    "fulcrum_tls_client_auth_required",
    "1 when clients must present a certificate (mutual TLS), else 0.",
    registry=REGISTRY,
)
AUTH_ENABLED = Gauge(
    "fulcrum_auth_enabled",
    "1 when callers are authenticated and authorised by role, else 0.",
    registry=REGISTRY,
)


class _OptionalGauge(Collector):
    """A gauge without labels that is absent until set (and again after :meth:`clear`).
    The value is one float swapped by reference: the scrape thread only reads it."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name = name
        self._doc = documentation
        self._value: float | None = None
        REGISTRY.register(self)

    def set(self, value: float) -> None:
        self._value = float(value)

    def clear(self) -> None:
        self._value = None

    def get(self) -> float | None:
        return self._value

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self._name, self._doc)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        value = self._value
        if value is not None:
            family = GaugeMetricFamily(self._name, self._doc)
            family.add_metric([], value)
            yield family


CERT_EXPIRY = _OptionalGauge(
    "fulcrum_tls_certificate_expiry_timestamp_seconds",
    "notAfter of the served TLS certificate, Unix seconds (absent on a plaintext daemon "
    "or when the certificate cannot be parsed).",
)
AUTH_IDENTITIES = Gauge(
    "fulcrum_auth_identities",
    "Configured caller identities, by role.",
    ["role"],
    registry=REGISTRY,
)
MALFORMED = Counter(
    "fulcrum_rpc_malformed_requests",
    "Requests whose bytes did not parse as the method's message (answered "
    "INVALID_ARGUMENT), by service and method.",
    ["service", "method"],
    registry=REGISTRY,
)
