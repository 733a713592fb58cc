// The wire (docs/protocol.md sections 3 to 8): strict decoding of what a device receives (plan, ack, pace, chunk),
// reassembly of chunked transfers, the messages a device sends, and the update records of a report (dense, row
// masks as a bitmask or an index list, sampled updates; values in f4, f2, bf16, q8 or q8r).
import { F64, decode, encode } from './msgpack.mjs';

export class WireError extends Error {}
export const ID_RE = /^[A-Za-z0-9_.:-]{1,128}$/;
export const isInt = (v) => (typeof v === 'number' && Number.isInteger(v)) || typeof v === 'bigint';
export const isNum = (v) => (v instanceof F64 && Number.isFinite(v.v)) || isInt(v);
export const num = (v) => (v instanceof F64 ? v.v : Number(v));

const FIELDS = {
  plan: ['task_id', 'round', 'device_id', 'deadline', 'strategy', 'runtime', 'program_hash', 'weights', 'hparams',
    'seed', 'upload', 'program'],
  ack: ['task_id', 'device_id', 'status', 'reason'],
  pace: ['device_id', 'after'],
  chunk: ['id', 'i', 'n', 't', 'b'],
};
const BYTES = { f4: 4, f8: 8, f2: 2, u1: 1, i4: 4, i8: 8 };

/** A scalars map (section 7) as a plain object; floats stay F64 so a reader can refuse one where an int belongs. */
function scalars(m, what) {
  if (!(m instanceof Map) || m.size > 256) throw new WireError(`${what}: not a map of at most 256 entries`);
  const out = {};
  for (const [k, v] of m) {
    if (k.length > 256) throw new WireError(`${what}: key too long`);
    if (v instanceof F64) { if (!Number.isFinite(v.v)) throw new WireError(`${what}.${k} is not finite`); }
    else if (typeof v === 'string') { if (v.length > 256) throw new WireError(`${what}.${k} is too long`); }
    else if (!(v === null || typeof v === 'boolean' || isInt(v))) throw new WireError(`${what}.${k} is not a scalar`);
    out[k] = v;
  }
  return out;
}

/** An array record (section 4) as {shape, values: Float32Array} (plans carry f4 weights; the other plain dtypes
 * are accepted and converted). */
export function readArray(m, what) {
  if (!(m instanceof Map) || m.size !== 3 || !m.has('d') || !m.has('s') || !m.has('b')) throw new WireError(`${what}: not an array record`);
  const d = m.get('d'), s = m.get('s'), b = m.get('b');
  if (!(d in BYTES)) throw new WireError(`${what}: dtype ${d} is not accepted by this device`);
  if (!Array.isArray(s) || s.length > 8 || !s.every((x) => typeof x === 'number' && Number.isInteger(x) && x >= 0 && x < 2 ** 31))
    throw new WireError(`${what}: bad shape`);
  if (!(b instanceof Uint8Array)) throw new WireError(`${what}: data is not bytes`);
  const count = s.reduce((a, x) => a * x, 1);
  if (count * BYTES[d] !== b.length) throw new WireError(`${what}: shape and data length disagree`);
  const dv = new DataView(b.buffer, b.byteOffset, b.byteLength);
  const values = new Float32Array(count);
  for (let i = 0; i < count; i++) {
    const v = d === 'f4' ? dv.getFloat32(4 * i, true) : d === 'f8' ? dv.getFloat64(8 * i, true)
      : d === 'f2' ? f16ToNumber(dv.getUint16(2 * i, true)) : d === 'u1' ? b[i] : d === 'i4' ? dv.getInt32(4 * i, true)
        : Number(dv.getBigInt64(8 * i, true));
    if (!Number.isFinite(v)) throw new WireError(`${what}: non-finite values`);
    values[i] = v;
  }
  return { shape: s, values };
}

