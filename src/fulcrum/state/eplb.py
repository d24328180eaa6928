"""In-memory tables of the expert-parallel load balancer (EPLB).

Per EP group: its layout, a generation (a new one on every registration), the map in
force and the last few versions, the statistics window, the load observed under the map
in force, and the rebalance period counter.

- Window: the last N steps of reported load, kept as ``window_buckets`` buckets of
  ``ceil(N / buckets)`` steps; a report [b, e) goes whole into the bucket of step e - 1, and
  buckets older than N steps behind the newest are dropped. Memory per group:
  (buckets + 2) x layers x experts x 8 bytes. Arrays are replaced, never mutated in place,
  so a rebalance or a snapshot writer can read them from another thread.
- Reports: must name the version in force or the one before it (steps that ran while
  the new map was being loaded; loads are per logical expert, so they count the same);
  load values in [0, 2^53], at most ``max_report_steps`` steps per report, step_end <=
  2^63 - 1.
- Observed moe_lb: of the map in force, over every report accepted since it took effect.
- Period: every M reported steps the service recomputes the map (:meth:`EplbState.prepare`
  -> core ``rebalance`` off the event loop -> :meth:`EplbState.commit`). A commit is
  refused unless the group is the same registration (generation) at the same version,
  and the map passes ``core.eplb.validate`` (else the old map stays, outcome ``invalid``).
- Snapshot (``state.eplb_store``): one map file and one window file per group in the
  ``snapshot_path`` directory. A change of a map in force (registration, new version,
  deregistration) is first written, in a worker thread, and only then applied on the
  loop (all writes are serialised by one lock, and the group is re-checked after it), so
  a failed write changes nothing. Windows are written every ``window_snapshot_interval_s``
  when something changed, and at drain. At start each group's files are read on their
  own (``eplb_store.restore``: every value checked for type and range; any error a
  hostile file raises is caught): a bad file is moved aside as ``.corrupt``, logged once
  and counted in ``fulcrum_eplb_snapshot_corrupt_total`` (only that group loses it), stale
  ``.tmp`` files are removed, and at most ``max_groups`` groups are restored (the rest
  are moved aside as ``.excess``). A restarted daemon serves the same versions. A
  single-file snapshot of the previous format at ``snapshot_path`` is converted at start
  (kept as ``.v1``; its windows restart empty).
- Durable maps (``ha.backend: etcd``): ``durable`` (a :class:`Durable`, set by
  ``fulcrum.ha``) gets every change of a map in force before the snapshot file and before
  it applies, under the same lock; its write is guarded by the leadership, so a deposed
  leader's write fails and nothing changes. A new leader :meth:`EplbState.adopt` s the
  groups it reads back (same versions, same maps; windows restart empty).

Every mutating call validates all its inputs first and raises a ``fulcrum.errors`` error
before changing anything.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

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
from fulcrum.core.eplb.registry import check_map
from fulcrum.core.eplb.validate import InvalidMap, map_problems
from fulcrum.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from fulcrum.metrics import eplb as m
from fulcrum.state import eplb_store as store
from fulcrum.units import MAX_EXACT_FLOAT, MAX_I64

__all__ = [
    "EplbState",
    "Group",
    "GroupSpec",
    "MapVersion",
    "RebalanceJob",
    "ReportOutcome",
    "reply_bytes_bound",
]

log = structlog.get_logger(__name__)

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

INITIAL = "initial"
_GENERATIONS = itertools.count(1)


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


@dataclass
class Group:
    """Mutable state of one EP group (owned by :class:`EplbState`, event loop only)."""

    group_id: str
    layout: GroupLayout
    history: deque[MapVersion]
    bucket_steps: int
    window_buckets: int
    generation: int = 0
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
    window_dirty: bool = False

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
    """Result of an accepted report (``counted_version``: the version in force whose
    statistics it was added to)."""

    map_version: int
    counted_version: int
    observed_moe_lb: float
    due: bool
    window_steps: int
    steps_to_rebalance: int


@dataclass(frozen=True, slots=True)
class RebalanceJob:
    """Inputs of one rebalance, taken from the state; every array is immutable (the state
    replaces its arrays instead of changing them), so a worker thread may read them.

    Attributes:
        loads: window sum (L, E) tokens.
        buckets: the window's buckets (L, E) each, and ``steps`` their step counts, for
            the noise estimate (``core.eplb.window``).
    """

    group_id: str
    generation: int
    layout: GroupLayout
    loads: F64
    buckets: tuple[F64, ...]
    steps: tuple[int, ...]
    previous: MapVersion
    algorithm: str
    params: RebalanceParams
    trigger: str
    steps_at_prepare: int


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    """How a commit ended: ``applied``, ``unchanged``, ``stale`` (the group changed meanwhile)
    or ``invalid`` (the map broke a rule), and the version in force afterwards."""

    outcome: str
    version: MapVersion


def _layout_error(err: ValueError) -> InvalidArgument:
    text = str(err)
    fieldname, _, rule = text.partition(": ")
    names = {"n_layers": "num_layers", "n_logical": "num_experts", "n_groups": "num_expert_groups"}
    return InvalidArgument(names.get(fieldname, fieldname), rule or text)


def reply_bytes_bound(layout: GroupLayout) -> int:
    """Upper bound on the bytes of one ExpertMap message of ``layout``: three int32
    tensors, phy2log (L, P), replica counts (L, E) and log2phy (L, E, R) with R at most
    ``P - E + 1`` replicas of one expert, plus 1 KiB of other fields."""
    lay = layout
    width = lay.n_physical - lay.n_logical + 1
    return 4 * lay.n_layers * (lay.n_physical + lay.n_logical * (1 + width)) + 1024


def _map_record(g: Group, mv: MapVersion) -> store.MapRecord:
    return store.MapRecord(
        group_id=g.group_id,
        layout=g.layout,
        version=mv.version,
        algorithm=mv.algorithm,
        predicted_moe_lb=mv.predicted_moe_lb,
        predicted_before=mv.predicted_before,
        phy2log=mv.placement.phy2log,
    )


def _window_record(g: Group) -> store.WindowRecord:
    keys = sorted(g.buckets)
    return store.WindowRecord(
        group_id=g.group_id,
        layout=g.layout,
        version=g.current.version,
        bucket_steps=g.bucket_steps,
        buckets=tuple((k, g.bucket_step_counts[k], g.buckets[k]) for k in keys),
        last_step_end=g.last_step_end,
        steps_since_rebalance=g.steps_since_rebalance,
        observed=g.observed_sum,
    )


def resolve_layout(settings: EplbSettings, spec: GroupSpec, max_message_bytes: int) -> GroupLayout:
    """The resolved layout of a registration (validated against the bounds, including
    that a map reply fits in ``server.max_message_bytes``)."""
    s = settings
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
    need = reply_bytes_bound(layout)
    if need > max_message_bytes:
        raise InvalidArgument(
            "num_layers",
            f"a map of this group takes up to {need} bytes, over the "
            f"{max_message_bytes}-byte message limit (server.max_message_bytes)",
        )
    return layout


def check_initial(layout: GroupLayout, initial: I64) -> PlacementMap:
    """The initial map as a PlacementMap, or InvalidArgument; cost O(layers x slots)
    before anything of the map's own size is built."""
    want = (layout.n_layers, layout.n_physical)
    if initial.shape != want:
        raise InvalidArgument(
            "initial_map.shape", f"must be {list(want)}, got {list(initial.shape)}"
        )
    if initial.size and (int(initial.min()) < 0 or int(initial.max()) >= layout.n_logical):
        raise InvalidArgument("initial_map", f"expert ids must lie in [0, {layout.n_logical})")
    per_gpu = np.sort(
        initial.reshape(layout.n_layers, layout.ep_size, layout.slots_per_gpu), axis=-1
    )
    if (per_gpu[..., 1:] == per_gpu[..., :-1]).any():
        raise InvalidArgument("initial_map", "two replicas of one expert on one GPU")
    rows = np.arange(layout.n_layers)[:, None]
    counts = np.bincount(
        (rows * layout.n_logical + initial).ravel(),
        minlength=layout.n_layers * layout.n_logical,
    )
    if (counts == 0).any():
        raise InvalidArgument("initial_map", "every logical expert needs a slot")
    placement = PlacementMap.from_phy2log(initial, layout.ep_size, layout.n_logical)
    problems = map_problems(layout, placement, no_colocation=True, node_limited=True)
    if problems:
        raise InvalidArgument("initial_map", problems[0])
    return placement


