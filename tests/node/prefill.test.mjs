// A prefill engine (one DP group) and a submitter (the entrypoint), from the protos alone
// (docs/protocol.md: "Prefill engine", "Entrypoint"), with acknowledged delivery: a pulled
// batch is leased to the engine, the engine acknowledges what it accepted (Ack, or
// ack_request_ids on its next Pull), and Submit resolves on the acknowledgement, naming
// the engine that actually runs the request. A request whose lease runs out goes to
// another engine; the late acknowledgement is refused. Submit is idempotent, and fails
// fast with UNAVAILABLE (retry-after-ms) when no prefill engine is registered.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  Status,
  call,
  codeOf,
  connect,
  errorOf,
  metrics,
  sample,
  startDaemon,
} from "./lib/fulcrum.mjs";

/** Wait until `n` requests are queued in the tier "<16K" (polls /metrics, bounded). */
async function queued(n) {
  for (let i = 0; i < 500; i++) {
    const depth = sample(await metrics(daemon), 'fulcrum_prefill_queue_depth{tier="<16K"}');
    if (depth === n) return;
    await new Promise((r) => setTimeout(r, 10));
  }
  throw new Error(`queue depth never reached ${n}`);
}

let daemon;
let api;

before(async () => {
  daemon = await startDaemon({
    config: { fleet: { heartbeat_timeout_ms: 60_000 }, prefill: { lease_ms: 500 } },
  });
  api = connect(daemon.address);
});

after(async () => {
  api?.close();
  assert.equal(await daemon?.stop(), 0);
});

const ENGINE = "pf-a";
const OTHER = "pf-b";
const STEP_NS = "1000000000"; // 1 s step budget

