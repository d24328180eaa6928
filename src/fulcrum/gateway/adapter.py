"""The ONE place where the gateway touches the balancers' state (re-point it here).

Decode: :class:`DecodeAdapter`; prefill: :class:`PrefillAdapter` (at the end).

The picker needs three things from the decode balancer: place a request on a decode GPU
chosen by the configured policy *among the GPUs the gateway may route to*, release it,
and list the next-best GPUs as fallbacks. It uses only public API of
:class:`fulcrum.state.decode.DecodeState`: ``place(..., allowed=...)``, ``release``,
``view`` (read only), ``slot_ranges`` and ``add_slot_listener``.

Restricting a placement is the decode table's filter step, ``place(..., allowed=...)``
(:func:`fulcrum.core.decode.select_allowed`), in the cheaper of its two forms: a subset
hint (a few GPUs of the fleet) as the sorted int64 slot indices it names (O(k) per pick);
"GPUs with a serving address" (most of the fleet), when some GPU has none, as a boolean
mask over the slots, the adapter's own table passed without a copy. With every GPU
addressed and no hint, ``allowed`` is None: the decode table's unchanged fast path. The
policy chooses among the allowed GPUs with the whole fleet as context (dual's mean KV per
request is the fleet's). Nothing here writes the view.

Per-slot tables are kept incrementally: the decode table tells the adapter (as a
:class:`~fulcrum.state.decode.SlotListener`) which instance occupies which slots, and the
address book which member's addresses changed, so that a join or a leave costs
O(that member's GPUs); a growth or compaction of the view (amortised) rebuilds them. The
slot-index array of each distinct subset hint is cached (at most
:data:`MAX_CACHED_SUBSETS`) until the next change of layout or addresses, so a pick
resolves its hint in O(hint size) (a frozenset and a dict hit; sorting the slots only
when not cached), never O(all GPUs) in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Final, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from fulcrum.core.decode import Allowed, FleetView
from fulcrum.core.decode.fallbacks import best_in_blocks, best_slots
from fulcrum.core.decode.view import INT64_MAX
from fulcrum.core.tenants import DEFAULT_CLASS, RequestClass
from fulcrum.errors import NotFound, ResourceExhausted
from fulcrum.gateway import metrics as gm
from fulcrum.gateway.registry import AddressBook
from fulcrum.state.decode import DecodeState
from fulcrum.state.prefill import Batch, Delivery, PrefillState

#: (instance_id, gpu_index) of a decode GPU.
GpuKey = tuple[str, int]
I64 = npt.NDArray[np.int64]

#: Distinct subset hints whose allowed-slot arrays are cached (the cache is emptied when
#: full, and on every change of layout or addresses).
MAX_CACHED_SUBSETS: Final = 1024
#: Above every open GPU's ``order_conc`` (closed GPUs hold INT64_MAX and have no room).
INT64_MAX_KEY: Final = INT64_MAX


class NoEligibleEndpoint(Exception):
    """No GPU with a serving address is in the request's allowed set (answer 503)."""


class Placement(NamedTuple):
    """A held decode placement: the chosen GPU, its address and the fallback addresses
    (a NamedTuple: one per request, cheaper to build than a frozen dataclass)."""

    request_id: str
    gpu: GpuKey
    address: str
    fallbacks: tuple[str, ...]
    kv_tokens: int
    prompt_tokens: int = 0
    prefiller: str = ""  # P/D: ip:port of the prefill rank, "" when none