def _check_report(
    settings: EplbSettings, group: Group, map_version: int, step_begin: int, step_end: int,
    load: F64,
) -> None:
    """Every rule of a report (module docstring); raises before anything changes."""
    current = group.current.version
    if map_version == 0:
        raise InvalidArgument("map_version", "must be set (the version in force)")
    if map_version not in (current, current - 1):
        raise FailedPrecondition(
            f"map_version: {map_version} is neither the map in force (version "
            f"{current}) nor the one before it; fetch it and report under it"
        )
    if step_end <= step_begin:
        raise InvalidArgument("step_end", f"must be > step_begin ({step_begin})")
    if step_end > MAX_I64:
        raise InvalidArgument("step_end", f"must be in [1, 2^63-1], got {step_end}")
    limit = settings.max_report_steps
    if step_end - step_begin > limit:
        raise InvalidArgument(
            "step_end",
            f"step_end - step_begin must be in [1, {limit}] (eplb.max_report_steps), "
            f"got {step_end - step_begin}",
        )
    if step_begin < group.last_step_end:
        raise FailedPrecondition(
            f"step_begin: {step_begin} is before the end of the previous report "
            f"({group.last_step_end}); step ranges must not go backwards"
        )
    want = (group.layout.n_layers, group.layout.n_logical)
    if load.shape != want:
        raise InvalidArgument("load.shape", f"must be {list(want)}, got {list(load.shape)}")
    if not np.isfinite(load).all():
        raise InvalidArgument("load", "values must be finite")
    if (load < 0).any():
        raise InvalidArgument("load", "values must be >= 0")
    if (load > MAX_EXACT_FLOAT).any():
        raise InvalidArgument("load", "values must be in [0, 2^53]")


