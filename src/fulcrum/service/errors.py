"""Map domain errors to gRPC status codes, and field-validation helpers for servicers."""

from __future__ import annotations

import grpc

from fulcrum.errors import FulcrumError, InvalidArgument
from fulcrum.units import MAX_U64

__all__ = ["CODES", "MAX_U64", "RETRY_AFTER_KEY", "require_id", "require_range", "status_of"]

CODES: dict[str, grpc.StatusCode] = {
    code.name: code for code in grpc.StatusCode
}

#: Trailing-metadata key carrying a retry hint (milliseconds) with RESOURCE_EXHAUSTED.
RETRY_AFTER_KEY = "retry-after-ms"


def status_of(err: FulcrumError) -> grpc.StatusCode:
    """The gRPC status code of a domain error."""
    return CODES.get(err.code_name, grpc.StatusCode.UNKNOWN)


def require_id(value: str, field: str, max_len: int = 128) -> str:
    """A request/member id: 1 to ``max_len`` printable ASCII characters without spaces."""
    if not value:
        raise InvalidArgument(field, "must not be empty")
    if len(value) > max_len:
        raise InvalidArgument(field, f"must be at most {max_len} characters")
    if not value.isascii() or not value.isprintable() or " " in value:
        raise InvalidArgument(field, "must be printable ASCII without spaces")
    return value


def require_range(value: int, field: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi]."""
    if not lo <= value <= hi:
        raise InvalidArgument(field, f"must be in [{lo}, {hi}], got {value}")
    return value
