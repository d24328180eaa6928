// Helpers of the Node.js protocol suite: load the .proto files (nothing else from
// Fulcrum), start the daemon as an operator would (`fulcrum serve --config <yaml>`), and
// call the API with promises. See docs/protocol.md for the sequences played here.
import { spawn } from "node:child_process";
import net from "node:net";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import readline from "node:readline";
import { fileURLToPath } from "node:url";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const HERE = path.dirname(fileURLToPath(import.meta.url));
export const ROOT = path.resolve(HERE, "..", "..", "..");
const PROTO_DIR = path.join(ROOT, "proto");
const FILES = ["decode", "diagnostics", "expert", "fleet", "prefill", "vision"].map(
  (name) => `fulcrum/v1/${name}.proto`,
);

// uint64 fields as decimal strings (incarnations exceed 2^53 on long-lived daemons),
// enums as names, every field present with its default, oneofs named.
const definition = protoLoader.loadSync(FILES, {
  includeDirs: [PROTO_DIR],
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
});
export const v1 = grpc.loadPackageDefinition(definition).fulcrum.v1;
export const Status = grpc.status;

const CHANNEL_OPTIONS = {
  // Reconnect within ~1 s after a daemon restart (the default backs off to 2 minutes).
  "grpc.initial_reconnect_backoff_ms": 100,
  "grpc.max_reconnect_backoff_ms": 1000,
};

/** One stub per service on one channel. */
export function connect(address) {
  const creds = grpc.credentials.createInsecure();
  const fleet = new v1.FleetService(address, creds, CHANNEL_OPTIONS);
  const channelOverride = fleet.getChannel();
  const opts = { ...CHANNEL_OPTIONS, channelOverride };
  return {
    fleet,
    prefill: new v1.PrefillBalancerService(address, creds, opts),
    decode: new v1.DecodeBalancerService(address, creds, opts),
    vision: new v1.VisionBalancerService(address, creds, opts),
    expert: new v1.ExpertBalancerService(address, creds, opts),
    diagnostics: new v1.DiagnosticsService(address, creds, opts),
    close() {
      fleet.close();
    },
  };
}

/**
 * A unary call as a promise. Rejects with the grpc-js error (`code`, `details`,
 * `metadata`). `deadlineMs` bounds the call (default 10 s).
 */
export function call(stub, method, request, { deadlineMs = 10_000, metadata } = {}) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + deadlineMs);
    stub[method](request, metadata ?? new grpc.Metadata(), { deadline }, (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

/** The gRPC status code of a call that must fail (fails the test if it succeeds). */
export async function codeOf(promise) {
  try {
    await promise;
  } catch (err) {
    return err.code;
  }
  throw new Error("call succeeded but was expected to fail");
}

/** The error of a call that must fail. */
export async function errorOf(promise) {
  try {
    await promise;
  } catch (err) {
    return err;
  }
  throw new Error("call succeeded but was expected to fail");
}

/** Name of a status code, for messages. */
export function codeName(code) {
  return Object.keys(grpc.status).find((k) => grpc.status[k] === code) ?? String(code);
}

/** Retry a call while it ends UNAVAILABLE (daemon restarting or draining), with backoff. */
export async function retryUnavailable(fn, { attempts = 40, firstMs = 50, maxMs = 1000 } = {}) {
  let wait = firstMs;
  for (let i = 1; ; i++) {
    try {
      return await fn();
    } catch (err) {
      if (err.code !== grpc.status.UNAVAILABLE || i >= attempts) throw err;
    }
    await new Promise((r) => setTimeout(r, wait));
    wait = Math.min(wait * 2, maxMs);
  }
}

/** A Tensor of int64 values, raw little-endian C-order bytes. */
export function int64Tensor(rows) {
  const shape = [rows.length, rows[0].length];
  const data = Buffer.alloc(shape[0] * shape[1] * 8);
  rows.flat().forEach((v, i) => data.writeBigInt64LE(BigInt(v), i * 8));
  return { dtype: "int64", shape, data };
}

/** The rows of an int32 Tensor (the dtype of every map the daemon sends). */
export function int32Rows(tensor) {
  if (tensor.dtype !== "int32") throw new Error(`expected int32, got ${tensor.dtype}`);
  const [n, ...rest] = tensor.shape;
  const width = rest.reduce((a, b) => a * b, 1);
  const data = Buffer.from(tensor.data);
  const rows = [];
  for (let r = 0; r < n; r++) {
    const row = [];
    for (let c = 0; c < width; c++) row.push(data.readInt32LE((r * width + c) * 4));
    rows.push(row);
  }
  return rows;
}

/** A seeded pseudo-random generator (mulberry32), for reproducible loads. */
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Next message of a server stream, or its error (bounded by `timeoutMs`). */
export function nextMessage(stream, timeoutMs = 10_000) {
  if (!stream._fulcrumQueue) {
    stream._fulcrumQueue = [];
    stream._fulcrumWaiters = [];
    const push = (item) => {
      const waiter = stream._fulcrumWaiters.shift();
      if (waiter) waiter(item);
      else stream._fulcrumQueue.push(item);
    };
    stream.on("data", (data) => push({ data }));
    stream.on("error", (error) => push({ error }));
    stream.on("end", () => push({ end: true }));
  }
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error("no stream message in time")), timeoutMs);
    const take = (item) => {
      clearTimeout(timer);
      if (item.error) reject(item.error);
      else if (item.end) reject(new Error("stream ended"));
      else resolve(item.data);
    };
    const item = stream._fulcrumQueue.shift();
    if (item) take(item);
    else stream._fulcrumWaiters.push(take);
  });
}

