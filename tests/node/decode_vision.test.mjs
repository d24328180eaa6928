// A decode instance, a VE machine and an entrypoint, from the protos alone
// (docs/protocol.md: "Decode instance", "VE machine", "Entrypoint").
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  Status,
  call,
  codeOf,
  connect,
  errorOf,
  metrics,
  nextMessage,
  sample,
  startDaemon,
} from "./lib/fulcrum.mjs";

let daemon;
let api;

before(async () => {
  daemon = await startDaemon({
    config: {
      fleet: { heartbeat_timeout_ms: 60_000 },
      decode: { lease_ms: 60_000 },
    },
  });
  api = connect(daemon.address);
});

after(async () => {
  api?.close();
  assert.equal(await daemon?.stop(), 0);
});

const decodeShape = (gpus, maxConcurrency = 4, maxKv = 100_000) => ({
  gpus: Array.from({ length: gpus }, () => ({
    max_concurrency: maxConcurrency,
    max_kv_tokens: String(maxKv),
  })),
});

describe("decode instance", () => {
  let incarnation;

  test("registers its GPUs and learns its heartbeat interval", async () => {
    const reply = await call(api.fleet, "Register", {
      member_id: "dec-a",
      decode_instance: decodeShape(2),
    });
    incarnation = reply.incarnation;
    assert.ok(BigInt(incarnation) > 0n);
    assert.ok(reply.heartbeat_interval_ms > 0);
    assert.ok(reply.heartbeat_timeout_ms > reply.heartbeat_interval_ms);
  });

  test("heartbeats each GPU's load; the balancer places on the lighter GPU", async () => {
    await call(api.fleet, "Heartbeat", {
      member_id: "dec-a",
      incarnation,
      decode_instance: {
        gpus: [
          { concurrency: 3, kv_tokens: "60000" },
          { concurrency: 0, kv_tokens: "0" },
        ],
      },
    });
    const placed = await call(api.decode, "PlaceDecode", { request_id: "r1", kv_tokens: "1000" });
    assert.equal(placed.instance_id, "dec-a");
    assert.equal(placed.gpu_index, 1);
    assert.equal(placed.gpu_concurrency, 1);
    assert.equal(placed.gpu_kv_tokens, "1000");
    assert.equal(placed.incarnation, incarnation);
    assert.ok(placed.lease_ms > 0);
    const text = await metrics(daemon);
    assert.equal(sample(text, 'fulcrum_fleet_members{kind="decode_instance"}'), 1);
  });

  test("operator reads: GetDecodeLoad per GPU (paged) and ListMembers with the summed load", async () => {
    const load = await call(api.decode, "GetDecodeLoad", {});
    assert.equal(load.next_page_token, "");
    assert.deepEqual(
      load.instances.map((i) => [
        i.instance_id, i.incarnation, i.total_concurrency, i.total_kv_tokens,
      ]),
      [["dec-a", incarnation, "4", "61000"]],
    );
    const [inst] = load.instances;
    assert.deepEqual(
      [inst.concurrency, inst.kv_tokens, inst.max_concurrency, inst.max_kv_tokens],
      [[3, 1], ["60000", "1000"], [4, 4], ["100000", "100000"]],
    );
    const one = await call(api.decode, "GetDecodeLoad", { instance_id: "dec-a", page_size: 1 });
    assert.deepEqual(one.instances, load.instances);
    assert.equal(
      await codeOf(call(api.decode, "GetDecodeLoad", { instance_id: "nobody" })),
      Status.NOT_FOUND,
    );
    const err = await errorOf(call(api.decode, "GetDecodeLoad", { page_size: 100_000 }));
    assert.equal(err.code, Status.INVALID_ARGUMENT);
    assert.match(err.details, /^page_size:/);
    const listed = await call(api.fleet, "ListMembers", { kind: "MEMBER_KIND_DECODE_INSTANCE" });
    assert.equal(listed.next_page_token, "");
    const [member] = listed.members;
    assert.equal(member.info, "decode_instance");
    assert.deepEqual(
      [
        member.decode_instance.concurrency,
        member.decode_instance.kv_tokens,
        member.decode_instance.max_gpu_concurrency,
        member.decode_instance.max_gpu_kv_tokens,
      ],
      ["4", "61000", 3, "60000"],
    );
  });

  test("a heartbeat with the wrong number of GPUs is INVALID_ARGUMENT naming the field", async () => {
    const err = await errorOf(
      call(api.fleet, "Heartbeat", {
        member_id: "dec-a",
        incarnation,
        decode_instance: { gpus: [{ concurrency: 1, kv_tokens: "1" }] },
      }),
    );
    assert.equal(err.code, Status.INVALID_ARGUMENT);
    assert.match(err.details, /decode_instance\.gpus/);
  });

  test("a stale incarnation is FAILED_PRECONDITION; an unknown member NOT_FOUND", async () => {
    assert.equal(
      await codeOf(call(api.fleet, "Heartbeat", { member_id: "dec-a", incarnation: "1" })),
      Status.FAILED_PRECONDITION,
    );
    assert.equal(
      await codeOf(call(api.fleet, "Heartbeat", { member_id: "nobody", incarnation: "1" })),
      Status.NOT_FOUND,
    );
  });

  test("entrypoint: duplicate id ALREADY_EXISTS, release frees, second release NOT_FOUND", async () => {
    assert.equal(
      await codeOf(call(api.decode, "PlaceDecode", { request_id: "r1", kv_tokens: "10" })),
      Status.ALREADY_EXISTS,
    );
    const released = await call(api.decode, "ReleaseDecode", { request_id: "r1" });
    assert.equal(released.instance_id, "dec-a");
    assert.equal(released.gpu_index, 1);
    assert.equal(
      await codeOf(call(api.decode, "ReleaseDecode", { request_id: "r1" })),
      Status.NOT_FOUND,
    );
  });

  test("a full fleet is RESOURCE_EXHAUSTED with a retry-after-ms trailer", async () => {
    // GPU 0 reports 3 of 4 requests, GPU 1 holds none: 5 more fit, the 6th does not.
    for (let i = 0; i < 5; i++) {
      await call(api.decode, "PlaceDecode", { request_id: `full-${i}`, kv_tokens: "100" });
    }
    const err = await errorOf(
      call(api.decode, "PlaceDecode", { request_id: "full-5", kv_tokens: "100" }),
    );
    assert.equal(err.code, Status.RESOURCE_EXHAUSTED);
    const [retry] = err.metadata.get("retry-after-ms");
    assert.ok(Number(retry) > 0, `retry-after-ms trailer: ${retry}`);
    for (let i = 0; i < 5; i++) {
      await call(api.decode, "ReleaseDecode", { request_id: `full-${i}` });
    }
  });

  test("the entrypoint's stream answers each message in order; errors keep it open", async () => {
    const stream = api.decode.PlaceDecodeStream();
    stream.write({ sequence: "1", place: { request_id: "s1", kv_tokens: "10" } });
    stream.write({ sequence: "2", place: { request_id: "s1", kv_tokens: "10" } });
    stream.write({ sequence: "3", release: { request_id: "s1" } });
    stream.write({ sequence: "4" });
    const replies = [];
    for (let i = 0; i < 4; i++) replies.push(await nextMessage(stream));
    stream.end();
    assert.deepEqual(
      replies.map((r) => [r.sequence, r.code, r.result ?? ""]),
      [
        ["1", Status.OK, "place"],
        ["2", Status.ALREADY_EXISTS, ""],
        ["3", Status.OK, "release"],
        ["4", Status.INVALID_ARGUMENT, ""],
      ],
    );
    assert.match(replies[3].message, /^op:/);
  });

  test("deregistering drops its placements: a later release is NOT_FOUND", async () => {
    await call(api.decode, "PlaceDecode", { request_id: "r-lost", kv_tokens: "10" });
    await call(api.fleet, "Deregister", { member_id: "dec-a", incarnation });
    assert.equal(
      await codeOf(call(api.decode, "ReleaseDecode", { request_id: "r-lost" })),
      Status.NOT_FOUND,
    );
    assert.equal(
      await codeOf(call(api.decode, "PlaceDecode", { request_id: "r-none", kv_tokens: "10" })),
      Status.RESOURCE_EXHAUSTED,
    );
  });
});

