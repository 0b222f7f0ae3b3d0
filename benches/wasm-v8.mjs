// Runs the native micro-benchmarks (benches/core.rs) built for wasm32-wasip1 under node's V8:
// the same engine family Envoy runs the filter in, so the figures show what the core costs as
// wasm (no host calls: the store is the bench's in-memory stand-in). Optional, for exploring:
// no make target needs it.
//
//   cargo bench --target wasm32-wasip1 --bench core --no-run
//   node --no-warnings benches/wasm-v8.mjs target/wasm32-wasip1/release/deps/core-*.wasm [--quick]
//
// The library links the proxy-wasm SDK on wasm32, so the module imports Envoy's host functions
// (never called by the benchmarks: each is a stub returning 0) and exports the SDK's
// `_initialize` beside `_start`, which node's WASI refuses unless only `_start` is handed over.
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';
import { argv, env } from 'node:process';

const wasi = new WASI({ version: 'preview1', args: argv.slice(2), env, preopens: {} });
const module = await WebAssembly.compile(await readFile(argv[2]));
const imports = wasi.getImportObject();
imports.env = {};
for (const imp of WebAssembly.Module.imports(module)) {
  if (imp.module === 'env' && imp.kind === 'function') imports.env[imp.name] = () => 0;
}
const instance = await WebAssembly.instantiate(module, imports);
wasi.start({ exports: { memory: instance.exports.memory, _start: instance.exports._start } });
