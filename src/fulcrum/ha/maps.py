"""EPLB maps in etcd (``ha.backend: etcd``): each group's map in force, its version and
its layout, as the same JSON document as a snapshot map file
(:func:`fulcrum.state.eplb_store.map_doc`), under ``<election_key>/eplb/<sha256(group)>``.

Writes go through :meth:`fulcrum.ha.etcd.EtcdElector.guarded` (a transaction that holds
only while this daemon's election key is the one it created), before the change applies.
A document larger than etcd's request limit (1.5 MiB by default, less an envelope) is
refused at RegisterGroup (INVALID_ARGUMENT naming the size and the limit). Windows stay
soft: a new leader's windows start empty and refill in ``window_steps`` reported steps.
"""

from __future__ import annotations

import json

import aetcd.rpc as rpc
import structlog

from fulcrum.errors import InvalidArgument
from fulcrum.ha.etcd import EtcdElector
from fulcrum.state import eplb_store as store

log = structlog.get_logger(__name__)

#: etcd's default --max-request-bytes (1.5 MiB) less room for the transaction envelope.
MAX_DOC_BYTES = 1536 * 1024 - 4096


class EtcdMaps:
    """:class:`fulcrum.state.eplb.Durable` on etcd (see the module docstring)."""

    def __init__(self, elector: EtcdElector, election_key: str) -> None:
        self._elector = elector
        self.prefix = (election_key.rstrip("/") + "/eplb/").encode()

    def key(self, group_id: str) -> bytes:
        return self.prefix + store.group_key(group_id).encode()

    @staticmethod
    def encode(rec: store.MapRecord) -> bytes:
        """The document of a map; InvalidArgument when etcd could not take it."""
        data = json.dumps(store.map_doc(rec), separators=(",", ":")).encode()
        if len(data) > MAX_DOC_BYTES:
            raise InvalidArgument(
                "layout", f"group {rec.group_id!r}'s map is {len(data)} bytes as stored, over "
                f"etcd's request limit ({MAX_DOC_BYTES} bytes usable of 1.5 MiB) that "
                "ha.backend etcd writes it under; use fewer layers or physical experts per "
                "group, or ha.backend none"
            )
        return data

    async def save(self, rec: store.MapRecord) -> None:
        data = self.encode(rec)
        put = rpc.RequestOp(request_put=rpc.PutRequest(key=self.key(rec.group_id), value=data))
        await self._elector.guarded([put])

    async def remove(self, group_id: str) -> None:
        op = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=self.key(group_id)))
        await self._elector.guarded([op])

    async def load(self) -> list[store.RestoredGroup]:
        """Every group stored; a document that does not parse is logged and skipped."""
        out = []
        for key, value in await self._elector.get_prefix(self.prefix):
            try:
                out.append(store.parse_group(json.loads(value)))
            except (ValueError, TypeError, KeyError) as err:
                log.error("ha_eplb_map_unreadable", key=key.decode(errors="replace"),
                          error=str(err), effect="this group is not served; register it again")
        return out
