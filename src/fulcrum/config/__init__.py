"""YAML -> validated, frozen settings. Every key has a default, so an empty file (or no
file at all) is a working single-node configuration.

``load_settings(path)`` raises :class:`ConfigError`, whose message lists every offending
key's dotted path with the rule it breaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from fulcrum.config import checks
from fulcrum.config.base import Section
from fulcrum.config.decode import DecodeSettings
from fulcrum.config.eplb import EplbSettings
from fulcrum.config.gateway import GatewaySettings
from fulcrum.config.ha import HaSettings
from fulcrum.config.prefill import PrefillSettings
from fulcrum.config.security import SecuritySettings
from fulcrum.config.server import FleetSettings, LoggingSettings, MetricsSettings, ServerSettings
from fulcrum.config.tenants import TenantsSettings
from fulcrum.config.vision import VisionSettings

__all__ = [
    "ConfigError",
    "Settings",
    "effective_reload",
    "is_empty_document",
    "load_settings",
    "parse_settings",
    "restart_only_keys",
]


class Settings(Section):
    """The whole configuration."""

    server: ServerSettings = Field(default_factory=ServerSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    prefill: PrefillSettings = Field(default_factory=PrefillSettings)
    decode: DecodeSettings = Field(default_factory=DecodeSettings)
    vision: VisionSettings = Field(default_factory=VisionSettings)
    eplb: EplbSettings = Field(default_factory=EplbSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    tenants: TenantsSettings = Field(default_factory=TenantsSettings)
    ha: HaSettings = Field(default_factory=HaSettings)
    #: True when read from a file that names no setting (empty, only comments, ``{}``):
    #: fine to start with, refused as a reload (every key would revert to its default).
    _empty_document: bool = PrivateAttr(default=False)


def is_empty_document(settings: Settings) -> bool:
    """Whether ``settings`` came from a file naming no setting (see ``Settings``)."""
    return settings._empty_document


class ConfigError(Exception):
    """The configuration is refused; the message names each key path and rule."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _format(err: ValidationError) -> list[str]:
    return checks.format_errors(err, Settings)


def parse_settings(data: Any) -> Settings:
    """Validate a parsed YAML document (a mapping, or None for all defaults)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(["<root>: must be a mapping of sections"])
    try:
        return Settings.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err)) from None


def load_settings(path: str | Path | None) -> Settings:
    """Read and validate a YAML file; ``None`` gives the embedded defaults."""
    if path is None:
        return Settings()
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError([f"{path}: cannot read ({err.strerror})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError([f"{path}: not valid YAML ({err})"]) from None
    settings = parse_settings(data)
    problems = checks.cross_field(settings)  # files only: see fulcrum.config.checks
    if problems:
        raise ConfigError(problems)
    settings._empty_document = not data
    return settings


def with_overrides(settings: Settings, overrides: dict[str, Any]) -> Settings:
    """A copy of ``settings`` with nested ``overrides`` applied and validated."""
    merged = _deep_merge(settings.model_dump(), overrides)
    return parse_settings(merged)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# -- reload: reloadable and restart-only keys ------------------------------------------------


def is_restart_only(info: Any) -> bool:
    """True if a field (``FieldInfo``) is marked ``json_schema_extra={"restart_only": True}``."""
    extra = info.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("restart_only"))


def _section_type(info: Any) -> type[BaseModel] | None:
    ann = info.annotation
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    return None


def restart_only_keys(model: type[BaseModel] = Settings, prefix: str = "") -> list[str]:
    """Dotted paths of every restart-only key (e.g. ``server.port``), in field order."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        sub = _section_type(info)
        if sub is not None:
            out.extend(restart_only_keys(sub, f"{prefix}{name}."))
        elif is_restart_only(info):
            out.append(prefix + name)
    return out


def _get(data: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        data = data[part]
    return data


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        data = data[part]
    data[last] = value


def effective_reload(old: Settings, new: Settings) -> tuple[Settings, list[str]]:
    """The settings a reload runs with: ``new``, except that every restart-only key keeps
    its value from ``old``. Returns them and the restart-only keys whose value ``new``
    changed (sorted dotted paths; empty when a restart is not needed)."""
    old_d, new_d = old.model_dump(), new.model_dump()
    changed = [k for k in restart_only_keys() if _get(old_d, k) != _get(new_d, k)]
    if not changed:
        return new, []
    for key in changed:
        _set(new_d, key, _get(old_d, key))
    try:
        effective = Settings.model_validate(new_d)
    except ValidationError as err:
        problems = [f"{p} (with the restart-only keys {changed} at their running values)"
                    for p in _format(err)]
        raise ConfigError(problems) from None
    return effective, sorted(changed)
