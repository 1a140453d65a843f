// Generates src/schema.ts, the request and response types, from the server's OpenAPI document.
//
//   node scripts/generate.mjs http://127.0.0.1:7700/openapi.json [OUT]
//   node scripts/generate.mjs path/to/openapi.json [OUT]
//
// OUT defaults to src/schema.ts beside this script. A `$ref` that points nowhere in the
// document is read as "any value" (and reported) rather than failing, so that the types can
// still be made from a document with such a slip; once the document is fixed, running this
// again is all it takes.

import { readFile, writeFile } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import openapiTS, { COMMENT_HEADER, astToString } from "openapi-typescript";

const DEFAULT_OUT = fileURLToPath(new URL("../src/schema.ts", import.meta.url));

async function readDocument(source) {
  if (/^https?:\/\//.test(source)) {
    const response = await fetch(source);
    if (!response.ok) throw new Error(`GET ${source}: HTTP ${response.status}`);
    return response.json();
  }
  return JSON.parse(await readFile(source, "utf8"));
}

function resolvePointer(document, ref) {
  const tokens = ref.slice(2).split("/").map((token) => token.replaceAll("~1", "/").replaceAll("~0", "~"));
  let node = document;
  for (const token of tokens) {
    if (node === null || typeof node !== "object" || !Object.hasOwn(node, token)) return undefined;
    node = node[token];
  }
  return node;
}

// Replaces every local `$ref` whose target is missing with an empty schema; returns the refs.
function replaceDanglingRefs(document) {
  const dangling = new Set();
  const visit = (node) => {
    if (node === null || typeof node !== "object") return;
    for (const [key, child] of Object.entries(node)) {
      if (child !== null && typeof child === "object" && typeof child.$ref === "string" && child.$ref.startsWith("#/")) {
        if (resolvePointer(document, child.$ref) === undefined) {
          dangling.add(child.$ref);
          node[key] = { description: `unresolved ${child.$ref} in the OpenAPI document` };
          continue;
        }
      }
      visit(child);
    }
  };
  visit(document);
  return [...dangling];
}

async function generate(source) {
  const document = await readDocument(source);
  for (const ref of replaceDanglingRefs(document)) {
    console.warn(`warning: ${ref} is referenced but not defined; typed as unknown`);
  }
  // An object schema without properties (an event's payload) holds any fields, not none.
  const ast = await openapiTS(document, { silent: true, emptyObjectsUnknown: true });
  return COMMENT_HEADER + astToString(ast);
}

const [source, out = DEFAULT_OUT] = process.argv.slice(2);
if (!source) {
  console.error("usage: node scripts/generate.mjs URL_OR_FILE [OUT]");
  process.exit(2);
}
await writeFile(out, await generate(source));
console.log(`wrote ${out}`);