class DecodeAdapter:
    """Place / release through the decode balancer, restricted to addressed GPUs.

    ``addresses`` maps a decode GPU to its ``ip:port`` (the static pool's table, same dict
    object; call :meth:`addresses_changed` after changing it); ``registered`` holds the
    addresses members registered. A GPU without an address is never picked.
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
        #: slot -> address (None: free slot or GPU without an address).
        self._slot_addr: list[str | None] = []
        #: slot -> has an address (numpy, for the "addressed GPUs only" array).
        self._has_addr = np.zeros(0, dtype=np.bool_)
        self._addr_slot: dict[str, int] = {}
        self._ranges: dict[str, tuple[int, int]] = {}
        self._used = 0  # slots held by instances
        self._addressed = 0  # of which with an address
        self._masks: dict[frozenset[str], I64] = {}
        #: Bumped on every change of layout or addresses: a table kept by decode slot
        #: (the cache-aware picker's index slots) is valid for one generation.
        self.generation = 0
        #: Called by the scraper per endpoint: (ip:port, requests waiting, KV cache
        #: capacity in tokens or 0 when the page does not say, the scrape's time in ns,
        #: the engine process's start in s since the epoch or 0 when the page does not say).
        self.scrape_listeners: list[Callable[[str, int, int, int, float], None]] = []
        #: Called with the addresses an instance's GPUs got (a join, a registration, a
        #: rebuild of the tables), so that per-endpoint state is made off a request's path.
        self.address_listeners: list[Callable[[list[str]], None]] = []
        self._rebuild()
        state.add_slot_listener(self)
        if registered is not None:
            registered.add_listener(self._member_changed)

    @property
    def policy_name(self) -> str:
        return self._state.policy_name

    def has_address(self, address: str) -> bool:
        """``address`` (``ip:port``) serves a decode slot now."""
        return address in self._addr_slot

    # -- slot tables (incremental) ---------------------------------------------------------

    def _lookup(self, key: GpuKey) -> str | None:
        got = self._addresses.get(key)
        if got is None and self._registered is not None:
            got = self._registered.get(key)
        return got

    def _ensure(self, size: int) -> None:
        if len(self._slot_addr) < size:
            grow = max(size, 2 * len(self._slot_addr)) - len(self._slot_addr)
            self._slot_addr.extend([None] * grow)
            self._has_addr = np.concatenate([self._has_addr, np.zeros(grow, dtype=np.bool_)])

    def _set(self, slot: int, address: str | None) -> None:
        old = self._slot_addr[slot]
        if old is not None:
            if self._addr_slot.get(old) == slot:
                del self._addr_slot[old]
            self._addressed -= 1
        self._slot_addr[slot] = address
        self._has_addr[slot] = address is not None
        if address is not None:
            self._addr_slot[address] = slot
            self._addressed += 1

    def _fill(self, instance_id: str, start: int, gpus: int) -> None:
        got = [self._lookup((instance_id, g)) for g in range(gpus)]
        for g, address in enumerate(got):
            self._set(start + g, address)
        named = [a for a in got if a is not None]
        if named:
            for tell in self.address_listeners:
                tell(named)

    def _changed(self) -> None:
        self._masks.clear()
        self.generation += 1
        gm.ENDPOINTS.set(self._addressed)

    def _rebuild(self) -> None:
        """Every table from the decode table's current layout: O(fleet)."""
        self._slot_addr = []
        self._has_addr = np.zeros(0, dtype=np.bool_)
        self._addr_slot = {}
        self._ranges = {}
        self._used = self._addressed = 0
        self._ensure(self._state.view.n_gpus)
        for instance_id, start, gpus in self._state.slot_ranges():
            self._ranges[instance_id] = (start, gpus)
            self._used += gpus
            self._fill(instance_id, start, gpus)
        self._changed()

    def slots_opened(self, instance_id: str, start: int, gpus: int) -> None:
        """SlotListener: an instance joined (O(its GPUs))."""
        self._ensure(start + gpus)
        self._ranges[instance_id] = (start, gpus)
        self._used += gpus
        self._fill(instance_id, start, gpus)
        self._changed()

    def slots_closed(self, instance_id: str, start: int, gpus: int) -> None:
        """SlotListener: an instance left (O(its GPUs))."""
        if self._ranges.pop(instance_id, None) is None:
            return
        self._used -= gpus
        for slot in range(start, start + gpus):
            self._set(slot, None)
        self._changed()

    def slots_moved(self) -> None:
        """SlotListener: the view was grown or compacted (amortised O(fleet))."""
        self._rebuild()

    def _member_changed(self, instance_id: str) -> None:
        """A member's registered addresses changed (O(its GPUs))."""
        got = self._ranges.get(instance_id)
        if got is not None:
            self._fill(instance_id, *got)
            self._changed()

    def addresses_changed(self, instance_id: str | None = None) -> None:
        """The static pool's table changed: for one instance (O(its GPUs)), or for all."""
        if instance_id is None:
            self._rebuild()
        else:
            self._member_changed(instance_id)

    def addresses(self) -> list[str]:
        """Every decode address the gateway may route to now (``ip:port``)."""
        return list(self._addr_slot)

    def known(self, address: str) -> bool:
        """Whether ``address`` is a decode GPU the gateway may route to now."""
        return address in self._addr_slot

    def _allowed(self, subset: Collection[str] | None) -> Allowed | None:
        """The allowed slots of a request: None (every slot: all GPUs are addressed), the
        mask of addressed slots (most of the fleet: O(1), kept current in place), or the
        sorted slot indices of a subset hint (cached per distinct hint)."""
        if subset is None:
            if self._addressed == self._used:
                return None
            n = self._state.view.n_gpus
            self._ensure(n)
            return self._has_addr[:n]  # a view of the live table, no copy
        key = subset if isinstance(subset, frozenset) else frozenset(subset)
        got = self._masks.get(key)
        if got is None:
            addr_slot = self._addr_slot
            got = np.array(sorted(addr_slot[a] for a in key if a in addr_slot), dtype=np.int64)
            if len(self._masks) >= MAX_CACHED_SUBSETS:
                self._masks.clear()
            self._masks[key] = got
        return got

    def candidates(
        self, kv_tokens: int, subset: Collection[str] | None = None
    ) -> tuple[I64, list[str], I64]:
        """The endpoints the decode policy's filter leaves for a request of ``kv_tokens``
        tokens: allowed (addressed, in ``subset``), live, a free concurrency slot and KV
        room. Returns their slots (int64, shape ``(k,)``, ascending), addresses and the
        view's ``order_conc`` keys (fewer requests, then more KV first; shape ``(k,)``)."""
        view = self._state.view
        ok = view.headroom >= kv_tokens
        allowed = self._allowed(subset)
        idx: I64
        if allowed is None:
            idx = ok.nonzero()[0].astype(np.int64)
        elif allowed.dtype == np.bool_:
            idx = (ok[: allowed.shape[0]] & allowed).nonzero()[0].astype(np.int64)
        else:
            idx = allowed[ok[allowed]].astype(np.int64)
        if idx.shape[0] and int(idx[-1]) >= len(self._slot_addr):  # pragma: no cover
            self._ensure(int(idx[-1]) + 1)  # the tables follow the view: never short
        has = self._has_addr[idx]
        if not has.all():  # pragma: no cover - only addressed slots are allowed
            idx = idx[has]
        # One C-level pass (a Python expression per slot cost 0.7 ms at 4,096 endpoints).
        addrs = cast(list[str], list(map(self._slot_addr.__getitem__, idx.tolist())))
        return idx, addrs, view.order_conc[idx]

    # -- decisions -------------------------------------------------------------------------

    def place(
        self,
        request_id: str,
        kv_tokens: int,
        now_ns: int,
        subset: Collection[str] | None = None,
        fallbacks: int = 0,
        pin: int | None = None,
        cls: RequestClass = DEFAULT_CLASS,
    ) -> Placement:
        """Place ``kv_tokens`` tokens (prompt + output estimate) on an allowed decode GPU.

        Allowed: GPUs with an address, and in ``subset`` (``ip:port`` strings) when given.
        ``pin``: a slot from :meth:`candidates` the caller chose (cache-aware picks); the
        decode table then places on it alone (its filter still applies). ``cls``: the
        request's class from its headers (the table's tenant step sees it).
        Raises NoEligibleEndpoint when none is allowed, and the decode table's errors
        (ResourceExhausted when no allowed GPU has room, InvalidArgument, AlreadyExists).
        """
        state = self._state
        allowed = self._allowed(subset) if pin is None else np.array([pin], dtype=np.int64)
        if allowed is None:
            if self._used == 0:
                raise NoEligibleEndpoint("no decode endpoint")
        elif allowed.dtype != np.bool_ and (
            allowed.shape[0] == 0 or not bool(state.view.live[allowed].any())
        ):
            raise NoEligibleEndpoint(
                "no live decode endpoint in the subset hint"
                if subset is not None
                else "no live decode endpoint with a serving address"
            )
        try:
            r = state.place(request_id, kv_tokens, now_ns, allowed=allowed, cls=cls)
        except ResourceExhausted:
            # No room, or no allowed GPU left live (the table may just have dropped a
            # lapsed instance): the latter is "no eligible endpoint", not a bound.
            live = state.view.live
            if not bool(live.any() if allowed is None else live[allowed].any()):
                raise NoEligibleEndpoint("no live decode endpoint") from None
            raise
        key = (r.instance_id, r.gpu_index)
        address = self._lookup(key)
        if address is None:  # pragma: no cover - only addressed GPUs are allowed
            state.release(request_id, now_ns)
            raise NoEligibleEndpoint(f"decode GPU {key} has no serving address")
        fb: tuple[str, ...] = ()
        if fallbacks > 0:
            fb = self._fallbacks(address, kv_tokens, self._allowed(subset), fallbacks)
        return Placement(request_id, key, address, fb, kv_tokens)

    def _fallbacks(
        self, primary: str, kv_tokens: int, allowed: Allowed | None, k: int
    ) -> tuple[str, ...]:
        """Up to ``k`` other allowed GPUs that could take the request, fewest requests
        (then most free KV) first: the view's ``order_conc`` key; ties: lowest slot.

        One vectorised pass over the allowed slots; with every slot allowed on a view with
        block minima (>= 32,768 slots), only the blocks that can hold the ``k + 1`` best
        are read (ties between blocks then go to the block read first)."""
        slots = best_slots(self._state.view, kv_tokens, k + 1, allowed)  # primary may be one
        slot_addr = self._slot_addr
        out: list[str] = []
        for slot in slots:
            a = slot_addr[slot] if slot < len(slot_addr) else None
            if a is not None and a != primary:
                out.append(a)
                if len(out) == k:
                    break
        return tuple(out)

    @staticmethod
    def _best_in_blocks(
        view: FleetView, kv_tokens: int, m: int, mask: Allowed | None = None
    ) -> list[int]:
        """Up to ``m`` slots with room (and in ``mask`` when given), smallest
        ``order_conc`` first, read through the view's block minima (lower bounds of any
        slot's key in the block, masked or not): the ``m`` blocks with the smallest
        minima first, then every block whose minimum beats the ``m``-th key found, until
        none does. O(blocks + read slots) instead of O(n)."""
        return best_in_blocks(view, kv_tokens, m, mask)

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
    ``settings``, ``draining``). The gateway submits a request as the entrypoint would
    and pulls on behalf of engines that do not run Fulcrum's engine loop. Both calls end
    in the one core balancer, :class:`fulcrum.core.prefill.balancer.PrefillBalancer`
    (``PrefillState.balancer``, the object the simulator drives): the same tier queues,
    round redistribution of engines across tiers, who may pull, batch taking and
    least-loaded rank choice as for engines that pull themselves; only the figures of a
    proxied pull (remaining quota, rank loads) come from the gateway's own accounting
    (:mod:`fulcrum.gateway.prefill`)."""

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

    async def submit(self, request_id: str, total_tokens: int, wait_ns: int,
                     cls: RequestClass = DEFAULT_CLASS) -> Delivery:
        """Queue a request of class ``cls``; returns where an engine's pull put it
        (engine, DP rank)."""
        return await self._state.submit(request_id, total_tokens, 0, wait_ns, cls=cls)

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