/** A decoded message checked against section 7; ``expect``: the kinds the topic allows. */
export function checkMessage(m, expect) {
  if (!(m instanceof Map)) throw new WireError('message is not a map');
  if (m.get('v') !== 1) throw new WireError(`protocol version ${m.get('v')}, expected 1`);
  const k = m.get('k');
  if (!expect.includes(k)) throw new WireError(`unexpected kind ${k}`);
  const allowed = new Set(['v', 'k', ...FIELDS[k]]);
  for (const key of m.keys()) if (!allowed.has(key)) throw new WireError(`${k}: unknown field ${key}`);
  const need = (key, ok, what) => {
    if (!m.has(key)) throw new WireError(`${k}: missing field ${key}`);
    const v = m.get(key);
    if (!ok(v)) throw new WireError(`${k}: field ${key} is not ${what}`);
    if (typeof v === 'string' && v.length > 256) throw new WireError(`${k}: field ${key} is too long`);
    return v;
  };
  const id = (key) => need(key, (v) => typeof v === 'string' && ID_RE.test(v), 'an id');
  const str = (key) => need(key, (v) => typeof v === 'string', 'a string');
  if (k === 'ack') {
    const st = str('status');
    if (!['accepted', 'duplicate', 'late', 'rejected'].includes(st)) throw new WireError(`ack: unknown status ${st}`);
    return { kind: k, task_id: id('task_id'), device_id: id('device_id'), status: st, reason: str('reason') };
  }
  if (k === 'pace') {
    const after = num(need('after', isNum, 'a number'));
    if (!(after >= 0 && after <= 86400)) throw new WireError('pace: after out of range');
    return { kind: k, device_id: id('device_id'), after };
  }
  if (k === 'chunk') {
    const i = need('i', isInt, 'an int'), n = need('n', isInt, 'an int'), t = need('t', isInt, 'an int');
    if (!(i >= 0 && i < n && n <= 2 ** 20 && t > 0)) throw new WireError('chunk: index, count or size out of range');
    return { kind: k, id: id('id'), i: Number(i), n: Number(n), t: Number(t), b: need('b', (v) => v instanceof Uint8Array, 'bytes') };
  }
  const prog = m.get('program');
  if (!m.has('program') || (prog !== null && !(prog instanceof Uint8Array))) throw new WireError('plan: program is not bytes or nil');
  const seed = need('seed', isInt, 'an int'), round = need('round', isInt, 'an int');
  if (seed < 0 || round < 0) throw new WireError('plan: seed or round out of range');
  const wmap = need('weights', (v) => v instanceof Map && v.size <= 4096, 'a map of at most 4096 arrays');
  const weights = {};
  for (const [name, rec] of wmap) {
    if (!name) throw new WireError('plan: empty weight name');
    weights[name] = readArray(rec, `plan.weights[${name}]`);
  }
  return { kind: k, task_id: id('task_id'), round: Number(round), device_id: id('device_id'),
    deadline: num(need('deadline', isNum, 'a number')), strategy: str('strategy'), runtime: str('runtime'),
    program_hash: id('program_hash'), weights, hparams: scalars(need('hparams', (v) => v instanceof Map, 'a map'), 'hparams'),
    seed: BigInt(seed), upload: scalars(need('upload', (v) => v instanceof Map, 'a map'), 'upload'), program: prog };
}

/** Chunked transfers (section 8), per sender: ``add`` returns the whole payload once every chunk is in. */
export class Reassembler {
  constructor(maxBytes = 64 * 1024 * 1024) { this.maxBytes = maxBytes; this.parts = new Map(); this.completed = new Map(); }
  expire(now) {
    for (const [id, p] of this.parts) if (now - p.last > 60) this.parts.delete(id);
    for (const [id, t] of this.completed) if (now - t > 60) this.completed.delete(id);
  }
  add(c, now) {
    if (this.completed.has(c.id) && now - this.completed.get(c.id) <= 60) return null; // the tail of a resend
    let p = this.parts.get(c.id);
    if (!p) {
      if (c.t > this.maxBytes || c.n > Math.max(1, Math.ceil(c.t / 256))) throw new WireError('chunked transfer refused: too large or too many chunks');
      if (this.parts.size >= 4) this.parts.delete(this.parts.keys().next().value);
      p = { n: c.n, t: c.t, got: new Map(), size: 0, last: now };
      this.parts.set(c.id, p);
    }
    const bad = (why) => { this.parts.delete(c.id); throw new WireError(why); };
    if (c.n !== p.n || c.t !== p.t) bad('chunks of one transfer disagree on n or t');
    if (!p.got.has(c.i)) {
      if (!c.b.length || (c.b.length < 256 && c.i !== c.n - 1)) bad('a chunk other than the last is shorter than 256 bytes');
      p.got.set(c.i, c.b); p.size += c.b.length;
      if (p.size > p.t) bad('chunks exceed the announced size');
    }
    p.last = now;
    if (p.got.size < p.n) return null;
    this.parts.delete(c.id); this.completed.set(c.id, now);
    const whole = new Uint8Array(p.t);
    let off = 0;
    for (let i = 0; i < p.n; i++) { const b = p.got.get(i); if (off + b.length > p.t) throw new WireError('reassembled size differs'); whole.set(b, off); off += b.length; }
    if (off !== p.t) throw new WireError('reassembled size differs');
    return whole;
  }
}

/** Decode a payload received on ``topic``'s kind (chunks through ``reasm``); null while a transfer is incomplete. */
export function receive(kind, payload, reasm, now) {
  let msg = checkMessage(decode(payload), kind === 'pace' ? ['pace'] : [kind, 'chunk']);
  if (msg.kind !== 'chunk') return msg;
  const whole = reasm.add(msg, now);
  if (!whole) return null;
  msg = checkMessage(decode(whole), [kind]);
  return msg;
}

