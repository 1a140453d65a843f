// The checked-in `src/schema.ts` is what `scripts/generate.mjs` makes of the running
// server's `/openapi.json`: the types match the API the server serves.

import { after, test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { fileURLToPath } from "node:url";
import { Server, skipWithoutServer } from "../test-support/ratchet.mjs";

const PACKAGE = fileURLToPath(new URL("..", import.meta.url));
let server;
let scratch;

after(async () => {
  await server?.stop();
  if (scratch) rmSync(scratch, { recursive: true, force: true });
});

test("src/schema.ts is generated from the server's OpenAPI document", { skip: skipWithoutServer }, async () => {
  server = await Server.start();
  scratch = mkdtempSync(join(tmpdir(), "ratchet-schema-"));
  const generated = join(scratch, "schema.ts");
  await promisify(execFile)(process.execPath, [join(PACKAGE, "scripts/generate.mjs"), `${server.url}/openapi.json`, generated]);
  const checkedIn = readFileSync(join(PACKAGE, "src/schema.ts"), "utf8");
  assert.ok(
    readFileSync(generated, "utf8") === checkedIn,
    "src/schema.ts differs from the server's API: run `npm run generate -- http://HOST:PORT/openapi.json` against a server built from this tree",
  );
});
