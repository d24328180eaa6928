"""PlaceDecodeStream carries exactly the unary calls' semantics.

The same script of placements, releases and bad messages runs against two daemons with
the same seed, one through the unary calls and one through the stream; every answer
(result or status code and message) must be identical, in order, and the stream must
stay open after errors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from fulcrum.client import FulcrumClient
from fulcrum.core.decode import POLICY_NAMES
from fulcrum.testing import running_server
from fulcrum.v1 import decode_pb2 as pb
from tests.service.test_decode import add_instance

Answer = tuple[int, str, str]  # (code, message, result as text)


def script() -> list[pb.PlaceDecodeStreamRequest]:
    ops: list[pb.PlaceDecodeStreamRequest] = []

    def add_place(rid: str, kv: int) -> None:
        ops.append(
            pb.PlaceDecodeStreamRequest(place=pb.PlaceDecodeRequest(request_id=rid, kv_tokens=kv))
        )

    def add_release(rid: str) -> None:
        ops.append(pb.PlaceDecodeStreamRequest(release=pb.ReleaseDecodeRequest(request_id=rid)))

    for i in range(12):
        add_place(f"r{i}", 100_000 if i % 4 == 0 else 1_000 + 17 * i)
    add_place("r3", 500)  # duplicate -> ALREADY_EXISTS
    add_place("bad", 0)  # INVALID_ARGUMENT kv_tokens
    add_place("", 10)  # INVALID_ARGUMENT request_id
    add_place("huge", 50_000_000)  # RESOURCE_EXHAUSTED: fits nowhere
    add_release("r1")
    add_release("r1")  # NOT_FOUND
    add_release("")  # INVALID_ARGUMENT
    ops.append(pb.PlaceDecodeStreamRequest())  # no op -> INVALID_ARGUMENT
    for i in range(12, 20):
        add_place(f"r{i}", 200_000 if i % 3 == 0 else 800)
    for i in (0, 5, 12):
        add_release(f"r{i}")
    for seq, op in enumerate(ops):
        op.sequence = 1_000 + seq
    return ops


async def setup_fleet(c: FulcrumClient) -> None:
    await add_instance(
        c, "d-a", gpus=[(16, 2_000_000)] * 4, load=[(3, 500_000), (9, 20_000), (1, 900_000), (0, 0)]
    )
    await add_instance(c, "d-b", gpus=[(8, 1_000_000)] * 2)


async def run_unary(c: FulcrumClient, ops: list[pb.PlaceDecodeStreamRequest]) -> list[Answer]:
    out: list[Answer] = []
    for op in ops:
        which = op.WhichOneof("op")
        try:
            if which == "place":
                r: pb.PlaceDecodeResponse | pb.ReleaseDecodeResponse = await c.decode.PlaceDecode(
                    op.place
                )
            elif which == "release":
                r = await c.decode.ReleaseDecode(op.release)
            else:
                out.append((3, "op: one of place, release must be set", ""))
                continue
            out.append((0, "", str(r).replace("held_ms", "held")))
        except grpc.aio.AioRpcError as err:
            out.append((err.code().value[0], err.details() or "", ""))
    return out


async def run_stream(c: FulcrumClient, ops: list[pb.PlaceDecodeStreamRequest]) -> list[Answer]:
    async def gen() -> AsyncIterator[pb.PlaceDecodeStreamRequest]:
        for op in ops:
            yield op

    out: list[Answer] = []
    seqs = []
    async for reply in c.decode.PlaceDecodeStream(gen()):
        seqs.append(reply.sequence)
        which = reply.WhichOneof("result")
        result = str(getattr(reply, which)).replace("held_ms", "held") if which else ""
        out.append((reply.code, reply.message, result))
    assert seqs == [op.sequence for op in ops]  # one reply per message, in order
    return out


def strip_held(answers: list[Answer]) -> list[Answer]:
    """held_ms depends on wall time and incarnations on the daemon's start time; compare
    answers without them."""
    return [
        (
            code,
            msg,
            "\n".join(ln for ln in res.splitlines() if not ln.startswith(("held", "incarnation"))),
        )
        for code, msg, res in answers
    ]


@pytest.mark.parametrize("policy", ["dual", "power_of_two", "round_robin"])
async def test_stream_answers_exactly_like_unary(policy: str) -> None:
    assert policy in POLICY_NAMES
    ops = script()
    overrides = {"decode": {"policy": policy}}
    async with running_server(overrides) as d1, FulcrumClient(d1.address) as c1:
        await setup_fleet(c1)
        unary = await run_unary(c1, ops)
    async with running_server(overrides) as d2, FulcrumClient(d2.address) as c2:
        await setup_fleet(c2)
        streamed = await run_stream(c2, ops)
    assert strip_held(streamed) == strip_held(unary)
    codes = [code for code, _, _ in streamed]
    assert codes.count(0) == len(ops) - 7
    assert sorted(set(codes)) == [0, 3, 5, 6, 8]  # OK, INVALID, NOT_FOUND, EXISTS, EXHAUSTED


async def test_stream_stays_open_after_errors_and_interleaves(client: FulcrumClient) -> None:
    await add_instance(client, "d-a", gpus=[(4, 100_000)])
    ops = [
        pb.PlaceDecodeStreamRequest(sequence=1),  # no op
        pb.PlaceDecodeStreamRequest(
            sequence=2, place=pb.PlaceDecodeRequest(request_id="a", kv_tokens=10)
        ),
        pb.PlaceDecodeStreamRequest(sequence=3, release=pb.ReleaseDecodeRequest(request_id="a")),
        pb.PlaceDecodeStreamRequest(sequence=4, release=pb.ReleaseDecodeRequest(request_id="a")),
    ]
    answers = await run_stream(client, ops)
    assert [a[0] for a in answers] == [3, 0, 0, 5]
    assert answers[0][1] == "op: one of place, release must be set"
    assert 'instance_id: "d-a"' in answers[1][2]
