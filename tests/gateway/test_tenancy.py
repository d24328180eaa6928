"""Tenancy headers -> (tenant, priority, ttft_slo_ms): table-driven cases, the ignored
counter, and a property: any header value gives a class the daemon accepts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fulcrum.config.tenancy import GatewayTenancySettings
from fulcrum.core.tenants import MAX_TTFT_SLO_MS, TenantPolicy, TenantTable
from fulcrum.gateway import tenancy
from fulcrum.gateway.tenancy import Ignored, Tenancy
from fulcrum.metrics import REGISTRY

FID = "x-gateway-inference-fairness-id"
OBJ = "x-gateway-inference-objective"
TTFT = "x-slo-ttft-ms"
SETTINGS = GatewayTenancySettings(objectives={"critical": 5, "batch": -2, "huge": 100})
POLICY = TenantPolicy(max_tenant_length=16)

CASES: list[tuple[str, list[tuple[str, str]], Tenancy]] = [
    ("nothing", [], Tenancy()),
    ("other headers only", [("content-type", "application/json")], Tenancy()),
    ("tenant", [(FID, "team-a")], Tenancy(tenant="team-a")),
    ("tenant, mixed-case name", [("X-Gateway-Inference-Fairness-Id", "t")], Tenancy("t")),
    ("tenant, whitespace trimmed", [(FID, "  team-a \t")], Tenancy(tenant="team-a")),
    ("tenant, empty", [(FID, "")], Tenancy()),
    ("tenant, at the bound", [(FID, "a" * 16)], Tenancy(tenant="a" * 16)),
    ("tenant, over the bound", [(FID, "a" * 17)],
     Tenancy(ignored=(Ignored("fairness_id", "too_long"),))),
    ("tenant, control character", [(FID, "a\x01b")],
     Tenancy(ignored=(Ignored("fairness_id", "malformed"),))),
    ("tenant, repeated same", [(FID, "a"), (FID, "a")], Tenancy(tenant="a")),
    ("tenant, repeated differing", [(FID, "a"), (FID, "b")],
     Tenancy(ignored=(Ignored("fairness_id", "malformed"),))),
    ("objective", [(OBJ, "critical")], Tenancy(priority=5)),
    ("objective, negative (sheddable in the extension)", [(OBJ, "batch")],
     Tenancy(priority=-2)),
    ("objective, unknown: priority 0", [(OBJ, "nope")],
     Tenancy(ignored=(Ignored("objective", "unknown_objective"),))),
    ("objective, priority past tenants.max_priority", [(OBJ, "huge")],
     Tenancy(ignored=(Ignored("objective", "out_of_range"),))),
    ("objective, a number is not a name", [(OBJ, "5")],
     Tenancy(ignored=(Ignored("objective", "unknown_objective"),))),
    ("ttft", [(TTFT, "500")], Tenancy(ttft_slo_ms=500)),
    ("ttft, fraction rounds up", [(TTFT, "499.2")], Tenancy(ttft_slo_ms=500)),
    ("ttft, zero", [(TTFT, "0")], Tenancy(ignored=(Ignored("ttft_slo_ms", "out_of_range"),))),
    ("ttft, past one day", [(TTFT, str(MAX_TTFT_SLO_MS + 1))],
     Tenancy(ignored=(Ignored("ttft_slo_ms", "out_of_range"),))),
    ("ttft, negative", [(TTFT, "-5")],
     Tenancy(ignored=(Ignored("ttft_slo_ms", "malformed"),))),
    ("ttft, word", [(TTFT, "soon")],
     Tenancy(ignored=(Ignored("ttft_slo_ms", "malformed"),))),
    ("ttft, unit suffix", [(TTFT, "500ms")],
     Tenancy(ignored=(Ignored("ttft_slo_ms", "malformed"),))),
    ("ttft, non-ASCII digits", [(TTFT, "\u0665\u0660\u0660")],
     Tenancy(ignored=(Ignored("ttft_slo_ms", "malformed"),))),
    ("ttft, exponent", [(TTFT, "1e3")],
     Tenancy(ignored=(Ignored("ttft_slo_ms", "malformed"),))),
    ("all three", [(FID, "team-a"), (OBJ, "critical"), (TTFT, "250")],
     Tenancy("team-a", 5, 250)),
    ("one bad, others kept", [(FID, "team-a"), (OBJ, "nope"), (TTFT, "250")],
     Tenancy("team-a", 0, 250, (Ignored("objective", "unknown_objective"),))),
]


@pytest.mark.parametrize(("headers", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_headers_to_class(headers: list[tuple[str, str]], want: Tenancy) -> None:
    assert tenancy.parse(headers, SETTINGS, POLICY) == want


def test_header_names_follow_the_settings() -> None:
    s = GatewayTenancySettings(
        fairness_header="x-llm-d-inference-fairness-id",
        objective_header="x-llm-d-inference-objective",
        objectives={"critical": 3},
    )
    got = tenancy.parse(
        [("x-llm-d-inference-fairness-id", "a"), ("x-llm-d-inference-objective", "critical"),
         (FID, "ignored-name")], s, POLICY)
    assert got == Tenancy("a", 3)


def test_ignored_headers_are_counted() -> None:
    def value(role: str, reason: str) -> float:
        v = REGISTRY.get_sample_value(
            "fulcrum_gateway_tenancy_headers_ignored_total", {"header": role, "reason": reason})
        return v or 0.0

    before = value("ttft_slo_ms", "malformed"), value("objective", "unknown_objective")
    got = tenancy.parse([(TTFT, "x"), (OBJ, "nope"), (FID, "fine")], SETTINGS, POLICY)
    tenancy.count_ignored(got)
    assert got.tenant == "fine"
    assert value("ttft_slo_ms", "malformed") == before[0] + 1
    assert value("objective", "unknown_objective") == before[1] + 1


def test_settings_refuse_bad_names_and_clashes() -> None:
    with pytest.raises(ValueError, match="Kubernetes object name"):
        GatewayTenancySettings(objectives={"Not_A_Name": 1})
    with pytest.raises(ValueError, match="must differ"):
        GatewayTenancySettings(ttft_header=FID)
    with pytest.raises(ValueError, match="header name"):
        GatewayTenancySettings(fairness_header="X Tenant")


_VALUES = st.one_of(st.text(max_size=40), st.sampled_from(["critical", "batch", "huge", "12"]))


@given(st.lists(st.tuples(st.sampled_from([FID, OBJ, TTFT, "other"]), _VALUES), max_size=6))
def test_any_headers_give_a_class_the_daemon_accepts(headers: list[tuple[str, str]]) -> None:
    got = tenancy.parse(headers, SETTINGS, POLICY)
    # never raises, and the daemon's own validation accepts what it gives
    rc = TenantTable(POLICY).resolve(got.tenant, got.priority, got.ttft_slo_ms)
    assert POLICY.min_priority <= rc.priority <= POLICY.max_priority
    assert got.ttft_slo_ms is None or 1 <= got.ttft_slo_ms <= MAX_TTFT_SLO_MS
    assert len(got.ignored) <= 3