def _add_to_window(group: Group, step_begin: int, step_end: int, load: F64) -> None:
    """Put a valid report's load into its bucket (arrays replaced, never changed)."""
    idx = (step_end - 1) // group.bucket_steps
    bucket = group.buckets.get(idx)
    group.buckets[idx] = load if bucket is None else _frozen(bucket + load)
    group.bucket_step_counts[idx] = group.bucket_step_counts.get(idx, 0) + (
        step_end - step_begin
    )
    oldest = idx - group.window_buckets + 1
    stale = [k for k in group.buckets if k < oldest]
    for k in stale:
        del group.buckets[k]
        del group.bucket_step_counts[k]
    if stale or group.window_sum is None:
        group.window_sum = _frozen(np.sum(list(group.buckets.values()), axis=0))
    else:
        group.window_sum = _frozen(group.window_sum + load)
    group.last_step_end = step_end
    group.window_dirty = True


def _reset_observed(group: Group) -> None:
    shape = (group.layout.n_layers, group.layout.n_logical)
    group.observed_sum = _frozen(np.zeros(shape))
    group.observed_per_layer = np.ones(group.layout.n_layers)
    group.observed_moe_lb = 1.0
    m.MOE_LB_OBSERVED.labels(group.group_id).set(1.0)


def _update_observed(group: Group) -> None:
    assert group.observed_sum is not None
    placement = group.current.placement
    w = group.observed_sum
    top = float(w.max()) if w.size else 0.0
    if top > 0:
        w = w / top
    per_layer, overall = moe_lb_of_gpu_loads(gpu_loads(w, placement.phy2log, placement.ep_size))
    group.observed_per_layer = per_layer
    group.observed_moe_lb = overall
    m.MOE_LB_OBSERVED.labels(group.group_id).set(overall)


def _restore_window(group: Group, w: store.RestoredWindow) -> None:
    """Put a window read from its file (already checked) into a new group."""
    group.buckets = dict(w.buckets)
    group.bucket_step_counts = dict(w.step_counts)
    group.window_sum = (
        _frozen(np.sum(list(group.buckets.values()), axis=0)) if group.buckets else None
    )
    group.last_step_end = w.last_step_end
    group.steps_since_rebalance = w.steps_since_rebalance
    if w.observed is not None:
        group.observed_sum = w.observed
        _update_observed(group)
    m.WINDOW_STEPS.labels(group.group_id).set(group.window_steps)


def _log_kept(job: RebalanceJob, result: RebalanceResult, group: Group, before: float) -> None:
    # one line per rebalance that kept the map: operators see the periodic job ran
    log.info(
        "eplb_map_unchanged",
        group=job.group_id,
        version=group.current.version,
        algorithm=result.algorithm,
        trigger=job.trigger,
        moe_lb_current=round(before, 5),
        moe_lb_predicted=round(result.after.overall, 5),
        noise_threshold=round(result.noise_threshold, 6),
    )


