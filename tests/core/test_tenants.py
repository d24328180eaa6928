"""The tenant table: classes, bounds, folding, validation (issue 23)."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fulcrum.config import ConfigError, parse_settings
from fulcrum.core.tenants import (
    DEFAULT_CLASS,
    DEFAULT_TENANT,
    OTHER_LABEL,
    RequestClass,
    TenantPolicy,
    TenantSpec,
    TenantTable,
)
from fulcrum.errors import InvalidArgument


def _table(**kw: object) -> TenantTable:
    return TenantTable(TenantPolicy(**kw))  # type: ignore[arg-type]


def test_no_tenant_is_the_default_class() -> None:
    t = TenantTable()
    assert t.resolve() == DEFAULT_CLASS == RequestClass(DEFAULT_TENANT, 0, None)
    assert t.policy.single


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"priority": 9}, "priority"),
        ({"priority": -9}, "priority"),
        ({"tenant": "x" * 129}, "tenant"),
        ({"tenant": "a\nb"}, "tenant"),
        ({"ttft_slo_ms": -1}, "ttft_slo_ms"),
        ({"ttft_slo_ms": 86_400_001}, "ttft_slo_ms"),
    ],
)
def test_bad_fields_are_refused_naming_the_field_and_change_nothing(
        kwargs: dict[str, object], field: str) -> None:
    t = TenantTable()
    with pytest.raises(InvalidArgument) as err:
        t.resolve(**{"tenant": "fresh", **kwargs})  # type: ignore[arg-type]
    assert err.value.field == field
    assert t.tracked == 0


def test_configured_tenant_keeps_its_spec_and_label() -> None:
    spec = TenantSpec(weight=3.0, sheddable=True, ttft_slo_ns=2_000_000_000)
    t = _table(classes={"acme": spec})
    rc = t.resolve("acme", 2)
    assert rc == RequestClass("acme", 2, 2_000_000_000)
    assert t.weight("acme") == 3.0 and t.sheddable(rc)
    assert t.label("acme") == "acme"
    assert t.resolve("acme", 0, 500).ttft_slo_ns == 500_000_000


def test_unknown_tenants_get_own_fairness_id_default_spec_bounded_label() -> None:
    t = _table(default=TenantSpec(weight=2.0))
    rc = t.resolve("bob")
    assert rc.tenant == "bob" and t.weight("bob") == 2.0
    assert t.label("bob") == OTHER_LABEL
    assert set(t.labels()) == {DEFAULT_TENANT, OTHER_LABEL}


def test_tenant_past_max_tenants_is_folded_and_counted() -> None:
    t = _table(classes={"acme": TenantSpec()}, max_tenants=3)
    assert [t.resolve(x).tenant for x in ("a", "b", "c", "a", "acme")] == [
        "a", "b", DEFAULT_TENANT, "a", "acme"]
    assert t.folded == 1 and t.tracked == 2


def test_sheddable_by_priority_band() -> None:
    t = _table(sheddable_priorities=frozenset({-1}))
    assert t.sheddable(t.resolve("x", -1)) and not t.sheddable(t.resolve("x", 0))


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"classes": {"default": {}}}, "reserved"),
        ({"classes": {"a": {"weight": 0}}}, "tenants.classes.a.weight"),
        ({"classes": {"a": {"compute_cap": 1.5}}}, "compute_cap"),
        ({"sheddable_priorities": [99]}, "sheddable_priorities"),
        ({"max_tenants": 1, "classes": {"a": {}, "b": {}}}, "max_tenants"),
        ({"min_priority": 1}, "min_priority"),
    ],
)
def test_settings_refuse_bad_sections(section: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"tenants": section})
    assert needle in str(err.value)


def test_settings_to_policy_converts_units() -> None:
    s = parse_settings({"tenants": {"classes": {"a": {"weight": 3, "ttft_slo_ms": 250}},
                                    "starvation_bound_ms": 1000}})
    p = s.tenants.to_policy()
    assert p.classes["a"].ttft_slo_ns == 250_000_000
    assert p.starvation_bound_ns == 1_000_000_000
    assert parse_settings({}).tenants.to_policy() == TenantPolicy()
    assert pickle.loads(pickle.dumps(p)) == p  # crosses the simulator's process pool


@given(st.lists(st.text(min_size=0, max_size=6), max_size=60), st.integers(1, 8))
def test_fairness_ids_bounded_by_max_tenants(names: list[str], bound: int) -> None:
    t = _table(max_tenants=bound)
    ids = set()
    for n in names:
        try:
            ids.add(t.resolve(n).tenant)
        except InvalidArgument:
            continue
    assert len(ids - {DEFAULT_TENANT}) <= bound
    assert t.tracked <= bound
