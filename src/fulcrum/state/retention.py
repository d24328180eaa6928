"""Retained outcomes of acknowledged prefill submits, bounded per submitter.

An acknowledged request's outcome is kept ``retention_ms`` so that a retried Submit
(same id, same lengths) gets it instead of a second delivery. The table never evicts an
outcome early: when it is full -- ``max_retained`` outcomes in all, or
``max_retained_per_submitter`` of one submitter -- a NEW submit of that submitter is
refused RESOURCE_EXHAUSTED with ``retry-after-ms`` (until its oldest outcome expires).
One client's flood of unique ids therefore fills only its own share and is refused; it
cannot evict another client's outcomes (issue 22, row 7).

A submitter is the caller's identity as the service names it (the mTLS or token
identity; else the peer's host). Outcomes are kept in acknowledgement order; their
expiry is that order too while ``retention_ms`` is unchanged, so expired ones leave from
the head. Only the event loop touches it; times are ns from the daemon's clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from fulcrum.errors import ResourceExhausted

D = TypeVar("D")


@dataclass(frozen=True, slots=True)
class Retained(Generic[D]):
    """One kept outcome: the request's lengths (tokens), its outcome, when it expires
    (ns) and who submitted it."""

    total: int
    cached: int
    outcome: D
    expires_ns: int
    submitter: str


class RetentionTable(Generic[D]):
    """See module docstring."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, Retained[D]] = OrderedDict()
        self._per: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._kept)

    def of(self, submitter: str) -> int:
        """Outcomes kept for ``submitter``."""
        return self._per.get(submitter, 0)

    def purge(self, now_ns: int) -> None:
        """Drop the outcomes that expired by ``now_ns`` (from the head)."""
        kept = self._kept
        while kept:
            rid, entry = next(iter(kept.items()))
            if entry.expires_ns > now_ns:
                break
            self._pop(rid)

    def _pop(self, rid: str) -> None:
        entry = self._kept.pop(rid)
        left = self._per[entry.submitter] - 1
        if left > 0:
            self._per[entry.submitter] = left
        else:
            del self._per[entry.submitter]

    def get(self, rid: str, now_ns: int) -> Retained[D] | None:
        """The outcome kept for ``rid`` if it has not expired."""
        entry = self._kept.get(rid)
        if entry is None:
            return None
        if entry.expires_ns <= now_ns:
            self._pop(rid)
            return None
        return entry

    def admit(self, submitter: str, now_ns: int, total_bound: int, per_bound: int) -> None:
        """Raise RESOURCE_EXHAUSTED (with retry-after-ms: until the oldest outcome in the
        way expires) when a new submit of ``submitter`` could not be retained."""
        self.purge(now_ns)
        if len(self._kept) >= total_bound:
            head = next(iter(self._kept.values()), None)
            raise _full("prefill.max_retained", total_bound, head, now_ns)
        if self._per.get(submitter, 0) >= per_bound:
            head = next((e for e in self._kept.values() if e.submitter == submitter), None)
            raise _full("prefill.max_retained_per_submitter", per_bound, head, now_ns)

    def put(self, rid: str, total: int, cached: int, outcome: D, expires_ns: int,
            submitter: str) -> None:
        """Keep ``outcome`` for ``rid`` until ``expires_ns`` (replacing an older one)."""
        if rid in self._kept:
            self._pop(rid)
        self._kept[rid] = Retained(total, cached, outcome, expires_ns, submitter)
        self._per[submitter] += 1


def _full(key: str, bound: int, head: Retained[D] | None, now_ns: int) -> ResourceExhausted:
    wait_ms = 1 if head is None else max(1, -(-(head.expires_ns - now_ns) // 1_000_000))
    return ResourceExhausted(
        f"prefill: the retained-outcome table is full ({key} = {bound}); outcomes are kept "
        "for prefill.retention_ms and never evicted early, so new submits wait",
        retry_after_ms=wait_ms,
    )
