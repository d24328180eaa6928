"""Fleet membership table: admission, heartbeats, lapses.

Balancers subscribe per member kind with a :class:`FleetListener`; the table calls them on
join, on each heartbeat's load and on leave (deregistered, lapsed, or replaced by a new
incarnation). Validation happens before any change, so a refused call changes nothing.

Reload: :meth:`Fleet.apply_settings` takes every key of the ``fleet`` section at once
(heartbeat interval and timeout, member bounds; the sweep period is read by the sweeper at
each round). A shorter timeout lets members lapse at the next sweep; a lower
``max_members`` refuses new members until enough leave (none is evicted); a lower
``max_gpus_per_member`` applies to registrations from then on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from fulcrum.config.server import FleetSettings
from fulcrum.core.types import (
    DecodeInstanceLoad,
    DecodeInstanceShape,
    Member,
    MemberKind,
    MemberLoad,
    MemberShape,
    PrefillEngineShape,
    VisionMachineLoad,
    kind_of,
)
from fulcrum.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from fulcrum.units import MAX_U64, NS_PER_MS

ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
#: Largest per-GPU concurrency a decode instance may declare.
MAX_DECODE_CONCURRENCY = 1_000_000

#: Why a member left: planned, missed heartbeats, or replaced by a new incarnation.
LEAVE_REASONS = ("deregistered", "lapsed", "replaced")


class FleetListener(Protocol):
    """What a balancer implements to follow the members of its kind."""

    def validate_load(self, member: Member, load: MemberLoad) -> None:
        """Raise ``InvalidArgument`` if ``load`` does not fit ``member``; change nothing."""

    def on_join(self, member: Member, now_ns: int) -> None:
        """A member was admitted (fresh, or as a new incarnation after ``on_leave``)."""

    def on_load(self, member: Member, load: MemberLoad, now_ns: int) -> None:
        """A heartbeat carried an observed load (already validated)."""

    def on_leave(self, member: Member, reason: str, now_ns: int) -> None:
        """A member left placement; ``reason`` is one of :data:`LEAVE_REASONS`."""


def validate_member_id(member_id: str, field: str = "member_id") -> None:
    """Raise ``InvalidArgument`` unless ``member_id`` matches ``[A-Za-z0-9._:-]{1,128}``."""
    if not ID_RE.match(member_id):
        raise InvalidArgument(field, "must match [A-Za-z0-9._:-]{1,128}")


def validate_shape(shape: MemberShape, max_gpus: int) -> None:
    """Raise ``InvalidArgument`` naming the field when a shape breaks a bound."""
    if isinstance(shape, PrefillEngineShape):
        if not 1 <= shape.dp_ranks <= max_gpus:
            raise InvalidArgument("prefill_engine.dp_ranks", f"must be in [1, {max_gpus}]")
        if not 0 <= shape.step_quota_ns <= MAX_U64:
            raise InvalidArgument(
                "prefill_engine.step_quota_ns", "must be in [0, 2^64-1] (0 = the default)"
            )
    elif isinstance(shape, DecodeInstanceShape):
        if not 1 <= len(shape.max_concurrency) <= max_gpus:
            raise InvalidArgument("decode_instance.gpus", f"must have 1 to {max_gpus} entries")
        for i, (c, kv) in enumerate(zip(shape.max_concurrency, shape.max_kv_tokens, strict=True)):
            if not 1 <= c <= MAX_DECODE_CONCURRENCY:
                raise InvalidArgument(
                    f"decode_instance.gpus[{i}].max_concurrency",
                    f"must be in [1, {MAX_DECODE_CONCURRENCY}]",
                )
            if not 1 <= kv <= MAX_U64:
                raise InvalidArgument(
                    f"decode_instance.gpus[{i}].max_kv_tokens", "must be in [1, 2^64-1]"
                )
    else:
        if not 1 <= shape.gpus <= max_gpus:
            raise InvalidArgument("vision_machine.gpus", f"must be in [1, {max_gpus}]")
        if not 0 <= shape.max_patches_in_flight <= MAX_U64:
            raise InvalidArgument(
                "vision_machine.max_patches_in_flight", "must be in [0, 2^64-1] (0 = unlimited)"
            )


def _validate_load_shape(member: Member, load: MemberLoad) -> None:
    gpus = member.shape.gpus
    if member.kind is MemberKind.PREFILL_ENGINE:
        raise InvalidArgument(
            "load",
            "must be empty for a prefill engine (prefill engines report their load in Pull's "
            "rank_loads_ns)",
        )
    if isinstance(load, DecodeInstanceLoad):
        if member.kind is not MemberKind.DECODE_INSTANCE:
            raise InvalidArgument("load", f"decode_instance load for a {member.kind.value}")
        if len(load.concurrency) != gpus or len(load.kv_tokens) != gpus:
            raise InvalidArgument("decode_instance.gpus", f"must have {gpus} entries")
    elif isinstance(load, VisionMachineLoad):
        if member.kind is not MemberKind.VISION_MACHINE:
            raise InvalidArgument("load", f"vision_machine load for a {member.kind.value}")
        if len(load.patches_in_flight) != gpus:
            raise InvalidArgument("vision_machine.patches_in_flight", f"must have {gpus} entries")


@dataclass(slots=True)
class _Entry:
    member: Member
    last_seen_ns: int


class Fleet:
    """Live members by id. ``incarnation_base`` makes incarnations of a restarted daemon
    larger than those of the previous one (pass the start time in microseconds)."""

    def __init__(self, settings: FleetSettings, incarnation_base: int = 0) -> None:
        self._settings = settings
        self._timeout_ns = settings.heartbeat_timeout_ms * NS_PER_MS
        self._members: dict[str, _Entry] = {}
        #: Live members per kind, kept with ``_members`` (a count per Register, not a pass).
        self._kinds: dict[MemberKind, int] = dict.fromkeys(MemberKind, 0)
        self._listeners: dict[MemberKind, list[FleetListener]] = {k: [] for k in MemberKind}
        self._next_incarnation = incarnation_base + 1

    @property
    def settings(self) -> FleetSettings:
        return self._settings

    def apply_settings(self, settings: FleetSettings) -> None:
        """Take a reloaded ``fleet`` section (see the module docstring)."""
        self._settings = settings
        self._timeout_ns = settings.heartbeat_timeout_ms * NS_PER_MS

    def add_listener(self, kind: MemberKind, listener: FleetListener) -> None:
        """Follow the members of ``kind``."""
        self._listeners[kind].append(listener)

    def count(self, kind: MemberKind | None = None) -> int:
        """Live members (of one kind)."""
        if kind is None:
            return len(self._members)
        return self._kinds[kind]

    def register(self, member_id: str, shape: MemberShape, now_ns: int) -> tuple[Member, bool]:
        """Admit a member; returns it and whether it replaced an earlier incarnation."""
        validate_member_id(member_id)
        validate_shape(shape, self._settings.max_gpus_per_member)
        kind = kind_of(shape)
        old = self._members.get(member_id)
        if old is not None and old.member.kind is not kind:
            raise AlreadyExists(
                f"member_id: {member_id!r} is registered as a {old.member.kind.value}"
            )
        if old is None and len(self._members) >= self._settings.max_members:
            raise ResourceExhausted(
                f"fleet: at its bound of {self._settings.max_members} members", 1000
            )
        if old is not None:
            self._leave(old.member, "replaced", now_ns)
        member = Member(member_id, kind, self._next_incarnation, shape, now_ns)
        self._next_incarnation += 1
        self._members[member_id] = _Entry(member, now_ns)
        if old is None:  # a replacement is of the same kind
            self._kinds[kind] += 1
        for listener in self._listeners[kind]:
            listener.on_join(member, now_ns)
        return member, old is not None

    def _entry(
        self,
        member_id: str,
        incarnation: int | None,
        now_ns: int,
        kind: MemberKind | None = None,
        field: str = "member_id",
    ) -> _Entry:
        entry = self._members.get(member_id)
        if entry is None:
            raise NotFound(f"{field}: {member_id!r} is not registered (register again)")
        if kind is not None and entry.member.kind is not kind:
            raise NotFound(f"{field}: {member_id!r} is not a registered {kind.value}")
        if now_ns - entry.last_seen_ns > self._timeout_ns:
            self._leave(entry.member, "lapsed", now_ns)
            self._drop(member_id)
            raise NotFound(f"{field}: {member_id!r} lapsed (register again)")
        if incarnation is not None and incarnation != entry.member.incarnation:
            raise FailedPrecondition(
                f"incarnation: {incarnation} is not the current one of {member_id!r}"
            )
        return entry

    def get_live(
        self,
        member_id: str,
        incarnation: int | None,
        now_ns: int,
        kind: MemberKind | None = None,
        field: str = "member_id",
    ) -> Member:
        """The live member, or NotFound/FailedPrecondition. ``incarnation=None``: any.
        With ``kind``, a member of another kind is NotFound; messages name ``field`` (e.g.
        ``engine_id``)."""
        return self._entry(member_id, incarnation, now_ns, kind, field).member

    def heartbeat(
        self,
        member_id: str,
        incarnation: int,
        load: MemberLoad | None,
        now_ns: int,
        kind: MemberKind | None = None,
        field: str = "member_id",
    ) -> Member:
        """Refresh a member and hand its load to the listeners. With ``kind``, a member of
        another kind is refused (NotFound naming ``field``) and NOT refreshed: a call that
        stands for a heartbeat (a prefill Pull) counts only for the kind it serves."""
        entry = self._entry(member_id, incarnation, now_ns, kind, field)
        member = entry.member
        if load is not None:
            _validate_load_shape(member, load)
            for listener in self._listeners[member.kind]:
                listener.validate_load(member, load)
        entry.last_seen_ns = now_ns
        if load is not None:
            for listener in self._listeners[member.kind]:
                listener.on_load(member, load, now_ns)
        return member

    def deregister(self, member_id: str, incarnation: int, now_ns: int) -> Member:
        """Take a member out at once."""
        entry = self._entry(member_id, incarnation, now_ns)
        self._drop(member_id)
        self._leave(entry.member, "deregistered", now_ns)
        return entry.member

    def expire(self, now_ns: int) -> list[Member]:
        """Remove every member whose last heartbeat is older than the timeout."""
        lapsed = [
            e.member for e in self._members.values() if now_ns - e.last_seen_ns > self._timeout_ns
        ]
        for member in lapsed:
            self._drop(member.member_id)
            self._leave(member, "lapsed", now_ns)
        return lapsed

    def _drop(self, member_id: str) -> None:
        self._kinds[self._members.pop(member_id).member.kind] -= 1

    def _leave(self, member: Member, reason: str, now_ns: int) -> None:
        for listener in self._listeners[member.kind]:
            listener.on_leave(member, reason, now_ns)

    def members(self, kind: MemberKind | None = None) -> list[tuple[Member, int]]:
        """(member, last_seen_ns) of live members, sorted by id."""
        return sorted(
            (
                (e.member, e.last_seen_ns)
                for e in self._members.values()
                if kind is None or e.member.kind is kind
            ),
            key=lambda t: t[0].member_id,
        )

    def live_members(
        self, now_ns: int, kind: MemberKind | None = None, after: str = ""
    ) -> list[tuple[Member, int]]:
        """(member, last_seen_ns) of the members (of ``kind``) whose heartbeat has not
        lapsed at ``now_ns`` and whose id sorts after ``after``, sorted by id (a page of a
        listing starts after the previous page's last id). Changes nothing."""
        timeout = self._timeout_ns
        return sorted(
            (
                (e.member, e.last_seen_ns)
                for e in self._members.values()
                if (kind is None or e.member.kind is kind)
                and e.member.member_id > after
                and now_ns - e.last_seen_ns <= timeout
            ),
            key=lambda t: t[0].member_id,
        )
