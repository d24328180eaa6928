"""``least_kv`` (baseline): the eligible GPU with the smallest total KV (tokens).

Ties go to fewer requests, then the lowest index; otherwise concurrency is ignored except
by the capacity filter. No parameters.
"""

from __future__ import annotations

from typing import ClassVar, Final

from fulcrum.core.decode.policy import ByKey
from fulcrum.core.decode.view import I64, FleetView

NAME: Final = "least_kv"


class LeastKv(ByKey):
    """The ``least_kv`` policy (see module docstring)."""

    __slots__ = ()
    name: ClassVar[str] = NAME

    def key(self, view: FleetView) -> I64:
        # order_kv: less KV first, then fewer requests (closed GPUs last).
        return view.order_kv


def from_params(params: object) -> LeastKv:
    """Factory for the registry (no parameters)."""
    return LeastKv()
