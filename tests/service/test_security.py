"""TLS, mutual TLS and role authorisation through a real daemon on loopback.

Certificates are generated at run time (``cryptography``): a trusted CA, a rogue CA, a
server certificate for 127.0.0.1 and client certificates whose CN names an identity.
"""

from __future__ import annotations

import datetime
import importlib
import ipaddress
import pkgutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2

from fulcrum import testing
from fulcrum.client import FulcrumClient
from fulcrum.client.tls import channel_credentials, channel_credentials_from_pem, read_token
from fulcrum.config import ConfigError, with_overrides
from fulcrum.config.security import read_tokens
from fulcrum.metrics import REGISTRY
from fulcrum.service import authz
from fulcrum.service.server import Daemon
from fulcrum.testing import running_server
from fulcrum.v1 import (
    decode_pb2,
    diagnostics_pb2,
    expert_pb2,
    fleet_pb2,
    prefill_pb2,
)

# -- certificates ---------------------------------------------------------------------


@dataclass
class Pem:
    cert: bytes
    key: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca(cn: str) -> tuple[Pem, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)), key, cert


def make_leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    cn: str,
    *,
    server: bool = False,
) -> Pem:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


@dataclass
class Pki:
    dir: Path
    ca: Pem
    server: Pem
    clients: dict[str, Pem]
    rogue: dict[str, Pem]

    def write(self, name: str, data: bytes) -> str:
        path = self.dir / name
        path.write_bytes(data)
        return str(path)


ENGINE_TOKEN = "engine-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdefgh"
ENTRY_TOKEN = "entry-token-0123456789abcdefgh"

