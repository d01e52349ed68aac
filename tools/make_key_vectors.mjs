// Golden key vectors: what a TypeScript agent computes for a set of intents.
//
// Regenerate (Node 20 or later; the output is deterministic):
//
//     node tools/make_key_vectors.mjs > tests/data/key_vectors.jsonl
//
// Each line is one intent and what JavaScript makes of it:
//     {"scope": ..., "tool": ..., "args": <JSON value>, "canonical": ..., "key": ...}
// where canonical is stableStringify(args) below (the recipe of docs/design.md section 2) and key is
// the lowercase hex SHA-256 of the UTF-8 bytes of `${scope}:${tool}:${canonical}`.
//
// The lines are plain ASCII: every non-ASCII character is written as a \uXXXX escape, so lone
// surrogates survive and the file is valid UTF-8. Numbers in "args" are written so that Python's
// json.loads yields the value JavaScript had: -0 is written "-0.0" (JSON.stringify would write
// "0"), and vectors marked "float" write integral numbers with ".0" so that Python reads a float
// rather than an int; both must give the canonical text JavaScript gave.

import { createHash } from "node:crypto";

function stableStringify(v) {
  if (v === null || typeof v !== "object") return JSON.stringify(v);
  if (Array.isArray(v)) return `[${v.map(stableStringify).join(",")}]`;
  return `{${Object.keys(v)
    .sort()
    .map((k) => `${JSON.stringify(k)}:${stableStringify(v[k])}`)
    .join(",")}}`;
}

// A JSON text of `v` for the file: ASCII only, -0 kept, integral numbers as floats if asked.
function fileJson(v, floaty) {
  if (typeof v === "number") {
    if (Object.is(v, -0)) return "-0.0";
    const text = JSON.stringify(v);
    return floaty && !/[.e]/.test(text) ? `${text}.0` : text;
  }
  if (typeof v === "string") return asciiOnly(JSON.stringify(v));
  if (v === null || typeof v !== "object") return JSON.stringify(v);
  if (Array.isArray(v)) return `[${v.map((x) => fileJson(x, floaty)).join(",")}]`;
  return `{${Object.keys(v)
    .map((k) => `${asciiOnly(JSON.stringify(k))}:${fileJson(v[k], floaty)}`)
    .join(",")}}`;
}

