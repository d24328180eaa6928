"""deploy/prometheus: the rules and the example config pass promtool, the rule unit tests
pass, and every fulcrum_* metric the rules use is one the daemon exports.

promtool comes from Debian's ``prometheus`` package (.ci/run installs it); without it the
promtool tests skip, saying so.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import fulcrum.metrics
from fulcrum.metrics import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "fulcrum-rules.yaml"
RULE_TESTS = sorted((PROM / "tests").glob("*.yaml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (apt-get install prometheus); .ci/run installs it",
)


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
def test_rules_pass_promtool_check() -> None:
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_example_config_passes_promtool_check() -> None:
    out = promtool("check", "config", "prometheus.yaml", cwd=PROM)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
@pytest.mark.parametrize("path", RULE_TESTS, ids=lambda p: p.name)
def test_rule_unit_tests_pass(path: Path) -> None:
    out = promtool("test", "rules", path.name, cwd=path.parent)
    assert out.returncode == 0, out.stdout + out.stderr


def exported_names() -> set[str]:
    """Every sample name the daemon's registry can export (all metric modules loaded)."""
    for info in pkgutil.iter_modules(fulcrum.metrics.__path__):
        importlib.import_module(f"fulcrum.metrics.{info.name}")
    # the gateway's own metric modules (loaded by the daemon when the gateway is on;
    # imported here so that this module's tests pass alone too)
    for name in ("metrics", "pick_metrics"):
        importlib.import_module(f"fulcrum.gateway.{name}")
    names: set[str] = set()
    for family in REGISTRY.collect():
        base = family.name
        names.add(base)
        if family.type == "counter":
            names.add(base + "_total")
        if family.type == "histogram":
            names |= {base + "_bucket", base + "_count", base + "_sum"}
    # families that are absent until they have a value (the certificate expiry on a
    # plaintext daemon) are still registered under their names
    names |= set(REGISTRY._names_to_collectors)
    return names


def rule_metric_names() -> set[str]:
    names: set[str] = set()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"]
            names |= set(re.findall(r"\bfulcrum_[a-z0-9_]+", expr))
            # regex matchers on __name__ name their metrics by alternation
            for pattern in re.findall(r'__name__=~"([^"]+)"', expr):
                prefix, _, rest = pattern.partition("(")
                alts, _, suffix = rest.partition(")")
                names |= {prefix + a + suffix for a in alts.split("|")}
    return {n for n in names if not n.startswith("fulcrum_(")}


def test_rules_use_only_exported_metrics() -> None:
    missing = rule_metric_names() - exported_names()
    assert not missing, f"rules use metrics the daemon does not export: {sorted(missing)}"


def test_every_alert_has_severity_and_summary() -> None:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule
                assert rule["annotations"]["summary"], rule


def test_every_alert_is_unit_tested() -> None:
    alerts = {
        r["alert"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    tested = {
        t["alertname"]
        for path in RULE_TESTS
        for case in yaml.safe_load(path.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
        if t.get("exp_alerts")
    }
    assert alerts <= tested, f"alerts without a firing unit test: {sorted(alerts - tested)}"


# -- the Grafana dashboard ------------------------------------------------------------

GRAFANA = ROOT / "deploy" / "grafana"


def dashboard() -> dict[str, Any]:
    return dict(json.loads((GRAFANA / "fulcrum.json").read_text()))


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_dashboard_json_is_current() -> None:
    out = subprocess.run(
        [sys.executable, str(GRAFANA / "build_dashboard.py"), "--check"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, "run `python deploy/grafana/build_dashboard.py`"


def test_dashboard_has_a_row_per_balancer_and_unique_ids() -> None:
    panels = dashboard()["panels"]
    rows = [p["title"] for p in panels if p["type"] == "row"]
    for word in ("Prefill", "Decode", "Vision", "EPLB"):
        assert any(word in r for r in rows), rows
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in panels).lower()
    for word in ("imbalance", "queue", "placements", "rebalances"):
        assert word in titles


def test_dashboard_uses_only_exported_metrics_and_recorded_series() -> None:
    recorded = {
        r["record"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    }
    used: set[str] = set()
    for expr in dashboard_exprs():
        used |= set(re.findall(r"\bfulcrum_[a-z0-9_]+", expr))
        for name in re.findall(r"\bfulcrum:[a-z0-9_:]+", expr):
            assert name in recorded, name
    missing = used - exported_names()
    assert not missing, f"dashboard uses metrics the daemon does not export: {sorted(missing)}"


@needs_promtool
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every panel query, with Grafana's variables filled in, is valid PromQL (promtool
    parses it as a recording rule)."""
    rules = [
        {
            "record": f"dashboard:panel_{i}",
            "expr": e.replace("$__rate_interval", "5m").replace("$instance", ".*"),
        }
        for i, e in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
