"""Issue 22 row 5: a snapshot file can never stop the daemon.

Every variant the attack used (a map file holding ``null``, ``[]``, ``"x"`` or ``7``, a map
nested 100,000 deep, ``"version": 1e400``, an empty, truncated, "PK"+junk or bit-flipped
window file) goes through a real daemon start and a real gRPC call; hypothesis then fuzzes
the reader over arbitrary bytes and over structurally valid JSON with wrong types.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fulcrum.client import FulcrumClient
from fulcrum.metrics import REGISTRY
from fulcrum.state import eplb_store as store
from fulcrum.state.eplb_store import group_key
from fulcrum.testing import running_server
from fulcrum.v1 import diagnostics_pb2
from fulcrum.v1 import expert_pb2 as pb
from tests.service.test_eplb import register_request, report, skewed, state


def corrupt_count(kind: str) -> float:
    return REGISTRY.get_sample_value("fulcrum_eplb_snapshot_corrupt_total", {"file": kind}) or 0.0


async def _seed(snap: Path) -> None:
    """Groups a and b with maps and windows on disk."""
    overrides = {"eplb": {"snapshot_path": str(snap), "window_snapshot_interval_s": 0}}
    async with running_server(overrides) as d, FulcrumClient(d.address) as c:
        for gid in ("a", "b"):
            await c.expert.RegisterGroup(register_request(gid))
            await c.expert.ReportLoad(report(1, 0, 10, skewed(1), gid=gid))


def _map(snap: Path, gid: str = "a") -> Path:
    return snap / (group_key(gid) + ".map.json")


def _window(snap: Path, gid: str = "a") -> Path:
    return snap / (group_key(gid) + ".window.npz")


def _with_version(value: str) -> Callable[[Path], None]:
    def edit(snap: Path) -> None:
        text = _map(snap).read_text()
        doc = json.loads(text)
        old = f'"version":{doc["version"]}'
        assert old in text
        _map(snap).write_text(text.replace(old, f'"version":{value}'))

    return edit


def _flip(snap: Path) -> None:
    data = bytearray(_window(snap).read_bytes())
    for i in range(64, len(data), 97):
        data[i] ^= 0x5A
    _window(snap).write_bytes(bytes(data))


MAP_VARIANTS: dict[str, Callable[[Path], None]] = {
    "null": lambda s: _map(s).write_text("null"),
    "list": lambda s: _map(s).write_text("[]"),
    "string": lambda s: _map(s).write_text('"x"'),
    "number": lambda s: _map(s).write_text("7"),
    "nested": lambda s: _map(s).write_text("[" * 100_000),
    "version_1e400": _with_version("1e400"),
    "version_string": _with_version('"3"'),
    "version_true": _with_version("true"),
    "layout_list": lambda s: _map(s).write_text(
        _map(s).read_text().replace('"layout":{', '"layout":[{')
        .replace('},"version"', '}],"version"')
    ),
}
WINDOW_VARIANTS: dict[str, Callable[[Path], None]] = {
    "empty": lambda s: _window(s).write_bytes(b""),
    "truncated": lambda s: _window(s).write_bytes(_window(s).read_bytes()[:300]),
    "pk_junk": lambda s: _window(s).write_bytes(b"PK" + os.urandom(500)),
    "bit_flipped": _flip,
}


@pytest.mark.parametrize("variant", sorted(MAP_VARIANTS))
async def test_a_corrupt_map_file_costs_its_group_only(tmp_path: Path, variant: str) -> None:
    snap = tmp_path / "maps"
    await _seed(snap)
    MAP_VARIANTS[variant](snap)
    before = corrupt_count("map")
    async with running_server({"eplb": {"snapshot_path": str(snap)}}) as d, FulcrumClient(
        d.address
    ) as c:
        assert sorted(state(d).groups) == ["b"]
        got = await c.expert.GetMap(pb.GetMapRequest(group_id="b"))
        assert got.map.version == 1
        again = await c.expert.RegisterGroup(register_request("a"))  # a starts afresh
        assert again.created
    assert corrupt_count("map") == before + 1
    assert (snap / (group_key("a") + ".map.json.corrupt")).exists()


@pytest.mark.parametrize("variant", sorted(WINDOW_VARIANTS))
async def test_a_corrupt_window_file_costs_its_window_only(tmp_path: Path, variant: str) -> None:
    snap = tmp_path / "maps"
    await _seed(snap)
    WINDOW_VARIANTS[variant](snap)
    before = corrupt_count("window")
    async with running_server({"eplb": {"snapshot_path": str(snap)}}) as d:
        groups = state(d).groups
        assert sorted(groups) == ["a", "b"]
        assert groups["a"].window_steps == 0 and groups["b"].window_steps == 10
    assert corrupt_count("window") == before + 1
    assert (snap / (group_key("a") + ".window.npz.corrupt")).exists()


# -- hypothesis: the reader itself, over any bytes and any wrongly typed values ----------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12,
)


def _restore(snap: Path) -> list[store.RestoredGroup]:
    return store.restore(snap, max_groups=8, window_buckets=16)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    import asyncio

    snap = tmp_path_factory.mktemp("seed") / "maps"
    asyncio.run(_seed(snap))
    return {"map": _map(snap).read_bytes(), "window": _window(snap).read_bytes()}


def _fresh(tmp: Path, seeded: dict[str, bytes], **over: bytes) -> Path:
    snap = tmp / f"s{os.urandom(6).hex()}"
    snap.mkdir()
    _map(snap).write_bytes(over.get("map", seeded["map"]))
    _window(snap).write_bytes(over.get("window", seeded["window"]))
    return snap


def _outcome(snap: Path) -> None:
    got = _restore(snap)  # never raises
    names = {p.name for p in snap.iterdir()}
    if got:
        assert [g.group_id for g in got] == ["a"]
        assert _map(snap).name in names
    else:
        assert _map(snap).name + ".corrupt" in names


FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.binary(max_size=2048))
def test_any_map_bytes(tmp_path: Path, seeded: dict[str, bytes], data: bytes) -> None:
    _outcome(_fresh(tmp_path, seeded, map=data))


@FUZZ
@given(data=st.binary(max_size=2048), cut=st.integers(0, 4096), flip=st.integers(0, 4096))
def test_any_window_bytes(
    tmp_path: Path, seeded: dict[str, bytes], data: bytes, cut: int, flip: int
) -> None:
    real = bytearray(seeded["window"][: cut or None])
    if real:
        real[flip % len(real)] ^= 0xFF
    for raw in (data, bytes(real), b"PK\x03\x04" + data):
        snap = _fresh(tmp_path, seeded, window=raw)
        got = _restore(snap)
        assert [g.group_id for g in got] == ["a"]  # a bad window never costs the map


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.extend(_paths(v, (*prefix, k)))
    return out


def _put(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    return {**doc, path[0]: _put(doc[path[0]], path[1:], value)}


@FUZZ
@given(pick=st.integers(0, 10_000), value=JSON)
def test_valid_json_with_a_wrong_value(
    tmp_path: Path, seeded: dict[str, bytes], pick: int, value: Any
) -> None:
    doc = json.loads(seeded["map"])
    paths = _paths(doc)
    bad = _put(doc, paths[pick % len(paths)], value)
    _outcome(_fresh(tmp_path, seeded, map=json.dumps(bad).encode()))


@FUZZ
@given(key=st.sampled_from(["buckets", "bucket_step_counts", "last_step_end", "version",
                            "steps_since_rebalance", "layout", "group_id", "format"]),
       value=JSON)
def test_window_meta_with_a_wrong_value(
    tmp_path: Path, seeded: dict[str, bytes], key: str, value: Any
) -> None:
    import io

    with np.load(io.BytesIO(seeded["window"])) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(str(arrays["meta"]))
    meta[key] = value
    arrays["meta"] = np.array(json.dumps(meta))
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    got = _restore(_fresh(tmp_path, seeded, window=buf.getvalue()))
    assert [g.group_id for g in got] == ["a"]


@pytest.mark.parametrize("shape", [(3,), (6, 33), (0, 32), (6, 32, 1)])
@pytest.mark.parametrize("dtype", ["f8", "c16", "U4", "bool", "i1"])
def test_window_arrays_of_any_shape_and_dtype(
    tmp_path: Path, seeded: dict[str, bytes], shape: tuple[int, ...], dtype: str
) -> None:
    import io

    with np.load(io.BytesIO(seeded["window"])) as npz:
        arrays = {k: npz[k] for k in npz.files}
    key = next(k for k in arrays if k.startswith("b"))
    arrays[key] = np.zeros(shape, dtype=dtype)
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    snap = _fresh(tmp_path, seeded, window=buf.getvalue())
    got = _restore(snap)
    assert [g.group_id for g in got] == ["a"] and got[0].window is None
    assert (_window(snap).name + ".corrupt") in {p.name for p in snap.iterdir()}


# -- a real process ----------------------------------------------------------------------------


def test_the_daemon_starts_and_serves_with_corrupt_files(tmp_path: Path) -> None:
    import asyncio

    from tests.service.test_daemon_process import Proc, metric_value

    snap = tmp_path / "maps"
    asyncio.run(_seed(snap))
    _map(snap, "a").write_text("[" * 100_000)
    _map(snap, "b").write_text('{"format": 2, "version": 1e400}')
    cfg = tmp_path / "fulcrum.yaml"
    cfg.write_text(yaml.safe_dump({
        "server": {"port": 0, "grace_period_s": 5}, "metrics": {"port": 0},
        "logging": {"format": "json"}, "eplb": {"snapshot_path": str(snap)},
    }))
    proc = Proc(cfg)
    try:
        async def ping() -> bytes:
            async with FulcrumClient(proc.address) as c:
                r = await c.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"up"))
                return bytes(r.payload)

        assert asyncio.run(ping()) == b"up"
        assert metric_value(proc.metrics_port, "fulcrum_eplb_snapshot_corrupt_total",
                            {"file": "map"}) == 2
        proc.p.send_signal(signal.SIGTERM)
        lines = proc.rest(timeout=20)
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
            proc.p.wait()
    assert proc.p.returncode == 0
    bad = [e for e in lines if e.get("event") == "eplb_snapshot_map_unreadable"]
    assert len(bad) == 2  # each file logged once
