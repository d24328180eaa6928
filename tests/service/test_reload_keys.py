"""Issue 22 row 11 (keys outside prefill.* and gateway.*): every key classed reloadable is
applied by a reload reported ``applied``, seen where the running code reads it; a few are
also observed through a real gRPC channel."""

from __future__ import annotations

import typing
from typing import Any

import grpc
import pytest
from pydantic import BaseModel

from fulcrum.client import FulcrumClient
from fulcrum.config import Settings, _section_type, is_restart_only, with_overrides
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server
from fulcrum.v1 import fleet_pb2
from tests.service.test_eplb import register_request

#: Keys a reload test here cannot exercise, and where they are covered instead.
ELSEWHERE = {
    "security.tls.cert_file": "tests/service/test_security.py (rotation under TLS)",
    "security.tls.key_file": "tests/service/test_security.py (rotation under TLS)",
    "security.auth.tokens_file": "tests/service/test_security.py (needs a tokens file)",
    "security.auth.identities": "tests/service/test_security.py (needs client certificates)",
    "security.auth.enabled": "tests/service/test_security.py (authorisation needs TLS)",
    "tenants.classes": "tests/core/test_tenants.py (a mapping of sections, not one value)",
}
#: Values of keys whose type does not list them (names from a registry).
EXPLICIT = {"decode.policy": ["least_kv"], "vision.policy": ["least_patches"],
            "eplb.algorithm": ["reference"],
            # keys whose default is null or empty (issue 23)
            "tenants.default.compute_cap": [0.5], "tenants.default.ttft_slo_ms": [1000],
            "tenants.default.decode_max_concurrency": [4],
            "tenants.default.decode_max_kv_tokens": [4096],
            "tenants.default.vision_max_concurrency": [4],
            "tenants.sheddable_priorities": [[-1]]}


def _keys(model: type[BaseModel] = Settings, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, info in model.model_fields.items():
        sub = _section_type(info)
        if sub is not None:
            out.extend(_keys(sub, f"{prefix}{name}."))
        elif not is_restart_only(info):
            out.append((prefix + name, info))
    return out


RELOADABLE = [
    (k, info) for k, info in _keys()
    if not k.startswith(("prefill.", "gateway.")) and k not in ELSEWHERE
]


def _nested(key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cur = out
    *parents, last = key.split(".")
    for p in parents:
        cur = cur.setdefault(p, {})
    cur[last] = value
    return out


def _get(obj: Any, path: list[str]) -> Any:
    for p in path:
        obj = getattr(obj, p)
    return obj


def _candidates(info: Any, value: Any) -> list[Any]:
    args = typing.get_args(info.annotation)
    if args and all(isinstance(a, str) for a in args):
        return [a for a in args if a != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2, value - 1, 1]
    if isinstance(value, float):
        return [value + 0.5, value * 2, value / 2, 1.0]
    return []


def _changed(settings: Settings, key: str, info: Any) -> tuple[Settings, Any]:
    value = _get(settings, key.split("."))
    for cand in EXPLICIT.get(key) or _candidates(info, value):
        try:
            return with_overrides(settings, _nested(key, cand)), cand
        except Exception:
            continue
    raise AssertionError(f"{key}: no valid value other than {value!r} to reload to")


def _reader(d: Daemon, key: str) -> Any:
    """Where the running code reads ``key`` (the component's own settings)."""
    section, *rest = key.split(".")
    c = d.app.components
    if key.startswith("server.admission."):
        return _get(c["admission"].settings, rest[1:])
    holders = {
        "fleet": lambda: d.app.fleet.settings,
        "decode": lambda: c["decode"].settings,
        "vision": lambda: c["vision"]._settings,
        "eplb": lambda: c["eplb"].settings,
    }
    holder = holders.get(section, lambda: getattr(d.app.settings, section))()
    return _get(holder, rest)


@pytest.mark.parametrize(("key", "info"), RELOADABLE, ids=[k for k, _ in RELOADABLE])
async def test_every_reloadable_key_is_applied(key: str, info: Any) -> None:
    async with running_server() as d:
        new, value = _changed(d.app.settings, key, info)
        assert d.reload(new) == "applied"
        assert _reader(d, key) == value


async def test_reloaded_bounds_act_on_calls() -> None:
    async with running_server() as d, FulcrumClient(d.address) as c:
        d.reload(with_overrides(d.app.settings, {"eplb": {"max_groups": 1},
                                                 "fleet": {"max_members": 1}}))
        await c.expert.RegisterGroup(register_request("a"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.expert.RegisterGroup(register_request("b"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "eplb.max_groups" in (err.value.details() or "")
        shape = fleet_pb2.DecodeInstanceShape(
            gpus=[fleet_pb2.DecodeGpuCapacity(max_concurrency=8, max_kv_tokens=10**6)]
        )
        await c.fleet.Register(fleet_pb2.RegisterRequest(member_id="m0", decode_instance=shape))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.fleet.Register(
                fleet_pb2.RegisterRequest(member_id="m1", decode_instance=shape)
            )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