def _log_changed(job: RebalanceJob, result: RebalanceResult, new: MapVersion) -> None:
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
        moe_lb_before=round(new.predicted_before, 5),
        moe_lb_after=round(result.after.overall, 5),
        noise_threshold=round(result.noise_threshold, 6),
        slots_changed=mig.slots_changed,
        bytes_moved=mig.bytes_moved,
    )


def _first_version(placement: PlacementMap) -> MapVersion:
    return MapVersion(
        version=1,
        placement=placement,
        algorithm=INITIAL,
        predicted_moe_lb=1.0,
        predicted_before=1.0,
        migration=Migration(0, 0, 0, placement.phy2log.size),
    )


class Durable(Protocol):
    """Where maps in force are written before they apply (``fulcrum.ha.maps``)."""

    async def save(self, rec: store.MapRecord) -> None:
        """Write a group's map in force (raises a ``fulcrum.errors`` error if not)."""

    async def remove(self, group_id: str) -> None:
        """Forget a group."""


class EplbState:
    """All EP groups of the daemon (event loop only; file I/O in worker threads)."""

    def __init__(self, settings: EplbSettings, *, max_message_bytes: int = 1 << 30) -> None:
        self.settings = settings
        self.max_message_bytes = max_message_bytes
        self.groups: dict[str, Group] = {}
        self._store = store.Writer(lambda: self.directory)
        #: Durable store of the maps in force (None without an HA backend).
        self.durable: Durable | None = None
        if self.directory is not None:
            self._restore(self.directory)

    @property
    def directory(self) -> Path | None:
        """The snapshot directory (None without ``snapshot_path``)."""
        path = self.settings.snapshot_path
        return Path(path) if path else None

    # -- settings ------------------------------------------------------------------------

    def apply_settings(self, settings: EplbSettings) -> None:
        """Config reload: every key but the restart-only ones (snapshot path, window
        buckets) applies from now on: algorithm, migration weight and cap, noise z,
        restart gap and report bounds to later calls and rebalances, max_groups,
        max_watchers_per_group and retry_after_ms to later registrations and watches,
        history_versions to every group's history now."""
        self.settings = settings.model_copy(
            update={
                "snapshot_path": self.settings.snapshot_path,
                "window_buckets": self.settings.window_buckets,
            }
        )
        for g in self.groups.values():
            if g.history.maxlen != self.settings.history_versions:
                g.history = deque(g.history, maxlen=self.settings.history_versions)

    @property
    def params(self) -> RebalanceParams:
        """Knobs of the configured ``stable`` algorithm."""
        s = self.settings
        cap = s.max_bytes_per_rebalance
        return RebalanceParams(
            min_gain_per_gib=s.min_gain_per_gib,
            max_bytes=cap if cap > 0 else None,
            noise_z=s.noise_z,
            restart_gap=s.restart_gap,
        )

    # -- groups --------------------------------------------------------------------------

    def _new_group(self, group_id: str, layout: GroupLayout, first: MapVersion) -> Group:
        bucket, n_buckets = store.bucket_geometry(layout.window_steps, self.settings.window_buckets)
        g = Group(
            group_id=group_id,
            layout=layout,
            history=deque([first], maxlen=self.settings.history_versions),
            bucket_steps=bucket,
            window_buckets=n_buckets,
            generation=next(_GENERATIONS),
        )
        _reset_observed(g)
        return g

    def make_layout(self, spec: GroupSpec) -> GroupLayout:
        """:func:`resolve_layout` under this state's settings."""
        return resolve_layout(self.settings, spec, self.max_message_bytes)

    check_initial = staticmethod(check_initial)

    async def register(self, spec: GroupSpec, initial: I64 | None) -> tuple[Group, bool]:
        """Create a group (or return the existing one with the same layout).

        Args:
            spec: the registration.
            initial: optional map in force, shape (layers, physical), or None (identity).

        Returns:
            The group and whether it was created.
        """
        layout = self.make_layout(spec)
        existing = self._existing(spec.group_id, layout)
        if existing is not None:
            return existing, False
        placement = identity_map(layout) if initial is None else check_initial(layout, initial)
        first = _first_version(placement)
        group = self._new_group(spec.group_id, layout, first)
        async with self._store.lock():
            existing = self._existing(spec.group_id, layout)  # re-check after the wait
            if existing is not None:
                return existing, False
            if self.durable is not None:
                await self.durable.save(_map_record(group, first))
            await self._store.write(store.write_map, _map_record(group, first))
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
            generation=group.generation,
        )
        return group, True

    def _existing(self, group_id: str, layout: GroupLayout) -> Group | None:
        existing = self.groups.get(group_id)
        if existing is not None:
            if existing.layout != layout:
                raise AlreadyExists(f"group_id: {group_id!r} is registered with another shape")
            return existing
        if len(self.groups) >= self.settings.max_groups:
            raise ResourceExhausted(
                f"eplb: {self.settings.max_groups} groups registered (eplb.max_groups)",
                retry_after_ms=self.settings.retry_after_ms,
            )
        return None

    async def deregister(self, group_id: str) -> None:
        """Forget a group (NotFound if unknown); open watches end."""
        self.get(group_id)
        async with self._store.lock():
            group = self.get(group_id)  # re-check after the wait
            if self.durable is not None:
                await self.durable.remove(group_id)
            await self._store.write(store.remove_group, group_id)
        del self.groups[group_id]
        group.deleted = True
        group.notify()
        m.GROUPS.set(len(self.groups))
        m.forget_group(group_id)
        log.info("eplb_group_deregistered", group=group_id, generation=group.generation)

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
            map_version: the version in force or the one before it.
            load: shape (layers, experts), tokens per logical expert, float64.
        """
        group = self.get(group_id)
        _check_report(self.settings, group, map_version, step_begin, step_end, load)
        # -- valid: mutate (arrays are replaced, never changed in place)
        load = np.array(load, dtype=np.float64)
        load.setflags(write=False)
        _add_to_window(group, step_begin, step_end, load)
        steps = step_end - step_begin
        group.steps_since_rebalance += steps
        assert group.observed_sum is not None
        group.observed_sum = _frozen(group.observed_sum + load)
        _update_observed(group)
        m.REPORTED_STEPS.labels(group_id).inc(steps)
        m.WINDOW_STEPS.labels(group_id).set(group.window_steps)
        current = group.current.version
        return ReportOutcome(
            map_version=current,
            counted_version=current,
            observed_moe_lb=group.observed_moe_lb,
            due=group.steps_since_rebalance >= group.layout.period_steps,
            window_steps=group.window_steps,
            steps_to_rebalance=group.steps_to_rebalance,
        )

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
        keys = sorted(group.buckets)
        return RebalanceJob(
            group_id=group_id,
            generation=group.generation,
            layout=group.layout,
            loads=group.window_sum,
            buckets=tuple(group.buckets[k] for k in keys),
            steps=tuple(group.bucket_step_counts[k] for k in keys),
            previous=group.current,
            algorithm=name,
            params=self.params,
            trigger=trigger,
            steps_at_prepare=group.steps_since_rebalance,
        )

    def _same(self, job: RebalanceJob) -> Group | None:
        """The job's group if it is still the same registration at the same version."""
        group = self.groups.get(job.group_id)
        if group is None or group.deleted or group.generation != job.generation:
            return None
        if group.current.version != job.previous.version:
            return None
        return group

    async def commit(self, job: RebalanceJob, result: RebalanceResult) -> CommitOutcome:
        """Put the result in force if it changes the map, passes validation and the group
        is the same registration at the same version (write first, then apply).

        Raises:
            NotFound: the group was deregistered (or re-registered) meanwhile.
            Unavailable: the snapshot could not be written (nothing changed).
        """
        group = self.groups.get(job.group_id)
        if group is None or group.deleted or group.generation != job.generation:
            raise NotFound(
                f"group_id: {job.group_id!r} was deregistered or registered again during "
                "the rebalance"
            )
        kept = self._kept(group, job, result)
        if kept is not None:
            return kept
        before = result.before.overall if result.before is not None else 1.0
        new = MapVersion(
            version=group.current.version + 1,
            placement=result.placement,
            algorithm=result.algorithm,
            predicted_moe_lb=result.after.overall,
            predicted_before=before,
            migration=result.migration,
        )
        async with self._store.lock():
            if self._same(job) is not group:  # changed while waiting for the writer
                now = self.groups.get(job.group_id)
                return CommitOutcome("stale", job.previous if now is None else now.current)
            if self.durable is not None:
                await self.durable.save(_map_record(group, new))
            await self._store.write(store.write_map, _map_record(group, new))
        group.history.append(new)
        self._restart_period(group, job)
        group.rebalances += 1
        _reset_observed(group)
        _log_changed(job, result, new)
        group.notify()
        return CommitOutcome("applied", new)

    def _kept(
        self, group: Group, job: RebalanceJob, result: RebalanceResult
    ) -> CommitOutcome | None:
        """The outcome of a commit that keeps the map (stale, invalid, unchanged), or None
        when the result is to be put in force."""
        if group.current.version != job.previous.version:
            self._restart_period(group, job)
            return CommitOutcome("stale", group.current)  # another rebalance won
        try:
            check_map(result.algorithm, job.layout, result.placement)
        except InvalidMap as err:
            log.error(
                "eplb_invalid_map_refused",
                group=job.group_id,
                algorithm=result.algorithm,
                version=group.current.version,
                error=str(err),
            )
            return CommitOutcome("invalid", group.current)
        before = result.before.overall if result.before is not None else 1.0
        m.MOE_LB_PREDICTED.labels(job.group_id, "before").set(before)
        m.MOE_LB_PREDICTED.labels(job.group_id, "after").set(result.after.overall)
        m.NOISE_THRESHOLD.labels(job.group_id).set(result.noise_threshold)
        if result.placement.same_as(job.previous.placement):
            self._restart_period(group, job)
            _log_kept(job, result, group, before)
            return CommitOutcome("unchanged", group.current)
        return None

    def _restart_period(self, group: Group, job: RebalanceJob) -> None:
        """The period counts again from the rebalance's start; steps reported while it was
        computed count toward the next one. A failed rebalance leaves the period due."""
        group.steps_since_rebalance = max(0, group.steps_since_rebalance - job.steps_at_prepare)
        group.window_dirty = True

    # -- window snapshot -----------------------------------------------------------------

    async def save_window(self) -> int:
        """Write the window file of every group whose window changed since its last write
        (in a worker thread, one group at a time). Returns how many were written; a
        failed write is logged and counted, the group stays dirty and is tried again."""
        if self.directory is None:
            return 0
        written = 0
        async with self._store.lock():
            for g in [g for g in self.groups.values() if g.window_dirty]:
                if self.groups.get(g.group_id) is not g:
                    continue  # deregistered meanwhile: its files are gone
                g.window_dirty = False
                try:
                    await self._store.write(store.write_window, _window_record(g))
                except Unavailable:
                    g.window_dirty = True
                    continue
                written += 1
        return written

    def save_window_now(self) -> int:
        """:meth:`save_window` blocking the caller (drain only, when no call is served)."""
        written = 0
        for g in list(self.groups.values()):
            if g.window_dirty and self._store.write_now(_window_record(g)):
                g.window_dirty = False
                written += 1
        return written

    # -- restore -------------------------------------------------------------------------

    def _restore(self, directory: Path) -> None:
        """Every group ``state.eplb_store.restore`` reads back (module docstring); never
        raises for what the files hold."""
        s = self.settings
        found = store.restore(directory, max_groups=s.max_groups, window_buckets=s.window_buckets)
        self._add_restored(found)

    def adopt(self, found: list[store.RestoredGroup]) -> None:
        """Replace every group by ``found`` (a new leader's durable maps): groups not in
        it end (their watches close), each found group serves its version and map."""
        for g in self.groups.values():
            g.deleted = True
            g.notify()
            m.forget_group(g.group_id)
        self.groups = {}
        self._add_restored(found[: self.settings.max_groups])
        log.info("eplb_groups_adopted", groups=len(self.groups),
                 versions={g.group_id: g.current.version for g in self.groups.values()}
                 if len(self.groups) <= 16 else None)

    def _add_restored(self, found: list[store.RestoredGroup]) -> None:
        for rg in found:
            first = MapVersion(
                version=rg.version,
                placement=rg.placement,
                algorithm=rg.algorithm,
                predicted_moe_lb=rg.predicted_moe_lb,
                predicted_before=rg.predicted_before,
                migration=Migration(0, 0, 0, rg.placement.phy2log.size),
            )
            group = self._new_group(rg.group_id, rg.layout, first)
            if rg.window is not None:
                _restore_window(group, rg.window)
            self.groups[group.group_id] = group
            m.MAP_VERSION.labels(group.group_id).set(group.current.version)
        m.GROUPS.set(len(self.groups))


def _frozen(a: F64) -> F64:
    """``a`` marked read-only (it is shared with worker threads)."""
    a.setflags(write=False)
    return a
