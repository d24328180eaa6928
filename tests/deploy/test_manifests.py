"""Build artefacts that must stay valid: generated code, manifests, Dockerfile."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from fulcrum.config import parse_settings
from fulcrum.tools import genproto
from tests.deploy import kustomize

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
BASE = K8S_DIR / "base"
HA = K8S_DIR / "ha"
#: Whole manifests (the HA overlay's patches are partial objects: validated rendered).
MANIFESTS = [
    p
    for p in [*sorted(K8S_DIR.glob("*.yaml")), *sorted(BASE.glob("*.yaml")), HA / "pdb.yaml"]
    if p.name != "kustomization.yaml"
]


def test_generated_code_is_not_stale() -> None:
    assert genproto.check() == [], "run `make proto`"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_kubernetes_schema(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["apiVersion"].startswith("inference.networking.k8s.io/"):
            continue  # a CRD kind: tests/gateway/test_deploy.py validates it against its schema
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_invalid_manifest_is_refused() -> None:
    doc = yaml.safe_load((BASE / "deployment.yaml").read_text())
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_configmap_carries_a_valid_configuration() -> None:
    cm = yaml.safe_load((BASE / "configmap.yaml").read_text())
    settings = parse_settings(yaml.safe_load(cm["data"]["fulcrum.yaml"]))
    assert settings.server.host == "0.0.0.0"


def test_deployment_probes_and_grace_fit_the_daemon() -> None:
    dep = yaml.safe_load((BASE / "deployment.yaml").read_text())
    cm = yaml.safe_load((BASE / "configmap.yaml").read_text())
    settings = parse_settings(yaml.safe_load(cm["data"]["fulcrum.yaml"]))
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["grpc"]["port"] == settings.server.port
    assert container["livenessProbe"]["grpc"]["port"] == settings.server.port
    assert pod["terminationGracePeriodSeconds"] > settings.server.grace_period_s
    assert "requests" in container["resources"]
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(settings.metrics.port)


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_runs_as_non_root_with_health_check() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "USER 10001" in text
    assert "EXPOSE 50051 9464" in text
    assert "HEALTHCHECK" in text and "fulcrum\", \"health\"" in text
    assert "STOPSIGNAL SIGTERM" in text
    assert text.count("FROM ") >= 2  # multi-stage


def test_kustomization_lists_every_manifest_and_renders_valid_objects() -> None:
    assert kustomize.kustomization(K8S_DIR)["resources"] == ["base"]
    k = kustomize.kustomization(BASE)
    assert set(k["resources"]) == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    docs = kustomize.render(K8S_DIR)
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service"}
    assert kustomize.one(docs, "Deployment")["spec"]["replicas"] == 1
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
