"""The ONE place where the gateway touches the balancers' state (re-point it here).

Decode: :class:`DecodeAdapter`; prefill: :class:`PrefillAdapter` (at the end).

The picker needs three things from the decode balancer: place a request on a decode GPU
chosen by the configured policy *among the GPUs the gateway may route to*, release it,
and list the next-best GPUs as fallbacks. It uses only the public methods of
:class:`fulcrum.state.decode.DecodeState` (``place``, ``release``, ``view``,
``gpu_loads``) and of the core's :class:`~fulcrum.core.decode.view.GpuWriter`.

Restricting a placement to a set of GPUs (the request's subset hint, or the GPUs that have
a serving address) is done by closing the other GPUs of the view (``live = False``) for
the duration of one synchronous ``place`` call and reopening them right after, on the
event loop with no await in between, so no other caller ever sees the closed GPUs. The
policy therefore decides exactly as it would on a fleet made of the allowed GPUs only
(the dual policy's mean KV per request is that of the allowed GPUs). When the decode
table grows an ``allowed`` argument, replace :meth:`DecodeAdapter.place`'s masking with it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from fulcrum.core.decode.view import GpuWriter
from fulcrum.errors import NotFound, ResourceExhausted
from fulcrum.gateway import metrics as gm
from fulcrum.gateway.registry import AddressBook
from fulcrum.state.decode import DecodeState
from fulcrum.state.prefill import Batch, Delivery, PrefillState

#: (instance_id, gpu_index) of a decode GPU.
GpuKey = tuple[str, int]


class NoEligibleEndpoint(Exception):
    """No GPU with a serving address is in the request's allowed set (answer 503)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """A held decode placement: the chosen GPU, its address and the fallback addresses."""

    request_id: str
    gpu: GpuKey
    address: str
    fallbacks: tuple[str, ...]
    kv_tokens: int
    prompt_tokens: int = 0
    prefiller: str = ""  # P/D: ip:port of the prefill rank, "" when none


