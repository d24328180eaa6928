"""Service wiring shared by the placement tables (decode, vision).

Both tables follow one kind of fleet member, publish metrics snapshots through the event
loop, apply their settings section on reload and sweep expired leases periodically;
:func:`wire_table` does all of that once, :func:`liveness` gives them the fleet's check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from fulcrum.config import Settings
from fulcrum.core.types import MemberKind
from fulcrum.errors import FailedPrecondition, InvalidArgument, NotFound
from fulcrum.service.app import App
from fulcrum.service.errors import require_id
from fulcrum.service.streams import sweep_leases


class Table(Protocol):
    """What :func:`wire_table` needs of a placement table (``DecodeState``,
    ``VisionState``); it is also the fleet's listener for its member kind."""

    @property
    def settings(self) -> Any: ...

    def set_schedule(self, schedule: Any) -> None: ...

    def apply_settings(self, settings: Any) -> None: ...

    def expire(self, now_ns: int) -> int: ...

    def count_release_refused(self, outcome: str) -> None: ...


def check_request_id(request_id: str, refused: Callable[[str], None]) -> None:
    """Refuse a malformed ``request_id`` (INVALID_ARGUMENT naming the rule), counting it
    through ``refused("invalid_argument")``. Fast path of ``require_id`` (same rule)."""
    if not (
        0 < len(request_id) <= 128
        and request_id.isascii()
        and request_id.isprintable()
        and " " not in request_id
    ):
        try:
            require_id(request_id, "request_id")
        except InvalidArgument:
            refused("invalid_argument")
            raise


def release_id(request_id: str, state: Table) -> str:
    """``request_id`` of a release, checked (INVALID_ARGUMENT naming the rule; the
    refusal is counted by ``state``)."""
    try:
        return require_id(request_id, "request_id")
    except InvalidArgument:
        state.count_release_refused("invalid_argument")
        raise


def liveness(app: App) -> Callable[[str, int, int], bool]:
    """``live(member_id, incarnation, now_ns)``: whether the fleet still has the member
    live in that incarnation."""
    fleet = app.fleet

    def live(member_id: str, incarnation: int, now_ns: int) -> bool:
        try:
            fleet.get_live(member_id, incarnation, now_ns)
        except (NotFound, FailedPrecondition):
            return False
        return True

    return live


def wire_table(app: App, section: str, kind: MemberKind, state: Table) -> None:
    """Register ``state`` as ``app.components[section]``, follow members of ``kind``,
    publish through the loop, apply ``settings.<section>`` on reload and sweep leases
    every ``<section>.sweep_interval_ms`` (read at every round, so a reload applies it)."""
    app.components[section] = state
    app.fleet.add_listener(kind, state)  # type: ignore[arg-type]
    state.set_schedule(asyncio.get_running_loop().call_soon_threadsafe)

    def reload(settings: Settings) -> None:
        state.apply_settings(getattr(settings, section))

    app.reload_hooks.append(reload)
    app.spawn(
        sweep_leases(app, state.expire, lambda: state.settings.sweep_interval_ms),
        f"{section}-leases",
    )


def register_table(
    server: grpc.aio.Server,
    app: App,
    section: str,
    kind: MemberKind,
    state: Table,
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    servicer: Any,
) -> None:
    """:func:`wire_table` ``state``, then add ``servicer`` to ``server`` with the generated
    ``add_..._to_server`` function ``add_servicer``."""
    wire_table(app, section, kind, state)
    add_servicer(servicer, server)
