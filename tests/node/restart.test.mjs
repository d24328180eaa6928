// A daemon restart seen by one client of each kind (docs/protocol.md: "Daemon restart"),
// and a member that lapses (docs/protocol.md: "Membership").
// The daemon keeps no fleet or prefill state across a restart (EPLB maps only with
// eplb.snapshot_path, not set here): every member must notice and register again.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import {
  Status,
  call,
  codeOf,
  connect,
  errorOf,
  int64Tensor,
  metrics,
  retryUnavailable,
  sample,
  startDaemon,
} from "./lib/fulcrum.mjs";

const CONFIG = { fleet: { heartbeat_timeout_ms: 60_000 } };
let daemon;
let api;

after(async () => {
  api?.close();
  if (daemon) await daemon.stop();
});

const GROUP = {
  group_id: "ep-r",
  role: "GROUP_ROLE_DECODE",
  ep_size: 2,
  num_layers: 2,
  num_experts: 4,
  expert_bytes: "1024",
};
const ones = () => int64Tensor([[1, 1, 1, 1], [1, 1, 1, 1]]);

async function registerAll() {
  const dec = await call(api.fleet, "Register", {
    member_id: "dec-r",
    decode_instance: { gpus: [{ max_concurrency: 8, max_kv_tokens: "100000" }] },
  });
  const ve = await call(api.fleet, "Register", {
    member_id: "ve-r",
    vision_machine: { gpus: 1 },
  });
  const pf = await call(api.fleet, "Register", {
    member_id: "pf-r",
    prefill_engine: { dp_ranks: 1 },
  });
  const group = await call(api.expert, "RegisterGroup", GROUP);
  return { dec: dec.incarnation, ve: ve.incarnation, pf: pf.incarnation, group };
}

test("every member notices a daemon restart and registers again", async () => {
  daemon = await startDaemon({ config: CONFIG });
  const port = daemon.port;
  api = connect(daemon.address);
  const before = await registerAll();
  await call(api.expert, "ReportLoad", {
    group_id: "ep-r", map_version: "1", step_begin: "0", step_end: "5", load: ones(),
  });

  // A submit waits in the queue (the engine does not pull) when the daemon is told to stop.
  const pending = call(api.prefill, "Submit", {
    request_id: "q-1", total_tokens: "1000", max_wait_ms: 20_000,
  }, { deadlineMs: 30_000 });
  // Wait (bounded: 10 s) until it is queued; fail, never fall through, at the deadline.
  const depth = 'fulcrum_prefill_queue_depth{tier="<16K"}';
  const deadline = Date.now() + 10_000;
  while (sample(await metrics(daemon), depth) !== 1) {
    assert.ok(Date.now() < deadline, "the submit was not queued within 10 s");
    await new Promise((r) => setTimeout(r, 10));
  }
  const draining = daemon.stop("SIGTERM");
  const err = await errorOf(pending);
  assert.equal(err.code, Status.UNAVAILABLE, err.details); // drained: resubmit elsewhere/later
  assert.equal(await draining, 0);

  // Same port, fresh daemon. The client keeps its channel; grpc-js reconnects.
  daemon = await startDaemon({ port, config: CONFIG });

  // Decode instance: its heartbeat is NOT_FOUND -> register again (new, larger incarnation).
  const hb = () => call(api.fleet, "Heartbeat", { member_id: "dec-r", incarnation: before.dec });
  assert.equal(await codeOf(retryUnavailable(hb)), Status.NOT_FOUND);
  // VE machine and prefill engine: the same answer on a heartbeat or a pull.
  assert.equal(
    await codeOf(call(api.fleet, "Heartbeat", { member_id: "ve-r", incarnation: before.ve })),
    Status.NOT_FOUND,
  );
  assert.equal(
    await codeOf(call(api.prefill, "Pull", {
      engine_id: "pf-r", incarnation: before.pf, remaining_quota_ns: "1000000000",
    })),
    Status.NOT_FOUND,
  );
  // EP group: its report is NOT_FOUND -> register the group again (map version 1 again).
  assert.equal(
    await codeOf(call(api.expert, "ReportLoad", {
      group_id: "ep-r", map_version: "1", step_begin: "5", step_end: "10", load: ones(),
    })),
    Status.NOT_FOUND,
  );

  const after = await registerAll();
  for (const kind of ["dec", "ve", "pf"]) {
    assert.ok(BigInt(after[kind]) > BigInt(before[kind]), `${kind}: incarnation must grow`);
  }
  assert.equal(after.group.created, true);
  assert.equal(after.group.map_version, "1");
  await call(api.expert, "ReportLoad", {
    group_id: "ep-r", map_version: "1", step_begin: "5", step_end: "10", load: ones(),
  });
  await call(api.fleet, "Heartbeat", {
    member_id: "dec-r",
    incarnation: after.dec,
    decode_instance: { gpus: [{ concurrency: 1, kv_tokens: "10" }] },
  });

  // The submitter resubmits; the re-registered engine pulls it.
  const pulled = call(api.prefill, "Pull", {
    engine_id: "pf-r", incarnation: after.pf, remaining_quota_ns: "1000000000",
    rank_loads_ns: ["0"], max_wait_ms: 5_000,
  });
  const placing = call(api.prefill, "Submit", { request_id: "q-1", total_tokens: "1000" });
  assert.equal((await pulled).requests[0].request_id, "q-1");
  // Acknowledged delivery (issue 13): the Submit resolves on the engine's Ack.
  await call(api.prefill, "Ack", { engine_id: "pf-r", incarnation: after.pf, request_ids: ["q-1"] });
  const placed = await placing;
  assert.equal(placed.engine_id, "pf-r");
  const text = await metrics(daemon);
  assert.equal(sample(text, 'fulcrum_fleet_members{kind="prefill_engine"}'), 1);
});