const FULCRUM_BIN = process.env.FULCRUM_BIN ?? path.join(ROOT, ".venv", "bin", "fulcrum");

/**
 * Start `fulcrum serve --config <tmp yaml>` (free ports unless `port` is given) and wait
 * for its `daemon_started` log line. `config` is merged into the test defaults.
 */
export async function startDaemon({ port = 0, config = {} } = {}) {
  const dir = mkdtempSync(path.join(tmpdir(), "fulcrum-node-"));
  const doc = {
    ...config,
    server: {
      host: "127.0.0.1",
      port,
      grace_period_s: 3,
      drain_linger_s: 0,
      seed: 1234,
      ...(config.server ?? {}),
    },
    metrics: { port: 0, ...(config.metrics ?? {}) },
    logging: { level: "info", format: "json", ...(config.logging ?? {}) },
  };
  const file = path.join(dir, "fulcrum.yaml");
  writeFileSync(file, JSON.stringify(doc, null, 2)); // JSON is YAML
  const proc = spawn(FULCRUM_BIN, ["serve", "--config", file], {
    stdio: ["ignore", "pipe", "pipe"],
    env: { ...process.env, PYTHONUNBUFFERED: "1" },
  });
  const lines = [];
  const stderr = [];
  proc.stderr.on("data", (chunk) => stderr.push(String(chunk)));
  const exited = new Promise((resolve) => proc.on("exit", (code, signal) => resolve({ code, signal })));
  const started = new Promise((resolve, reject) => {
    const rl = readline.createInterface({ input: proc.stdout });
    rl.on("line", (line) => {
      let event;
      try {
        event = JSON.parse(line);
      } catch {
        return;
      }
      lines.push(event);
      if (event.event === "daemon_started") resolve(event);
    });
    exited.then(({ code }) =>
      reject(new Error(`daemon exited (${code}) before starting: ${stderr.join("")}`)),
    );
  });
  const timeout = new Promise((_, reject) =>
    setTimeout(() => reject(new Error("daemon did not start in 30 s")), 30_000).unref(),
  );
  const event = await Promise.race([started, timeout]);
  return {
    address: event.address,
    port: Number(String(event.address).split(":").pop()),
    metricsPort: Number(event.metrics_port),
    proc,
    lines,
    /** SIGTERM (drain) and wait for the exit; returns the exit code. */
    async stop(signal = "SIGTERM") {
      if (proc.exitCode === null && proc.signalCode === null) proc.kill(signal);
      const { code } = await exited;
      rmSync(dir, { recursive: true, force: true });
      return code;
    },
  };
}

