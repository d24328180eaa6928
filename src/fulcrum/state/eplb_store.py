"""Snapshot files of the EPLB, one pair per group, written from worker threads.

Layout: ``snapshot_path`` is a directory; group ``g`` has ``<key>.map.json`` (its map in
force and layout) and ``<key>.window.npz`` (its statistics window and counters), where
``key`` is the SHA-256 of the group id (file names stay short and safe whatever the id).
Each write goes to a temporary ``.tmp`` file, is fsynced and renamed over the target, so
a reader sees the old file or the new one. At start, stale ``.tmp`` files are removed and
every group's files are read on their own: a file that cannot be read or does not match
its group is renamed ``<name>.corrupt`` and only that group loses it.

Everything here is plain blocking file I/O over immutable inputs (frozen layouts,
read-only arrays, copied scalars), meant to run in a worker thread; it touches no
balancer state.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fulcrum.core.eplb import GroupLayout

__all__ = [
    "FORMAT",
    "MapRecord",
    "WindowRecord",
    "clean_tmp",
    "convert_v1",
    "group_key",
    "map_doc",
    "move_aside",
    "read_map_files",
    "read_window",
    "remove_group",
    "write_map",
    "write_window",
]

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


def read_map_files(directory: Path) -> list[tuple[Path, dict[str, Any] | Exception]]:
    """Every map file, sorted by name, with its parsed JSON or the error reading it."""
    out: list[tuple[Path, dict[str, Any] | Exception]] = []
    for p in sorted(directory.glob("*" + MAP_SUFFIX)):
        try:
            doc = json.loads(p.read_bytes())
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"unknown map file format {doc.get('format')!r}")
            out.append((p, doc))
        except (OSError, ValueError) as err:
            out.append((p, err))
    return out


def read_window(directory: Path, group_id: str) -> tuple[dict[str, Any], dict[str, F64]] | None:
    """A group's window file: (meta, arrays), or None if there is none.

    Raises:
        OSError, ValueError, KeyError: unreadable or malformed.
    """
    path = directory / (group_key(group_id) + WINDOW_SUFFIX)
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as npz:
        meta = json.loads(str(npz["meta"]))
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError("unknown window file format")
        arrays = {k: np.array(npz[k], dtype=np.float64) for k in npz.files if k != "meta"}
    return meta, arrays


def window_path(directory: Path, group_id: str) -> Path:
    """Where a group's window file lives."""
    return directory / (group_key(group_id) + WINDOW_SUFFIX)


def decode_map(doc: dict[str, Any]) -> tuple[GroupLayout, I64]:
    """Layout and phy2log (L, P) of a map file.

    Raises:
        ValueError, KeyError, TypeError: malformed.
    """
    layout = GroupLayout(**doc["layout"])
    shape = tuple(int(x) for x in doc["shape"])
    if shape != (layout.n_layers, layout.n_physical):
        raise ValueError(f"map shape {list(shape)} does not match the layout")
    raw = np.frombuffer(base64.b64decode(doc["phy2log"]), dtype="<i4")
    if raw.size != layout.n_layers * layout.n_physical:
        raise ValueError("map data does not match its shape")
    return layout, raw.reshape(shape).astype(np.int64)


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
    old = path.with_name(path.name + ".v1")
    os.replace(path, old)
    path.mkdir(parents=True, exist_ok=True)
    for gd in groups:
        data = json.dumps(gd, separators=(",", ":")).encode()
        _atomic_write(path / (group_key(str(gd["group_id"])) + MAP_SUFFIX), data)
    return len(groups)
