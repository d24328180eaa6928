"""Serving addresses registered by decode instances (``DecodeGpuCapacity.serving_address``).

A decode instance that registers with Fulcrum may give the ``ip:port`` of each of its
GPUs (DP ranks); the gateway then routes to those GPUs too. The fleet service validates
the addresses before admitting the member (a refused registration changes nothing) and
records them here after; the book follows the fleet and forgets a member that leaves.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence

from fulcrum.core.types import Member, MemberLoad
from fulcrum.errors import InvalidArgument

#: (instance_id, gpu_index) of a decode GPU.
GpuKey = tuple[str, int]


def _valid(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            return ipaddress.ip_address(host).version == 6
        except ValueError:
            return False
    try:
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        return False


def validate_addresses(addresses: Sequence[str]) -> tuple[str, ...] | None:
    """The GPUs' serving addresses of a registration (None when none is set); raises
    InvalidArgument naming the field when some but not all are set or one is malformed."""
    if not any(addresses):
        return None
    for i, a in enumerate(addresses):
        if not a:
            raise InvalidArgument(
                f"decode_instance.gpus[{i}].serving_address",
                "must be set on every GPU or on none",
            )
        if len(a) > 64 or not _valid(a):
            raise InvalidArgument(
                f"decode_instance.gpus[{i}].serving_address",
                "must be IPv4:port or [IPv6]:port, port in [1, 65535]",
            )
    if len(set(addresses)) != len(addresses):
        raise InvalidArgument("decode_instance.gpus.serving_address", "must be distinct")
    return tuple(addresses)


class AddressBook:
    """Registered serving addresses by decode GPU (a FleetListener of decode instances).

    ``version`` grows on every change, so readers can cache derived tables; listeners
    added with :meth:`add_listener` are called with the member id after each change."""

    def __init__(self) -> None:
        self._by_member: dict[str, tuple[int, tuple[str, ...]]] = {}
        self.version = 0
        self._listeners: list[Callable[[str], None]] = []

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(member_id)`` after every change of that member's addresses."""
        self._listeners.append(listener)

    def _changed(self, member_id: str) -> None:
        self.version += 1
        for listener in self._listeners:
            listener(member_id)

    def record(self, member: Member, addresses: tuple[str, ...] | None) -> None:
        """After a registration: the member's addresses (None: it has none)."""
        if addresses is None:
            if self._by_member.pop(member.member_id, None) is not None:
                self._changed(member.member_id)
            return
        self._by_member[member.member_id] = (member.incarnation, addresses)
        self._changed(member.member_id)

    def get(self, key: GpuKey) -> str | None:
        entry = self._by_member.get(key[0])
        if entry is None or not 0 <= key[1] < len(entry[1]):
            return None
        return entry[1][key[1]]

    def __len__(self) -> int:
        return sum(len(a) for _inc, a in self._by_member.values())

    # -- FleetListener -----------------------------------------------------------------------

    def validate_load(self, member: Member, load: MemberLoad) -> None:
        """Any load is fine here (the decode table validates it)."""

    def on_join(self, member: Member, now_ns: int) -> None:
        """Addresses are recorded by the fleet service right after the join."""

    def on_load(self, member: Member, load: MemberLoad, now_ns: int) -> None:
        """Loads do not change addresses."""

    def on_leave(self, member: Member, reason: str, now_ns: int) -> None:
        entry = self._by_member.get(member.member_id)
        if entry is not None and entry[0] == member.incarnation:
            del self._by_member[member.member_id]
            self._changed(member.member_id)
