// Client halves (edge/algorithms/{driver,fedavg,fedprox,fedsparse}.py; clients/native/src/algorithms.cpp):
// strict hyperparameters, batches from a fresh permutation per epoch (the last batch short), each algorithm's
// steps over a trainer that returns the loss and gradients of the exported program, the update's encoding
// (value formats, row masks, sampled updates). Random draws come from xoshiro256** seeded from (plan seed,
// stream): stream 0 orders the batches, 1 is FedSparse's noise, 2 its masks, 100 stochastic rounding, 101 row
// sampling (the Python device's streams; the values differ from numpy's, which the protocol allows).
import { F64 } from './msgpack.mjs';
import { VALUE_FORMATS, encodeValues, isInt, isNum, maskFields, num, valueBytes } from './wire.mjs';

/** A plan this device cannot run (its training fails: section 9.3 step 6). */
export class PlanError extends Error {}

// ------------------------------------------------------------------ random draws
const M64 = (1n << 64n) - 1n;
const rotl = (x, k) => ((x << BigInt(k)) | (x >> BigInt(64 - k))) & M64;
/** xoshiro256** seeded by splitmix64 from seed ^ (golden * (stream + 1)), as the native device does. */
export class Rng {
  constructor(seed, stream) {
    let x = (BigInt(seed) ^ ((0x9E3779B97F4A7C15n * BigInt(stream + 1)) & M64)) & M64;
    this.s = [0n, 0n, 0n, 0n].map(() => {
      x = (x + 0x9E3779B97F4A7C15n) & M64;
      let z = x;
      z = ((z ^ (z >> 30n)) * 0xBF58476D1CE4E5B9n) & M64;
      z = ((z ^ (z >> 27n)) * 0x94D049BB133111EBn) & M64;
      return z ^ (z >> 31n);
    });
  }
  next() {
    const s = this.s, r = (rotl((s[1] * 5n) & M64, 7) * 9n) & M64, t = (s[1] << 17n) & M64;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t; s[3] = rotl(s[3], 45);
    return r;
  }
  /** Uniform in [0, 1). */
  uniform() { return Number(this.next() >> 11n) * 2 ** -53; }
  /** Uniform integer in [0, n), unbiased. */
  below(n) {
    const N = BigInt(n), lim = M64 - (M64 % N);
    let r;
    do r = this.next(); while (r >= lim);
    return Number(r % N);
  }
  permutation(n) {
    const p = Array.from({ length: n }, (_, i) => i);
    for (let i = n - 1; i > 0; i--) { const j = this.below(i + 1); [p[i], p[j]] = [p[j], p[i]]; }
    return p;
  }
}

// ------------------------------------------------------------------ hyperparameters (edge/algorithms/*.py: Hparams)
const BASE = [['lr', 'F', 0.05, 0], ['epochs', 'I', 1, 1, 10000], ['batch_size', 'I', 20, 1, 2 ** 20]];
export const STRATEGIES = {
  fedavg: { objective: 'ce', fields: BASE },
  fedprox: { objective: 'fedprox', fields: [...BASE, ['mu', 'F', 0.01, 0]] },
  fedsparse: { objective: 'fedsparse', fields: [...BASE, ['v_lr', 'F', 1e-3, 0], ['lambda0', 'F', 1e-2, 0],
    ['ce_scale', 'F', 1e-4, 0], ['T', 'F', 1e-3, 1e-9], ['relative', 'B', false]] },
};

/** The plan's hyperparameters, typed strictly: unknown keys, a float where an int belongs, a bool where a number
 * belongs and values out of range are a PlanError. */
