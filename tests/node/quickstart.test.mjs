// docs/protocol.md's Node.js quickstart, run as written (copied next to this suite's
// node_modules) against a daemon started as an operator would.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { readFileSync, rmSync, writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { promisify } from "node:util";

import { ROOT, startDaemon } from "./lib/fulcrum.mjs";

test("the protocol guide's Node.js quickstart places and releases a decode", async () => {
  const doc = readFileSync(path.join(ROOT, "docs", "protocol.md"), "utf8");
  const section = doc.slice(doc.indexOf("### Node.js"));
  const code = section.slice(section.indexOf("```js\n") + 6).split("```")[0];
  assert.ok(code.trim().split("\n").length <= 20);
  const script = path.join(path.dirname(new URL(import.meta.url).pathname), "quickstart.tmp.mjs");
  writeFileSync(script, code);
  const daemon = await startDaemon();
  try {
    const { stdout } = await promisify(execFile)(
      process.execPath, [script, daemon.address, path.join(ROOT, "proto")], { timeout: 30_000 });
    assert.match(stdout, /decode on decode-0 GPU [01]/);
  } finally {
    rmSync(script, { force: true });
    assert.equal(await daemon.stop(), 0);
  }
});
