// Runs the filter's own request callbacks (the shipped .wasm) under node's V8 against a stub
// proxy-wasm host: counts the host calls each request makes, by kind, and times the VM's side
// of a request (the stub host's own work included, a few µs). What Envoy adds around each
// call (its locks, copies, the V8 entries) is not here: that is scripts/bench-overhead.py's
// job. Optional, for exploring and for checking a change's host calls; no make target needs it.
//
//   node --no-warnings benches/wasm-requests.mjs target/wasm32-wasip1/release/dp_affinity.wasm \
//       [header|body] [requests] [plugin configuration JSON]
//
// The requests are scripts/bench-overhead.py's: `header` is B's GET with `x-smg-routing-key`,
// one of 1000 keys in turn, plugin {"dp_size":4,"assign":{"mode":"hash"}}; `body` is P's 64 KiB
// chat body without a key (16 prompts in turn) with prefix placement on. A plugin configuration
// given as the last argument replaces the mode's. The clock advances 1 ms
// per request and the tick runs every 1000 requests, so each key comes back after 1 s (its
// table entry is then due for a refresh, as in the Envoy run). Each request goes through
// context create, request headers (and body), response headers (`:status` 200, `x-dp-rank: 1`)
// and the answer's body ending the stream (a property is read only for an answer cut short),
// done, log, delete, as Envoy calls them. Times: 20 rounds after a warm-up, min and median.
// Last line: a digest of every header and shared-data value the module wrote, in order.
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';

// Every header the module writes and every shared-data value it stores, in order, digested:
// two builds of the same source (other optimiser passes, say) must print the same digest.
const written = createHash('sha256');
let writes = 0;
function note(what) {
  written.update(what + '\n');
  writes++;
}
import { argv, hrtime } from 'node:process';

const [wasmPath, mode = 'header', requestsArg = '20000', pluginArg] = argv.slice(2);
if (!wasmPath || !['header', 'body'].includes(mode)) {
  console.error('usage: node benches/wasm-requests.mjs <module.wasm> [header|body] [requests] [plugin JSON]');
  process.exit(2);
}
const requests = Number(requestsArg);
const PLUGIN = pluginArg
  ? JSON.parse(pluginArg)
  : {
      header: { dp_size: 4, assign: { mode: 'hash' } },
      body: { dp_size: 4, assign: { mode: 'hash' }, prefix: { enabled: true } },
    }[mode];

const OK = 0;
const NOT_FOUND = 1;
const CAS_MISMATCH = 8;
const REQUEST_BODY = 0;
const VM_CONFIGURATION = 6;
const PLUGIN_CONFIGURATION = 7;

const enc = new TextEncoder();
let ex;
const calls = new Map();
const count = (name) => calls.set(name, (calls.get(name) || 0) + 1);
const shared = new Map();
let nextCas = 1;
let nowNs = 1_800_000_000n * 1_000_000_000n;
let requestHeaders = [];
let responseHeaders = [];
let body = new Uint8Array(0);

const view = () => new DataView(ex.memory.buffer);
const text = (ptr, len) => Buffer.from(ex.memory.buffer, ptr, len).toString('latin1');

/** Hands `data` to the VM as the host does: allocated by the module, pointer and size out. */
function give(data, ptrOut, sizeOut) {
  const ptr = data.length ? ex.proxy_on_memory_allocate(data.length) : 0;
  if (data.length) new Uint8Array(ex.memory.buffer).set(data, ptr);
  view().setUint32(ptrOut, ptr, true);
  view().setUint32(sizeOut, data.length, true);
}

/** A header map in the ABI's layout: count, (name, value) lengths, then NUL-terminated bytes. */
function serialize(pairs) {
  const bytes = pairs.map(([n, v]) => [enc.encode(n), enc.encode(v)]);
  const size = bytes.reduce((s, [n, v]) => s + n.length + v.length + 2, 4 + pairs.length * 8);
  const out = new Uint8Array(size);
  const d = new DataView(out.buffer);
  d.setUint32(0, pairs.length, true);
  let at = 4 + pairs.length * 8;
  bytes.forEach(([n, v], i) => {
    d.setUint32(4 + i * 8, n.length, true);
    d.setUint32(8 + i * 8, v.length, true);
    out.set(n, at);
    at += n.length + 1;
    out.set(v, at);
    at += v.length + 1;
  });
  return out;
}

