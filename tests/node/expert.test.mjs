// An EP group's load reporter (EP rank 0), from the protos alone
// (docs/protocol.md: "EP group").
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  Status,
  call,
  codeOf,
  connect,
  errorOf,
  int32Rows,
  int64Tensor,
  nextMessage,
  rng,
  startDaemon,
} from "./lib/fulcrum.mjs";

const LAYERS = 6;
const EXPERTS = 32;
const EP = 4;

let daemon;
let api;

before(async () => {
  daemon = await startDaemon();
  api = connect(daemon.address);
});

after(async () => {
  api?.close();
  assert.equal(await daemon?.stop(), 0);
});

const registration = {
  group_id: "ep-a",
  role: "GROUP_ROLE_PREFILL",
  ep_size: EP,
  gpus_per_node: 8,
  num_layers: LAYERS,
  num_experts: EXPERTS,
  window_steps: 20,
  period_steps: 40,
  expert_bytes: String(1 << 20),
};

/** Expert popularity: lognormal(0, 1) per layer and expert (seeded Box-Muller). */
function popularity(random) {
  return Array.from({ length: LAYERS }, () =>
    Array.from({ length: EXPERTS }, () => {
      const z = Math.sqrt(-2 * Math.log(1 - random())) * Math.cos(2 * Math.PI * random());
      return Math.exp(z);
    }),
  );
}
const POP = popularity(rng(42));

/** Tokens per expert over `steps` steps: ~50 tokens per step times the popularity. */
function skewedLoad(random, steps) {
  return POP.map((row) => row.map((p) => Math.round(p * 50 * steps * (0.9 + 0.2 * random()))));
}

describe("EP group", () => {
  const random = rng(7);
  let version;
  let watch;

  test("registers (idempotent with the same shape, ALREADY_EXISTS with another)", async () => {
    const reply = await call(api.expert, "RegisterGroup", registration);
    assert.equal(reply.created, true);
    assert.equal(reply.map_version, "1");
    const s = reply.shape;
    assert.equal(s.num_physical, 48); // 32 + 4 redundant per GPU x 4 GPUs
    assert.equal(s.slots_per_gpu, 12);
    const again = await call(api.expert, "RegisterGroup", registration);
    assert.equal(again.created, false);
    assert.equal(
      await codeOf(call(api.expert, "RegisterGroup", { ...registration, num_layers: 5 })),
      Status.ALREADY_EXISTS,
    );
    version = reply.map_version;
  });

  test("watches its map: the map in force arrives on connect", async () => {
    watch = api.expert.WatchMaps({ group_id: "ep-a" });
    const first = await nextMessage(watch);
    assert.equal(first.map.version, "1");
    assert.equal(first.map.algorithm, "initial");
    const phy = int32Rows(first.map.physical_to_logical);
    assert.equal(phy.length, LAYERS);
    assert.equal(phy[0].length, 48);
    // The identity map: slot s holds expert s mod num_experts.
    assert.deepEqual(phy[0].slice(30, 34), [30, 31, 0, 1]);
  });

  test("reports windows of steps as a raw int64 tensor and as packed values", async () => {
    const first = await call(api.expert, "ReportLoad", {
      group_id: "ep-a",
      map_version: version,
      step_begin: "0",
      step_end: "10",
      load: int64Tensor(skewedLoad(random, 10)),
    });
    assert.equal(first.map_version, "1");
    assert.equal(first.rebalanced, false);
    assert.equal(first.window_steps, "10");
    assert.equal(first.steps_to_rebalance, "30");
    const packed = await call(api.expert, "ReportLoad", {
      group_id: "ep-a",
      map_version: version,
      step_begin: "10",
      step_end: "20",
      load_values: skewedLoad(random, 10).flat().map(String),
    });
    assert.equal(packed.steps_to_rebalance, "20");
    assert.ok(packed.observed_moe_lb >= 1);
  });

  test("refusals change nothing: shape, dtype, overlap, both payloads", async () => {
    const bad = [
      [{ load: int64Tensor([[1, 2]]) }, Status.INVALID_ARGUMENT, /^load\.shape/],
      [
        { load: { dtype: "int8", shape: [LAYERS, EXPERTS], data: Buffer.alloc(LAYERS * EXPERTS) } },
        Status.INVALID_ARGUMENT,
        /^load\.dtype/,
      ],
      [{ load: int64Tensor(skewedLoad(random, 1)), step_begin: "5", step_end: "25" },
        Status.FAILED_PRECONDITION, /^step_begin/],
      [{ load: int64Tensor(skewedLoad(random, 1)), load_values: ["1"] },
        Status.INVALID_ARGUMENT, /^load:/],
      [{ load: int64Tensor(skewedLoad(random, 1)), map_version: "9" },
        Status.FAILED_PRECONDITION, /^map_version/],
    ];
    for (const [fields, code, message] of bad) {
      const err = await errorOf(
        call(api.expert, "ReportLoad", {
          group_id: "ep-a",
          map_version: version,
          step_begin: "20",
          step_end: "21",
          ...fields,
        }),
      );
      assert.equal(err.code, code, err.details);
      assert.match(err.details, message);
    }
    assert.equal(
      await codeOf(call(api.expert, "ReportLoad", {
        group_id: "nope", map_version: "1", step_begin: "0", step_end: "1",
        load: int64Tensor(skewedLoad(random, 1)),
      })),
      Status.NOT_FOUND,
    );
  });

  test("the period's last report rebalances; the watch delivers the new map", async () => {
    let reply;
    for (let begin = 20; begin < 40; begin += 10) {
      reply = await call(api.expert, "ReportLoad", {
        group_id: "ep-a",
        map_version: version,
        step_begin: String(begin),
        step_end: String(begin + 10),
        load: int64Tensor(skewedLoad(random, 10)),
      });
    }
    assert.equal(reply.rebalanced, true, JSON.stringify(reply));
    assert.equal(reply.map_version, "2");
    const next = await nextMessage(watch);
    assert.equal(next.map.version, "2");
    assert.notEqual(next.map.algorithm, "initial");
    assert.ok(next.map.slots_changed > 0);
    const counts = int32Rows(next.map.replica_counts);
    for (const row of counts) {
      assert.equal(row.reduce((a, b) => a + b, 0), 48);
      assert.ok(Math.min(...row) >= 1); // every expert keeps a replica
    }
    // Steps measured under v1 while v2 loads still count (loads are per logical expert);
    // the reply says they were counted under v2. The engine then moves to v2.
    const late = await call(api.expert, "ReportLoad", {
      group_id: "ep-a", map_version: version, step_begin: "40", step_end: "41",
      load: int64Tensor(skewedLoad(random, 1)),
    });
    assert.equal(late.counted_map_version, "2");
    version = next.map.version;
    const ok = await call(api.expert, "ReportLoad", {
      group_id: "ep-a", map_version: version, step_begin: "41", step_end: "50",
      load: int64Tensor(skewedLoad(random, 10)),
    });
    assert.equal(ok.map_version, "2");
    const old = await call(api.expert, "GetMap", { group_id: "ep-a", version: "1" });
    assert.equal(old.map.version, "1");
  });

  test("deregistering ends the watch with NOT_FOUND", async () => {
    await call(api.expert, "DeregisterGroup", { group_id: "ep-a" });
    const err = await nextMessage(watch).then(
      () => assert.fail("expected the watch to end"),
      (e) => e,
    );
    assert.equal(err.code, Status.NOT_FOUND);
  });
});