describe("VE machine", () => {
  let incarnation;

  test("registers, heartbeats patches in flight and reads the balancer's view", async () => {
    const reg = await call(api.fleet, "Register", {
      member_id: "ve-a",
      vision_machine: { gpus: 2, max_patches_in_flight: "4096" },
    });
    incarnation = reg.incarnation;
    await call(api.fleet, "Heartbeat", {
      member_id: "ve-a",
      incarnation,
      vision_machine: { patches_in_flight: ["2000", "0"] },
    });
    const load = await call(api.vision, "GetMachineLoad", { machine_id: "ve-a" });
    assert.deepEqual(load.patches_in_flight, ["2000", "0"]);
    assert.equal(load.max_patches_in_flight, "4096");
    const listed = await call(api.fleet, "ListMembers", {
      kind: "MEMBER_KIND_VISION_MACHINE",
      page_size: 10,
    });
    assert.deepEqual(
      listed.members.map((m) => [m.member_id, m.info, m.vision_machine.patches_in_flight]),
      [["ve-a", "vision_machine", ["2000", "0"]]],
    );
  });

  test("entrypoint places images (patches = ceil(w/p) * ceil(h/p)) and releases them", async () => {
    const placed = await call(api.vision, "PlaceImages", {
      request_id: "img-1",
      images: [
        { width: 448, height: 448, patch_size: 14 },
        { width: 30, height: 10, patch_size: 14 },
      ],
    });
    assert.deepEqual(
      placed.placements.map((p) => [p.machine_id, p.gpu_index, p.patches]),
      [
        ["ve-a", 1, "1024"],
        ["ve-a", 1, "3"],
      ],
    );
    let load = await call(api.vision, "GetMachineLoad", { machine_id: "ve-a" });
    assert.deepEqual(load.patches_in_flight, ["2000", "1027"]);
    assert.equal(load.images, 2);
    const released = await call(api.vision, "ReleaseImages", { request_id: "img-1" });
    assert.equal(released.images, 2);
    assert.equal(released.patches, "1027");
    load = await call(api.vision, "GetMachineLoad", { machine_id: "ve-a" });
    assert.deepEqual(load.patches_in_flight, ["2000", "0"]);
  });

  test("bad images are INVALID_ARGUMENT naming the image; unknown machine NOT_FOUND", async () => {
    const err = await errorOf(
      call(api.vision, "PlaceImages", { request_id: "img-2", images: [{ width: 0, height: 5 }] }),
    );
    assert.equal(err.code, Status.INVALID_ARGUMENT);
    assert.match(err.details, /^images\[0\]\.width/);
    assert.equal(
      await codeOf(call(api.vision, "GetMachineLoad", { machine_id: "nope" })),
      Status.NOT_FOUND,
    );
    assert.equal(
      await codeOf(call(api.vision, "ReleaseImages", { request_id: "img-2" })),
      Status.NOT_FOUND,
    );
  });

  test("a heartbeat of the wrong kind is INVALID_ARGUMENT", async () => {
    assert.equal(
      await codeOf(
        call(api.fleet, "Heartbeat", {
          member_id: "ve-a",
          incarnation,
          decode_instance: { gpus: [{ concurrency: 1, kv_tokens: "1" }] },
        }),
      ),
      Status.INVALID_ARGUMENT,
    );
  });
});