export function parseHparams(strategy, hp) {
  const s = STRATEGIES[strategy];
  if (!s) throw new PlanError(`strategy ${JSON.stringify(strategy)} is not implemented (${Object.keys(STRATEGIES).join(', ')})`);
  const out = Object.fromEntries(s.fields.map(([k, , d]) => [k, d]));
  const unknown = Object.keys(hp).filter((k) => !(k in out)).sort();
  if (unknown.length) throw new PlanError(`unknown hyperparameters ${JSON.stringify(unknown.slice(0, 5))} for ${strategy}`);
  for (const [k, kind, , min = -Infinity, max = Infinity] of s.fields) {
    if (!(k in hp)) continue;
    const v = hp[k];
    if (kind === 'B') { if (typeof v !== 'boolean') throw new PlanError(`hparams ${k}: expected a bool`); out[k] = v; continue; }
    if (kind === 'I' && !isInt(v)) throw new PlanError(`hparams ${k}: expected an int`);
    if (kind === 'F' && !isNum(v)) throw new PlanError(`hparams ${k}: expected a number`);
    const x = num(v);
    if (x < min) throw new PlanError(`hparams ${k} = ${x}: must be at least ${min}`);
    if (x > max) throw new PlanError(`hparams ${k} = ${x}: must be at most ${max}`);
    out[k] = x;
  }
  return out;
}

// ------------------------------------------------------------------ the maths the client halves share
const softplus = (v) => Math.max(v, 0) + Math.log1p(Math.exp(-Math.abs(v)));
const sigmoid = (a) => 0.5 * (1 + Math.tanh(0.5 * a));
const U_EPS = 1e-6;

/** SGD in binary32, as ORT's optimizer and numpy's ``p -= (lr * g).astype(float32)`` do. */
function sgd(p, g, lr) {
  const l = Math.fround(lr);
  for (let i = 0; i < p.length; i++) p[i] = Math.fround(p[i] - Math.fround(l * g[i]));
}

/** torch's Adamax (edge/optim.py), binary64 state. */
class Adamax {
  constructor(lr) { this.lr = lr; this.b1 = 0.9; this.b2 = 0.999; this.eps = 1e-8; this.t = 0; this.m = {}; this.u = {}; }
  step(params, grads) {
    this.t += 1;
    const c1 = 1 - this.b1 ** this.t;
    for (const [k, g] of Object.entries(grads)) {
      const m = (this.m[k] ||= new Float64Array(g.length)), u = (this.u[k] ||= new Float64Array(g.length)), p = params[k];
      for (let i = 0; i < g.length; i++) {
        m[i] = m[i] * this.b1 + (1 - this.b1) * g[i];
        u[i] = Math.max(this.b2 * u[i], Math.abs(g[i]) + this.eps);
        p[i] = Math.fround(p[i] - Math.fround((this.lr / c1) * m[i] / u[i]));
      }
    }
  }
}

/** ||w_g|| per unit of an MLP layer (its weight row and bias), binary64; relative to the layer's mean with ``relative``. */
function norms(p, shapes, L, relative) {
  const w = p[`${L}.weight`], b = p[`${L}.bias`], rows = shapes[`${L}.weight`][0], rs = w.length / rows;
  const n = new Float64Array(rows);
  for (let g = 0; g < rows; g++) {
    let s = 0;
    for (let j = 0; j < rs; j++) s += w[g * rs + j] * w[g * rs + j];
    n[g] = Math.sqrt(s + b[g] * b[g]);
  }
  if (relative) {
    const mean = n.reduce((a, x) => a + x, 0) / (n.length || 1);
    if (mean > 0) for (let g = 0; g < n.length; g++) n[g] /= mean;
  }
  return n;
}
function gateLogits(p, shapes, L, T, relative) {
  const n = norms(p, shapes, L, relative), v = p[`${L}.v`];
  return n.map((x, g) => (x - softplus(v[g])) / T);
}

const f32Input = (data, shape) => ({ dtype: 'float32', data, shape });

// ------------------------------------------------------------------ one plan
/**
 * Run ``plan`` (decoded: weights as {shape, values}) with ``trainer`` (its ``meta``: the program's params, shapes,
 * inputs, objective, model; ``lossAndGrads(params, inputs)``) on ``data`` ({x: Float32Array rows x features,
 * y: Int32Array, n, features}). ``onStep(done, total)`` is awaited after every step (a page repaints there).
 * Returns {weights: {name: Float32Array}, shapes, masks: {name: active rows}, metrics}. ``trace`` (an object), when
 * given, collects the random draws (batches, noise, mask uniforms), so a test can replay them in a reference.
 */