/** Text of the daemon's /metrics. */
export async function metrics(daemon) {
  const res = await fetch(`http://127.0.0.1:${daemon.metricsPort}/metrics`);
  return res.text();
}

/** Value of one sample of /metrics (name with labels exactly as printed), or undefined. */
export function sample(text, series) {
  for (const line of text.split("\n")) {
    if (line.startsWith(series + " ")) return Number(line.slice(series.length + 1));
  }
  return undefined;
}

/** A loopback TCP port nothing listens on (bound, then closed). */
export function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

const ETCD_BIN = process.env.ETCD_BIN ?? "etcd";

/**
 * A single-member etcd on loopback (Debian's etcd-server; `.ci/run` installs it) with
 * its data in a temporary directory; resolves once /health answers.
 */
export async function startEtcd({ timeoutMs = 20_000 } = {}) {
  const dir = mkdtempSync(path.join(tmpdir(), "fulcrum-etcd-"));
  const [clientPort, peerPort] = [await freePort(), await freePort()];
  const client = `http://127.0.0.1:${clientPort}`;
  const peer = `http://127.0.0.1:${peerPort}`;
  const proc = spawn(ETCD_BIN, [
    "--name", "t", "--data-dir", dir, "--listen-client-urls", client,
    "--advertise-client-urls", client, "--listen-peer-urls", peer,
    "--initial-advertise-peer-urls", peer, "--initial-cluster", `t=${peer}`,
    "--log-level", "error",
  ], { stdio: "ignore" });
  const exited = new Promise((resolve) => proc.on("exit", resolve));
  const failed = new Promise((_, reject) => proc.on("error", reject));
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const healthy = await Promise.race([
      fetch(`${client}/health`).then((r) => r.json()).then((b) => b.health === "true", () => false),
      failed,
    ]);
    if (healthy) break;
    if (Date.now() > deadline || proc.exitCode !== null) {
      proc.kill("SIGKILL");
      throw new Error(`etcd did not become healthy in ${timeoutMs} ms`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  return {
    endpoint: `127.0.0.1:${clientPort}`,
    async stop() {
      if (proc.exitCode === null && proc.signalCode === null) proc.kill("SIGKILL");
      await exited;
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** Trailer of a standby's refusal naming the leader (host:port). */
export const LEADER_KEY = "x-fulcrum-leader";

/**
 * Stubs on several daemons of one pool (ha.backend: etcd), played from the protocol
 * alone: a call goes to the daemon believed to lead; a standby's refusal (UNAVAILABLE
 * with `x-fulcrum-leader`) sends it to the leader named, any other UNAVAILABLE to the
 * next address. Every call is repeated here: use it for idempotent calls only (Submit
 * by id, Register, Heartbeat, reads), or for any call refused by a standby.
 */
export function connectPool(addresses, { attempts = 40, firstMs = 50, maxMs = 500 } = {}) {
  const apis = new Map();
  const api = (address) => {
    if (!apis.has(address)) apis.set(address, connect(address));
    return apis.get(address);
  };
  const pool = {
    addresses: [...addresses],
    current: addresses[0],
    moves: 0,
    async call(service, method, request, options) {
      let wait = firstMs;
      for (let i = 1; ; i++) {
        const at = pool.current;
        try {
          return await call(api(at)[service], method, request, options);
        } catch (err) {
          if (err.code !== grpc.status.UNAVAILABLE || i >= attempts) throw err;
          const leader = err.metadata?.get(LEADER_KEY)?.[0]?.toString();
          const next = leader && leader !== at
            ? leader
            : pool.addresses[(pool.addresses.indexOf(at) + 1) % pool.addresses.length];
          if (pool.current === at && next !== at) {
            if (!pool.addresses.includes(next)) pool.addresses.push(next);
            pool.current = next;
            pool.moves += 1;
          }
        }
        await new Promise((r) => setTimeout(r, wait));
        wait = Math.min(wait * 2, maxMs);
      }
    },
    close() {
      for (const a of apis.values()) a.close();
    },
  };
  return pool;
}
