"""In-memory tables of the expert-parallel load balancer (EPLB).

Per EP group: its layout, the map in force and the last few versions, the statistics
window, the load observed under the map in force, and the rebalance period counter.

- Window: the last N steps of reported load, kept as ``window_buckets`` buckets of
  ``ceil(N / buckets)`` steps; a report [b, e) goes whole into the bucket of step e - 1, and
  buckets older than N steps behind the newest are dropped. Memory per group:
  (buckets + 2) x layers x experts x 8 bytes.
- Observed moe_lb: of the map in force, over every report accepted since it took effect
  (reports must name the version in force, so all of them ran under that map).
- Period: every M reported steps (the sum of step_end - step_begin of accepted reports)
  the service recomputes the map (:meth:`EplbState.prepare` -> core ``rebalance`` off the
  event loop -> :meth:`EplbState.commit`); an unchanged map makes no new version.
- Snapshot: every change of a map in force (registration, new version, deregistration) is
  first written to ``snapshot_path`` (temporary file, fsync, atomic rename) and only then
  applied in memory, so a failed write changes nothing. At start the file is read back:
  a restarted daemon serves the same versions and so never triggers a reshuffle.
- Window snapshot: the statistics windows, the period counters, the end of the last
  reported step range and the load observed under the map in force are written to
  ``<snapshot_path>.window`` (numpy ``.npz``, temporary file, fsync, atomic rename) by
  :meth:`EplbState.save_window`, which the service calls every
  ``window_snapshot_interval_s`` when something changed and at drain. At start they are
  read back for the groups of the map snapshot with the same layout and bucket size, so
  the rebalance period does not restart from zero (the load observed under the map in
  force only if it is still the version in force). Reports after the last write are lost
  on a crash, not on a drain. An unreadable file is moved aside as ``.corrupt``.

Every mutating call validates all its inputs first and raises a ``fulcrum.errors`` error
before changing anything.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import tempfile
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from fulcrum.config.eplb import EplbSettings
from fulcrum.core.eplb import (
    REGISTRY,
    GroupLayout,
    Migration,
    PlacementMap,
    RebalanceParams,
    RebalanceResult,
    Role,
    identity_map,
    make_layout,
)
from fulcrum.core.eplb.metrics import gpu_loads, moe_lb_of_gpu_loads
from fulcrum.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from fulcrum.metrics import eplb as m

__all__ = ["EplbState", "Group", "GroupSpec", "MapVersion", "RebalanceJob", "ReportOutcome"]

log = structlog.get_logger(__name__)

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

SNAPSHOT_FORMAT = 1
INITIAL = "initial"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A registration request, before defaults (None = role default)."""

    group_id: str
    role: Role
    ep_size: int
    gpus_per_node: int
    n_layers: int
    n_logical: int
    n_groups: int
    redundant_per_gpu: int | None
    window_steps: int | None
    period_steps: int | None
    expert_bytes: int


@dataclass(frozen=True, slots=True)
class MapVersion:
    """One version of a group's map.

    Attributes:
        version: 1, 2, ...
        placement: the map (phy2log shape (layers, physical)).
        algorithm: algorithm that computed it ("initial" for the registration map).
        predicted_moe_lb: moe_lb of this map on the window it was computed from (1.0 for
            the initial map).
        predicted_before: moe_lb of the previous map on the same window (1.0 if none).
        migration: slots changed / copies received / bytes moved against the previous one.
    """

    version: int
    placement: PlacementMap
    algorithm: str
    predicted_moe_lb: float
    predicted_before: float
    migration: Migration
    #: Per-version memo of the service layer (e.g. the encoded protobuf message).
    memo: dict[str, object] = field(default_factory=dict, compare=False, repr=False)