class DecodeAdapter:
    """Place / release through the decode balancer, restricted to addressed GPUs.

    ``addresses`` maps a decode GPU to its ``ip:port`` (kept current by the endpoint
    table); a GPU without an address is never picked by the gateway.
    """

    def __init__(
        self,
        state: DecodeState,
        addresses: dict[GpuKey, str],
        registered: AddressBook | None = None,
    ) -> None:
        self._state = state
        self._addresses = addresses
        self._registered = registered
        self._book_version = -1
        self._view_id = -1
        self._writer: GpuWriter | None = None
        self._slot_key: list[GpuKey] = []
        self._slot_addr: list[str | None] = []
        self._addr_slot: dict[str, int] = {}
        self._all_addressed = False

    @property
    def policy_name(self) -> str:
        return self._state.policy_name

    def addresses_changed(self) -> None:
        """The address table changed: rebuild the slot maps at the next call."""
        self._view_id = -1

    def _sync(self) -> GpuWriter:
        """Slot maps of the current view (rebuilt when the decode table rebuilt its view)."""
        view = self._state.view
        book = self._registered
        if (
            id(view) != self._view_id
            or self._writer is None
            or self._writer.view is not view
            or (book is not None and book.version != self._book_version)
        ):
            keys = [(iid, g) for iid, g, _c, _k in self._state.gpu_loads()]
            self._slot_key = keys
            pool = self._addresses
            self._slot_addr = [
                pool.get(k) or (book.get(k) if book is not None else None) for k in keys
            ]
            self._book_version = book.version if book is not None else -1
            gm.ENDPOINTS.set(sum(a is not None for a in self._slot_addr))
            self._addr_slot = {a: s for s, a in enumerate(self._slot_addr) if a is not None}
            self._all_addressed = all(a is not None for a in self._slot_addr)
            self._writer = GpuWriter(view)
            self._view_id = id(view)
        return self._writer

    def _slot_addr_of(self, key: GpuKey) -> str | None:
        got = self._addresses.get(key)
        if got is None and self._registered is not None:
            got = self._registered.get(key)
        return got

    def known(self, address: str) -> bool:
        """Whether ``address`` is a decode GPU the gateway may route to now."""
        self._sync()
        return address in self._addr_slot

    def place(
        self,
        request_id: str,
        kv_tokens: int,
        now_ns: int,
        subset: Collection[str] | None = None,
        fallbacks: int = 0,
    ) -> Placement:
        """Place ``kv_tokens`` tokens (prompt + output estimate) on an allowed decode GPU.

        Allowed: GPUs with an address, and in ``subset`` (``ip:port`` strings) when given.
        Raises NoEligibleEndpoint when none is allowed, and the decode table's errors
        (ResourceExhausted when no allowed GPU has room, InvalidArgument, AlreadyExists).
        """
        writer = self._sync()
        n = len(self._slot_key)
        if subset is None and self._all_addressed:
            if n == 0:
                raise NoEligibleEndpoint("no decode endpoint")
            closed: list[int] = []
        else:
            slot_addr = self._slot_addr
            if subset is None:
                allow = [a is not None for a in slot_addr]
            else:
                want = set(subset)
                allow = [a is not None and a in want for a in slot_addr]
            if not any(allow[s] and writer.is_live(s) for s in range(n)):
                raise NoEligibleEndpoint(
                    "no live decode endpoint in the subset hint"
                    if subset is not None
                    else "no live decode endpoint with a serving address"
                )
            closed = [s for s in range(n) if not allow[s] and writer.is_live(s)]
        view = self._state.view
        for s in closed:
            c, k = writer.load(s)
            writer.write(s, c, k, False)
        try:
            r = self._state.place(request_id, kv_tokens, now_ns)
        except ResourceExhausted:
            # No room, or no live GPU left (the table may just have dropped a lapsed one):
            # the latter is "no eligible endpoint", not a bound.
            if not any(
                writer.view is self._state.view and writer.is_live(s)
                for s in range(len(self._slot_key))
                if s not in closed
            ):
                raise NoEligibleEndpoint("no live decode endpoint") from None
            raise
        finally:
            if closed and self._state.view is view:
                for s in closed:
                    c, k = writer.load(s)
                    writer.write(s, c, k, True)
        key = (r.instance_id, r.gpu_index)
        address = self._slot_addr_of(key)
        if address is None:  # pragma: no cover - closed GPUs are never chosen
            self._state.release(request_id, now_ns)
            raise NoEligibleEndpoint(f"decode GPU {key} has no serving address")
        fb: tuple[str, ...] = ()
        if fallbacks > 0:
            fb = self._fallbacks(address, kv_tokens, subset, fallbacks)
        return Placement(request_id, key, address, fb, kv_tokens)

    def _fallbacks(
        self, primary: str, kv_tokens: int, subset: Collection[str] | None, k: int
    ) -> tuple[str, ...]:
        """Up to ``k`` other allowed GPUs that could take the request, fewest requests
        (then most free KV) first: the view's ``order_conc`` key."""
        self._sync()
        view = self._state.view
        headroom = view.headroom.tolist()
        order = view.order_conc.tolist()
        want = None if subset is None else set(subset)
        cands = [
            (order[s], a)
            for s, a in enumerate(self._slot_addr)
            if a is not None
            and a != primary
            and headroom[s] >= kv_tokens
            and (want is None or a in want)
        ]
        cands.sort()
        return tuple(a for _o, a in cands[:k])

    def release(self, request_id: str, now_ns: int) -> bool:
        """Release a held placement; False when it was no longer held (expired, lost)."""
        try:
            self._state.release(request_id, now_ns)
        except NotFound:
            return False
        return True


class PrefillAdapter:
    """Submit / pull through the prefill balancer (public methods of
    :class:`fulcrum.state.prefill.PrefillState`: ``submit``, ``pull``, ``predict_ns``,
    ``settings``). The gateway submits a request as the entrypoint would and pulls on
    behalf of engines that do not run Fulcrum's engine loop: the same queues, tiers,
    engine choice (most remaining quota) and rank choice (least loaded) as for engines
    that pull themselves."""

    def __init__(self, state: PrefillState) -> None:
        self._state = state

    @property
    def step_quota_ns(self) -> int:
        """Default step budget of an engine (ns), ``prefill.step_quota_ns``."""
        return int(self._state.settings.step_quota_ns)

    def predict_ns(self, total_tokens: int, cached_tokens: int = 0) -> int:
        """Predicted prefill cost of a request (ns) with the cost model in force."""
        return self._state.predict_ns(total_tokens, cached_tokens)

    @property
    def draining(self) -> bool:
        """The prefill balancer refuses new work (daemon drain)."""
        return bool(self._state.draining)

    def max_total_tokens(self) -> int:
        return int(self._state.settings.max_total_tokens)

    async def submit(self, request_id: str, total_tokens: int, wait_ns: int) -> Delivery:
        """Queue a request; returns where an engine's pull put it (engine, DP rank)."""
        return await self._state.submit(request_id, total_tokens, 0, wait_ns)

    async def pull(
        self,
        engine_id: str,
        incarnation: int,
        remaining_ns: int,
        rank_loads_ns: list[int],
        wait_ns: int,
    ) -> Batch:
        """Pull on behalf of an engine (long poll of up to ``wait_ns``)."""
        return await self._state.pull(
            engine_id, incarnation, remaining_ns, rank_loads_ns, wait_ns, 0
        )
