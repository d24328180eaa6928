"""The simulator's tenants (issue 23): trace fields, the cluster's tenants settings, the
core's order rules and shed intent, by_tenant / by_priority, the tenant-mix builder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fulcrum.core.prefill.rules.order import Fifo, StrictRoundRobin, VtcTokens, WfqNs
from fulcrum.sim import cli
from fulcrum.sim.cluster import Cluster
from fulcrum.sim.engine import Simulator, simulate
from fulcrum.sim.policies import get_policy_set
from fulcrum.sim.report import summarize
from fulcrum.sim.rows import TraceError
from fulcrum.sim.tenant_mix import TenantPart, tag, tenant_mix
from fulcrum.sim.tenant_report import max_service_gap_s
from fulcrum.sim.traces import read_trace
from fulcrum.sim.workload import Request

MS = 1_000_000
ENTRY_KEYS = {"requests", "finished", "shed", "ttft_p50_s", "ttft_p99_s", "ttft_by_tier",
              "compute_share", "max_service_gap_s"}


def small(**tenants: object) -> Cluster:
    c = Cluster().with_overrides(prefill={"engines": 1, "ranks_per_engine": 1})
    if tenants:
        raw = c.model_dump()
        raw["tenants"] = tenants
        c = Cluster.model_validate(raw)
    return c


def flood(n: int, tenant: str, every_ms: int, tokens: int, prio: int = 0,
          slo: int | None = None, start: int = 0) -> list[Request]:
    return [Request(i, start + i * every_ms * MS, tokens, 2, tenant=tenant, priority=prio,
                    ttft_slo_ms=slo) for i in range(n)]


def test_minimal_jsonl_reads_the_class_fields(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "tenant": "acme", '
        '"priority": 2, "ttft_slo_ms": 1500}\n'
        '{"timestamp": 5, "input_length": 10, "output_length": 2}\n')
    a, b = read_trace(p)
    assert (a.tenant, a.priority, a.ttft_slo_ms) == ("acme", 2, 1500)
    assert (b.tenant, b.priority, b.ttft_slo_ms) == ("", 0, None)


@pytest.mark.parametrize(("field", "value"), [
    ("tenant", 3), ("priority", "high"), ("priority", 1.5), ("ttft_slo_ms", 0),
    ("ttft_slo_ms", "soon")])
def test_bad_class_fields_name_the_field_and_line(tmp_path: Path, field: str,
                                                  value: object) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1,
                             field: value}) + "\n")
    with pytest.raises(TraceError, match=rf":1: field '{field}'"):
        read_trace(p)


def test_priority_outside_the_range_is_refused_by_the_core_table() -> None:
    with pytest.raises(ValueError, match="priority: must be in"):
        Simulator(small(), get_policy_set("default"), flood(2, "a", 10, 100, prio=99))


@pytest.mark.parametrize(("name", "rule"), [
    ("default", WfqNs), ("fifo", Fifo), ("strict_rr", StrictRoundRobin),
    ("vtc_tokens", VtcTokens)])
def test_policy_sets_run_the_core_order_rules(name: str, rule: type) -> None:
    sim = Simulator(small(), get_policy_set(name), flood(2, "a", 10, 100))
    assert type(sim.balancer.config.rules.order) is rule
    assert sim.balancer.config.tenants == small().tenants.to_policy()


def test_by_tenant_and_by_priority_entries() -> None:
    reqs = sorted(flood(60, "heavy", 50, 12_000) + flood(60, "light", 50, 500, prio=1),
                  key=lambda r: r.arrival_ns)
    reqs = [Request(i, r.arrival_ns, r.input_tokens, 2, tenant=r.tenant,
                    priority=r.priority) for i, r in enumerate(reqs)]
    s = summarize(simulate(small(), get_policy_set("default"), reqs, drain_s=60))
    assert set(s["by_tenant"]) == {"heavy", "light"}
    assert set(s["by_priority"]) == {"1", "0"}
    for table in (s["by_tenant"], s["by_priority"]):
        for e in table.values():
            assert set(e) == ENTRY_KEYS and e["requests"] == 60
            assert set(e["ttft_by_tier"]) == {"<16K"}
            assert set(e["ttft_by_tier"]["<16K"]) == {"p50_s", "p99_s"}
    shares = sum(e["compute_share"] for e in s["by_tenant"].values())
    assert shares == pytest.approx(s["prefill_utilisation"], rel=1e-6)
    assert s["by_tenant"]["heavy"]["compute_share"] > s["by_tenant"]["light"]["compute_share"]


def test_sheddable_class_is_shed_on_a_predicted_miss_and_others_never() -> None:
    over = flood(200, "batch", 5, 8_000, slo=200) + flood(200, "chat", 5, 8_000, slo=200,
                                                          start=1)
    reqs = [Request(i, r.arrival_ns, r.input_tokens, 2, tenant=r.tenant,
                    ttft_slo_ms=r.ttft_slo_ms)
            for i, r in enumerate(sorted(over, key=lambda r: r.arrival_ns))]
    cluster = small(classes={"batch": {"sheddable": True}})
    s = summarize(simulate(cluster, get_policy_set("default"), reqs, drain_s=60))
    assert s["by_tenant"]["batch"]["shed"] > 0
    assert s["by_tenant"]["chat"]["shed"] == 0
    assert s["shed"] == s["by_tenant"]["batch"]["shed"]
    plain = summarize(simulate(small(), get_policy_set("default"), reqs, drain_s=60))
    assert plain["shed"] == 0  # the default never sheds on prediction


def test_weights_from_the_cluster_settings_split_compute() -> None:
    reqs = sorted(flood(400, "a", 20, 6_000) + flood(400, "b", 20, 6_000),
                  key=lambda r: r.arrival_ns)
    reqs = [Request(i, r.arrival_ns, r.input_tokens, 2, tenant=r.tenant)
            for i, r in enumerate(reqs)]
    cluster = small(classes={"a": {"weight": 3}})
    s = summarize(simulate(cluster, get_policy_set("default"), reqs, drain_s=0))
    a, b = (s["by_tenant"][t]["compute_share"] for t in ("a", "b"))
    assert a / (a + b) == pytest.approx(0.75, abs=0.05)


def test_max_service_gap() -> None:
    arrival = np.array([0, 0, 0, 50], dtype=np.int64)
    taken = np.array([10, 20, 40, 60], dtype=np.int64)
    assert max_service_gap_s(arrival, taken, 100) == pytest.approx(20e-9)
    assert max_service_gap_s(arrival, np.array([10, -1, -1, -1]), 100) == pytest.approx(90e-9)


def test_tenant_mix_tags_scales_and_cuts() -> None:
    a = flood(100, "", 100, 4_000)
    b = flood(300, "", 10, 400)
    cluster = small()
    mix = tenant_mix([TenantPart(a, "heavy", 1.5), TenantPart(b, "light", 0.2, 1, 900)],
                     cluster)
    heavy = [r for r in mix if r.tenant == "heavy"]
    light = [r for r in mix if r.tenant == "light"]
    assert heavy and light and len(heavy) + len(light) == len(mix)
    assert all(r.priority == 1 and r.ttft_slo_ms == 900 for r in light)
    assert [r.rid for r in mix] == list(range(len(mix)))
    assert tag(a, "x")[0].tenant == "x"


def test_cli_tenant_mix_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 2_000 + i,
                                     "output_length": 2}) + "\n" for i in range(50)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prefill: {engines: 1, ranks_per_engine: 2}\n"
                   "tenants: {classes: {a: {weight: 2}}}\n")
    argv = ["--tenant-mix", f"{p}:a:0.8,{p}:b:0.4:1", "--cluster", str(cfg), "--json",
            "--quiet", "--policies", "default,fifo,strict_rr,vtc_tokens", "--drain", "30"]
    assert cli.main(argv) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["policy"] for r in runs] == ["default", "fifo", "strict_rr", "vtc_tokens"]
    for r in runs:
        assert set(r["by_tenant"]) == {"a", "b"} and set(r["by_priority"]) == {"0", "1"}
    assert cli.main(["--tenant-mix", f"{p}:a", "--quiet"]) == 2
    assert "--tenant-mix part 0" in capsys.readouterr().err