@dataclass
class Group:
    """Mutable state of one EP group (owned by :class:`EplbState`)."""

    group_id: str
    layout: GroupLayout
    history: deque[MapVersion]
    bucket_steps: int
    window_buckets: int
    buckets: dict[int, F64] = field(default_factory=dict)
    bucket_step_counts: dict[int, int] = field(default_factory=dict)
    window_sum: F64 | None = None
    last_step_end: int = 0
    steps_since_rebalance: int = 0
    observed_sum: F64 | None = None
    observed_per_layer: F64 | None = None
    observed_moe_lb: float = 1.0
    rebalances: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    watchers: int = 0
    deleted: bool = False
    busy: bool = False

    @property
    def current(self) -> MapVersion:
        """The version in force."""
        return self.history[-1]

    @property
    def window_steps(self) -> int:
        """Steps covered by the reports in the window."""
        return sum(self.bucket_step_counts.values())

    @property
    def steps_to_rebalance(self) -> int:
        """Reported steps until the next periodic rebalance."""
        return max(0, self.layout.period_steps - self.steps_since_rebalance)

    def notify(self) -> None:
        """Wake every watcher (a new version, or the group was deleted)."""
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    """Result of an accepted report."""

    map_version: int
    observed_moe_lb: float
    due: bool
    window_steps: int
    steps_to_rebalance: int


@dataclass(frozen=True, slots=True)
class RebalanceJob:
    """Inputs of one rebalance, taken from the state (the loads are a copy)."""

    group_id: str
    layout: GroupLayout
    loads: F64
    previous: MapVersion
    algorithm: str
    params: RebalanceParams
    trigger: str
    steps_at_prepare: int


def _layout_error(err: ValueError) -> InvalidArgument:
    text = str(err)
    fieldname, _, rule = text.partition(": ")
    names = {"n_layers": "num_layers", "n_logical": "num_experts", "n_groups": "num_expert_groups"}
    return InvalidArgument(names.get(fieldname, fieldname), rule or text)