const serialized = new WeakMap();
function headerMap(type) {
  const pairs = type === 0 ? requestHeaders : responseHeaders;
  if (!serialized.has(pairs)) serialized.set(pairs, serialize(pairs));
  return serialized.get(pairs);
}

const host = {
  proxy_log: () => (count('log'), OK),
  proxy_get_log_level: (out) => (view().setUint32(out, 2, true), OK), // info, as Envoy's default
  proxy_get_current_time_nanoseconds(out) {
    count('get_current_time');
    view().setBigUint64(out, nowNs, true);
    return OK;
  },
  proxy_set_tick_period_milliseconds: () => OK,
  proxy_define_metric: (kind, name, len, out) => (view().setUint32(out, 1, true), OK),
  proxy_increment_metric: () => (count('increment_metric'), OK),
  proxy_record_metric: () => (count('record_metric'), OK),
  proxy_get_buffer_bytes(type, start, max, ptrOut, sizeOut) {
    if (type === PLUGIN_CONFIGURATION) return give(enc.encode(JSON.stringify(PLUGIN)), ptrOut, sizeOut), OK;
    if (type === VM_CONFIGURATION) return give(new Uint8Array(0), ptrOut, sizeOut), OK;
    count('get_buffer_bytes');
    if (type !== REQUEST_BODY) return NOT_FOUND;
    give(body.subarray(start, Math.min(body.length, start + max)), ptrOut, sizeOut);
    return OK;
  },
  proxy_set_buffer_bytes: () => (count('set_buffer_bytes'), OK),
  proxy_get_header_map_pairs(type, ptrOut, sizeOut) {
    count('get_header_map_pairs');
    give(headerMap(type), ptrOut, sizeOut);
    return OK;
  },
  proxy_get_header_map_value: () => (count('get_header_map_value'), NOT_FOUND),
  proxy_replace_header_map_value: (type, key, keyLen, value, valueLen) => (
    count('replace_header_map_value'), note(`header ${text(key, keyLen)}=${text(value, valueLen)}`), OK),
  proxy_add_header_map_value: () => (count('add_header_map_value'), OK),
  proxy_remove_header_map_value: () => (count('remove_header_map_value'), OK),
  proxy_get_shared_data(key, keyLen, ptrOut, sizeOut, casOut) {
    const entry = shared.get(text(key, keyLen));
    if (setupDone) count('get_shared_data');
    if (!entry) return NOT_FOUND;
    give(entry.value, ptrOut, sizeOut);
    view().setUint32(casOut, entry.cas, true);
    return OK;
  },
  proxy_set_shared_data(key, keyLen, value, valueLen, cas) {
    const name = text(key, keyLen);
    const entry = shared.get(name);
    if (setupDone) count('set_shared_data');
    if (cas !== 0 && entry && entry.cas !== cas) return CAS_MISMATCH;
    const bytes = new Uint8Array(ex.memory.buffer).slice(value, value + valueLen);
    shared.set(name, { value: bytes, cas: nextCas++ });
    note(`shared ${name} ${Buffer.from(bytes).toString('hex')}`);
    return OK;
  },
  proxy_get_property: (p, n) => (count('get_property(' + text(p, n).replace(/\0/g, '.') + ')'), NOT_FOUND),
  proxy_call_foreign_function(name, nameLen, args, argsLen, ptrOut, sizeOut) {
    count(`call_foreign_function(${text(name, nameLen)})`);
    give(new Uint8Array(0), ptrOut, sizeOut);
    return OK;
  },
  proxy_send_local_response: () => (count('send_local_response'), OK),
};
// Any other import counts as a call the stub does not know (it should never show).
const env = new Proxy(host, { get: (t, k) => t[k] || (() => (count(`unknown ${String(k)}`), OK)) });
const wasi = new Proxy(
  {
    random_get: (ptr, len) => (new Uint8Array(ex.memory.buffer).fill(7, ptr, ptr + len), 0),
    environ_sizes_get: (a, b) => (view().setUint32(a, 0, true), view().setUint32(b, 0, true), 0),
    proc_exit: (code) => {
      throw new Error(`proc_exit ${code}`);
    },
  },
  { get: (t, k) => t[k] || (() => 0) },
);

