"""The two-replica variant (deploy/kubernetes/ha): valid objects, probes on the health
names a standby answers, a PodDisruptionBudget, etcd endpoints from the ConfigMap, and
nothing else changed from the base."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import yaml

from fulcrum.config import parse_settings
from tests.deploy import kustomize
from tests.deploy.test_manifests import BASE, HA, K8S_DIR

DOCS = kustomize.render(HA)


def _settings() -> Any:
    cm = kustomize.one(DOCS, "ConfigMap")
    return parse_settings(yaml.safe_load(cm["data"]["fulcrum.yaml"]))


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = kustomize.one(docs, "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]
    return container


def test_every_rendered_object_validates() -> None:
    assert sorted(d["kind"] for d in DOCS) == [
        "ConfigMap", "Deployment", "PodDisruptionBudget", "Service",
    ]
    for doc in DOCS:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "fulcrum"


def test_two_replicas_whose_rollout_can_finish() -> None:
    """Only the leader is ever Ready: a rollout that waits for Ready new pods (or keeps
    the old leader until then) would never finish."""
    spec = kustomize.one(DOCS, "Deployment")["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "100%", "maxUnavailable": "100%"},
    }
    spread = spec["template"]["spec"]["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_probes_ask_the_health_names_of_leader_and_standby() -> None:
    settings = _settings()
    c = _container(DOCS)
    assert c["readinessProbe"]["grpc"] == {"port": settings.server.port, "service": "readiness"}
    assert c["livenessProbe"]["grpc"] == {"port": settings.server.port, "service": "liveness"}
    # readiness is the Service's leader switch: checked every second
    assert c["readinessProbe"]["periodSeconds"] * c["readinessProbe"]["failureThreshold"] <= 2


def test_config_elects_on_etcd_with_endpoints_from_the_configmap() -> None:
    settings = _settings()
    assert settings.ha.backend == "etcd"
    assert len(settings.ha.etcd.endpoints) >= 1
    assert all(ep.rsplit(":", 1)[1] == "2379" for ep in settings.ha.etcd.endpoints)
    assert settings.ha.lease_ttl_s == 3 and settings.ha.election_key
    pod = kustomize.one(DOCS, "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > settings.server.grace_period_s
    # the rest of the configuration is the base's
    base_cm = kustomize.one(kustomize.render(BASE), "ConfigMap")
    base = yaml.safe_load(base_cm["data"]["fulcrum.yaml"])
    ha = yaml.safe_load(kustomize.one(DOCS, "ConfigMap")["data"]["fulcrum.yaml"])
    assert {k: v for k, v in ha.items() if k != "ha"} == base


def test_each_pod_advertises_its_own_address() -> None:
    """The x-fulcrum-leader trailer names the leader's server.host: the pod IP here."""
    c = _container(DOCS)
    assert c["args"][-2:] == ["--host", "$(POD_IP)"]
    [env] = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    tls = [v for v in kustomize.one(DOCS, "Deployment")["spec"]["template"]["spec"]["volumes"]
           if v["name"] == "etcd-tls"]
    assert tls[0]["secret"] == {"secretName": "fulcrum-etcd-tls", "optional": True}


def test_the_disruption_budget_covers_the_pods_and_lets_a_standby_go() -> None:
    pdb = kustomize.one(DOCS, "PodDisruptionBudget")
    labels = kustomize.one(DOCS, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_overlay_changes_only_what_ha_needs() -> None:
    """Everything else (image, resources, security, mounts, Service) is the base's."""
    base = kustomize.render(K8S_DIR)
    assert kustomize.one(DOCS, "Service") == kustomize.one(base, "Service")
    b = kustomize.one(base, "Deployment")
    h = kustomize.one(DOCS, "Deployment")
    assert {k: v for k, v in h["spec"].items() if k not in ("replicas", "strategy", "template")} \
        == {k: v for k, v in b["spec"].items() if k not in ("replicas", "strategy", "template")}
    changed_pod = {"topologySpreadConstraints", "volumes", "containers"}
    hp, bp = h["spec"]["template"]["spec"], b["spec"]["template"]["spec"]
    assert {k: v for k, v in hp.items() if k not in changed_pod} == {
        k: v for k, v in bp.items() if k not in changed_pod
    }
    assert [v for v in hp["volumes"] if v["name"] != "etcd-tls"] == bp["volumes"]
    changed = {"args", "env", "readinessProbe", "livenessProbe", "volumeMounts"}
    hc, bc = _container([h]), _container([b])
    assert {k: v for k, v in hc.items() if k not in changed} == {
        k: v for k, v in bc.items() if k not in changed
    }
    assert hc["args"][:3] == bc["args"]
    assert [m for m in hc["volumeMounts"] if m["name"] != "etcd-tls"] == bc["volumeMounts"]


def test_a_patch_that_targets_nothing_is_refused(tmp_path: Any) -> None:
    """The renderer the checks above rely on fails on a patch without its target."""
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (tmp_path / "patch.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n")
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [cm.yaml]\npatches: [{path: patch.yaml}]\n"
    )
    try:
        kustomize.render(tmp_path)
    except AssertionError as err:
        assert "patches 0 objects" in str(err)
    else:
        raise AssertionError("a patch without a target was rendered")
