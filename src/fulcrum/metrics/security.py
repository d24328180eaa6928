"""Collectors of transport security and authorisation."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

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
CERT_EXPIRY = Gauge(
    "fulcrum_tls_certificate_expiry_timestamp_seconds",
    "notAfter of the server certificate, Unix seconds (absent when it cannot be read).",
    registry=REGISTRY,
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