export async function trainPlan(plan, trainer, data, onStep = async () => {}, trace = null) {
  const hp = parseHparams(plan.strategy, plan.hparams);
  const meta = trainer.meta, strategy = plan.strategy, objective = STRATEGIES[strategy].objective;
  if (meta.objective !== objective) throw new PlanError(`${strategy} needs a '${objective}' program, the plan's is '${meta.objective}'`);
  const names = Object.keys(plan.weights).sort(), params = [...meta.params].sort();
  if (names.join('\n') !== params.join('\n')) throw new PlanError("the plan's weights are not the program's parameters");
  const shapes = {}, p = {};
  for (const k of meta.params) {
    const want = meta.shapes[k], got = plan.weights[k].shape;
    if (want.length !== got.length || want.some((d, i) => d !== got[i])) throw new PlanError(`${k}: shape [${got}], the program's is [${want}]`);
    shapes[k] = got; p[k] = Float32Array.from(plan.weights[k].values);
  }
  const xin = meta.inputs[0];
  const feat = xin.shape.slice(1).reduce((a, d) => a * d, 1);
  if (data.n && feat !== data.features) throw new PlanError(`the data has ${data.features} features, the program takes ${feat}`);
  const classes = meta.model && meta.model.sizes ? meta.model.sizes[meta.model.sizes.length - 1] : Infinity;
  for (let r = 0; r < data.n; r++) if (!(data.y[r] >= 0 && data.y[r] < classes)) throw new PlanError(`label ${data.y[r]} is not below the program's ${classes} classes`);

  // the inputs each objective needs beyond x, y, w: fixed for the plan, or drawn per step
  const fixed = {};
  let layers = [], theta = {}, vNames = new Set();
  const relative = strategy === 'fedsparse' && hp.relative, T = hp.T ?? 1;
  if (strategy === 'fedprox') {
    fixed.mu = f32Input(Float32Array.of(hp.mu), []);
    for (const k of meta.params) fixed[`g.${k}`] = f32Input(Float32Array.from(p[k]), shapes[k]);
  } else if (strategy === 'fedsparse') {
    if (!meta.model || meta.model.arch !== 'mlp') throw new PlanError(`fedsparse on this device runs MLP programs, not ${meta.model && meta.model.arch}`);
    const hidden = meta.model.sizes.length - 2;
    for (let i = 0; i < hidden; i++) if (`fc${i}.v` in p) layers.push(`fc${i}`);
    for (const L of layers) { theta[L] = Float32Array.from(gateLogits(p, shapes, L, T, relative)); vNames.add(`${L}.v`); }
    for (const k of ['lambda0', 'ce_scale', 'T']) fixed[k] = f32Input(Float32Array.of(hp[k]), []);
  }
  const perStep = new Set(['x', 'y', 'w']);
  layers.forEach((_, i) => ['u', 'theta_logit', 'norm'].forEach((k) => perStep.add(`${k}${i}`)));
  for (const i of meta.inputs) {
    if (!perStep.has(i.name) && !(i.name in fixed)) throw new PlanError(`the program needs input '${i.name}', which ${strategy} does not produce`);
  }

  const rngBatches = new Rng(plan.seed, 0), rngU = new Rng(plan.seed, 1), rngZ = new Rng(plan.seed, 2);
  const vopt = new Adamax(hp.v_lr ?? 0);
  const losses = [], bs = hp.batch_size, n = data.n;
  let stepMs = 0;  // time in the steps themselves (the program's run and the optimiser), for the page and benchmarks
  const total = hp.epochs * Math.ceil(n / bs);
  for (let e = 0; e < hp.epochs && n > 0; e++) {
    const perm = rngBatches.permutation(n);
    for (let s = 0; s < n; s += bs) {
      const idx = perm.slice(s, s + bs), N = idx.length;
      if (trace) (trace.batches ||= []).push(idx);
      const x = new Float32Array(N * data.features), y = new BigInt64Array(N), w = new Float32Array(N).fill(1 / N);
      idx.forEach((r, j) => { x.set(data.x.subarray(r * data.features, (r + 1) * data.features), j * data.features); y[j] = BigInt(data.y[r]); });
      const inputs = { x: f32Input(x, [N, ...xin.shape.slice(1)]), y: { dtype: 'int64', data: y, shape: [N] }, w: f32Input(w, [N]), ...fixed };
      layers.forEach((L, i) => {
        const units = p[`${L}.v`].length, u = new Float32Array(units);
        for (let j = 0; j < units; j++) u[j] = U_EPS + (1 - 2 * U_EPS) * rngU.uniform();
        inputs[`u${i}`] = f32Input(u, [units]);
        if (trace) ((trace.noise ||= [])[losses.length] ||= {})[`u${i}`] = Array.from(u);
        inputs[`theta_logit${i}`] = f32Input(theta[L], [units]);
        inputs[`norm${i}`] = f32Input(Float32Array.from(norms(p, shapes, L, relative)), [units]);
      });
      const t0 = performance.now();
      const { loss, grads } = await trainer.lossAndGrads(p, inputs);
      if (!Number.isFinite(loss)) throw new Error(`the loss is not finite (${loss})`);
      const vg = {};
      for (const k of meta.params) {
        if (vNames.has(k)) vg[k] = grads[k]; else sgd(p[k], grads[k], hp.lr);
      }
      if (vNames.size) vopt.step(p, vg);
      stepMs += performance.now() - t0;
      losses.push(loss);
      await onStep(losses.length, total);
    }
  }

  const masks = {}, metrics = { train_loss: new F64(losses.length ? losses.reduce((a, b) => a + b, 0) / losses.length : 0), steps: losses.length };
  if (strategy === 'fedsparse') {
    let kept = 0;
    for (const L of layers) {
      const lg = gateLogits(p, shapes, L, T, relative), active = [];
      const r = lg.map(() => rngZ.uniform());
      if (trace) (trace.mask_uniforms ||= {})[L] = Array.from(r);
      lg.forEach((a, g) => { if (r[g] < sigmoid(a)) active.push(g); });
      kept += lg.length ? active.length / lg.length : 0;
      masks[`${L}.weight`] = active; masks[`${L}.bias`] = active;
    }
    metrics.kept = new F64(layers.length ? kept / layers.length : 1);
  }
  const weights = {};
  for (const k of meta.params) if (!vNames.has(k)) weights[k] = p[k];
  return { weights, shapes, masks, metrics, stepMs };
}

