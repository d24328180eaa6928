# ruff: noqa: E501 - PromQL queries read best on one line
"""Generate deploy/grafana/fulcrum.json, the Fulcrum dashboard: an overview row, then one
row per balancer (prefill, decode, VE, EPLB) with its imbalance, queues and decisions, a
tenants row (compute share, queues, shedding, deadline misses) and a security row. Run ``python deploy/grafana/build_dashboard.py`` after changing it; the test
suite checks that the JSON is current and uses only metrics the daemon exports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("fulcrum.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job="fulcrum", instance=~"$instance"'


class Board:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append(
            {"type": "row", "title": title, "id": self._id(), "collapsed": False,
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []}
        )
        self.y += 1

    def panel(
        self,
        title: str,
        targets: list[tuple[str, str]],
        *,
        unit: str = "short",
        kind: str = "timeseries",
        width: int = 8,
        description: str = "",
        thresholds: list[tuple[float, str]] | None = None,
    ) -> None:
        if self.x + width > 24:
            self.y += 8
            self.x = 0
        steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
        steps += [{"color": c, "value": v} for v, c in thresholds or []]
        self.panels.append(
            {
                "type": kind,
                "title": title,
                "description": description,
                "id": self._id(),
                "datasource": DS,
                "gridPos": {"h": 8, "w": width, "x": self.x, "y": self.y},
                "fieldConfig": {
                    "defaults": {
                        "unit": unit,
                        "thresholds": {"mode": "absolute", "steps": steps},
                    },
                    "overrides": [],
                },
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr,
                     "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)
                ],
            }
        )
        self.x += width


def build() -> dict[str, Any]:
    b = Board()
    b.row("Overview")
    b.panel("Daemon up", [(f"up{{{SEL}}}", "{{instance}}")], kind="stat", width=4,
            thresholds=[(0.5, "green")])
    b.panel("RPCs by code", [(f"sum by (code) (rate(fulcrum_rpc_requests_total{{{SEL}}}[$__rate_interval]))", "{{code}}")],
            unit="reqps", width=10)
    b.panel("RPC latency p99 by method", [(
        f"histogram_quantile(0.99, sum by (le, method) (rate(fulcrum_rpc_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
        "{{method}}")], unit="s", width=10)
    b.panel("Live fleet members", [(f"sum by (kind) (fulcrum_fleet_members{{{SEL}}})", "{{kind}}")],
            width=8)
    b.panel("Fleet events", [(f"sum by (kind, event) (rate(fulcrum_fleet_events_total{{{SEL}}}[$__rate_interval]))",
                              "{{kind}} {{event}}")], unit="ops", width=8)
    b.panel("Calls in flight / draining", [(f"fulcrum_rpc_in_flight{{{SEL}}}", "in flight"),
                                           (f"fulcrum_draining{{{SEL}}}", "draining")], width=8)
    b.panel("Calls shed (RESOURCE_EXHAUSTED + retry-after-ms) by class and reason", [(
        f"sum by (class, reason) (rate(fulcrum_rpc_shed_total{{{SEL}}}[$__rate_interval]))",
        "{{class}} {{reason}}")], unit="reqps", width=8)
    b.panel("Config reloads by outcome / restart required", [
        (f"sum by (outcome) (increase(fulcrum_config_reloads_total{{{SEL}}}[$__rate_interval]))",
         "{{outcome}}"),
        (f"fulcrum_config_restart_required{{{SEL}}}", "restart required")], width=8)

    b.row("Prefill balancer")
    b.panel("Queue depth by tier", [(f"sum by (tier) (fulcrum_prefill_queue_depth{{{SEL}}})", "{{tier}}")])
    b.panel("Queue wait p99 by tier", [(
        f"histogram_quantile(0.99, sum by (le, tier) (rate(fulcrum_prefill_wait_seconds_bucket{{{SEL}}}[$__rate_interval])))",
        "{{tier}}")], unit="s")
    b.panel("Queue-wait SLO errors (99% < 1 s)", [
        ("fulcrum:prefill_wait_slo_errors:ratio_rate5m", "5m"),
        ("fulcrum:prefill_wait_slo_errors:ratio_rate1h", "1h")], unit="percentunit",
        thresholds=[(0.01, "red")])
    b.panel("Engines per tier", [
        (f"sum by (tier) (fulcrum_prefill_engines{{{SEL}}})", "{{tier}}")])
    b.panel("Tier imbalance: engine share / demand share (1 = proportional)", [(
        f"(sum by (tier) (fulcrum_prefill_engines{{{SEL}}}) / ignoring(tier) group_left sum(fulcrum_prefill_engines{{{SEL}}}))"
        f" / (sum by (tier) (fulcrum_prefill_quota_demand_seconds{{{SEL}}}) / ignoring(tier) group_left sum(fulcrum_prefill_quota_demand_seconds{{{SEL}}}))",
        "{{tier}}")])
    b.panel("Quota demand share by tier", [(
        f"sum by (tier) (fulcrum_prefill_quota_demand_seconds{{{SEL}}}) / ignoring(tier) group_left sum(fulcrum_prefill_quota_demand_seconds{{{SEL}}})",
        "{{tier}}")], unit="percentunit")
    b.panel("Submits by outcome", [(
        f"sum by (outcome) (rate(fulcrum_prefill_submits_total{{{SEL}}}[$__rate_interval]))", "{{outcome}}")],
        unit="reqps")
    b.panel("Pulls by result", [(f"sum by (result) (rate(fulcrum_prefill_pulls_total{{{SEL}}}[$__rate_interval]))",
                                 "{{result}}")], unit="ops")
    b.panel("Requests taken by another tier's engines", [(
        f"sum by (tier, engine_tier) (rate(fulcrum_prefill_helped_requests_total{{{SEL}}}[$__rate_interval]))",
        "{{tier}} by {{engine_tier}}")], unit="reqps")
    b.panel("Requests run ahead of lower-band work (priority bands on ranks)", [
        (f"sum by (tier) (rate(fulcrum_prefill_overtaking_requests_total{{{SEL}}}[$__rate_interval]))",
         "{{tier}}"),
        (f"sum by (tier) (rate(fulcrum_prefill_precedence_requests_total{{{SEL}}}[$__rate_interval]))",
         "{{tier}} fair-share precedence")], unit="reqps")
    b.panel("Redistributions and engine moves", [
        (f"sum by (reason) (rate(fulcrum_prefill_rounds_total{{{SEL}}}[$__rate_interval]))", "rounds {{reason}}"),
        (f"rate(fulcrum_prefill_rebalance_moves_total{{{SEL}}}[$__rate_interval])", "moves")], unit="ops")
    b.panel("Cost model relative error p90", [
        (f"fulcrum_prefill_cost_model_relative_error_p90{{{SEL}}}", "p90 (refit window)")],
        unit="percentunit")

    b.row("Decode balancer")
    b.panel("Imbalance (max/mean) by dimension", [
        (f"max by (dimension) (fulcrum_decode_imbalance{{{SEL}}})", "{{dimension}}")],
        thresholds=[(1.5, "red")])
    b.panel("KV tokens per GPU", [(f"fulcrum_decode_gpu_kv_tokens{{{SEL}}}",
                                   "{{decode_instance}}/{{gpu}}")])
    b.panel("Concurrency per GPU", [(f"fulcrum_decode_gpu_concurrency{{{SEL}}}",
                                     "{{decode_instance}}/{{gpu}}")])
    b.panel("Placements by outcome and branch", [(
        f"sum by (outcome, branch) (rate(fulcrum_decode_placements_total{{{SEL}}}[$__rate_interval]))",
        "{{outcome}} {{branch}}")], unit="reqps")
    b.panel("Placements held", [(f"fulcrum_decode_placements_held{{{SEL}}}", "held")])
    b.panel("Lost and expired placements", [
        (f"sum by (reason) (rate(fulcrum_decode_lost_placements_total{{{SEL}}}[$__rate_interval]))", "lost {{reason}}"),
        (f"rate(fulcrum_decode_expirations_total{{{SEL}}}[$__rate_interval])", "expired")], unit="ops")

    b.row("Vision-encoder balancer")
    b.panel("Imbalance (max/mean patches in flight)", [
        (f"max(fulcrum_vision_imbalance{{{SEL}}})", "imbalance")], thresholds=[(1.5, "red")])
    b.panel("Patches in flight per GPU", [(f"fulcrum_vision_gpu_patches_in_flight{{{SEL}}}",
                                           "{{machine}}/{{gpu}}")])
    b.panel("Placements by outcome", [(
        f"sum by (outcome) (rate(fulcrum_vision_placements_total{{{SEL}}}[$__rate_interval]))", "{{outcome}}")],
        unit="reqps")
    b.panel("Patches placed", [(f"sum(rate(fulcrum_vision_patches_placed_total{{{SEL}}}[$__rate_interval]))",
                                "patches/s")], unit="short")
    b.panel("Placements held", [(f"fulcrum_vision_placements_held{{{SEL}}}", "held")])
    b.panel("Lost and expired placements", [
        (f"sum by (reason) (rate(fulcrum_vision_lost_placements_total{{{SEL}}}[$__rate_interval]))", "lost {{reason}}"),
        (f"rate(fulcrum_vision_expirations_total{{{SEL}}}[$__rate_interval])", "expired")], unit="ops")

    b.row("Tenants and priorities")
    b.panel("Prefill compute share by tenant", [(
        f"sum by (tenant) (rate(fulcrum_tenant_prefill_compute_seconds_total{{{SEL}}}[$__rate_interval])) / ignoring(tenant) group_left sum(rate(fulcrum_tenant_prefill_compute_seconds_total{{{SEL}}}[$__rate_interval]))",
        "{{tenant}}")], unit="percentunit",
        description="Share of the predicted prefill compute delivered to engines (GPU-seconds per second); tenant labels: configured tenants, default, other.")
    b.panel("Prefill compute by priority band (GPU-s/s)", [(
        f"sum by (priority) (rate(fulcrum_priority_prefill_compute_seconds_total{{{SEL}}}[$__rate_interval]))",
        "priority {{priority}}")])
    b.panel("Prefill queue depth by tenant", [(
        f"sum by (tenant) (fulcrum_tenant_prefill_queue_depth{{{SEL}}})", "{{tenant}}")])
    b.panel("Prefill queue wait p99 by tenant", [(
        f"histogram_quantile(0.99, sum by (le, tenant) (rate(fulcrum_tenant_prefill_wait_seconds_bucket{{{SEL}}}[$__rate_interval])))",
        "{{tenant}}")], unit="s")
    b.panel("Shed by balancer, tenant and reason", [(
        f"sum by (balancer, tenant, reason) (rate(fulcrum_tenant_shed_total{{{SEL}}}[$__rate_interval]))",
        "{{balancer}} {{tenant}} {{reason}}")], unit="reqps")
    b.panel("TTFT deadline misses by tenant", [(
        f"sum by (balancer, tenant) (rate(fulcrum_tenant_deadline_misses_total{{{SEL}}}[$__rate_interval]))",
        "{{balancer}} {{tenant}}")], unit="reqps")
    b.panel("Decode placements and vision requests held by tenant", [
        (f"sum by (tenant) (fulcrum_tenant_decode_placements{{{SEL}}})", "decode {{tenant}}"),
        (f"sum by (tenant) (fulcrum_tenant_vision_requests{{{SEL}}})", "vision {{tenant}}")])
    b.panel("Decode KV held by tenant", [(
        f"sum by (tenant) (fulcrum_tenant_decode_kv_tokens{{{SEL}}})", "{{tenant}}")])
    b.panel("Tenant table: tracked, folded, refused fields and headers", [
        (f"sum(fulcrum_tenants_tracked{{{SEL}}})", "tracked"),
        (f"sum(rate(fulcrum_tenant_folded_total{{{SEL}}}[$__rate_interval]))", "folded/s"),
        (f"sum by (field) (rate(fulcrum_tenant_invalid_fields_total{{{SEL}}}[$__rate_interval]))", "invalid {{field}}/s"),
        (f"sum by (header, reason) (rate(fulcrum_gateway_tenancy_headers_ignored_total{{{SEL}}}[$__rate_interval]))",
         "header {{header}} {{reason}}/s")])

    b.row("Gateway (endpoint picker)")
    b.panel("Picks by outcome", [(
        f"sum by (outcome) (rate(fulcrum_gateway_picks_total{{{SEL}}}[$__rate_interval]))",
        "{{outcome}}")], unit="reqps")
    b.panel("Releases by reason (expired: no access-log entry within gateway.max_hold_s)", [(
        f"sum by (reason) (rate(fulcrum_gateway_releases_total{{{SEL}}}[$__rate_interval]))",
        "{{reason}}")], unit="reqps")
    b.panel("Requests in flight, Envoy access-log entries (unary and HTTP modes), HTTP picker connections", [
        (f"sum(fulcrum_gateway_requests_in_flight{{{SEL}}})", "in flight"),
        (f"sum by (outcome) (rate(fulcrum_gateway_access_log_entries_total{{{SEL}}}[$__rate_interval]))",
         "log entries {{outcome}}/s"),
        (f"sum by (outcome) (rate(fulcrum_gateway_access_log_ttft_total{{{SEL}}}[$__rate_interval]))",
         "logged TTFT {{outcome}}/s"),
        (f"sum(fulcrum_gateway_authz_http_connections{{{SEL}}})", "HTTP connections")])
    b.panel("Pick time p99 and predicted TTFT p50 of the chosen endpoint", [
        (f"histogram_quantile(0.99, sum by (le) (rate(fulcrum_gateway_pick_seconds_bucket{{{SEL}}}[$__rate_interval])))",
         "pick p99"),
        (f"histogram_quantile(0.5, sum by (le) (rate(fulcrum_gateway_cache_predicted_ttft_seconds_bucket{{{SEL}}}[$__rate_interval])))",
         "predicted TTFT p50")], unit="s")
    b.panel("Prompt tokens found in an endpoint's cache (hit / prompt)", [(
        f"sum(rate(fulcrum_gateway_cache_hit_tokens_total{{{SEL}}}[$__rate_interval])) / "
        f"sum(rate(fulcrum_gateway_cache_prompt_tokens_total{{{SEL}}}[$__rate_interval]))",
        "hit ratio")], unit="percentunit")
    b.panel("Picks that copy a prefix another endpoint held, by charge (shared: requests in flight use it)", [(
        f"sum by (charge) (rate(fulcrum_gateway_cache_prefix_copies_total{{{SEL}}}[$__rate_interval]))",
        "{{charge}}")], unit="reqps")
    b.panel("Cost-model learning: observed first tokens by result (kept: picked alone), refits by result", [
        (f"sum by (result) (rate(fulcrum_gateway_cost_samples_total{{{SEL}}}[$__rate_interval]))",
         "samples {{result}}/s"),
        (f"sum by (result) (increase(fulcrum_gateway_cost_refits_total{{{SEL}}}[$__rate_interval]))",
         "refits {{result}}")])
    b.panel("Prefix index entries, and engines seen restarted (their index cleared)", [
        (f"sum(fulcrum_gateway_prefix_index_blocks{{{SEL}}})", "index blocks"),
        (f"sum(increase(fulcrum_gateway_engine_restarts_total{{{SEL}}}[$__rate_interval]))",
         "engine restarts")])

    b.row("Expert-parallel load balancer (EPLB)")
    b.panel("moe_lb observed vs predicted by group", [
        (f"fulcrum_eplb_moe_lb_observed{{{SEL}}}", "observed {{group}}"),
        (f'fulcrum_eplb_moe_lb_predicted{{{SEL}, when="after"}}', "predicted {{group}}")],
        thresholds=[(1.15, "red")])
    b.panel("Rebalances by outcome", [(
        f"sum by (outcome, trigger) (increase(fulcrum_eplb_rebalances_total{{{SEL}}}[$__rate_interval]))",
        "{{outcome}} {{trigger}}")])
    b.panel("Weights moved", [(f"sum by (group) (rate(fulcrum_eplb_moved_bytes_total{{{SEL}}}[$__rate_interval]))",
                               "{{group}}")], unit="Bps")
    b.panel("Map version by group", [(f"fulcrum_eplb_map_version{{{SEL}}}", "{{group}}")])
    b.panel("Window steps by group", [(f"fulcrum_eplb_window_steps{{{SEL}}}", "{{group}}")])
    b.panel("Rebalance compute time p99", [(
        f"histogram_quantile(0.99, sum by (le, algorithm) (rate(fulcrum_eplb_rebalance_duration_seconds_bucket{{{SEL}}}[$__rate_interval])))",
        "{{algorithm}}")], unit="s")

    b.row("Security")
    b.panel("Denials by reason", [(
        f"sum by (code, reason) (rate(fulcrum_auth_denials_total{{{SEL}}}[$__rate_interval]))",
        "{{code}} {{reason}}")], unit="reqps")
    b.panel("Admitted calls by role", [(
        f"sum by (role, source) (rate(fulcrum_auth_allowed_total{{{SEL}}}[$__rate_interval]))",
        "{{role}} ({{source}})")], unit="reqps")
    b.panel("Certificate expires in", [(
        f"fulcrum_tls_certificate_expiry_timestamp_seconds{{{SEL}}} - time()", "server")],
        unit="s", kind="stat", thresholds=[(0, "red"), (14 * 86400, "green")])

    return {
        "title": "Fulcrum",
        "uid": "fulcrum-overview",
        "description": "Fulcrum scheduling control plane: one row per balancer.",
        "tags": ["fulcrum"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "label": "Data source", "type": "datasource",
                 "query": "prometheus", "current": {}, "hide": 0},
                {"name": "instance", "label": "Daemon", "type": "query", "datasource": DS,
                 "query": 'label_values(up{job="fulcrum"}, instance)',
                 "definition": 'label_values(up{job="fulcrum"}, instance)',
                 "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
                 "current": {}, "hide": 0},
            ]
        },
        "annotations": {"list": []},
        "panels": b.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if OUT.read_text() == render() else 1)
    OUT.write_text(render())
