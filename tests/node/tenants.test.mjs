// Tenant, priority and ttft_slo_ms from the protos alone (docs/protocol.md: "Tenant,
// priority and deadline"): a bad field is INVALID_ARGUMENT naming it, a tenant's cap is
// RESOURCE_EXHAUSTED with retry-after-ms, and the optional deadline field round-trips.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { Status, call, connect, errorOf, startDaemon } from "./lib/fulcrum.mjs";

let daemon;
let api;

before(async () => {
  daemon = await startDaemon({
    config: {
      fleet: { heartbeat_timeout_ms: 60_000 },
      tenants: {
        classes: { capped: { decode_max_concurrency: 1 } },
        min_priority: -2,
        max_priority: 2,
      },
    },
  });
  api = connect(daemon.address);
  await call(api.fleet, "Register", {
    member_id: "dec-t",
    decode_instance: { gpus: [{ max_concurrency: 8, max_kv_tokens: "100000" }] },
  });
});

after(async () => {
  api?.close();
  assert.equal(await daemon?.stop(), 0);
});

describe("entrypoint with a class", () => {
  test("a priority outside the range is INVALID_ARGUMENT naming priority", async () => {
    const err = await errorOf(
      call(api.decode, "PlaceDecode", { request_id: "p-bad", kv_tokens: "100", priority: 3 }),
    );
    assert.equal(err.code, Status.INVALID_ARGUMENT);
    assert.match(err.details, /^priority: must be in \[-2, 2\]/);
  });

  test("the optional deadline and a tenant are accepted; the cap refuses the second", async () => {
    const first = await call(api.decode, "PlaceDecode", {
      request_id: "p-1",
      kv_tokens: "100",
      tenant: "capped",
      priority: 1,
      ttft_slo_ms: 500,
    });
    assert.equal(first.instance_id, "dec-t");
    const err = await errorOf(
      call(api.decode, "PlaceDecode", { request_id: "p-2", kv_tokens: "100", tenant: "capped" }),
    );
    assert.equal(err.code, Status.RESOURCE_EXHAUSTED);
    assert.ok(Number(err.metadata.get("retry-after-ms")[0]) >= 1);
    await call(api.decode, "ReleaseDecode", { request_id: "p-1" });
    const again = await call(api.decode, "PlaceDecode", {
      request_id: "p-2",
      kv_tokens: "100",
      tenant: "capped",
    });
    assert.equal(again.instance_id, "dec-t");
  });
});