// ------------------------------------------------------------------ the update (edge/algorithms/driver.py: encode_update)
/** The upload keys this device reads, typed strictly (section 6). */
export function uploadOptions(up) {
  const delta = up.delta ?? false;
  if (typeof delta !== 'boolean') throw new PlanError('upload delta must be true or false');
  const design = up.sample ?? null, keep = up.keep ?? 1, pMin = up.p_min ?? 0;
  if (![keep, pMin].every(isNum)) throw new PlanError('upload keep and p_min must be numbers');
  const k = num(keep), pm = num(pMin);
  if (design !== null) {
    if (!['norm', 'uniform'].includes(design)) throw new PlanError(`upload sample ${JSON.stringify(design)} is not norm or uniform`);
    if (!delta) throw new PlanError('sampled uploads send differences (upload.delta)');
    if (!(k > 0 && k <= 1 && pm >= 0 && pm <= 1)) throw new PlanError(`upload keep ${k} must be in (0, 1] and p_min ${pm} in [0, 1]`);
  }
  return { delta, design, keep: k, pMin: pm };
}
export const valueFormat = (up, ndim) => String(ndim <= 1 && 'dtype_1d' in up ? up.dtype_1d : up.dtype ?? 'f4');

/** Per row of every sampled tensor, the probability it is sent (driver.py: inclusion_probabilities). */
export function inclusionProbabilities(rowNorms, rowBytes, keep, pMin, design) {
  const sizes = rowNorms.map((a) => a.length), byt = [], score = [];
  rowNorms.forEach((a, t) => a.forEach((v) => { byt.push(rowBytes[t]); score.push(v / Math.sqrt(rowBytes[t])); }));
  const total = byt.reduce((a, b) => a + b, 0), target = keep * total;
  let flat;
  if (design === 'uniform' || !total) flat = byt.map(() => Math.max(keep, pMin));
  else {
    const clip = (v) => Math.min(1, Math.max(pMin, v));
    const spent = (c) => score.reduce((a, s, j) => a + clip(c * s) * byt[j], 0);
    let c;
    if (spent(0) >= target) c = 0;
    else if (score.reduce((a, s, j) => a + (s > 0 ? 1 : Math.min(pMin, 1)) * byt[j], 0) <= target) c = Infinity;
    else {
      const pos = score.filter((s) => s > 0);
      let lo = Math.log(Math.max(pMin, 1e-12) / Math.max(...pos)) - 1, hi = Math.log(1 / Math.min(...pos)) + 1;
      for (let it = 0; it < 60; it++) { const mid = 0.5 * (lo + hi); if (spent(Math.exp(mid)) < target) lo = mid; else hi = mid; }
      c = Math.exp(hi);
    }
    flat = score.map((s) => clip(s > 0 ? c * s : 0));
  }
  const out = [];
  let off = 0;
  for (const n of sizes) { out.push(flat.slice(off, off + n).map((q) => Math.min(255, Math.max(1, Math.ceil(q * 255 - 1e-9))) / 255)); off += n; }
  return out;
}
/** A sample with row j in it with probability p[j] (systematic sampling over a random order, driver.py). */
export function systematicSample(p, rng) {
  const order = rng.permutation(p.length), u = rng.uniform(), out = new Array(p.length).fill(false);
  let cum = 0;
  for (const j of order) { const prev = cum; cum += p[j]; out[j] = Math.ceil(cum - u) - Math.ceil(prev - u) > 0; }
  return out;
}

