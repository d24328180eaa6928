"""Server reflection serves the fulcrum.v1 descriptors with their source comments.

``grpcurl describe`` (and any reflection client) shows what a reflection server sends;
the ``_pb2`` modules carry no comments, so the daemon must serve
:func:`fulcrum.v1.descriptors.commented_pool`. Checked through a real reflection client
(``ProtoReflectionDescriptorDatabase``) over a real channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from fulcrum.service.server import Daemon
from fulcrum.v1 import descriptors, prefill_pb2

QUOTA_COMMENT = "Compute quota the engine can still take, in nanoseconds."
QUOTA_FIELD = "fulcrum.v1.PullRequest.remaining_quota_ns"


def _strip(proto: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """A copy without source info and json names (protoc's set has them, _pb2 not)."""
    out = descriptor_pb2.FileDescriptorProto()
    out.CopyFrom(proto)
    out.ClearField("source_code_info")

    def clear(msgs: object) -> None:
        for m in msgs:  # type: ignore[attr-defined]
            for f in m.field:
                f.ClearField("json_name")
            clear(m.nested_type)

    clear(out.message_type)
    return out


def test_descriptor_set_is_the_compiled_api_plus_comments() -> None:
    pool = descriptor_pool.Default()
    files = descriptors.file_protos()
    assert set(files) == {
        "fulcrum/v1/decode.proto",
        "fulcrum/v1/diagnostics.proto",
        "fulcrum/v1/expert.proto",
        "fulcrum/v1/fleet.proto",
        "fulcrum/v1/prefill.proto",
        "fulcrum/v1/vision.proto",
    }
    for name, proto in files.items():
        compiled = descriptor_pb2.FileDescriptorProto()
        pool.FindFileByName(name).CopyToProto(compiled)
        assert not compiled.HasField("source_code_info")
        assert _strip(proto) == compiled, name
        assert len(proto.source_code_info.location) > 10, name


def test_comments_names_units_and_rules() -> None:
    assert descriptors.comments(QUOTA_FIELD) == QUOTA_COMMENT
    assert "UNAVAILABLE when the daemon drains" in descriptors.comments(
        "fulcrum.v1.PrefillBalancerService.Submit"
    )
    assert descriptors.comments("fulcrum.v1.MemberKind.MEMBER_KIND_UNSPECIFIED") == (
        "Not set; refused."
    )
    assert descriptors.comments("fulcrum.v1.ExpertBalancerService").startswith(
        "ExpertBalancerService (EPLB)"
    )
    with pytest.raises(KeyError):
        descriptors.comments("fulcrum.v1.PullRequest.no_such_field")


def _field_comment(db: ProtoReflectionDescriptorDatabase, symbol: str) -> str:
    """The leading comment of a field, read from the reflection server's descriptor."""
    message, _, field = symbol.rpartition(".")
    proto = db.FindFileContainingSymbol(message)
    msg_index = [m.name for m in proto.message_type].index(message.rsplit(".", 1)[1])
    field_index = [f.name for f in proto.message_type[msg_index].field].index(field)
    path = [descriptor_pb2.FileDescriptorProto.MESSAGE_TYPE_FIELD_NUMBER, msg_index, 2,
            field_index]
    for loc in proto.source_code_info.location:
        if list(loc.path) == path:
            return str(loc.leading_comments).strip()
    return ""


def _query(address: str) -> tuple[str, list[str], str]:
    """(comment of QUOTA_FIELD, services, health file name) through a real reflection
    client (blocking: run it off the server's event loop)."""
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(db.get_services())
        comment = _field_comment(db, QUOTA_FIELD)
        health_file = db.FindFileContainingSymbol("grpc.health.v1.Health").name
        return comment, services, health_file


@pytest.fixture
async def reflection_only() -> AsyncIterator[str]:
    """A bare server with health and reflection on the commented pool."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    names = [
        prefill_pb2.DESCRIPTOR.services_by_name["PrefillBalancerService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    reflection.enable_server_reflection(names, server, pool=descriptors.commented_pool())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_commented_pool_serves_comments_and_other_files(reflection_only: str) -> None:
    comment, services, health_file = await asyncio.to_thread(_query, reflection_only)
    assert comment == QUOTA_COMMENT
    assert "fulcrum.v1.PrefillBalancerService" in services
    assert health_file == "grpc_health/v1/health.proto"  # non-fulcrum files still served


async def test_daemon_reflection_serves_field_comments(daemon: Daemon) -> None:
    comment, services, _ = await asyncio.to_thread(_query, daemon.address)
    assert "fulcrum.v1.FleetService" in services
    assert comment == QUOTA_COMMENT


def test_genproto_check_sees_a_changed_comment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The committed descriptor set is part of the staleness check: a comment edited in
    a .proto without `make proto` makes `genproto --check` fail, naming the set."""
    import shutil

    from fulcrum.tools import genproto

    protos = tmp_path / "proto"
    shutil.copytree(genproto.PROTO_DIR, protos)
    assert genproto.check() == []
    prefill = protos / "fulcrum" / "v1" / "prefill.proto"
    prefill.write_text(prefill.read_text().replace(QUOTA_COMMENT, "Quota, in ns."))
    monkeypatch.setattr(genproto, "PROTO_DIR", protos)
    assert "descriptor_set.py" in genproto.check()