describe("prefill engine and submitter", () => {
  let incarnation;

  const pull = (fields = {}, deadlineMs = 15_000) =>
    call(
      api.prefill,
      "Pull",
      {
        engine_id: ENGINE,
        incarnation,
        remaining_quota_ns: STEP_NS,
        rank_loads_ns: ["0", "0"],
        max_wait_ms: 5_000,
        ...fields,
      },
      { deadlineMs },
    );
  const submit = (id, total, fields = {}, deadlineMs = 15_000) =>
    call(
      api.prefill,
      "Submit",
      { request_id: id, total_tokens: String(total), cached_tokens: "0", max_wait_ms: 10_000, ...fields },
      { deadlineMs },
    );

  test("the engine registers its DP ranks and step budget, and reads the cost model", async () => {
    const reg = await call(api.fleet, "Register", {
      member_id: ENGINE,
      prefill_engine: { dp_ranks: 2, step_quota_ns: STEP_NS },
    });
    incarnation = reg.incarnation;
    const cm = await call(api.prefill, "GetCostModel", { engine_id: ENGINE });
    assert.equal(cm.step_quota_ns, STEP_NS);
    assert.ok(cm.a > 0 && cm.b > 0 && cm.max_chunk_tokens > 0);
    assert.ok(BigInt(cm.version) >= 1n);
  });

  const ack = (ids, engine = ENGINE, inc = incarnation) =>
    call(api.prefill, "Ack", { engine_id: engine, incarnation: inc, request_ids: ids });

  test("a pulled request is leased; Submit resolves on the Ack, naming engine and rank", async () => {
    const pulled = pull();
    const placing = submit("p-1", 1000);
    const batch = await pulled;
    assert.ok(batch.lease_ms > 0);
    let settled = false;
    placing.then(() => (settled = true), () => (settled = true));
    await new Promise((r) => setImmediate(r));
    assert.equal(settled, false); // not before the acknowledgement
    const acked = await ack(["p-1"]);
    assert.equal(acked.accepted, 1);
    assert.deepEqual(acked.rejected_request_ids, []);
    const placed = await placing;
    assert.equal(batch.requests.length, 1);
    const [r] = batch.requests;
    assert.equal(r.request_id, "p-1");
    assert.equal(r.total_tokens, "1000");
    assert.equal(placed.engine_id, ENGINE);
    assert.equal(placed.dp_rank, r.dp_rank);
    assert.equal(placed.tier, batch.tier);
    assert.equal(placed.tier_name, "<16K");
    assert.equal(placed.predicted_cost_ns, r.predicted_cost_ns);
    assert.equal(batch.batch_quota_ns, r.predicted_cost_ns);
  });

  test("queued requests come in one FIFO batch, each on the least-loaded rank", async () => {
    // Short prompts (about 33 ms each): under the default late binding an engine takes
    // work only while a rank holds less than a tenth of a step budget (100 ms).
    const submits = ["b-1", "b-2", "b-3"].map((id, i) => submit(id, 500 + i));
    // The three wait in the queue: the engine is not pulling. Rank 0 reports more work.
    await queued(3);
    const batch = await pull({ rank_loads_ns: ["50000000", "0"] });
    assert.deepEqual(
      batch.requests.map((r) => r.request_id),
      ["b-1", "b-2", "b-3"],
    );
    // Acknowledged on the next pull (no extra call).
    const next = await pull({ ack_request_ids: ["b-1", "b-2", "b-3"], max_wait_ms: 1 });
    assert.deepEqual(next.rejected_request_ids, []);
    const placed = await Promise.all(submits);
    assert.deepEqual(
      placed.map((p) => p.dp_rank),
      batch.requests.map((r) => r.dp_rank),
    );
    assert.equal(batch.requests[0].dp_rank, 1); // the idle rank first
  });

  test("an empty long poll ends with an empty batch after max_wait_ms", async () => {
    const batch = await pull({ max_wait_ms: 100 });
    assert.equal(batch.requests.length, 0);
  });

  test("a submit cancelled by its caller is never handed to an engine", async () => {
    const err = await errorOf(submit("c-1", 1000, {}, 300)); // client deadline 300 ms
    assert.equal(err.code, Status.DEADLINE_EXCEEDED);
    await queued(0);
    const batch = await pull({ max_wait_ms: 200 });
    assert.equal(batch.requests.length, 0);
  });

  test("a re-submit of an acknowledged id returns the same outcome, no second delivery", async () => {
    const again = await submit("p-1", 1000);
    assert.equal(again.engine_id, ENGINE);
    const batch = await pull({ max_wait_ms: 100 });
    assert.equal(batch.requests.length, 0);
  });

  test("refusals: bad lengths, id reused by another request, bad pulls", async () => {
    let err = await errorOf(submit("x-1", 100, { cached_tokens: "100" }));
    assert.equal(err.code, Status.INVALID_ARGUMENT);
    assert.match(err.details, /^cached_tokens/);
    err = await errorOf(submit("x-2", 0));
    assert.equal(err.code, Status.INVALID_ARGUMENT);
    assert.match(err.details, /^total_tokens/);
    const first = submit("x-3", 1000, { max_wait_ms: 1000 });
    await queued(1);
    // Nobody pulls: another request (other lengths) reusing the queued id is refused...
    err = await errorOf(submit("x-3", 2000));
    assert.equal(err.code, Status.ALREADY_EXISTS);
    // ...and the queued one runs out of its own wait (the daemon's answer, not ours).
    err = await errorOf(first);
    assert.equal(err.code, Status.DEADLINE_EXCEEDED);
    assert.match(err.details, /no engine took the request/);
    err = await errorOf(pull({ rank_loads_ns: ["0"] }));
    assert.equal(err.code, Status.INVALID_ARGUMENT);
    assert.match(err.details, /^rank_loads_ns/);
    // A leased pull must say how loaded its ranks are (no guessing "idle").
    err = await errorOf(pull({ rank_loads_ns: [] }));
    assert.equal(err.code, Status.INVALID_ARGUMENT);
    assert.match(err.details, /^rank_loads_ns: required/);
    assert.equal(await codeOf(pull({ incarnation: "1" })), Status.FAILED_PRECONDITION);
    assert.equal(await codeOf(pull({ engine_id: "nobody" })), Status.NOT_FOUND);
  });

  test("the engine reports measured step times", async () => {
    const reply = await call(api.prefill, "ReportStepTimes", {
      engine_id: ENGINE,
      samples: [
        { q: "1000", c: "0", measured_ns: "20000000" },
        { q: "2000", c: "1000", measured_ns: "45000000" },
      ],
    });
    assert.equal(reply.accepted, 2);
    const err = await errorOf(
      call(api.prefill, "ReportStepTimes", {
        engine_id: ENGINE,
        samples: [{ q: "0", c: "0", measured_ns: "1" }],
      }),
    );
    assert.equal(err.code, Status.INVALID_ARGUMENT);
    assert.match(err.details, /^samples\[0\]\.q/);
  });

  test("with no engine, Submit fails fast: UNAVAILABLE with retry-after-ms", async () => {
    await call(api.fleet, "Deregister", { member_id: ENGINE, incarnation });
    const err = await errorOf(submit("n-1", 1000, { max_wait_ms: 10_000 }));
    assert.equal(err.code, Status.UNAVAILABLE);
    assert.match(err.details, /no live prefill engine/);
    assert.ok(Number(err.metadata.get("retry-after-ms")[0]) > 0);
  });

  test("a deregistered engine's pull is NOT_FOUND: register again", async () => {
    assert.equal(await codeOf(pull({ max_wait_ms: 0 })), Status.NOT_FOUND);
    const reg = await call(api.fleet, "Register", {
      member_id: ENGINE,
      prefill_engine: { dp_ranks: 2, step_quota_ns: STEP_NS },
    });
    assert.ok(BigInt(reg.incarnation) > BigInt(incarnation));
    incarnation = reg.incarnation;
    const pulled = pull();
    const placing = submit("n-2", 1000);
    assert.equal((await pulled).requests[0].request_id, "n-2");
    await ack(["n-2"]);
    assert.equal((await placing).engine_id, ENGINE);
  });

  test("partition: an engine frozen after a pull loses no request; the submitter learns the real engine once", async () => {
    const other = await call(api.fleet, "Register", {
      member_id: OTHER,
      prefill_engine: { dp_ranks: 2, step_quota_ns: STEP_NS },
    });
    // pf-a pulls the request, then freezes: no Ack, no Pull.
    const frozen = pull();
    const placing = submit("part-1", 1000, { max_wait_ms: 10_000 });
    const held = await frozen;
    assert.deepEqual(held.requests.map((r) => r.request_id), ["part-1"]);
    // pf-b long-polls: once pf-a's lease runs out, the request comes back at the head
    // of its tier and pf-b gets it.
    const theirs = await call(
      api.prefill,
      "Pull",
      {
        engine_id: OTHER,
        incarnation: other.incarnation,
        remaining_quota_ns: STEP_NS,
        rank_loads_ns: ["0", "0"],
        max_wait_ms: 5_000,
      },
      { deadlineMs: 15_000 },
    );
    assert.deepEqual(theirs.requests.map((r) => r.request_id), ["part-1"]);
    assert.equal((await ack(["part-1"], OTHER, other.incarnation)).accepted, 1);
    const placed = await placing;
    assert.equal(placed.engine_id, OTHER); // the engine that actually runs it
    assert.equal(placed.dp_rank, theirs.requests[0].dp_rank);
    // pf-a thaws and acknowledges late: refused, it must not run the request.
    const late = await ack(["part-1"]);
    assert.equal(late.accepted, 0);
    assert.deepEqual(late.rejected_request_ids, ["part-1"]);
    // ... and is killed (here: deregistered). The submitter's answer stays the same.
    await call(api.fleet, "Deregister", { member_id: ENGINE, incarnation });
    const again = await submit("part-1", 1000);
    assert.equal(again.engine_id, OTHER);
    const m = await metrics(daemon);
    assert.ok(sample(m, 'fulcrum_prefill_leases_total{outcome="expired"}') >= 1);
    assert.ok(sample(m, 'fulcrum_prefill_leases_total{outcome="rejected_ack"}') >= 1);
  });
});