test("a member that stops heartbeating lapses: its placements are lost, it registers again", async () => {
  const lapsing = await startDaemon({
    config: { fleet: { heartbeat_interval_ms: 100, heartbeat_timeout_ms: 500, sweep_interval_ms: 50 } },
  });
  const client = connect(lapsing.address);
  try {
    const reg = await call(client.fleet, "Register", {
      member_id: "dec-l",
      decode_instance: { gpus: [{ max_concurrency: 8, max_kv_tokens: "100000" }] },
    });
    assert.equal(reg.heartbeat_timeout_ms, 500);
    await call(client.decode, "PlaceDecode", { request_id: "l-1", kv_tokens: "10" });
    // No heartbeat from now on: wait (bounded) until the daemon's sweep has taken it out
    // and dropped its placements. (ListMembers stops listing a lapsed member at once,
    // before the sweep: poll the lost-placements counter, which the sweep sets.)
    const lost = 'fulcrum_decode_lost_placements_total{reason="lapsed"}';
    let dropped = 0;
    for (let i = 0; i < 200 && dropped < 1; i++) {
      await new Promise((r) => setTimeout(r, 50));
      dropped = sample(await metrics(lapsing), lost) ?? 0;
    }
    assert.equal(dropped, 1);
    const members = (await call(client.fleet, "ListMembers", {})).members.map((m) => m.member_id);
    assert.deepEqual(members, []);
    assert.equal(
      await codeOf(call(client.decode, "ReleaseDecode", { request_id: "l-1" })),
      Status.NOT_FOUND,
    );
    const err = await errorOf(
      call(client.fleet, "Heartbeat", { member_id: "dec-l", incarnation: reg.incarnation }),
    );
    assert.equal(err.code, Status.NOT_FOUND);
    const again = await call(client.fleet, "Register", {
      member_id: "dec-l",
      decode_instance: { gpus: [{ max_concurrency: 8, max_kv_tokens: "100000" }] },
    });
    assert.ok(BigInt(again.incarnation) > BigInt(reg.incarnation));
  } finally {
    client.close();
    assert.equal(await lapsing.stop(), 0);
  }
});
