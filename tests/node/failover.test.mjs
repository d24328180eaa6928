// Failover (docs/operations.md "Clients of a pool with several daemons"): two daemons
// electing a leader on a real etcd (ha.backend: etcd). The standby refuses with the
// leader's address in the x-fulcrum-leader trailer; once the leader is killed (SIGKILL)
// the standby takes over and a member registers again there, as after a restart.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import {
  LEADER_KEY,
  Status,
  call,
  connect,
  connectPool,
  errorOf,
  startDaemon,
  startEtcd,
} from "./lib/fulcrum.mjs";

const cleanup = [];
after(async () => {
  for (const fn of cleanup.reverse()) await fn();
});

const DECODE = {
  member_id: "dec-f",
  decode_instance: { gpus: [{ max_concurrency: 8, max_kv_tokens: "100000" }] },
};

/** The daemon that answers Ping (the leader), polled until `ms` pass. */
async function whoLeads(daemons, ms) {
  const apis = daemons.map((d) => connect(d.address));
  try {
    const deadline = Date.now() + ms;
    while (Date.now() < deadline) {
      for (const [i, api] of apis.entries()) {
        try {
          await call(api.diagnostics, "Ping", {}, { deadlineMs: 1_000 });
          return daemons[i];
        } catch (err) {
          if (err.code !== Status.UNAVAILABLE) throw err;
        }
      }
      await new Promise((r) => setTimeout(r, 50));
    }
    throw new Error(`no leader elected in ${ms} ms`);
  } finally {
    for (const api of apis) api.close();
  }
}

test("a standby names the leader; after the leader is killed the standby serves", async () => {
  const etcd = await startEtcd();
  cleanup.push(() => etcd.stop());
  const ha = {
    backend: "etcd",
    election_key: `/fulcrum-node-test/${process.pid}/leader`,
    lease_ttl_s: 3, // the defaults: less spurious fencing on a loaded machine
    renew_deadline_s: 2,
    retry_period_s: 0.1,
    etcd: { endpoints: [etcd.endpoint] },
  };
  const a = await startDaemon({ config: { ha } });
  cleanup.push(() => a.stop("SIGKILL"));
  const b = await startDaemon({ config: { ha } });
  cleanup.push(() => b.stop("SIGKILL"));
  const leader = await whoLeads([a, b], 30_000);
  const standby = leader === a ? b : a;

  // The standby refuses at once, naming the leader.
  const direct = connect(standby.address);
  cleanup.push(() => direct.close());
  const refused = await errorOf(call(direct.fleet, "Register", DECODE));
  assert.equal(refused.code, Status.UNAVAILABLE, refused.details);
  assert.equal(refused.metadata.get(LEADER_KEY)[0].toString(), leader.address);

  // A pool client given the standby first follows the trailer to the leader.
  const pool = connectPool([standby.address, leader.address]);
  cleanup.push(() => pool.close());
  const first = await pool.call("fleet", "Register", DECODE);
  assert.equal(pool.current, leader.address);
  const placed = await pool.call("decode", "PlaceDecode", { request_id: "f-1", kv_tokens: "10" });
  assert.equal(placed.instance_id, "dec-f");

  // kill -9 the leader: the standby takes over within about the lease TTL.
  await leader.stop("SIGKILL");
  const hb = await errorOf(
    pool.call("fleet", "Heartbeat", { member_id: "dec-f", incarnation: first.incarnation }),
  );
  // the new leader never heard of the member: NOT_FOUND, as after a restart
  assert.equal(hb.code, Status.NOT_FOUND, hb.details);
  assert.equal(pool.current, standby.address);
  const again = await pool.call("fleet", "Register", DECODE);
  assert.ok(BigInt(again.incarnation) > 0n);
  await pool.call("fleet", "Heartbeat", { member_id: "dec-f", incarnation: again.incarnation });
  const moved = await pool.call("decode", "PlaceDecode", { request_id: "f-2", kv_tokens: "10" });
  assert.equal(moved.instance_id, "dec-f");
  assert.equal(moved.incarnation, again.incarnation);
  const members = await pool.call("fleet", "ListMembers", {});
  assert.deepEqual(members.members.map((m) => m.member_id), ["dec-f"]);
});