IDENTITIES: dict[str, Any] = {
    "engine-a": {"role": "engine", "ids": ["engine-a-*", "group-a"], "kinds": ["prefill_engine"]},
    "entry": {"role": "entrypoint"},
    "ops": {"role": "admin"},
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key, ca_cert = make_ca("fulcrum-test-ca")
    _, rogue_key, rogue_cert = make_ca("rogue-ca")
    clients = {cn: make_leaf(ca_key, ca_cert, cn) for cn in ("engine-a", "entry", "ops", "nobody")}
    rogue = {"ops": make_leaf(rogue_key, rogue_cert, "ops")}
    p = Pki(d, ca, make_leaf(ca_key, ca_cert, "fulcrum-server", server=True), clients, rogue)
    p.write("ca.crt", ca.cert)
    p.write("server.crt", p.server.cert)
    p.write("server.key", p.server.key)
    p.write(
        "tokens",
        f"# identity token\nengine-a {ENGINE_TOKEN}\nops {ADMIN_TOKEN}\n\nentry {ENTRY_TOKEN}\n"
        .encode(),
    )
    return p


def mtls_overrides(pki: Pki) -> dict[str, Any]:
    return {
        "metrics": {"enabled": False},  # not needed here; stopping its server costs 0.5 s
        "security": {
            "plaintext": False,
            "tls": {
                "cert_file": str(pki.dir / "server.crt"),
                "key_file": str(pki.dir / "server.key"),
                "client_ca_file": str(pki.dir / "ca.crt"),
            },
            "auth": {"enabled": True, "identities": IDENTITIES},
        }
    }


def token_overrides(pki: Pki) -> dict[str, Any]:
    return {
        "metrics": {"enabled": False},
        "security": {
            "plaintext": False,
            "tls": {
                "cert_file": str(pki.dir / "server.crt"),
                "key_file": str(pki.dir / "server.key"),
            },
            "auth": {
                "enabled": True,
                "tokens_file": str(pki.dir / "tokens"),
                "identities": IDENTITIES,
            },
        }
    }


@pytest.fixture
async def mtls_daemon(pki: Pki) -> AsyncIterator[Daemon]:
    async with running_server(mtls_overrides(pki)) as d:
        yield d


@pytest.fixture
async def token_daemon(pki: Pki) -> AsyncIterator[Daemon]:
    async with running_server(token_overrides(pki)) as d:
        yield d


def mtls_client(d: Daemon, pki: Pki, who: str | None, *, rogue: bool = False) -> FulcrumClient:
    pem = (pki.rogue if rogue else pki.clients).get(who or "") if who else None
    creds = channel_credentials_from_pem(
        pki.ca.cert, pem.cert if pem else None, pem.key if pem else None
    )
    # retries off: a failed handshake must surface at once
    return FulcrumClient(
        d.address, credentials=creds, timeout_s=5.0, options=[("grpc.enable_retries", 0)]
    )


def token_client(d: Daemon, pki: Pki, token: str | None) -> FulcrumClient:
    creds = channel_credentials(ca_file=pki.dir / "ca.crt")
    return FulcrumClient(d.address, credentials=creds, metadata_token=token, timeout_s=5.0)


def denials(code: str, reason: str, method: str) -> float:
    value = REGISTRY.get_sample_value(
        "fulcrum_auth_denials_total",
        {"service": method.split("/")[0], "method": method.split("/")[1], "code": code,
         "reason": reason},
    )
    return value or 0.0


async def code_of(coro: Any) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def register(member_id: str) -> fleet_pb2.RegisterRequest:
    return fleet_pb2.RegisterRequest(
        member_id=member_id, prefill_engine=fleet_pb2.PrefillEngineShape(dp_ranks=2)
    )


# -- mutual TLS -------------------------------------------------------------------------


async def test_mtls_engine_acts_for_its_own_ids(mtls_daemon: Daemon, pki: Pki) -> None:
    async with mtls_client(mtls_daemon, pki, "engine-a") as c:
        reply = await c.fleet.Register(register("engine-a-0"))
        assert reply.incarnation > 0
        beat = await c.fleet.Heartbeat(
            fleet_pb2.HeartbeatRequest(member_id="engine-a-0", incarnation=reply.incarnation)
        )
        assert beat.heartbeat_timeout_ms > 0
        pong = await c.diagnostics.Ping(diagnostics_pb2.PingRequest(payload=b"x"))
        assert pong.payload == b"x"


async def test_mtls_engine_acting_for_another_engine_is_denied(
    mtls_daemon: Daemon, pki: Pki
) -> None:
    before = denials("PERMISSION_DENIED", "bound_id", "FleetService/Register")
    async with mtls_client(mtls_daemon, pki, "engine-a") as c:
        assert await code_of(c.fleet.Register(register("engine-b-0"))) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert await code_of(
            c.fleet.Heartbeat(fleet_pb2.HeartbeatRequest(member_id="engine-b-0", incarnation=1))
        ) == grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(
            c.prefill.Pull(prefill_pb2.PullRequest(engine_id="engine-b-0", incarnation=1))
        ) == grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(
            c.expert.ReportLoad(expert_pb2.ReportLoadRequest(group_id="group-b"))
        ) == grpc.StatusCode.PERMISSION_DENIED
    assert denials("PERMISSION_DENIED", "bound_id", "FleetService/Register") == before + 1
    # the refused registration changed nothing
    assert all(m.member_id != "engine-b-0" for m, _ in mtls_daemon.app.fleet.members(None))


async def test_mtls_engine_calling_admin_methods_is_denied(
    mtls_daemon: Daemon, pki: Pki
) -> None:
    before = denials("PERMISSION_DENIED", "role", "ExpertBalancerService/Rebalance")
    async with mtls_client(mtls_daemon, pki, "engine-a") as c:
        assert await code_of(c.fleet.ListMembers(fleet_pb2.ListMembersRequest())) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert await code_of(
            c.expert.Rebalance(expert_pb2.RebalanceRequest(group_id="group-a"))
        ) == grpc.StatusCode.PERMISSION_DENIED
        # entrypoint methods are not an engine's either, streaming ones included
        assert await code_of(
            c.decode.PlaceDecode(decode_pb2.PlaceDecodeRequest(request_id="r", kv_tokens=1))
        ) == grpc.StatusCode.PERMISSION_DENIED

        async def one() -> AsyncIterator[decode_pb2.PlaceDecodeStreamRequest]:
            yield decode_pb2.PlaceDecodeStreamRequest(sequence=1)

        call = c.decode.PlaceDecodeStream(one())
        assert await code_of(call.read()) == grpc.StatusCode.PERMISSION_DENIED
    assert denials("PERMISSION_DENIED", "role", "ExpertBalancerService/Rebalance") == before + 1


async def test_mtls_admin_and_entrypoint_roles(mtls_daemon: Daemon, pki: Pki) -> None:
    async with mtls_client(mtls_daemon, pki, "ops") as admin:
        await admin.fleet.ListMembers(fleet_pb2.ListMembersRequest())
        # admin passes authorisation: whatever the balancer answers, it is not a denial
        code = await code_of(admin.expert.Rebalance(expert_pb2.RebalanceRequest(group_id="g")))
        assert code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
        # and admin may act for any id
        await admin.fleet.Register(register("engine-z-9"))
    async with mtls_client(mtls_daemon, pki, "entry") as entry:
        code = await code_of(
            entry.decode.PlaceDecode(decode_pb2.PlaceDecodeRequest(request_id="r", kv_tokens=1))
        )
        assert code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
        assert await code_of(
            entry.prefill.Pull(prefill_pb2.PullRequest(engine_id="engine-a-0"))
        ) == grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(entry.fleet.Register(register("entry"))) == (
            grpc.StatusCode.PERMISSION_DENIED
        )


async def test_mtls_unknown_certificate_name_is_denied(mtls_daemon: Daemon, pki: Pki) -> None:
    before = denials("PERMISSION_DENIED", "unknown_identity", "DiagnosticsService/Ping")
    async with mtls_client(mtls_daemon, pki, "nobody") as c:
        assert await code_of(c.diagnostics.Ping(diagnostics_pb2.PingRequest())) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
    assert denials("PERMISSION_DENIED", "unknown_identity", "DiagnosticsService/Ping") == (
        before + 1
    )


@pytest.mark.parametrize("case", ["no_certificate", "other_ca", "plaintext"])
async def test_mtls_handshake_refusals(mtls_daemon: Daemon, pki: Pki, case: str) -> None:
    """Without a certificate, with one from another CA, or in plaintext, the TLS handshake
    fails: the call ends UNAVAILABLE and no handler runs. Good clients are unaffected."""
    if case == "plaintext":
        bad = FulcrumClient(mtls_daemon.address, timeout_s=2.0,
                            options=[("grpc.enable_retries", 0)])
    else:
        bad = mtls_client(mtls_daemon, pki, None if case == "no_certificate" else "ops",
                          rogue=case == "other_ca")
    async with bad:
        assert await code_of(bad.diagnostics.Ping(diagnostics_pb2.PingRequest(), timeout=2)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        assert await code_of(bad.health.Check(health_pb2.HealthCheckRequest(), timeout=2)) == (
            grpc.StatusCode.UNAVAILABLE
        )
    async with mtls_client(mtls_daemon, pki, "ops") as good:
        await good.diagnostics.Ping(diagnostics_pb2.PingRequest())


# -- TLS + bearer tokens ----------------------------------------------------------------


async def test_tokens_identify_and_authorise(token_daemon: Daemon, pki: Pki) -> None:
    async with token_client(token_daemon, pki, ENGINE_TOKEN) as engine:
        await engine.fleet.Register(register("engine-a-1"))
        assert await code_of(engine.fleet.Register(register("engine-b-1"))) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert await code_of(engine.fleet.ListMembers(fleet_pb2.ListMembersRequest())) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
    async with token_client(token_daemon, pki, ADMIN_TOKEN) as admin:
        reply = await admin.fleet.ListMembers(fleet_pb2.ListMembersRequest())
        assert [m.member_id for m in reply.members] == ["engine-a-1"]


async def test_missing_or_bad_token_is_unauthenticated(token_daemon: Daemon, pki: Pki) -> None:
    before = denials("UNAUTHENTICATED", "no_identity", "DiagnosticsService/Ping")
    async with token_client(token_daemon, pki, None) as anon:
        assert await code_of(anon.diagnostics.Ping(diagnostics_pb2.PingRequest())) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        # health stays open
        reply = await anon.health.Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for header in ("Bearer not-a-token-0123456789", "Basic abc", "Bearer "):
            assert await code_of(
                anon.diagnostics.Ping(
                    diagnostics_pb2.PingRequest(), metadata=(("authorization", header),)
                )
            ) == grpc.StatusCode.UNAUTHENTICATED
    assert denials("UNAUTHENTICATED", "no_identity", "DiagnosticsService/Ping") == before + 1
    assert denials("UNAUTHENTICATED", "bad_token", "DiagnosticsService/Ping") >= 3


async def test_denials_are_logged_without_secrets(token_daemon: Daemon, pki: Pki) -> None:
    wrong = "Bearer wrong-secret-0123456789abcdef"
    with structlog.testing.capture_logs() as logs:
        async with token_client(token_daemon, pki, ENGINE_TOKEN) as engine:
            await code_of(engine.fleet.ListMembers(fleet_pb2.ListMembersRequest()))
            await code_of(
                engine.diagnostics.Ping(
                    diagnostics_pb2.PingRequest(), metadata=(("authorization", wrong),)
                )
            )
    denied = [e for e in logs if e["event"] == "call_denied"]
    assert {e["reason"] for e in denied} >= {"role"}
    assert any(e["identity"] == "engine-a" for e in denied)
    text = repr(logs)
    for secret in (ENGINE_TOKEN, ADMIN_TOKEN, "wrong-secret"):
        assert secret not in text


async def test_reload_swaps_identities_and_tokens(pki: Pki) -> None:
    tokens = pki.dir / "tokens-reload"
    tokens.write_text(f"engine-a {ENGINE_TOKEN}\n")
    over = token_overrides(pki)
    over["security"]["auth"]["tokens_file"] = str(tokens)
    async with running_server(over) as d:
        async with token_client(d, pki, ADMIN_TOKEN) as admin:
            assert await code_of(admin.fleet.ListMembers(fleet_pb2.ListMembersRequest())) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            tokens.write_text(f"engine-a {ENGINE_TOKEN}\nops {ADMIN_TOKEN}\n")
            new = with_overrides(d.app.settings, {})
            for hook in d.app.reload_hooks:
                hook(new)
            await admin.fleet.ListMembers(fleet_pb2.ListMembersRequest())
            # turning authorisation off by reload lets everyone through
            off = with_overrides(d.app.settings, {"security": {"auth": {"enabled": False}}})
            for hook in d.app.reload_hooks:
                hook(off)
        async with token_client(d, pki, None) as anon:
            await anon.fleet.ListMembers(fleet_pb2.ListMembersRequest())


# -- defaults, config and the rule table ----------------------------------------------


async def test_default_is_plaintext_without_auth(daemon: Daemon, client: FulcrumClient) -> None:
    assert daemon.app.settings.security.plaintext
    assert not daemon.app.settings.security.auth.enabled
    await client.fleet.ListMembers(fleet_pb2.ListMembersRequest())
    assert REGISTRY.get_sample_value("fulcrum_tls_enabled") == 0


@pytest.mark.parametrize(
    ("security", "expected"),
    [
        ({"plaintext": False}, "cert_file and key_file are required"),
        ({"plaintext": False, "tls": {"cert_file": "/nonexistent", "key_file": "/nonexistent"}},
         "no such file"),
        ({"tls": {"cert_file": "x"}}, "plaintext: must be false"),
        ({"auth": {"enabled": True}}, "needs auth.tokens_file or tls.client_ca_file"),
        ({"auth": {"identities": {"x": {"role": "root"}}}}, "role"),
        ({"auth": {"bogus": 1}}, "unknown key"),
    ],
)
def test_config_refusals(security: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        testing.test_settings({"security": security})
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("solo\n", "line 1: expected"),
        ("# c\nops short\n", "line 2: token shorter"),
        (f"ops {ADMIN_TOKEN}\nengine-a {ADMIN_TOKEN}\n", "line 2: token already given"),
        (f"ghost {ADMIN_TOKEN}\n", "identities not in auth.identities"),
    ],
)
def test_tokens_file_refusals_never_echo_tokens(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        testing.test_settings(
            {"security": {"auth": {"enabled": True, "tokens_file": str(path),
                                   "identities": IDENTITIES}}}
        )
    assert expected in str(err.value)
    assert ADMIN_TOKEN not in str(err.value)


def test_read_tokens_and_client_helpers(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text(f"ops {ADMIN_TOKEN}  \n#x\n")
    assert read_tokens(str(path)) == {ADMIN_TOKEN: "ops"}
    tok = tmp_path / "token"
    tok.write_text(f"  {ADMIN_TOKEN}\n")
    assert read_token(tok) == ADMIN_TOKEN
    tok.write_text("\n")
    with pytest.raises(ValueError, match="expected one token"):
        read_token(tok)
    with pytest.raises(ValueError, match="together"):
        channel_credentials_from_pem(None, b"cert", None)


def all_services() -> list[ServiceDescriptor]:
    """Every service declared in fulcrum.v1 (new proto files included)."""
    import fulcrum.v1

    out = []
    for info in pkgutil.iter_modules(fulcrum.v1.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"fulcrum.v1.{info.name}")
            out.extend(module.DESCRIPTOR.services_by_name.values())
    return out


def test_rule_table_covers_every_method_and_names_real_id_fields() -> None:
    """Every Fulcrum RPC has an explicit rule, and each id field exists as a string in the
    request message (a renamed field must not silently disable the check)."""
    listed = set()
    for service in all_services():
        for m in service.methods:
            full = f"/{service.full_name}/{m.name}"
            listed.add(full)
            assert full in authz.METHOD_RULES, f"no rule for {full}"
            rule = authz.METHOD_RULES[full]
            if rule.id_field is not None:
                field = m.input_type.fields_by_name.get(rule.id_field)
                assert field is not None, f"{full}: no field {rule.id_field}"
                assert field.type == field.TYPE_STRING
    assert set(authz.METHOD_RULES) <= listed, set(authz.METHOD_RULES) - listed
    assert authz.rule_for("/grpc.health.v1.Health/Check") is None
    assert authz.rule_for("/fulcrum.v1.Unknown/Drain") == authz.Rule(
        frozenset({"admin"})
    )


@pytest.mark.parametrize(
    ("role", "ids", "member", "allowed"),
    [
        ("engine", ("engine-a-*",), "engine-a-3", True),
        ("engine", ("engine-a-*",), "engine-ab", False),
        ("engine", ("engine-a",), "engine-a", True),
        ("engine", (), "engine-a", False),
        ("engine", ("*",), "", True),
        ("admin", (), "anything", True),
        ("entrypoint", ("x",), "y", False),
    ],
)
def test_identity_binding(role: str, ids: tuple[str, ...], member: str, allowed: bool) -> None:
    assert authz.Identity("n", role, ids, "token").may_act_for(member) is allowed


async def test_malformed_bytes_are_checked_after_authentication(
    token_daemon: Daemon, pki: Pki
) -> None:
    def ident(b: bytes) -> bytes:
        return b

    garbage = b"\x0a\x02\xc3\x28"  # member_id holding invalid UTF-8
    path = "/fulcrum.v1.FleetService/Register"
    for token, expected in (
        (None, grpc.StatusCode.UNAUTHENTICATED),
        (ADMIN_TOKEN, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        async with token_client(token_daemon, pki, token) as c:
            call = c.channel.unary_unary(
                path, request_serializer=ident, response_deserializer=ident
            )
            assert await code_of(call(garbage)) == expected


# -- identities bound to member kinds ---------------------------------------------------


def decode_register(member_id: str) -> fleet_pb2.RegisterRequest:
    return fleet_pb2.RegisterRequest(
        member_id=member_id,
        decode_instance=fleet_pb2.DecodeInstanceShape(
            gpus=[fleet_pb2.DecodeGpuCapacity(max_concurrency=8, max_kv_tokens=1000)] * 64
        ),
    )


def vision_register(member_id: str) -> fleet_pb2.RegisterRequest:
    return fleet_pb2.RegisterRequest(
        member_id=member_id, vision_machine=fleet_pb2.VisionMachineShape(gpus=8)
    )


async def test_engine_credential_cannot_register_another_member_kind(
    token_daemon: Daemon, pki: Pki
) -> None:
    """engine-a may register prefill engines under its ids, not a 64-GPU decode instance
    nor a VE machine under the same ids; the refusal changes nothing."""
    before = denials("PERMISSION_DENIED", "kind", "FleetService/Register")
    async with token_client(token_daemon, pki, ENGINE_TOKEN) as engine:
        for request in (decode_register("engine-a-7"), vision_register("engine-a-8")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await engine.fleet.Register(request)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "shape: identity engine-a may not register a" in str(err.value.details())
            assert "prefill_engine" in str(err.value.details())
        await engine.fleet.Register(register("engine-a-9"))
        # no shape at all: the service's INVALID_ARGUMENT, not a denial
        assert await code_of(
            engine.fleet.Register(fleet_pb2.RegisterRequest(member_id="engine-a-6"))
        ) == grpc.StatusCode.INVALID_ARGUMENT
    assert denials("PERMISSION_DENIED", "kind", "FleetService/Register") == before + 2
    ids = {m.member_id for m, _ in token_daemon.app.fleet.members(None)}
    assert "engine-a-7" not in ids and "engine-a-8" not in ids and "engine-a-9" in ids
    async with token_client(token_daemon, pki, ADMIN_TOKEN) as admin:  # admin: any kind
        await admin.fleet.Register(decode_register("dec-admin"))


@pytest.mark.parametrize(
    ("role", "kinds", "kind", "allowed"),
    [
        ("engine", ("prefill_engine",), "prefill_engine", True),
        ("engine", ("prefill_engine",), "decode_instance", False),
        ("engine", ("prefill_engine",), "vision_machine", False),
        ("engine", ("decode_instance", "vision_machine"), "vision_machine", True),
        ("engine", (), "prefill_engine", False),
        ("entrypoint", ("decode_instance",), "decode_instance", True),
        ("admin", (), "decode_instance", True),
    ],
)
def test_identity_kind_binding(
    role: str, kinds: tuple[str, ...], kind: str, allowed: bool
) -> None:
    ident = authz.Identity("n", role, ("*",), "token", frozenset(kinds))
    assert ident.may_register(kind) is allowed
    rule = authz.METHOD_RULES["/fulcrum.v1.FleetService/Register"]
    request = {
        "prefill_engine": register("m"),
        "decode_instance": decode_register("m"),
        "vision_machine": vision_register("m"),
    }[kind]
    if allowed or role != "engine":
        authz.Authorizer.authorize_id(ident, rule, request)
    else:
        with pytest.raises(authz.Denied) as err:
            authz.Authorizer.authorize_id(ident, rule, request)
        assert err.value.reason == "kind"


def test_register_rule_names_the_shape_oneof() -> None:
    """The kind check reads Register's ``shape`` oneof, whose field names are the kinds."""
    rule = authz.METHOD_RULES["/fulcrum.v1.FleetService/Register"]
    assert rule.kind_oneof == "shape"
    oneof = fleet_pb2.RegisterRequest.DESCRIPTOR.oneofs_by_name["shape"]
    assert {f.name for f in oneof.fields} == {"prefill_engine", "decode_instance",
                                                "vision_machine"}


def test_unknown_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        testing.test_settings(
            {"security": {"auth": {"identities": {"x": {"role": "engine", "kinds": ["gpu"]}}}}}
        )
    assert "security.auth.identities.x.kinds.0" in str(err.value)


# -- certificate rotation and the expiry gauge ------------------------------------------


def tls_client(d: Daemon, ca: bytes) -> FulcrumClient:
    # a connection of its own (no subchannel sharing), retries off: a failed handshake
    # surfaces at once
    return FulcrumClient(
        d.address,
        credentials=channel_credentials_from_pem(ca, None, None),
        timeout_s=5.0,
        options=[("grpc.enable_retries", 0), ("grpc.use_local_subchannel_pool", 1)],
    )


async def test_reload_rotates_the_server_certificate(tmp_path: Path) -> None:
    """A reload with a new certificate (another CA's) serves it to new connections without
    a restart; clients trusting only the old CA then fail the handshake. The expiry gauge
    follows the served certificate."""
    old_ca, old_key, old_ca_cert = make_ca("old-ca")
    new_ca, new_key, new_ca_cert = make_ca("new-ca")
    old_leaf = make_leaf(old_key, old_ca_cert, "fulcrum-server", server=True)
    new_leaf = make_leaf(new_key, new_ca_cert, "fulcrum-server", server=True)
    (tmp_path / "server.crt").write_bytes(old_leaf.cert)
    (tmp_path / "server.key").write_bytes(old_leaf.key)
    over = {
        "metrics": {"enabled": False},
        "security": {"plaintext": False, "tls": {"cert_file": str(tmp_path / "server.crt"),
                                                  "key_file": str(tmp_path / "server.key")}},
    }
    async with running_server(over) as d:
        expiry = x509.load_pem_x509_certificate(old_leaf.cert).not_valid_after_utc.timestamp()
        assert REGISTRY.get_sample_value(
            "fulcrum_tls_certificate_expiry_timestamp_seconds") == expiry
        async with tls_client(d, old_ca.cert) as c:
            await c.diagnostics.Ping(diagnostics_pb2.PingRequest())
        async with tls_client(d, new_ca.cert) as c:
            assert await code_of(c.diagnostics.Ping(diagnostics_pb2.PingRequest(), timeout=2)) \
                == grpc.StatusCode.UNAVAILABLE

        # a key that does not match the certificate is refused: the old pair stays
        (tmp_path / "server.crt").write_bytes(new_leaf.cert)
        with structlog.testing.capture_logs() as logs:
            assert d.reload(with_overrides(d.app.settings, {})) == "applied"
        assert any(e["event"] == "tls_reload_refused" for e in logs)
        async with tls_client(d, old_ca.cert) as c:
            await c.diagnostics.Ping(diagnostics_pb2.PingRequest())

        (tmp_path / "new.key").write_bytes(new_leaf.key)
        rotated = with_overrides(
            d.app.settings, {"security": {"tls": {"key_file": str(tmp_path / "new.key")}}}
        )
        assert d.reload(rotated) == "applied"
        assert d.app.components["tls"].rotations == 1
        async with tls_client(d, new_ca.cert) as c:
            await c.diagnostics.Ping(diagnostics_pb2.PingRequest())
        async with tls_client(d, old_ca.cert) as c:
            assert await code_of(c.diagnostics.Ping(diagnostics_pb2.PingRequest(), timeout=2)) \
                == grpc.StatusCode.UNAVAILABLE
        expiry = x509.load_pem_x509_certificate(new_leaf.cert).not_valid_after_utc.timestamp()
        assert REGISTRY.get_sample_value(
            "fulcrum_tls_certificate_expiry_timestamp_seconds") == expiry


async def test_plaintext_daemon_exports_no_certificate_expiry(daemon: Daemon) -> None:
    """The gauge is absent (not 0) on a plaintext daemon, so the expiry alert cannot fire."""
    assert daemon.app.settings.security.plaintext
    assert REGISTRY.get_sample_value(
        "fulcrum_tls_certificate_expiry_timestamp_seconds") is None
    names = {f.name for f in REGISTRY.collect()}
    assert "fulcrum_tls_certificate_expiry_timestamp_seconds" not in names


async def test_reload_with_restart_only_tls_keys_keeps_them(pki: Pki) -> None:
    async with running_server(token_overrides(pki)) as d:
        changed = with_overrides(
            d.app.settings,
            {"security": {"tls": {"client_ca_file": str(pki.dir / "ca.crt")}}},
        )
        with structlog.testing.capture_logs() as logs:
            assert d.reload(changed) == "restart_required"
        assert d.app.settings.security.tls.client_ca_file == ""
        warn = next(e for e in logs if e["event"] == "config_restart_required")
        assert warn["keys"] == ["security.tls.client_ca_file"]
