"""What the prefill shell's parts share (one object, made by :class:`PrefillState`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fulcrum.config.prefill import PrefillSettings
from fulcrum.core.prefill.balancer import PrefillBalancer
from fulcrum.core.prefill.leases import LeaseTable
from fulcrum.state.prefill.export import PrefillMetrics


@dataclass(frozen=True, slots=True)
class Shell:
    """The core balancer and lease table, the metrics export, the ``prefill:`` section in
    force (``settings()``: a reload applies to the next call) and the daemon's clock
    (ns)."""

    balancer: PrefillBalancer
    leases: LeaseTable
    metrics: PrefillMetrics
    settings: Callable[[], PrefillSettings]
    clock: Callable[[], int]


class Part:
    """A part of the shell: keeps the shared objects of its :class:`Shell`."""

    def __init__(self, shell: Shell) -> None:
        self._bal = shell.balancer
        self._leases = shell.leases
        self._m = shell.metrics
        self._settings = shell.settings
        self._clock = shell.clock
