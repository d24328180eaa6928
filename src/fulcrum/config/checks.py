"""Checks of a configuration file beyond one key's bounds, and problems in the CLI's words.

``cross_field(settings)`` lists the rules that tie keys together (a heartbeat interval
below the timeout, distinct ports, ...), each as ``key.path: rule`` naming the values.
``format_errors(err)`` turns a pydantic ``ValidationError`` into the same form: the
dotted key path, the rule without pydantic's "Value error," prefix, and for an unknown
key the closest known key ("did you mean ...?", difflib).

:func:`fulcrum.config.load_settings` applies both to every file it reads (``fulcrum
serve``, ``check-config``, a reload); settings built in code by ``parse_settings`` are
checked key by key only.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

_PREFIXES = ("Value error, ", "Assertion failed, ")


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model holding the key at ``loc`` (list indices skipped)."""
    model: type[BaseModel] | None = root
    for part in loc[:-1]:
        if model is None or isinstance(part, int):
            continue
        info = model.model_fields.get(str(part))
        if info is None:
            return None
        ann = info.annotation
        args = getattr(ann, "__args__", ())
        candidates = [ann, *args]
        model = next((c for c in candidates
                      if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _unknown(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    model = _model_at(root, loc)
    if model is None:
        return "unknown key"
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return f"unknown key (did you mean {close[0]!r}?)" if close else "unknown key"


def format_errors(err: ValidationError, root: type[BaseModel]) -> list[str]:
    """``key.path: rule`` for every error of ``err`` (``root``: the validated model)."""
    out = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            msg = _unknown(root, tuple(e["loc"]))
        else:
            msg = str(e["msg"])
            for prefix in _PREFIXES:
                msg = msg.removeprefix(prefix)
        out.append(f"{path}: {msg}")
    return out


def _ports(settings: Any) -> list[str]:
    s, m, g = settings.server, settings.metrics, settings.gateway
    ports = [("server.port", s.host, s.port)]
    if m.enabled:
        ports.append(("metrics.port", m.host, m.port))
    if g.enabled:
        ports += [("gateway.port", g.host, g.port), ("gateway.health_port", g.host, g.health_port)]
    out = []
    seen: dict[tuple[str, int], str] = {}
    for key, host, port in ports:
        if port == 0:
            continue  # any free port: never a clash
        for (h, p), other in seen.items():
            if p == port and (h == host or "0.0.0.0" in (h, host) or "::" in (h, host)):
                out.append(f"{key}: {port} is also {other}; give each listener its own port")
        seen[(host, port)] = key
    return out


def cross_field(settings: Any) -> list[str]:
    """Every rule tying keys together that ``settings`` breaks (empty: none)."""
    f, out = settings.fleet, []
    if f.heartbeat_interval_ms >= f.heartbeat_timeout_ms:
        out.append(
            f"fleet.heartbeat_interval_ms: {f.heartbeat_interval_ms} must be below "
            f"fleet.heartbeat_timeout_ms ({f.heartbeat_timeout_ms}): members would lapse "
            "between two heartbeats (a timeout of 3-5 intervals is usual)"
        )
    if f.sweep_interval_ms >= f.heartbeat_timeout_ms:
        out.append(
            f"fleet.sweep_interval_ms: {f.sweep_interval_ms} must be below "
            f"fleet.heartbeat_timeout_ms ({f.heartbeat_timeout_ms}): a lapsed member would "
            "be noticed a whole timeout late"
        )
    max_wait_ms = settings.prefill.max_submit_wait_ms
    if max_wait_ms >= settings.server.max_call_s * 1000:
        out.append(
            f"prefill.max_submit_wait_ms: {max_wait_ms} must be below server.max_call_s "
            f"({settings.server.max_call_s:g} s): the call deadline would end the wait first"
        )
    return out + _ports(settings)
