"""``least_requests`` (baseline): the eligible GPU with the fewest requests.

Ties go to the lowest index; KV length is ignored except by the capacity filter. This is
what today's request-count routers do. No parameters.
"""

from __future__ import annotations

from typing import ClassVar, Final

from fulcrum.core.decode.policy import ByKey
from fulcrum.core.decode.view import I64, KV_BITS, FleetView

NAME: Final = "least_requests"


class LeastRequests(ByKey):
    """The ``least_requests`` policy (see module docstring)."""

    __slots__ = ()
    name: ClassVar[str] = NAME

    def key(self, view: FleetView) -> I64:
        # order_conc >> 40 is the concurrency of open GPUs and 2**23 - 1 for closed ones.
        return view.order_conc >> KV_BITS


def from_params(params: object) -> LeastRequests:
    """Factory for the registry (no parameters)."""
    return LeastRequests()
