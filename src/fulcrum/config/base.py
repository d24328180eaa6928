"""Base of every configuration section: unknown keys are refused, values are frozen."""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

#: ``json_schema_extra`` of a key that a reload (SIGHUP) cannot change: the daemon keeps
#: the value it started with, logs the key by name and counts the reload as
#: ``restart_required``. Every other key is reloadable.
RESTART_ONLY: Final[dict[str, Any]] = {"restart_only": True}


def message_bytes(description: str, **extra: Any) -> Any:
    """A bound on one message or request body, bytes: 16 MiB by default, 1 KiB to 1 GiB
    (the gRPC server's ``server.max_message_bytes`` and the ext_proc picker's
    ``gateway.max_body_bytes`` share these, so both ends of a body agree by default)."""
    return Field(16 * 1024 * 1024, ge=1024, le=1 << 30, description=description, **extra)


class Section(BaseModel):
    """A configuration section. Subclasses declare fields with defaults and bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