/** ``payload`` as chunk messages of at most ``chunkBytes`` data each (or itself when it fits). */
export function split(payload, id, chunkBytes) {
  if (payload.length <= chunkBytes) return [payload];
  const n = Math.ceil(payload.length / chunkBytes), out = [];
  for (let i = 0; i < n; i++) out.push(encode({ v: 1, k: 'chunk', id, i, n, t: payload.length, b: payload.subarray(i * chunkBytes, (i + 1) * chunkBytes) }));
  return out;
}

export const statusMessage = (device, state, ts) => encode({ v: 1, k: 'status', device_id: device, state, ts: new F64(ts) });

// ------------------------------------------------------------------ value formats (section 6)
export function f16ToNumber(h) {
  const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}
const roundEven = (v) => { const f = Math.floor(v), d = v - f; return d > 0.5 || (d === 0.5 && f % 2 !== 0) ? f + 1 : f; };
/** binary16 bits of x, to nearest even, saturating at +-65504 (never infinity). */
export function numberToF16(x) {
  const sign = x < 0 || Object.is(x, -0) ? 0x8000 : 0;
  const a = Math.min(Math.abs(x), 65504);
  if (a < 2 ** -25) return sign;
  let e = Math.floor(Math.log2(a));
  if (2 ** e > a) e -= 1; else if (2 ** (e + 1) <= a) e += 1;
  if (e < -14) return sign | roundEven(a / 2 ** -24);
  let m = roundEven((a / 2 ** e - 1) * 1024);
  if (m === 1024) { m = 0; e += 1; }
  return sign | ((e + 15) << 10) | m;
}
const f32 = new Float32Array(1), u32 = new Uint32Array(f32.buffer);
const bits32 = (x) => { f32[0] = x; return u32[0]; };
const fromBits32 = (u) => { u32[0] = u >>> 0; return f32[0]; };
/** The smallest binary32 >= a with its 7 low mantissa bits zero (q8's scale, section 6). */
function scaleUp(a) {
  if (a === 0) return 0;
  let s = Math.fround(a);
  if (s < a) s = fromBits32(bits32(s) + 1);
  let u = bits32(s);
  if (u & 0x7f) u = (u | 0x7f) + 1;
  return fromBits32(u);
}
export const VALUE_FORMATS = ['f4', 'f2', 'bf16', 'q8', 'q8r'];
/** Bytes of ``count`` values of ``rows`` rows in format ``code``. */
export function valueBytes(code, count, rows) {
  return { f4: 4 * count, f2: 2 * count, bf16: 2 * count, q8: 4 + count, q8r: 4 * rows + count }[code];
}
/** ``x`` (Float64Array, ``rows`` rows) in value format ``code``; q8 and q8r round stochastically with ``uniform``. */
export function encodeValues(x, rows, code, uniform) {
  const n = x.length, out = new Uint8Array(valueBytes(code, n, rows)), dv = new DataView(out.buffer);
  for (const v of x) if (!Number.isFinite(v) || Math.abs(v) > 3.4028234663852886e38) throw new Error('non-finite values cannot be encoded');
  if (code === 'f4') for (let i = 0; i < n; i++) dv.setFloat32(4 * i, x[i], true);
  else if (code === 'f2') for (let i = 0; i < n; i++) dv.setUint16(2 * i, numberToF16(x[i]), true);
  else if (code === 'bf16') {
    for (let i = 0; i < n; i++) {
      const u = bits32(Math.fround(x[i])), a = 0x7fff + ((u >>> 16) & 1);
      dv.setUint16(2 * i, Math.min(((u & 0x7fffffff) + a) >>> 16, 0x7f7f) | ((u >>> 16) & 0x8000), true);
    }
  } else {
    const groups = code === 'q8' ? 1 : rows, per = groups ? n / groups : 0, base = 4 * groups;
    for (let g = 0; g < groups; g++) {
      let amax = 0;
      for (let j = 0; j < per; j++) amax = Math.max(amax, Math.abs(x[g * per + j]));
      const s = scaleUp(amax / 127);
      dv.setFloat32(4 * g, s, true);
      for (let j = 0; j < per; j++) {
        const t = s > 0 ? Math.max(-127, Math.min(127, x[g * per + j] / s)) : 0;
        const q = Math.max(-127, Math.min(127, Math.floor(t + uniform())));
        dv.setInt8(base + g * per + j, q);
      }
    }
  }
  return out;
}

// ------------------------------------------------------------------ masks (section 5): bitmask or index list
/** The smaller of a bitmask and an index list for ``active`` (sorted row numbers) of ``n`` rows, as record fields. */
export function maskFields(active, n) {
  const bitmask = Math.ceil(n / 8), w = n <= 65536 ? 2 : 4;
  if (w * active.length < bitmask) {
    const b = new Uint8Array(w * active.length), dv = new DataView(b.buffer);
    active.forEach((r, j) => (w === 2 ? dv.setUint16(2 * j, r, true) : dv.setUint32(4 * j, r, true)));
    return { i: b, w };
  }
  const m = new Uint8Array(bitmask);
  for (const r of active) m[r >> 3] |= 0x80 >> (r & 7);
  return { m };
}
