#!/usr/bin/env node
// Node-only tools over the web device's core, for the tests and the benchmark:
//   node clients/web/tools.mjs check-vectors DIR      decode every plan, ack and pace vector of firmware_tests/protocol
//   node clients/web/tools.mjs run-plan IN.json OUT.json   train one plan (no broker) and write the report
// IN.json: {"program": FILE, "data": FILE, "plan": {task_id, device_id, round, strategy, seed, hparams, floats: [names of
// hparams sent as floats], upload, weights: {name: {shape, values}}}, "sampled": bool, "repeat": N}. OUT.json: the
// trained weights and masks, the metrics, the report's msgpack (base64), the mean time per step (ms) and the trace of
// the random draws (batches, noise, mask uniforms).
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { F64, decode, encode } from './src/msgpack.mjs';
import { Reassembler, WireError, checkMessage } from './src/wire.mjs';
import { encodeUpdate, trainPlan } from './src/algorithms.mjs';
import { OrtWebTrainer } from './src/trainer.mjs';
import { loadData } from './src/data.mjs';
import { loadOrt } from './ort-node.mjs';

/** 0 when every vector decodes (valid) or is refused (invalid) as its JSON says; vectors of extensions this device
 * does not declare (coded_downlink) are skipped. */
export async function checkVectors(dir) {
  let fails = 0, n = 0, skipped = 0;
  const read = (name) => new Uint8Array(fs.readFileSync(path.join(dir, `${name}.msgpack`)));
  for (const f of fs.readdirSync(dir).filter((x) => x.endsWith('.json')).sort()) {
    const m = JSON.parse(fs.readFileSync(path.join(dir, f), 'utf8'));
    if (!['plan', 'ack', 'pace'].includes(m.kind)) continue;
    if ((m.requires || []).some((r) => r !== 'sampled_upload')) { skipped += 1; continue; }
    let err = null;
    try {
      if (m.chunks) {
        const r = new Reassembler();
        let whole = null, first = null;
        for (let i = 0; i < m.chunks; i++) {
          try {
            const got = r.add(checkMessage(decode(read(`${m.name}.${i}`)), ['chunk']), 0);
            if (got) whole = checkMessage(decode(got), [m.kind]);
          } catch (e) { first = first || e; }
        }
        if (first) throw first;
        if (!whole) throw new WireError('the series did not reassemble');
      } else checkMessage(decode(read(m.name)), m.kind === 'pace' ? ['pace'] : [m.kind, 'chunk']);
    } catch (e) { err = e.message; }
    n += 1;
    if ((err === null) !== m.valid) { fails += 1; console.log(`FAIL ${m.name}: ${err === null ? 'accepted' : err}`); }
  }
  console.log(`${n - fails}/${n} vectors as expected (${skipped} of extensions skipped)`);
  return fails ? 1 : 0;
}

async function runPlan(inFile, outFile) {
  const spec = JSON.parse(fs.readFileSync(inFile, 'utf8'));
  const ort = await loadOrt(1);
  const trainer = await OrtWebTrainer.load(ort, new Uint8Array(fs.readFileSync(spec.program)));
  const data = await loadData(new Uint8Array(fs.readFileSync(spec.data)), spec.data);
  const p = spec.plan, floats = new Set(p.floats || []);
  const hparams = Object.fromEntries(Object.entries(p.hparams).map(([k, v]) => [k, floats.has(k) || (typeof v === 'number' && !Number.isInteger(v)) ? new F64(v) : v]));
  const weights = Object.fromEntries(Object.entries(p.weights).map(([k, v]) => [k, { shape: v.shape, values: Float32Array.from(v.values) }]));
  const plan = { ...p, hparams, weights, seed: BigInt(p.seed), upload: Object.fromEntries(Object.entries(p.upload || {}).map(([k, v]) => [k, typeof v === 'number' && !Number.isInteger(v) ? new F64(v) : v])) };
  let r, t0 = performance.now(), steps = 0, trace = {};
  for (let i = 0; i < (spec.repeat || 1); i++) { trace = {}; r = await trainPlan(plan, trainer, data, async () => {}, trace); steps += r.metrics.steps; }
  const stepMs = (performance.now() - t0) / Math.max(steps, 1);
  const tensors = encodeUpdate(r.weights, r.shapes, plan, r.masks, !!spec.sampled);
  const report = encode({ v: 1, k: 'report', task_id: p.task_id || 'r0a0', device_id: p.device_id || 'web-1', n: data.n, metrics: r.metrics, tensors, extras: {} });
  fs.writeFileSync(outFile, JSON.stringify({
    weights: Object.fromEntries(Object.entries(r.weights).map(([k, v]) => [k, Array.from(v)])), masks: r.masks,
    metrics: Object.fromEntries(Object.entries(r.metrics).map(([k, v]) => [k, v instanceof F64 ? v.v : v])),
    report: Buffer.from(report).toString('base64'), step_ms: stepMs, trace }));
  await trainer.release();
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const [cmd, a, b] = process.argv.slice(2);
  if (cmd === 'check-vectors') process.exit(await checkVectors(a));
  else if (cmd === 'run-plan') await runPlan(a, b);
  else { console.error('usage: tools.mjs check-vectors DIR | run-plan IN.json OUT.json'); process.exit(2); }
}