/**
 * The report's update records: per tensor the active rows (``masks``: sorted rows; absent = dense) in the plan's
 * value format, w_new - w_plan (binary64) with ``upload.delta``; with ``upload.sample`` and ``sampled`` (the device
 * declared sampled_upload) a matrix sends a random subset of its rows with their inclusion probabilities.
 */
export function encodeUpdate(weights, shapes, plan, masks = {}, sampled = false) {
  const up = plan.upload, { delta, design, keep, pMin } = uploadOptions(up);
  const rngQ = new Rng(plan.seed, 100), rngS = new Rng(plan.seed, 101);
  const rows = {}, rowSize = {};
  for (const [k, w] of Object.entries(weights)) {
    const code = valueFormat(up, shapes[k].length);
    if (!VALUE_FORMATS.includes(code)) throw new PlanError(`upload value format ${JSON.stringify(code)} is not one this device encodes`);
    const n = shapes[k][0] ?? 1, rs = shapes[k].length ? w.length / (n || 1) : 1, orig = plan.weights[k].values;
    const active = masks[k] ?? null, list = active ?? Array.from({ length: shapes[k].length ? n : 1 }, (_, i) => i);
    const v = new Float64Array(list.length * rs);
    list.forEach((r, j) => { for (let c = 0; c < rs; c++) v[j * rs + c] = delta ? w[r * rs + c] - orig[r * rs + c] : w[r * rs + c]; });
    rows[k] = { v, list, active }; rowSize[k] = rs;
  }
  const names = Object.keys(weights);
  const sampledNames = sampled && design && keep < 1 ? names.filter((k) => shapes[k].length >= 2 && rows[k].list.length) : [];
  const probs = {};
  if (sampledNames.length) {
    const rowNorms = sampledNames.map((k) => rows[k].list.map((_, j) => { let s = 0; for (let c = 0; c < rowSize[k]; c++) s += rows[k].v[j * rowSize[k] + c] ** 2; return Math.sqrt(s); }));
    const nb = sampledNames.map((k) => valueBytes(valueFormat(up, 2), rowSize[k], 1) + 1);
    const bytesOf = (k) => valueBytes(valueFormat(up, shapes[k].length), rows[k].v.length, rows[k].list.length);
    const dense = names.reduce((a, k) => a + bytesOf(k), 0);
    const whole = names.filter((k) => !sampledNames.includes(k)).reduce((a, k) => a + bytesOf(k), 0)
      + sampledNames.reduce((a, k) => a + Math.ceil(rows[k].list.length / 8), 0);
    const rowCost = rowNorms.reduce((a, ns, t) => a + ns.length * nb[t], 0);
    const fit = rowCost > 0 ? Math.min(1, Math.max((keep * dense - whole) / rowCost - 0.5 / 255, 1 / 255)) : 1;
    inclusionProbabilities(rowNorms, nb, fit, pMin, design).forEach((q, t) => { probs[sampledNames[t]] = q; });
  }
  const out = {};
  for (const k of names) {
    const code = valueFormat(up, shapes[k].length), { v, list, active } = rows[k], rs = rowSize[k];
    const rec = { s: shapes[k] };
    let vals = v, nrows = list.length;
    if (k in probs) {
      const s = systematicSample(probs[k], rngS), pos = [];
      s.forEach((b, j) => { if (b) pos.push(j); });
      vals = new Float64Array(pos.length * rs);
      pos.forEach((j, i) => vals.set(v.subarray(j * rs, (j + 1) * rs), i * rs));
      nrows = pos.length;
      rec.h = { k: list.length, p: Uint8Array.from(pos.map((j) => Math.round(probs[k][j] * 255))), ...maskFields(pos, list.length) };
    }
    const shape = shapes[k].length ? [nrows, ...shapes[k].slice(1)] : [];
    rec.x = { d: code, s: shape, b: encodeValues(vals, shapes[k].length ? nrows : 1, code, () => rngQ.uniform()) };
    if (active) Object.assign(rec, maskFields(active, shapes[k][0]));
    out[k] = rec;
  }
  return out;
}

