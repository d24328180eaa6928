"""Snapshot files of the EPLB, one pair per group, written from worker threads.

Layout: ``snapshot_path`` is a directory; group ``g`` has ``<key>.map.json`` (its map in
force and layout) and ``<key>.window.npz`` (its statistics window and counters), where
``key`` is the SHA-256 of the group id (file names stay short and safe whatever the id).
Each write goes to a temporary ``.tmp`` file, is fsynced and renamed over the target, so
a reader sees the old file or the new one. At start, stale ``.tmp`` files are removed and
every group's files are read on their own (:func:`restore`): every value of a file is
checked for its type and range before it is used, and a file that cannot be read or does
not match its group (whatever its bytes: any JSON, any npz member, truncated or
bit-flipped) is renamed ``<name>.corrupt``, logged once and counted in
``fulcrum_eplb_snapshot_corrupt_total{file}``; only that group loses it.

Everything here but :class:`Writer` is plain blocking file I/O over immutable inputs
(frozen layouts, read-only arrays, copied scalars), meant to run in a worker thread (or
at start, before the loop serves); it touches no balancer state.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from fulcrum.core.eplb import GroupLayout, PlacementMap
from fulcrum.core.eplb.validate import map_problems
from fulcrum.errors import Unavailable
from fulcrum.metrics.eplb import SNAPSHOT_CORRUPT, SNAPSHOT_WRITES
from fulcrum.units import MAX_I64

__all__ = [
    "FORMAT",
    "Corrupt",
    "MapRecord",
    "RestoredGroup",
    "RestoredWindow",
    "WindowRecord",
    "Writer",
    "bucket_geometry",
    "clean_tmp",
    "convert_v1",
    "group_key",
    "map_doc",
    "move_aside",
    "parse_group",
    "read_window",
    "remove_group",
    "restore",
    "write_map",
    "write_window",
]

log = structlog.get_logger(__name__)

FORMAT = 2
MAP_SUFFIX = ".map.json"
WINDOW_SUFFIX = ".window.npz"

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def group_key(group_id: str) -> str:
    """File name stem of a group."""
    return hashlib.sha256(group_id.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class MapRecord:
    """Immutable input of a map file (built on the loop, serialised in a thread)."""

    group_id: str
    layout: GroupLayout
    version: int
    algorithm: str
    predicted_moe_lb: float
    predicted_before: float
    phy2log: I64  # read-only (L, P)


@dataclass(frozen=True, slots=True)
class WindowRecord:
    """Immutable input of a window file: bucket arrays are never mutated after creation."""

    group_id: str
    layout: GroupLayout
    version: int
    bucket_steps: int
    buckets: tuple[tuple[int, int, F64], ...]  # (bucket index, steps, loads (L, E))
    last_step_end: int
    steps_since_rebalance: int
    observed: F64 | None


def layout_doc(lay: GroupLayout) -> dict[str, Any]:
    """JSON form of a layout."""
    return {
        "role": lay.role,
        "ep_size": lay.ep_size,
        "gpus_per_node": lay.gpus_per_node,
        "n_layers": lay.n_layers,
        "n_logical": lay.n_logical,
        "n_groups": lay.n_groups,
        "redundant_per_gpu": lay.redundant_per_gpu,
        "expert_bytes": lay.expert_bytes,
        "window_steps": lay.window_steps,
        "period_steps": lay.period_steps,
    }


def map_doc(rec: MapRecord) -> dict[str, Any]:
    """JSON form of a map file."""
    return {
        "format": FORMAT,
        "group_id": rec.group_id,
        "layout": layout_doc(rec.layout),
        "version": rec.version,
        "algorithm": rec.algorithm,
        "predicted_moe_lb": rec.predicted_moe_lb,
        "predicted_before": rec.predicted_before,
        "shape": list(rec.phy2log.shape),
        "phy2log": base64.b64encode(rec.phy2log.astype("<i4").tobytes()).decode(),
    }


def _atomic_write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".eplb-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_map(directory: Path, rec: MapRecord) -> None:
    """Serialise and write a group's map file atomically (blocking; worker thread)."""
    data = json.dumps(map_doc(rec), separators=(",", ":")).encode()
    _atomic_write(directory / (group_key(rec.group_id) + MAP_SUFFIX), data)


