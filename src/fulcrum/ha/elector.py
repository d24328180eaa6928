"""The one interface an election backend implements (etcd today; a Kubernetes Lease
backend would be another implementation of the same protocol).

A backend campaigns for one key per pool, holds it under a lease it renews, and drives a
:class:`~fulcrum.ha.gate.Gate`: ``gate.extend(sent + renew_deadline)`` after each renewal
sent at ``sent`` while it leads, ``gate.close(reason)`` when it knows it does not. It
records the observed leader's address in ``gate.leader``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol


class LeaseLost(Exception):
    """The lease this daemon held has expired or its key was taken: its state may be
    stale (another daemon may have served meanwhile)."""


class Elector(Protocol):
    """Leader election for one pool."""

    #: Awaited after the key is won and before the gate opens (load durable state).
    on_elected: Callable[[], Awaitable[None]] | None
    #: Called when a lease this daemon led under is lost (the daemon then restarts).
    on_lost: Callable[[str], None] | None

    async def run(self) -> None:
        """Campaign, renew and observe until cancelled; never raises for etcd faults."""

    async def resign(self) -> None:
        """Give the key up now (graceful shutdown): a standby takes over at once."""

    @property
    def leading(self) -> bool:
        """Whether this daemon holds the key (the gate says whether it may serve)."""

    def fence_deadline(self) -> float:
        """``time.monotonic()`` seconds until which this daemon may serve (0 = not)."""