class EplbState:
    """All EP groups of the daemon."""

    def __init__(self, settings: EplbSettings) -> None:
        self.settings = settings
        self.groups: dict[str, Group] = {}
        self._window_dirty = False
        if settings.snapshot_path:
            self._restore(Path(settings.snapshot_path))
            self._restore_window()

    # -- settings ------------------------------------------------------------------------

    def apply_settings(self, settings: EplbSettings) -> None:
        """Config reload: algorithm, migration weight and cap apply to later rebalances.
        The snapshot path and bounds are read at start only."""
        self.settings = settings.model_copy(
            update={
                "snapshot_path": self.settings.snapshot_path,
                "window_buckets": self.settings.window_buckets,
            }
        )

    @property
    def params(self) -> RebalanceParams:
        """Migration weight / cap of the configured ``stable`` algorithm."""
        cap = self.settings.max_bytes_per_rebalance
        return RebalanceParams(
            min_gain_per_gib=self.settings.min_gain_per_gib, max_bytes=cap if cap > 0 else None
        )

    # -- groups --------------------------------------------------------------------------

    def _new_group(self, group_id: str, layout: GroupLayout, first: MapVersion) -> Group:
        bucket = max(1, math.ceil(layout.window_steps / self.settings.window_buckets))
        g = Group(
            group_id=group_id,
            layout=layout,
            history=deque([first], maxlen=self.settings.history_versions),
            bucket_steps=bucket,
            window_buckets=math.ceil(layout.window_steps / bucket),
        )
        self._reset_observed(g)
        return g

    def make_layout(self, spec: GroupSpec) -> GroupLayout:
        """The resolved layout of a registration (validated against the bounds)."""
        s = self.settings
        for name, value, hi in (
            ("ep_size", spec.ep_size, s.max_ep_size),
            ("num_layers", spec.n_layers, s.max_layers),
            ("num_experts", spec.n_logical, s.max_experts),
        ):
            if not 1 <= value <= hi:
                raise InvalidArgument(name, f"must be in [1, {hi}], got {value}")
        if spec.expert_bytes <= 0:
            raise InvalidArgument("expert_bytes", "must be > 0")
        try:
            layout = make_layout(
                spec.role,
                spec.ep_size,
                spec.n_layers,
                spec.n_logical,
                gpus_per_node=spec.gpus_per_node,
                n_groups=spec.n_groups,
                expert_bytes=spec.expert_bytes,
                redundant_per_gpu=spec.redundant_per_gpu,
                window_steps=spec.window_steps,
                period_steps=spec.period_steps,
            )
        except ValueError as err:
            raise _layout_error(err) from None
        if layout.n_physical > 4 * s.max_experts:
            raise InvalidArgument("redundant_per_gpu", "too many physical slots per layer")
        return layout

    def register(self, spec: GroupSpec, initial: I64 | None) -> tuple[Group, bool]:
        """Create a group (or return the existing one with the same layout).

        Args:
            spec: the registration.
            initial: optional map in force, shape (layers, physical), or None (identity).

        Returns:
            The group and whether it was created.
        """
        layout = self.make_layout(spec)
        existing = self.groups.get(spec.group_id)
        if existing is not None:
            if existing.layout != layout:
                raise AlreadyExists(f"group_id: {spec.group_id!r} is registered with another shape")
            return existing, False
        if len(self.groups) >= self.settings.max_groups:
            raise ResourceExhausted(
                f"eplb: {self.settings.max_groups} groups registered (eplb.max_groups)",
                retry_after_ms=self.settings.retry_after_ms,
            )
        if initial is None:
            placement = identity_map(layout)
        else:
            want = (layout.n_layers, layout.n_physical)
            if initial.shape != want:
                raise InvalidArgument(
                    "initial_map.shape", f"must be {list(want)}, got {list(initial.shape)}"
                )
            if initial.size and (initial.min() < 0 or initial.max() >= layout.n_logical):
                raise InvalidArgument(
                    "initial_map", f"expert ids must lie in [0, {layout.n_logical})"
                )
            placement = PlacementMap.from_phy2log(initial, layout.ep_size, layout.n_logical)
            if (placement.replica_counts == 0).any():
                raise InvalidArgument("initial_map", "every logical expert needs a slot")
        first = MapVersion(
            version=1,
            placement=placement,
            algorithm=INITIAL,
            predicted_moe_lb=1.0,
            predicted_before=1.0,
            migration=Migration(0, 0, 0, placement.phy2log.size),
        )
        group = self._new_group(spec.group_id, layout, first)
        self._persist({**self.groups, spec.group_id: group})
        self.groups[spec.group_id] = group
        m.GROUPS.set(len(self.groups))
        m.MAP_VERSION.labels(spec.group_id).set(1)
        log.info(
            "eplb_group_registered",
            group=spec.group_id,
            role=layout.role,
            ep_size=layout.ep_size,
            physical=layout.n_physical,
            layers=layout.n_layers,
        )
        return group, True

    def deregister(self, group_id: str) -> None:
        """Forget a group (NotFound if unknown); open watches end."""
        group = self.get(group_id)
        rest = {k: v for k, v in self.groups.items() if k != group_id}
        self._persist(rest)
        del self.groups[group_id]
        group.deleted = True
        group.notify()
        m.GROUPS.set(len(self.groups))
        m.forget_group(group_id)
        log.info("eplb_group_deregistered", group=group_id)

    def get(self, group_id: str) -> Group:
        """The group, or NotFound."""
        group = self.groups.get(group_id)
        if group is None:
            raise NotFound(f"group_id: no EP group {group_id!r}")
        return group

    def get_map(self, group_id: str, version: int) -> MapVersion:
        """A kept version (0 = the one in force), or NotFound."""
        group = self.get(group_id)
        if version == 0:
            return group.current
        for mv in group.history:
            if mv.version == version:
                return mv
        raise NotFound(
            f"version: {version} of group {group_id!r} is not kept "
            f"(kept: {group.history[0].version}..{group.current.version})"
        )

    # -- statistics ----------------------------------------------------------------------

    def report(
        self, group_id: str, map_version: int, step_begin: int, step_end: int, load: F64
    ) -> ReportOutcome:
        """Add the load of steps [step_begin, step_end) to the window.

        Args:
            load: shape (layers, experts), tokens per logical expert, float64.
        """
        group = self.get(group_id)
        layout = group.layout
        if map_version == 0:
            raise InvalidArgument("map_version", "must be set (the version in force)")
        if map_version != group.current.version:
            raise FailedPrecondition(
                f"map_version: {map_version} is not the map in force "
                f"(version {group.current.version}); fetch it and report under it"
            )
        if step_end <= step_begin:
            raise InvalidArgument("step_end", f"must be > step_begin ({step_begin})")
        if step_begin < group.last_step_end:
            raise FailedPrecondition(
                f"step_begin: {step_begin} is before the end of the previous report "
                f"({group.last_step_end}); step ranges must not go backwards"
            )
        want = (layout.n_layers, layout.n_logical)
        if load.shape != want:
            raise InvalidArgument("load.shape", f"must be {list(want)}, got {list(load.shape)}")
        if not np.isfinite(load).all():
            raise InvalidArgument("load", "values must be finite")
        if (load < 0).any():
            raise InvalidArgument("load", "values must be >= 0")
        # -- valid: mutate
        idx = (step_end - 1) // group.bucket_steps
        bucket = group.buckets.get(idx)
        if bucket is None:
            group.buckets[idx] = load.copy()
            group.bucket_step_counts[idx] = 0
        else:
            bucket += load
        group.bucket_step_counts[idx] += step_end - step_begin
        oldest = idx - group.window_buckets + 1
        stale = [k for k in group.buckets if k < oldest]
        for k in stale:
            del group.buckets[k]
            del group.bucket_step_counts[k]
        if stale or group.window_sum is None:
            group.window_sum = np.sum(list(group.buckets.values()), axis=0)
        else:
            group.window_sum += load
        group.last_step_end = step_end
        self._window_dirty = True
        steps = step_end - step_begin
        group.steps_since_rebalance += steps
        assert group.observed_sum is not None
        group.observed_sum += load
        self._update_observed(group)
        m.REPORTED_STEPS.labels(group_id).inc(steps)
        m.WINDOW_STEPS.labels(group_id).set(group.window_steps)
        return ReportOutcome(
            map_version=group.current.version,
            observed_moe_lb=group.observed_moe_lb,
            due=group.steps_since_rebalance >= layout.period_steps,
            window_steps=group.window_steps,
            steps_to_rebalance=group.steps_to_rebalance,
        )

    def _reset_observed(self, group: Group) -> None:
        shape = (group.layout.n_layers, group.layout.n_logical)
        group.observed_sum = np.zeros(shape)
        group.observed_per_layer = np.ones(group.layout.n_layers)
        group.observed_moe_lb = 1.0
        m.MOE_LB_OBSERVED.labels(group.group_id).set(1.0)

    def _update_observed(self, group: Group) -> None:
        assert group.observed_sum is not None
        placement = group.current.placement
        per_layer, overall = moe_lb_of_gpu_loads(
            gpu_loads(group.observed_sum, placement.phy2log, placement.ep_size)
        )
        group.observed_per_layer = per_layer
        group.observed_moe_lb = overall
        m.MOE_LB_OBSERVED.labels(group.group_id).set(overall)

    # -- rebalance -----------------------------------------------------------------------

    def prepare(self, group_id: str, algorithm: str | None, trigger: str) -> RebalanceJob:
        """Inputs of a rebalance of ``group_id``; FailedPrecondition without statistics."""
        group = self.get(group_id)
        name = algorithm or self.settings.algorithm
        if name not in REGISTRY:
            raise InvalidArgument(
                "algorithm",
                f"unknown EPLB algorithm {name!r}; known: {', '.join(sorted(REGISTRY))}",
            )
        if group.window_sum is None or not group.buckets:
            raise FailedPrecondition(f"group_id: {group_id!r} has no load reported yet")
        return RebalanceJob(
            group_id=group_id,
            layout=group.layout,
            loads=group.window_sum.copy(),
            previous=group.current,
            algorithm=name,
            params=self.params,
            trigger=trigger,
            steps_at_prepare=group.steps_since_rebalance,
        )

    def commit(self, job: RebalanceJob, result: RebalanceResult) -> tuple[MapVersion, bool]:
        """Put the result in force if it changes the map and the group is as it was.

        Returns:
            The version in force afterwards and whether it is new.
        """
        group = self.groups.get(job.group_id)
        if group is None or group.deleted:
            raise NotFound(f"group_id: {job.group_id!r} was deregistered during the rebalance")
        if group.current.version != job.previous.version:
            self._restart_period(group, job)
            return group.current, False  # another rebalance won; this one is stale
        before = result.before.overall if result.before is not None else 1.0
        m.MOE_LB_PREDICTED.labels(job.group_id, "before").set(before)
        m.MOE_LB_PREDICTED.labels(job.group_id, "after").set(result.after.overall)
        if result.placement.same_as(job.previous.placement):
            self._restart_period(group, job)
            return group.current, False
        new = MapVersion(
            version=group.current.version + 1,
            placement=result.placement,
            algorithm=result.algorithm,
            predicted_moe_lb=result.after.overall,
            predicted_before=before,
            migration=result.migration,
        )
        # write-ahead: the snapshot holds the new version before it is in force
        self._persist(self.groups, {job.group_id: new})
        group.history.append(new)
        self._restart_period(group, job)
        group.rebalances += 1
        self._reset_observed(group)
        mig = result.migration
        m.MAP_VERSION.labels(job.group_id).set(new.version)
        m.SLOTS_CHANGED.labels(job.group_id).inc(mig.slots_changed)
        m.COPIES_RECEIVED.labels(job.group_id).inc(mig.copies_received)
        m.MOVED_BYTES.labels(job.group_id).inc(mig.bytes_moved)
        log.info(
            "eplb_map_changed",
            group=job.group_id,
            version=new.version,
            algorithm=result.algorithm,
            trigger=job.trigger,
            moe_lb_before=round(before, 5),
            moe_lb_after=round(result.after.overall, 5),
            slots_changed=mig.slots_changed,
            bytes_moved=mig.bytes_moved,
        )
        group.notify()
        return new, True

    def _restart_period(self, group: Group, job: RebalanceJob) -> None:
        """The period counts again from the rebalance's start; steps reported while it was
        computed count toward the next one. A failed rebalance leaves the period due."""
        group.steps_since_rebalance = max(0, group.steps_since_rebalance - job.steps_at_prepare)
        self._window_dirty = True

    # -- window snapshot -----------------------------------------------------------------

    @property
    def window_path(self) -> Path | None:
        """Where the statistics windows are written (None without ``snapshot_path``)."""
        path = self.settings.snapshot_path
        return Path(path + ".window") if path else None

    def save_window(self) -> bool:
        """Write every group's window and period counters if they changed since the last
        write (atomic). Returns whether a file was written; a failed write is logged and
        counted, the state is unchanged and the next call tries again."""
        target = self.window_path
        if target is None or not self._window_dirty:
            return False
        arrays: dict[str, npt.NDArray[Any]] = {}
        meta: list[dict[str, Any]] = []
        for i, g in enumerate(self.groups.values()):
            keys = sorted(g.buckets)
            for k in keys:
                arrays[f"g{i}_b{k}"] = g.buckets[k]
            if g.observed_sum is not None:
                arrays[f"g{i}_observed"] = g.observed_sum
            meta.append(
                {
                    "group_id": g.group_id,
                    "layout": _group_doc(g, g.current)["layout"],
                    "version": g.current.version,
                    "bucket_steps": g.bucket_steps,
                    "buckets": keys,
                    "bucket_step_counts": [g.bucket_step_counts[k] for k in keys],
                    "last_step_end": g.last_step_end,
                    "steps_since_rebalance": g.steps_since_rebalance,
                }
            )
        arrays["meta"] = np.array(json.dumps({"format": SNAPSHOT_FORMAT, "groups": meta}))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".eplb-window-", suffix=".tmp", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    np.savez(f, **arrays)  # type: ignore[arg-type]
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as err:
            m.SNAPSHOT_WRITES.labels("failed").inc()
            log.error("eplb_window_snapshot_failed", path=str(target), error=str(err))
            return False
        m.SNAPSHOT_WRITES.labels("ok").inc()
        self._window_dirty = False
        return True

    def _restore_window(self) -> None:
        path = self.window_path
        if path is None or not path.exists():
            return
        restored = 0
        try:
            with np.load(path, allow_pickle=False) as npz:
                doc = json.loads(str(npz["meta"]))
                if doc.get("format") != SNAPSHOT_FORMAT:
                    raise ValueError(f"unknown window snapshot format {doc.get('format')!r}")
                updates: list[tuple[Group, dict[str, Any], dict[int, F64], F64 | None]] = []
                for i, gd in enumerate(doc["groups"]):
                    group = self.groups.get(str(gd["group_id"]))
                    if (
                        group is None
                        or GroupLayout(**gd["layout"]) != group.layout
                        or int(gd["bucket_steps"]) != group.bucket_steps
                    ):
                        continue  # deregistered, re-shaped, or another bucket size
                    shape = (group.layout.n_layers, group.layout.n_logical)
                    buckets = {
                        int(k): np.array(npz[f"g{i}_b{k}"], dtype=np.float64) for k in gd["buckets"]
                    }
                    observed = None
                    if int(gd["version"]) == group.current.version and f"g{i}_observed" in npz:
                        observed = np.array(npz[f"g{i}_observed"], dtype=np.float64)
                    for a in (*buckets.values(), *([] if observed is None else [observed])):
                        if a.shape != shape or not np.isfinite(a).all() or (a < 0).any():
                            raise ValueError(f"group {gd['group_id']!r}: bad window array")
                    updates.append((group, gd, buckets, observed))
        except (OSError, ValueError, KeyError, TypeError) as err:
            aside = path.with_name(path.name + ".corrupt")
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            log.error("eplb_window_unreadable", path=str(path), moved_to=str(aside), error=str(err))
            return
        for group, gd, buckets, observed in updates:  # all validated: apply
            group.buckets = buckets
            group.bucket_step_counts = {
                int(k): int(n) for k, n in zip(gd["buckets"], gd["bucket_step_counts"], strict=True)
            }
            group.window_sum = np.sum(list(buckets.values()), axis=0) if buckets else None
            group.last_step_end = int(gd["last_step_end"])
            group.steps_since_rebalance = int(gd["steps_since_rebalance"])
            if observed is not None:
                group.observed_sum = observed
                self._update_observed(group)
            m.WINDOW_STEPS.labels(group.group_id).set(group.window_steps)
            restored += 1
        log.info("eplb_window_restored", path=str(path), groups=restored)

    # -- snapshot ------------------------------------------------------------------------

    def _persist(
        self, groups: Mapping[str, Group], current: Mapping[str, MapVersion] | None = None
    ) -> None:
        """Write ``groups`` (with ``current`` overriding their maps in force) atomically."""
        path = self.settings.snapshot_path
        if not path:
            return
        over = current or {}
        doc = {
            "format": SNAPSHOT_FORMAT,
            "groups": [_group_doc(g, over.get(k, g.current)) for k, g in groups.items()],
        }
        target = Path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".eplb-", suffix=".tmp", dir=target.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, separators=(",", ":"))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as err:
            m.SNAPSHOT_WRITES.labels("failed").inc()
            log.error("eplb_snapshot_failed", path=path, error=str(err))
            raise Unavailable(f"eplb: cannot write the snapshot {path} ({err.strerror})") from None
        m.SNAPSHOT_WRITES.labels("ok").inc()

    def _restore(self, path: Path) -> None:
        if not path.exists():
            return
        try:
            doc = json.loads(path.read_text())
            if doc.get("format") != SNAPSHOT_FORMAT:
                raise ValueError(f"unknown snapshot format {doc.get('format')!r}")
            groups = {}
            for gd in doc["groups"]:
                group = self._group_from_doc(gd)
                groups[group.group_id] = group
        except (OSError, ValueError, KeyError, TypeError) as err:
            aside = path.with_name(path.name + ".corrupt")
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            log.error(
                "eplb_snapshot_unreadable", path=str(path), moved_to=str(aside), error=str(err)
            )
            return
        self.groups = groups
        m.GROUPS.set(len(groups))
        for g in groups.values():
            m.MAP_VERSION.labels(g.group_id).set(g.current.version)
        log.info("eplb_snapshot_restored", path=str(path), groups=len(groups))

    def _group_from_doc(self, gd: dict[str, Any]) -> Group:
        lay = gd["layout"]
        layout = GroupLayout(**lay)
        shape = tuple(gd["shape"])
        raw = np.frombuffer(base64.b64decode(gd["phy2log"]), dtype="<i4")
        phy2log = raw.reshape(shape).astype(np.int64)
        if shape != (layout.n_layers, layout.n_physical):
            raise ValueError(f"group {gd['group_id']!r}: map shape {shape} does not match")
        placement = PlacementMap.from_phy2log(phy2log, layout.ep_size, layout.n_logical)
        first = MapVersion(
            version=int(gd["version"]),
            placement=placement,
            algorithm=str(gd["algorithm"]),
            predicted_moe_lb=float(gd["predicted_moe_lb"]),
            predicted_before=float(gd["predicted_before"]),
            migration=Migration(0, 0, 0, placement.phy2log.size),
        )
        return self._new_group(str(gd["group_id"]), layout, first)


def _group_doc(g: Group, cur: MapVersion) -> dict[str, Any]:
    lay = g.layout
    return {
        "group_id": g.group_id,
        "layout": {
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
        },
        "version": cur.version,
        "algorithm": cur.algorithm,
        "predicted_moe_lb": cur.predicted_moe_lb,
        "predicted_before": cur.predicted_before,
        "shape": list(cur.placement.phy2log.shape),
        "phy2log": base64.b64encode(cur.placement.phy2log.astype("<i4").tobytes()).decode(),
    }
