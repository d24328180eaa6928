"""Faults at the edges: etcd unreachable when the daemon starts (standby, one line, keeps
trying, leads once etcd is there) and etcd TLS misconfigured (one error line naming the
file and the reason, exit status 2)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fulcrum.ha.harness import ETCD, DaemonProcess, EtcdProcess, free_port, ha_config
from tests.ha.helpers import metric, ping
from tests.polling import until_sync


def test_etcd_unreachable_at_start_then_reachable(tmp_path: Path) -> None:
    if ETCD is None:
        if os.environ.get("CI") == "true":
            pytest.fail("etcd is not installed (.ci/run installs etcd-server)")
        pytest.skip("etcd is not installed")
    port = free_port()
    d = DaemonProcess(ha_config(f"127.0.0.1:{port}", "/fulcrum-test/late"),
                      tmp_path, "late")
    etcd: EtcdProcess | None = None
    try:
        assert d.health() == "NOT_SERVING"
        assert d.health("liveness") == "SERVING"
        until_sync(lambda: metric(d, "fulcrum_ha_etcd_errors_total") >= 5,
                   "several failed tries", 30)
        assert len(d.events("ha_etcd_unreachable")) == 1  # one line, however many tries
        assert d.events("ha_etcd_unreachable")[0]["endpoint"] == f"127.0.0.1:{port}"
        etcd = EtcdProcess(port=port)
        until_sync(lambda: d.health() == "SERVING", "leads once etcd is up", 30)
        assert ping(d) is None
        assert d.event("ha_etcd_reachable") is not None
    finally:
        d.stop()
        if etcd is not None:
            etcd.stop()


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(1).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _serve(tmp_path: Path, tls: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    cfg = ha_config("127.0.0.1:1", "/fulcrum-test/tls")
    cfg["ha"]["etcd"]["tls"] = tls
    path = tmp_path / "tls.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = subprocess.run([sys.executable, "-m", "fulcrum.cli", "serve", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    return p.returncode, [e for e in lines if e.get("level") == "error"]


@pytest.mark.parametrize("case", ["missing", "not_pem", "key_mismatch"])
def test_tls_misconfigured_is_one_line_naming_the_file(
    tmp_path: Path, case: str,
) -> None:
    ca, _ = _self_signed(tmp_path, "ca")
    cert, _ = _self_signed(tmp_path, "client")
    _, other_key = _self_signed(tmp_path, "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    tls: dict[str, Any] = {
        "missing": {"ca_file": str(tmp_path / "nope.pem")},
        "not_pem": {"ca_file": str(garbage)},
        "key_mismatch": {"ca_file": str(ca), "cert_file": str(cert),
                         "key_file": str(other_key)},
    }[case]
    def named(problem: str) -> bool:
        return {
            "missing": str(tmp_path / "nope.pem") in problem and "cannot read" in problem,
            "not_pem": str(garbage) in problem and "not a PEM" in problem,
            "key_mismatch": str(other_key) in problem and "does not match" in problem,
        }[case]
    code, errors = _serve(tmp_path, tls)
    assert code == 2
    assert len(errors) == 1, errors
    assert errors[0]["event"] == "ha_etcd_tls_invalid"
    assert named(str(errors[0]["problem"])), errors[0]
