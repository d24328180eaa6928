"""Per-tenant caps and band shedding of decode and vision (core, pure): properties."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fulcrum.core.tenant_caps import BAND, CAP, Fill, TenantHeld, band_threshold, refusal
from fulcrum.core.tenants import RequestClass, TenantPolicy, TenantSpec, TenantTable

POLICY = TenantPolicy(
    classes={"capped": TenantSpec(decode_max_concurrency=3, decode_max_kv_tokens=1000),
             "batch": TenantSpec(sheddable=True)},
    min_priority=-4, max_priority=4, sheddable_priorities=frozenset({-4, -3, -2, -1}),
)
TABLE = TenantTable(POLICY)
TENANTS = st.sampled_from(["capped", "batch", "default", "x"])


def caps(tenant: str) -> tuple[int | None, int | None]:
    spec = POLICY.classes.get(tenant, POLICY.default)
    return spec.decode_max_concurrency, spec.decode_max_kv_tokens


@given(st.lists(st.tuples(st.booleans(), TENANTS, st.integers(1, 600)), max_size=60))
def test_admitted_requests_never_pass_a_cap(ops: list[tuple[bool, str, int]]) -> None:
    held = TenantHeld()
    live: list[tuple[str, int]] = []
    for place, tenant, kv in ops:
        if place:
            if refusal(TABLE, RequestClass(tenant), held, caps(tenant), kv) is None:
                held.add(tenant, kv)
                live.append((tenant, kv))
        elif live:
            t, k = live.pop(0)
            held.remove(t, k)
        for t, n, a in held.items():
            want = [k for (tt, k) in live if tt == t]
            assert (n, a) == (len(want), sum(want))
            max_n, max_a = caps(t)
            assert max_n is None or n <= max_n
            assert max_a is None or a <= max_a
    assert len(held) == len({t for t, _ in live})


def test_cap_refusal_names_the_tenant_and_the_cap() -> None:
    held = TenantHeld()
    for _ in range(3):
        held.add("capped", 10)
    got = refusal(TABLE, RequestClass("capped"), held, caps("capped"), 10)
    assert got is not None and got.reason == CAP and "its cap: 3" in got.message
    held.remove("capped", 10)
    assert refusal(TABLE, RequestClass("capped"), held, caps("capped"), 981) is not None
    assert refusal(TABLE, RequestClass("capped"), held, caps("capped"), 980) is None


@given(st.integers(-4, 4), st.integers(-4, 4), st.integers(0, 1000), st.floats(0.01, 1.0))
def test_lower_bands_are_shed_first(p: int, q: int, used: int, reserve: float) -> None:
    lo, hi = min(p, q), max(p, q)
    def fill() -> Fill:
        return Fill(requests=used, max_requests=1000, amount=0, max_amount=0)
    held = TenantHeld()

    def shed(prio: int) -> bool:
        r = refusal(TABLE, RequestClass("x", prio), held, (None, None), 1, fill, reserve)
        return r is not None and r.reason == BAND

    if shed(hi):
        assert shed(lo)  # a band is never refused while a lower one is admitted
    assert not shed(0)  # band 0 of a non-sheddable tenant is never shed
    assert band_threshold(POLICY, lo, reserve) <= band_threshold(POLICY, hi, reserve)


def test_sheddable_tenant_is_shed_past_the_reserve_and_others_are_not() -> None:
    def fill() -> Fill:
        return Fill(requests=95, max_requests=100, amount=0, max_amount=0)
    held = TenantHeld()
    got = refusal(TABLE, RequestClass("batch", 4), held, (None, None), 1, fill, 0.9)
    assert got is not None and got.reason == BAND
    assert refusal(TABLE, RequestClass("x", 4), held, (None, None), 1, fill, 0.9) is None
    # reserve 0: never shed on fill
    assert refusal(TABLE, RequestClass("batch", -4), held, (None, None), 1, fill, 0.0) is None
