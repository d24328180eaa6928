"""Per-tenant caps of the decode and vision balancers, and shedding of lower bands first
when the fleet is nearly full (issue 23). Pure: the shells (``state/decode.py``,
``state/vision.py``, the simulator's stages) hold one :class:`TenantHeld` each and ask
:func:`refusal` before the capacity filter; a refusal is an intent, the shell answers
RESOURCE_EXHAUSTED with ``retry-after-ms``.

*Caps* (:class:`fulcrum.core.tenants.TenantSpec`): a tenant may hold at most
``max_requests`` requests and ``max_amount`` units (KV tokens for decode; None: no cap)
at once. A cap is one more filter in front of the GPUs: over it, no GPU is eligible.

*Bands*: a request of a sheddable class (the tenant's ``sheddable`` or a band in
``tenants.sheddable_priorities``) is refused when the fleet's fill after it (the larger
of held requests / request capacity and held units / unit capacity, over live GPUs)
would pass ``1 - reserve * (max_priority - priority + 1) / span`` (``span`` = the number
of bands): the lowest band is refused first, at ``1 - reserve``; higher bands keep
finding room longer. ``reserve`` 0 turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from fulcrum.core.tenants import RequestClass, TenantPolicy, TenantTable

#: Reasons of a refusal (metric label values).
CAP: Final = "cap"
BAND: Final = "band"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Intent: refuse a request. ``reason``: :data:`CAP` or :data:`BAND`; ``message``
    names the bound and the values."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Fill:
    """The fleet's load over its live GPUs: ``requests`` and ``amount`` held (units:
    KV tokens or patches), with their capacities (0: unbounded, not counted)."""

    requests: int
    max_requests: int
    amount: int
    max_amount: int

    def after(self, amount: int) -> float:
        """Fraction of the fleet in use after one more request of ``amount`` units."""
        f = 0.0
        if self.max_requests > 0:
            f = (self.requests + 1) / self.max_requests
        if self.max_amount > 0:
            f = max(f, (self.amount + amount) / self.max_amount)
        return f


class TenantHeld:
    """Requests and units (KV tokens, patches) held per fairness id by one balancer.
    Bounded: one entry per tenant holding something (at most the tenant table's bound)."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, int]] = {}

    def held(self, tenant: str) -> tuple[int, int]:
        """(requests, units) ``tenant`` holds."""
        return self._held.get(tenant, (0, 0))

    def add(self, tenant: str, amount: int) -> None:
        """``tenant`` holds one more request of ``amount`` units."""
        n, a = self._held.get(tenant, (0, 0))
        self._held[tenant] = (n + 1, a + amount)

    def remove(self, tenant: str, amount: int) -> None:
        """One request of ``tenant`` of ``amount`` units ended (never below zero)."""
        n, a = self._held.get(tenant, (0, 0))
        if n <= 1:
            self._held.pop(tenant, None)
        else:
            self._held[tenant] = (n - 1, max(0, a - amount))

    def __len__(self) -> int:
        return len(self._held)

    def items(self) -> list[tuple[str, int, int]]:
        """(tenant, requests, units) of every tenant holding something."""
        return [(t, n, a) for t, (n, a) in self._held.items()]


def band_threshold(policy: TenantPolicy, priority: int, reserve: float) -> float:
    """Fill past which a sheddable request of ``priority`` is refused (1.0: never)."""
    span = policy.max_priority - policy.min_priority + 1
    return 1.0 - reserve * (policy.max_priority - priority + 1) / span


def refusal(
    table: TenantTable,
    rc: RequestClass,
    held: TenantHeld,
    caps: tuple[int | None, int | None],
    amount: int,
    fill: Callable[[], Fill] | None = None,
    reserve: float = 0.0,
) -> Refusal | None:
    """Whether a request of class ``rc`` and ``amount`` units may go on: None, or the
    refusal. ``table``: the tenant table (its policy, and whether ``rc`` is sheddable:
    :meth:`~fulcrum.core.tenants.TenantTable.sheddable`); ``caps``: the tenant's (max
    requests, max units), None = no cap; ``fill``: gives the fleet's load, called only
    for a sheddable request (None: no band shedding); ``reserve``: the fraction of the
    fleet kept for higher bands (see the module docstring)."""
    max_n, max_a = caps
    n, a = held.held(rc.tenant)
    if max_n is not None and n + 1 > max_n:
        return Refusal(CAP, f"tenant {rc.tenant!r} holds {n} requests (its cap: {max_n})")
    if max_a is not None and a + amount > max_a:
        return Refusal(CAP, f"tenant {rc.tenant!r} holds {a} units; {amount} more would "
                       f"pass its cap ({max_a})")
    if fill is None or reserve <= 0:
        return None
    if not table.sheddable(rc):
        return None
    limit = band_threshold(table.policy, rc.priority, reserve)
    used = fill().after(amount)
    if used > limit:
        return Refusal(BAND, f"fleet {used:.0%} full: sheddable priority {rc.priority} is "
                       f"refused past {limit:.0%}")
    return None