function asciiOnly(text) {
  return text.replace(/[\u0080-\uffff]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
}

// mulberry32: a small seeded PRNG, so that every run writes the same file.
function prng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const rand = prng(20260102);
const pick = (items) => items[Math.floor(rand() * items.length)];
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

const SCOPES = ["run-1", "thread:42:checkpoint:7", "r\u00e9sum\u00e9-\u{1F600}", "0", "a b c", "scope/with/slashes"];
const TOOLS = ["send_email", "charge-card", "db.insert", "\u5de5\u5177", "x", "Create Ticket"];

const lines = [];
function add(args, { floaty = false, scope = null, tool = null } = {}) {
  scope ??= pick(SCOPES);
  tool ??= pick(TOOLS);
  const canonical = stableStringify(args);
  const key = createHash("sha256").update(`${scope}:${tool}:${canonical}`, "utf8").digest("hex");
  lines.push(
    `{"scope":${asciiOnly(JSON.stringify(scope))},"tool":${asciiOnly(JSON.stringify(tool))},` +
      `"args":${fileJson(args, floaty)},"canonical":${asciiOnly(JSON.stringify(canonical))},` +
      `"key":"${key}"}`,
  );
}

// -- scalars and empty containers at the root, and every scope and tool name ----------------------
for (const v of [null, true, false, 0, 1, -1, "", "a", [], {}, [[]], [{}], { a: {} }]) add(v);
for (const scope of SCOPES) for (const tool of TOOLS) add({ n: 1, s: "x" }, { scope, tool });

// -- numbers in every formatting range of Number.prototype.toString ---------------------------
const NUMBERS = [
  0, -0, 1, -1, 100, 1e-7, 1e-6, 1.5e-7, 1.5e-6, 9.999999999999999e-7, 1e-5, 1e-4, 0.001, 1e15,
  1e16, 1e17, 1e20, 1e21, 1e22, 1.5e21, 9.99999999999999e20, 999999999999999900000,
  123456789012345680000, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
  -1.7976931348623157e308, 2 ** 53, 2 ** 53 - 1, -(2 ** 53), 2 ** 53 + 2, 2 ** 63, 2 ** 64,
  0.1, 0.2, 0.1 + 0.2, 0.3, 0.2 + 0.3 - 0.5, 1 / 3, 2 / 3, -1 / 3, Math.PI, Math.E, 1e-300,
  1e300, 123.456, -123.456, 1000000000000000.5, 0.000001234, 1.2345e-7, 4.35, 0.5, 1e100,
  1.7e-100, 25, 4294967296, 4294967295.5, 1e308, 3e-7, 7e20, 7e21,
];
for (const n of NUMBERS) {
  add(n);
  add([n], { floaty: true });
  add({ n, m: -n }, { floaty: true });
}
// seeded random doubles across magnitudes 1e-30 .. 1e30, both signs
for (let i = 0; i < 150; i++) {
  const x = (1 + 9 * rand()) * 10 ** int(-30, 30);
  const digits = int(1, 17);
  const n = Number(x.toPrecision(digits)) * (rand() < 0.3 ? -1 : 1);
  add({ value: n }, { floaty: rand() < 0.5 });
}
// seeded random bit patterns: every exponent, subnormals included
{
  const view = new DataView(new ArrayBuffer(8));
  for (let i = 0; i < 100; ) {
    view.setUint32(0, Math.floor(rand() * 2 ** 32));
    view.setUint32(4, Math.floor(rand() * 2 ** 32));
    const n = view.getFloat64(0);
    if (!Number.isFinite(n)) continue;
    add([n, -n]);
    i++;
  }
}

// -- strings ----------------------------------------------------------------------------------
const controls = [];
for (let c = 0; c < 0x20; c++) controls.push(String.fromCharCode(c));
controls.push("\u007f");
for (const c of controls) add({ [`k${c}`]: `a${c}b`, c });
add(controls.join(""));
add({ quote: '"', backslash: "\\", both: '\\"', slash: "/", apos: "'", escaped: "\\n\\u0000" });
add(["\u2028", "\u2029", "line\u2028sep\u2029para", "\u0085", "\u00a0", "\ufeff", "\ufffe", "\uffff"]);
add({ text: "caf\u00e9 \u00fcber \u65e5\u672c\u8a9e \u0416 \u{1F600}\u{1F1EB}\u{1F1F7} \u{10FFFF}" });
add({
  high: "\ud800",
  low: "\udc00",
  highEnd: "abc\udbff",
  lowStart: "\udfffabc",
  reversed: "\udc00\ud800",
  pair: "\ud83d\ude00",
  mixed: "x\ud800y\udc00z\ud83d\ude00",
});
for (const s of ["\ud800", "\udbff", "\udc00", "\udfff", "a\ud800\ud800b", "\ud83d"]) add([s]);

// -- key order: UTF-16 code units, not code points --------------------------------------------
const KEYS = [
  "", "a", "A", "b", "aa", "a\u0000", "ab", "\u007f", "\u0080", "\u00e9", "z", "Z", "0", "10", "9",
  "\ud7ff", "\ue000", "\uffff", "\ufffd", "\u{10000}", "\u{1F600}", "\u{10FFFF}", "\ud800",
  "\udc00", "\udbff", "\udfff", "\u{1F600}x", "\ue000x", "_", "-", " ", "~",
];
add(Object.fromEntries(KEYS.map((k, i) => [k, i])));
add({ "\ue000": 1, "\u{1F600}": 2 });
add({ "\uffff": 1, "\u{10000}": 2 });
add({ "\ud800": 1, "\u{10000}": 2, "\udc00": 3 });
add({ a: { "\uffff": [{ "\u{10000}": null, "\ue000": true }] } });
for (let i = 0; i < 40; i++) {
  const keys = [];
  for (let j = int(2, 8); j > 0; j--) keys.push(pick(KEYS) + (rand() < 0.3 ? pick(KEYS) : ""));
  add(Object.fromEntries(keys.map((k, i) => [k, i])));
}

// -- nested values, random but seeded -----------------------------------------------------------
const WORDS = [
  "id", "name", "email", "amount", "currency", "items", "qty", "price", "tags", "meta", "when",
  "note", "to", "cc", "body", "subject", "\u00e9t\u00e9", "\u540d\u524d", "\u{1F600}", "\ue000",
  "a\"b", "back\\slash", "new\nline", "",
];
function randomValue(depth) {
  const r = rand();
  if (depth <= 0 || r < 0.45) {
    const s = rand();
    if (s < 0.1) return null;
    if (s < 0.2) return rand() < 0.5;
    if (s < 0.35) return int(-1000000, 1000000);
    if (s < 0.5) return Number(((rand() - 0.5) * 10 ** int(-8, 22)).toPrecision(int(1, 17)));
    return Array.from({ length: int(0, 3) }, () => pick(WORDS)).join(pick([" ", "", "-", "\u00b7"]));
  }
  if (r < 0.7) return Array.from({ length: int(0, 5) }, () => randomValue(depth - 1));
  const obj = {};
  for (let n = int(0, 6); n > 0; n--) obj[pick(WORDS)] = randomValue(depth - 1);
  return obj;
}
for (let i = 0; i < 120; i++) add(randomValue(int(1, 6)), { floaty: rand() < 0.3 });
// one deep value (24 levels)
{
  let v = { leaf: [1, "x"] };
  for (let i = 0; i < 23; i++) v = i % 2 ? { next: v } : [v];
  add(v);
}

process.stdout.write(`${lines.join("\n")}\n`);
