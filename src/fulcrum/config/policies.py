"""Configuration sections derived from a rule registry (:mod:`fulcrum.core.registry`).

A balancer section names its policy (``<balancer>.policy``, validated against the
registry's names) and carries one sub-section per policy that has parameters
(``<balancer>.<policy>.*``). The sub-sections are pydantic models generated from the
policies' own parameter dataclasses (:func:`fulcrum.core.registry.knob`: same keys,
defaults, bounds and descriptions), so the configuration reference lists them; the
policy's dataclass validates the values again when the policy is built. A policy
registered after the section class was built (a plugin, a test-only policy) is still
accepted: its key is parsed by the registry itself (:meth:`PolicySection.policy_params`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, PrivateAttr, create_model, field_validator, model_validator
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

from fulcrum.config.base import Section
from fulcrum.core.registry import Registry


def lease_field(default_ms: int) -> Any:
    """``<table>.lease_ms``: placements not released within it expire."""
    return Field(
        default_ms,
        ge=10,
        le=86_400_000,
        description="placements not released within this time expire (and are counted), ms",
    )


def sweep_field() -> Any:
    """``<table>.sweep_interval_ms``: period of the lease-expiry sweep."""
    return Field(500, ge=5, le=60_000, description="period of the lease-expiry sweep, ms")


def gpu_series_field(what: str) -> Any:
    """``<table>.metrics_gpu_series``: bound of the per-GPU gauges (``what``: "decode")."""
    return Field(
        256,
        ge=0,
        le=1_000_000,
        description=(
            f"per-GPU gauges are exported for every {what} GPU while there are at most "
            "this many, else for this many most loaded GPUs (per-member sums and summaries "
            "are always exported); bounds the /metrics size at full scale, GPUs"
        ),
    )


def params_section(name: str, params: type[Any]) -> type[Section]:
    """A pydantic section with the fields of the parameter dataclass ``params``."""
    hints = typing.get_type_hints(params)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        meta = f.metadata
        fields[f.name] = (
            hints[f.name],
            Field(f.default, description=meta.get("description"), **meta.get("bounds", {})),
        )
    title = "".join(part.title() for part in name.split("_")) + "Settings"
    section: type[Section] = create_model(title, __base__=Section, __module__=__name__,
                                          **fields)
    section.__doc__ = params.__doc__
    # Findable by name, so that settings holding it pickle (the simulator's --jobs
    # workers receive the cluster, which embeds the daemon's decode section).
    globals().setdefault(title, section)
    return section


def policy_fields(registry: Registry[Any]) -> dict[str, tuple[type[Section], Any]]:
    """``{policy: (section type, field)}`` of every registered policy with parameters."""
    out: dict[str, tuple[type[Section], Any]] = {}
    for name in registry:
        params = registry.entry(name).params
        if dataclasses.fields(params):
            section = params_section(name, params)
            out[name] = (section, Field(default_factory=section))
    return out


class PolicySection(Section):
    """Base of a balancer section whose ``policy`` names an entry of :attr:`REGISTRY`.

    Subclasses set ``REGISTRY``, declare ``policy`` and insert :func:`policy_fields` among
    their fields (see :mod:`fulcrum.config.decode`)."""

    REGISTRY: ClassVar[Registry[Any]]
    #: What a policy is called in messages ("decode policy", "VE policy").
    NOUN: ClassVar[str] = "policy"
    _late: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _late_policies(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Parse the keys of policies registered after the class was built."""
        late: dict[str, Any] = {}
        if isinstance(data, Mapping):
            data = dict(data)
            for key in [k for k in data if k not in cls.model_fields and k in cls.REGISTRY]:
                late[key] = cls.REGISTRY.parse(key, data.pop(key))
        out = handler(data)
        out._late.update(late)
        return out

    @field_validator("policy", check_fields=False)
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in cls.REGISTRY:
            known = ", ".join(sorted(cls.REGISTRY))
            raise ValueError(f"unknown {cls.NOUN} {value!r}; known: {known}")
        return value

    @model_validator(mode="after")
    def _checked_params(self) -> PolicySection:
        for name in self.REGISTRY:
            section = getattr(self, name, None)
            if isinstance(section, Section):  # the policy's own dataclass checks it too
                self.REGISTRY.parse(name, section.model_dump())
        return self

    def policy_params(self, name: str | None = None) -> Any:
        """The parameter dataclass of policy ``name`` (default: the one in force)."""
        name = name if name is not None else str(self.__dict__["policy"])
        if name in self._late:
            return self._late[name]
        section = getattr(self, name, None)
        raw = section.model_dump() if isinstance(section, Section) else None
        return self.REGISTRY.parse(name, raw)