def write_window(directory: Path, rec: WindowRecord) -> None:
    """Serialise and write a group's window file atomically (blocking; worker thread)."""
    arrays: dict[str, npt.NDArray[Any]] = {}
    for k, _, a in rec.buckets:
        arrays[f"b{k}"] = a
    if rec.observed is not None:
        arrays["observed"] = rec.observed
    meta = {
        "format": FORMAT,
        "group_id": rec.group_id,
        "layout": layout_doc(rec.layout),
        "version": rec.version,
        "bucket_steps": rec.bucket_steps,
        "buckets": [k for k, _, _ in rec.buckets],
        "bucket_step_counts": [n for _, n, _ in rec.buckets],
        "last_step_end": rec.last_step_end,
        "steps_since_rebalance": rec.steps_since_rebalance,
    }
    arrays["meta"] = np.array(json.dumps(meta))
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    _atomic_write(directory / (group_key(rec.group_id) + WINDOW_SUFFIX), buf.getvalue())


def remove_group(directory: Path, group_id: str) -> None:
    """Delete a group's files (blocking; missing files are fine)."""
    for suffix in (MAP_SUFFIX, WINDOW_SUFFIX):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / (group_key(group_id) + suffix))


def clean_tmp(directory: Path) -> int:
    """Remove temporary files a crash left behind; returns how many."""
    n = 0
    if not directory.is_dir():
        return 0
    for p in directory.glob(".eplb-*.tmp"):
        with contextlib.suppress(OSError):
            p.unlink()
            n += 1
    return n


def move_aside(path: Path, suffix: str = ".corrupt") -> Path:
    """Rename ``path`` to ``path + suffix`` (best effort); returns the new name."""
    aside = path.with_name(path.name + suffix)
    with contextlib.suppress(OSError):
        os.replace(path, aside)
    return aside


def convert_v1(path: Path) -> int:
    """Turn a format-1 single-file snapshot at ``path`` into this directory layout: the
    file is kept as ``<path>.v1`` and every group gets its map file. Returns the number
    of groups.

    Raises:
        OSError, ValueError, KeyError, TypeError: not a readable format-1 file.
    """
    doc = json.loads(path.read_bytes())
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise ValueError(
            f"unknown snapshot format {doc.get('format') if isinstance(doc, dict) else None!r}"
        )
    groups = [dict(gd, format=FORMAT) for gd in doc["groups"]]
    files = [
        (group_key(str(gd["group_id"])) + MAP_SUFFIX, json.dumps(gd, separators=(",", ":")))
        for gd in groups
    ]  # everything computed before the file is renamed: a failure leaves it in place
    old = path.with_name(path.name + ".v1")
    os.replace(path, old)
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files:
        _atomic_write(path / name, data.encode())
    return len(groups)


# -- reading at start: every value of every file is checked before it is used -----------------


class Corrupt(ValueError):
    """A snapshot file that cannot be restored (the message says why)."""


@dataclass(frozen=True, slots=True)
class RestoredWindow:
    """A group's window as read from its file; arrays (L, E) float64, read-only."""

    buckets: dict[int, F64]
    step_counts: dict[int, int]
    last_step_end: int
    steps_since_rebalance: int
    observed: F64 | None  # None unless written under the version in force


@dataclass(frozen=True, slots=True)
class RestoredGroup:
    """A group as read from its map file (and its window file, when it had a usable one)."""

    group_id: str
    layout: GroupLayout
    version: int
    algorithm: str
    predicted_moe_lb: float
    predicted_before: float
    placement: PlacementMap
    window: RestoredWindow | None


