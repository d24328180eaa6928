"""Base of every configuration section: unknown keys are refused, values are frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A configuration section. Subclasses declare fields with defaults and bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