/** Accuracy of the plan's weights on (up to ``limit`` rows of) the local data, from the program's ``logits`` output;
 * null for a program without one or with inputs other than the data's and FedProx's. Shown on the page only. */
export async function evaluate(plan, trainer, data, limit = 512) {
  const meta = trainer.meta;
  if (!(meta.outputs || []).includes('logits') || !data.n) return null;
  const params = {};
  for (const k of meta.params) { if (!plan.weights[k]) return null; params[k] = Float32Array.from(plan.weights[k].values); }
  const n = Math.min(limit, data.n), F = data.features;
  const inputs = { x: f32Input(data.x.slice(0, n * F), [n, ...meta.inputs[0].shape.slice(1)]),
    y: { dtype: 'int64', data: BigInt64Array.from(data.y.slice(0, n), (v) => BigInt(v)), shape: [n] }, w: f32Input(new Float32Array(n).fill(1 / n), [n]) };
  for (const i of meta.inputs) {
    if (i.name in inputs) continue;
    if (i.name === 'mu') inputs.mu = f32Input(Float32Array.of(0), []);
    else if (i.name.startsWith('g.') && params[i.name.slice(2)]) inputs[i.name] = f32Input(params[i.name.slice(2)], meta.shapes[i.name.slice(2)]);
    else return null;
  }
  const { aux } = await trainer.lossAndGrads(params, inputs);
  const logits = aux.logits, C = logits.length / n;
  let correct = 0;
  for (let r = 0; r < n; r++) {
    let best = 0;
    for (let c = 1; c < C; c++) if (logits[r * C + c] > logits[r * C + best]) best = c;
    if (best === data.y[r]) correct += 1;
  }
  return correct / n;
}
