"""The prefill engines the shell knows, following the fleet, and the check of an engine's
call (Pull, Ack, ReportStepTimes): the caller must be a live, registered prefill engine;
a call that quotes its incarnation also counts as its heartbeat."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from fulcrum.core.prefill.bands import split_band
from fulcrum.core.tenants import TenantPolicy
from fulcrum.core.types import Member, MemberKind, PrefillEngineShape
from fulcrum.errors import InvalidArgument, NotFound
from fulcrum.state.fleet import Fleet
from fulcrum.state.prefill.records import Engine


class EngineRoster:
    """See module docstring. ``clock()``: the daemon's clock (ns)."""

    def __init__(self, fleet: Fleet, clock: Callable[[], int]) -> None:
        self._fleet = fleet
        self._clock = clock
        self.engines: dict[str, Engine] = {}

    def __len__(self) -> int:
        return len(self.engines)

    def step_quota_ns(self, engine_id: str) -> int:
        """The engine's own step budget (ns; 0: unknown or the section's)."""
        eng = self.engines.get(engine_id)
        return eng.step_quota_ns if eng is not None else 0

    def refresh_s(self) -> float:
        """How often a parked pull refreshes its engine's heartbeat (s): half the fleet's
        heartbeat timeout."""
        return self._fleet.settings.heartbeat_timeout_ms / 2000

    def caller(self, engine_id: str, incarnation: int) -> Engine:
        """The live prefill engine of a call; a refused call is not a heartbeat."""
        now = self._clock()
        try:
            member = self._fleet.get_live(engine_id, incarnation or None, now)
        except NotFound as err:
            raise NotFound(err.message.replace("member_id:", "engine_id:", 1)) from None
        eng = self.engines.get(engine_id)
        if member.kind is not MemberKind.PREFILL_ENGINE or eng is None:
            raise NotFound(f"engine_id: {engine_id!r} is not a registered prefill engine")
        if incarnation:  # a pull from the current incarnation also counts as a heartbeat
            self._fleet.heartbeat(engine_id, incarnation, None, now)
        return eng

    def puller(self, engine_id: str, incarnation: int,
               rank_loads_ns: Sequence[int]) -> Engine:
        """The live engine of a pull, or NotFound / InvalidArgument (rank loads, ns: one
        per DP rank, or none)."""
        eng = self.caller(engine_id, incarnation)
        if rank_loads_ns and len(rank_loads_ns) != eng.dp_ranks:
            raise InvalidArgument(
                "rank_loads_ns", f"must have {eng.dp_ranks} entries (one per DP rank) or none"
            )
        return eng

    def keepalive(self, eng: Engine, incarnation: int) -> None:
        """A parked pull keeps its engine alive (when it quoted its incarnation)."""
        if incarnation and eng.live:
            self.caller(eng.member_id, incarnation)

    def join(self, member: Member) -> Engine | None:
        """``member`` (a prefill engine) registered; returns the incarnation it replaces
        (no longer live), if any."""
        shape = member.shape
        assert isinstance(shape, PrefillEngineShape)
        old = self.engines.get(member.member_id)
        if old is not None:
            old.live = False
        self.engines[member.member_id] = Engine(
            member.member_id, member.incarnation, shape.dp_ranks, shape.step_quota_ns or 0
        )
        return old

    def leave(self, engine_id: str) -> Engine | None:
        """``engine_id`` left; returns it (no longer live), None when unknown."""
        eng = self.engines.pop(engine_id, None)
        if eng is not None:
            eng.live = False
        return eng


def check_band_loads(eng: Engine, rank_loads_ns: Sequence[int],
                     band_loads: Mapping[float, Sequence[int]] | None,
                     policy: TenantPolicy) -> dict[float, list[int]] | None:
    """A pull's ``band_rank_loads`` checked against its engine and the priority range:
    one entry per rank each, none above the rank's whole load (InvalidArgument naming
    ``band_rank_loads`` otherwise); None when empty."""
    if not band_loads:
        return None
    out: dict[float, list[int]] = {}
    for prio, row in band_loads.items():
        if not policy.min_priority <= split_band(prio)[0] <= policy.max_priority:
            raise InvalidArgument("band_rank_loads", f"priority {prio} is outside "
                                  f"{policy.min_priority}..{policy.max_priority}")
        if len(row) != eng.dp_ranks:
            raise InvalidArgument("band_rank_loads", f"priority {prio}: must have "
                                  f"{eng.dp_ranks} entries (one per DP rank)")
        if rank_loads_ns and any(int(b) > int(w) for b, w in zip(row, rank_loads_ns,
                                                                 strict=True)):
            raise InvalidArgument("band_rank_loads", f"priority {prio}: an entry is above "
                                  "its rank's rank_loads_ns")
        out[prio] = [int(x) for x in row]
    return out