def bucket_geometry(window_steps: int, window_buckets: int) -> tuple[int, int]:
    """(steps per bucket, buckets kept) of a window of ``window_steps`` steps."""
    bucket = max(1, math.ceil(window_steps / window_buckets))
    return bucket, math.ceil(window_steps / bucket)


def _int(doc: dict[str, Any], key: str, lo: int = 0) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_I64:
        raise Corrupt(f"{key}: must be an integer in [{lo}, 2^63-1], got {_short(v)}")
    return v


def _real(doc: dict[str, Any], key: str) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise Corrupt(f"{key}: must be a finite number, got {_short(v)}")
    return float(v)


def _str(doc: dict[str, Any], key: str) -> str:
    v = doc.get(key)
    if not isinstance(v, str):
        raise Corrupt(f"{key}: must be a string, got {_short(v)}")
    return v


def _ints(doc: dict[str, Any], key: str) -> list[int]:
    v = doc.get(key)
    if not isinstance(v, list):
        raise Corrupt(f"{key}: must be a list of integers, got {_short(v)}")
    return [_int({key: x}, key) for x in v]


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return text if len(text) <= 40 else text[:40] + "..."


def _doc(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise Corrupt(f"{what}: must be a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise Corrupt(f"{what}: unknown format {_short(data.get('format'))}")
    return data


def parse_layout(data: Any) -> GroupLayout:
    """A layout from its JSON form (:func:`layout_doc`); Corrupt or ValueError if malformed."""
    if not isinstance(data, dict) or set(data) != set(_LAYOUT_KEYS):
        raise Corrupt(f"layout: must be an object with the keys {', '.join(_LAYOUT_KEYS)}")
    role = _str(data, "role")
    if role not in ("prefill", "decode"):
        raise Corrupt(f"layout.role: must be 'prefill' or 'decode', got {_short(role)}")
    ints = {k: _int(data, k) for k in _LAYOUT_KEYS if k != "role"}
    return GroupLayout(role=role, **ints)  # type: ignore[arg-type]  # checked just above


_LAYOUT_KEYS = tuple(f.name for f in fields(GroupLayout))


def decode_map(doc: dict[str, Any]) -> tuple[GroupLayout, I64]:
    """Layout and phy2log (L, P) of a map file.

    Raises:
        ValueError (Corrupt among them): malformed.
    """
    layout = parse_layout(doc.get("layout"))
    shape = tuple(_ints(doc, "shape"))
    if shape != (layout.n_layers, layout.n_physical):
        raise Corrupt(f"shape: {list(shape)} does not match the layout")
    raw = np.frombuffer(base64.b64decode(_str(doc, "phy2log"), validate=True), dtype="<i4")
    if raw.size != layout.n_layers * layout.n_physical:
        raise Corrupt("phy2log: data does not match its shape")
    return layout, raw.reshape(shape).astype(np.int64)


def parse_group(doc: dict[str, Any]) -> RestoredGroup:
    """A group from its map file's JSON (its window not read yet).

    Raises:
        ValueError (Corrupt among them): a value has the wrong type, range or shape, or
            the map breaks a rule.
    """
    layout, phy2log = decode_map(doc)
    placement = PlacementMap.from_phy2log(phy2log, layout.ep_size, layout.n_logical)
    problems = map_problems(layout, placement, no_colocation=False, node_limited=False)
    if problems:
        raise Corrupt(f"phy2log: {problems[0]}")
    return RestoredGroup(
        group_id=_str(doc, "group_id"),
        layout=layout,
        version=_int(doc, "version", lo=1),
        algorithm=_str(doc, "algorithm"),
        predicted_moe_lb=_real(doc, "predicted_moe_lb"),
        predicted_before=_real(doc, "predicted_before"),
        placement=placement,
        window=None,
    )


def _array(npz: Any, name: str, shape: tuple[int, int]) -> F64:
    """Member ``name`` of an open npz, checked to be a real (L, E) array before it is
    read (its size in the archive is bounded by the shape), finite and >= 0."""
    info = npz.zip.getinfo(name + ".npy")
    if info.file_size > 8 * shape[0] * shape[1] + 4096:
        raise Corrupt(f"{name}: {info.file_size} bytes, more than a {list(shape)} array")
    a = npz[name]
    if a.dtype.kind not in "fiu" or a.shape != shape:
        raise Corrupt(f"{name}: must be a real {list(shape)} array, got {a.dtype} {list(a.shape)}")
    out: F64 = np.array(a, dtype=np.float64)
    if not np.isfinite(out).all() or (out < 0).any():
        raise Corrupt(f"{name}: values must be finite and >= 0")
    out.setflags(write=False)
    return out


def _meta(npz: Any) -> dict[str, Any]:
    if "meta" not in npz.files or npz.zip.getinfo("meta.npy").file_size > 1 << 20:
        raise Corrupt("meta: missing or over 1 MiB")
    raw = npz["meta"]
    if raw.dtype.kind != "U" or raw.shape != ():
        raise Corrupt(f"meta: must be a string, got {raw.dtype} {list(raw.shape)}")
    return _doc(json.loads(str(raw)), "window file")


def _window_fits(meta: dict[str, Any], group: RestoredGroup, bucket_steps: int) -> bool:
    return (
        _str(meta, "group_id") == group.group_id
        and parse_layout(meta.get("layout")) == group.layout
        and _int(meta, "bucket_steps") == bucket_steps
    )


def read_window(path: Path, group: RestoredGroup, window_buckets: int) -> RestoredWindow | None:
    """The window file of ``group`` at ``path``: None when there is none or it was written
    for another shape (logged).

    Raises:
        Exception: the file is unreadable or malformed (any error of numpy, zipfile or
            json on hostile bytes, and Corrupt for a value out of its rules).
    """
    if not path.exists():
        return None
    bucket_steps, n_buckets = bucket_geometry(group.layout.window_steps, window_buckets)
    shape = (group.layout.n_layers, group.layout.n_logical)
    with np.load(path, allow_pickle=False) as npz:
        meta = _meta(npz)
        if not _window_fits(meta, group, bucket_steps):
            log.info("eplb_window_ignored", group=group.group_id, reason="another shape")
            return None
        keys, counts = _ints(meta, "buckets"), _ints(meta, "bucket_step_counts")
        if len(keys) != len(counts) or len(set(keys)) != len(keys) or len(keys) > n_buckets:
            raise Corrupt("buckets: the bucket lists do not match")
        buckets = {k: _array(npz, f"b{k}", shape) for k in keys}
        observed = None
        if _int(meta, "version") == group.version and "observed" in npz.files:
            observed = _array(npz, "observed", shape)
        return RestoredWindow(
            buckets=buckets,
            step_counts=dict(zip(keys, counts, strict=True)),
            last_step_end=_int(meta, "last_step_end"),
            steps_since_rebalance=_int(meta, "steps_since_rebalance"),
            observed=observed,
        )


def window_path(directory: Path, group_id: str) -> Path:
    """Where a group's window file lives."""
    return directory / (group_key(group_id) + WINDOW_SUFFIX)


def _corrupt(kind: str, path: Path, err: BaseException, **extra: Any) -> None:
    """Move a bad file aside, log it once and count it."""
    aside = move_aside(path)
    SNAPSHOT_CORRUPT.labels(kind).inc()
    log.error(
        f"eplb_snapshot_{kind}_unreadable",
        path=str(path),
        moved_to=str(aside),
        error=f"{type(err).__name__}: {err}"[:500],
        **extra,
    )


def _read_group(path: Path, seen: set[str]) -> RestoredGroup | None:
    try:
        group = parse_group(_doc(json.loads(path.read_bytes()), "map file"))
        if path.name != group_key(group.group_id) + MAP_SUFFIX:
            raise Corrupt("file name does not match its group id")
        if group.group_id in seen:
            raise Corrupt(f"group {group.group_id!r} appears twice")
    # Hostile bytes reach json, base64 and numpy: whatever they raise (RecursionError,
    # OverflowError, MemoryError, ...) costs this group its file, never the daemon.
    except Exception as err:
        _corrupt("map", path, err)
        return None
    return group


def _with_window(directory: Path, group: RestoredGroup, window_buckets: int) -> RestoredGroup:
    path = window_path(directory, group.group_id)
    try:
        window = read_window(path, group, window_buckets)
    except Exception as err:  # as in _read_group: a bad window costs its window only
        _corrupt("window", path, err, group=group.group_id)
        return group
    return group if window is None else replace(group, window=window)


def _convert(path: Path) -> bool:
    """A format-1 file at ``path`` converted (True), or moved aside (False)."""
    try:
        n = convert_v1(path)
    except Exception as err:
        _corrupt("snapshot", path, err, hint="snapshot_path must be a directory or a format-1 file")
        return False
    log.info("eplb_snapshot_converted", path=str(path), groups=n)
    return True


def restore(directory: Path, *, max_groups: int, window_buckets: int) -> list[RestoredGroup]:
    """Every group readable in ``directory`` (at most ``max_groups``; the rest are moved
    aside as ``.excess``). Never raises for what a file holds: a bad file is moved aside
    as ``.corrupt``, logged once and counted in ``fulcrum_eplb_snapshot_corrupt_total``."""
    if directory.exists() and not directory.is_dir() and not _convert(directory):
        return []
    if not directory.is_dir():
        return []
    removed = clean_tmp(directory)
    if removed:
        log.info("eplb_snapshot_tmp_removed", path=str(directory), files=removed)
    out: list[RestoredGroup] = []
    seen: set[str] = set()
    for path in sorted(directory.glob("*" + MAP_SUFFIX)):
        group = _read_group(path, seen)
        if group is None:
            continue
        if len(out) >= max_groups:
            aside = move_aside(path, ".excess")
            log.error("eplb_snapshot_group_over_limit", group=group.group_id,
                      moved_to=str(aside), limit=max_groups)
            continue
        seen.add(group.group_id)
        out.append(_with_window(directory, group, window_buckets))
    log.info("eplb_snapshot_restored", path=str(directory), groups=len(out))
    return out


# -- the writer: one at a time, in worker threads ----------------------------------------------


class Writer:
    """Serialised writes into one snapshot directory (``None``: no snapshot, every write
    is a no-op). Held by the state on the event loop; the I/O runs in worker threads."""

    def __init__(self, directory: Callable[[], Path | None]) -> None:
        self._directory = directory
        self._lock: asyncio.Lock | None = None

    @property
    def directory(self) -> Path | None:
        """The directory now (read from the settings on every write)."""
        return self._directory()

    def lock(self) -> asyncio.Lock:
        """The lock every write of the directory holds (callers re-check after it)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def write(self, fn: Callable[[Path, Any], None], arg: Any) -> None:
        """Run ``fn(directory, arg)`` in a worker thread.

        Raises:
            Unavailable: the write failed (logged and counted; nothing was replaced).
        """
        directory = self.directory
        if directory is None:
            return
        try:
            await asyncio.to_thread(fn, directory, arg)
        except OSError as err:
            SNAPSHOT_WRITES.labels("failed").inc()
            log.error("eplb_snapshot_failed", path=str(directory), error=str(err))
            raise Unavailable(
                f"eplb: cannot write the snapshot in {directory} ({err.strerror})"
            ) from None
        SNAPSHOT_WRITES.labels("ok").inc()

    def write_now(self, rec: WindowRecord) -> bool:
        """Write a window file blocking the caller (drain only); False if it failed."""
        directory = self.directory
        if directory is None:
            return False
        try:
            write_window(directory, rec)
        except OSError as err:
            SNAPSHOT_WRITES.labels("failed").inc()
            log.error("eplb_window_snapshot_failed", group=rec.group_id, error=str(err))
            return False
        SNAPSHOT_WRITES.labels("ok").inc()
        return True
