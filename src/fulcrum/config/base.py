"""Base of every configuration section: unknown keys are refused, values are frozen."""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict

#: ``json_schema_extra`` of a key that a reload (SIGHUP) cannot change: the daemon keeps
#: the value it started with, logs the key by name and counts the reload as
#: ``restart_required``. Every other key is reloadable.
RESTART_ONLY: Final[dict[str, Any]] = {"restart_only": True}


class Section(BaseModel):
    """A configuration section. Subclasses declare fields with defaults and bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