let setupDone = false;
const module = await WebAssembly.compile(readFileSync(wasmPath));
({ exports: ex } = await WebAssembly.instantiate(module, { env, wasi_snapshot_preview1: wasi }));
ex._initialize();
ex.proxy_on_context_create(1, 0);
if (!ex.proxy_on_vm_start(1, 0) || !ex.proxy_on_configure(1, 1)) throw new Error('the filter refused its configuration');
setupDone = true;

/** scripts/bench-overhead.py's chat body: about `size` bytes, conversation `n`, no key. */
function chatBody(size, n) {
  const head = `{"model":"mock-model","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"conversation ${n}: `;
  const tail = '"}],"max_tokens":16}';
  const words = 'the quick brown fox jumps over the lazy dog while \\"quoted\\" text\\n flows on ';
  const fill = size - head.length - tail.length;
  const filler = words.repeat(Math.ceil(fill / words.length) + 1).slice(0, fill).replace(/\\+$/, '');
  return enc.encode(head + filler + tail);
}

const common = [[':authority', 'bench'], [':scheme', 'http'], ['x-forwarded-proto', 'http'], ['x-request-id', '0f3c6a1e-8a8e-4b7b-9a55-6c1b7bd3b0a1']];
const keyed = Array.from({ length: 1000 }, (_, i) => [[':path', '/v1/models'], [':method', 'GET'], ['x-smg-routing-key', `conv-${i}`], ...common]);
const bodies = Array.from({ length: 16 }, (_, i) => chatBody(65536, i));
const posted = bodies.map((b) => [[':path', '/v1/chat/completions'], [':method', 'POST'], ['content-type', 'application/json'], ['content-length', String(b.length)], ...common]);
const answer = [[':status', '200'], ['content-type', 'application/json'], ['x-dp-rank', '1'], ['content-length', '12'], ['server', 'envoy']];

let context = 2;
let sent = 0;
function request() {
  const id = context++;
  nowNs += 1_000_000n;
  if (sent % 1000 === 0) ex.proxy_on_tick(1);
  ex.proxy_on_context_create(id, 1);
  responseHeaders = answer;
  if (mode === 'header') {
    requestHeaders = keyed[sent % keyed.length];
    ex.proxy_on_request_headers(id, requestHeaders.length, 1);
  } else {
    body = bodies[sent % bodies.length];
    requestHeaders = posted[sent % posted.length];
    ex.proxy_on_request_headers(id, requestHeaders.length, 0);
    ex.proxy_on_request_body(id, body.length, 1);
  }
  ex.proxy_on_response_headers(id, responseHeaders.length, 0);
  ex.proxy_on_response_body(id, 12, 1); // the answer's 12 bytes end the stream, as Envoy calls it
  ex.proxy_on_done(id);
  ex.proxy_on_log(id);
  ex.proxy_on_delete(id);
  sent++;
}

for (let i = 0; i < 5000; i++) request(); // warm-up: V8 tiers the hot code up
calls.clear();
const before = sent;
const perRound = Math.max(1, Math.floor(requests / 20));
const rounds = [];
for (let r = 0; r < 20; r++) {
  const t0 = hrtime.bigint();
  for (let i = 0; i < perRound; i++) request();
  rounds.push(Number(hrtime.bigint() - t0) / perRound);
}
rounds.sort((a, b) => a - b);
const measured = sent - before;
console.log(`${mode}: ${rounds[0].toFixed(0)} ns/request min, ${rounds[10].toFixed(0)} median (20 rounds of ${perRound}; stub host included)`);
console.log('host calls per request:');
for (const [name, n] of [...calls].sort()) console.log(`  ${name.padEnd(36)} ${(n / measured).toFixed(3)}`);
console.log(`writes: ${writes}, digest ${written.digest('hex')}`);
