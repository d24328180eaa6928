"""The gateway's deployment files stay valid: Envoy bootstrap (Envoy's own validator),
Fulcrum config, InferencePool against the CRD's schema, README section."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from fulcrum.config import ConfigError, load_settings, parse_settings
from fulcrum.gateway.testing import envoy_binary

ROOT = Path(__file__).resolve().parents[2]
ENVOY = ROOT / "deploy" / "envoy" / "envoy.yaml"
POOL = ROOT / "deploy" / "kubernetes" / "inferencepool.yaml"
SCHEMA = Path(__file__).parent / "data" / "inferencepool_v1_schema.json"


def test_envoy_bootstrap_validates() -> None:
    out = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(ENVOY)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_envoy_bootstrap_has_the_pitfall_settings() -> None:
    cfg = yaml.safe_load(ENVOY.read_text())
    assert cfg["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}
    (listener,) = cfg["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8081}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (early,) = hcm["early_header_mutation_extensions"]
    removed = [m["remove"] for m in early["typed_config"]["mutations"]]
    assert "x-gateway-destination-endpoint" in removed
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    assert float(ext["message_timeout"].rstrip("s")) >= 1.0
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["match"]["headers"][0]["name"] == "x-gateway-destination-endpoint"
    assert all(r["route"]["timeout"] == "0s" for r in routes)
    assert routes[1]["route"]["cluster"] == "fallback_pool"
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    dst = clusters["picked_endpoint"]
    assert dst["type"] == "ORIGINAL_DST"
    assert dst["original_dst_lb_config"]["http_header_name"] == "x-gateway-destination-endpoint"
    epp = clusters["fulcrum_epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert epp["endpoint"]["address"]["socket_address"]["port_value"] == 9002


def test_fulcrum_example_config() -> None:
    s = load_settings(ROOT / "deploy" / "envoy" / "fulcrum.yaml")
    assert s.gateway.enabled and s.gateway.port == 9002 and s.gateway.health_port == 9003
    addrs = [a for e in s.gateway.pool.decode for a in e.addresses()]
    assert addrs == [f"127.0.0.1:{p}" for p in range(8101, 8105)]


def test_inferencepool_validates_against_the_crd_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    docs = list(yaml.safe_load_all(POOL.read_text()))
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, schema)
    svc = next(d for d in docs if d["kind"] == "Service")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == svc["metadata"]["name"]
    assert ref["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    bad = json.loads(json.dumps(pool))
    del bad["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    ("gateway", "path"),
    [
        ({"pool": {"decode": [{"id": "a", "host": "h.example", "ports": [1]}]}}, "host"),
        ({"pool": {"decode": [{"id": "a", "host": "10.0.0.1", "ports": [1, 1]}]}}, "ports"),
        ({"pool": {"decode": [{"id": "a b", "host": "10.0.0.1", "ports": [1]}]}}, "id"),
        (
            {
                "pool": {
                    "decode": [
                        {"id": "a", "host": "10.0.0.1", "ports": [1]},
                        {"id": "b", "host": "10.0.0.1", "ports": [1]},
                    ]
                }
            },
            "decode: an ip:port appears twice",
        ),
        ({"chars_per_token": 0}, "gateway.chars_per_token"),
        ({"nope": 1}, "gateway.nope"),
    ],
)
def test_bad_gateway_config_is_refused_naming_the_key(
    gateway: dict[str, object], path: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"gateway": gateway})
    assert path in str(err.value)


def test_readme_has_the_section() -> None:
    # The gateway guide moved from the README to docs/gateway.md (issue 25).
    text = (ROOT / "docs" / "gateway.md").read_text()
    assert "## The picker in detail" in text
    assert "](docs/gateway.md)" in (ROOT / "README.md").read_text()
    assert "deploy/envoy/envoy.yaml" in text
