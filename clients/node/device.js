#!/usr/bin/env node
// A fedge device in JavaScript (Node >= 18, no packages), written from docs/protocol.md alone: its own MQTT 3.1.1
// client, its own msgpack codec, strict decoding, the device state machine of section 9, and FedAvg on an MLP
// (the fedge-torch/1 JSON program with objective "ce": ReLU hidden layers, softmax cross-entropy, plain SGD).
// It sends dense updates only (f4, or f2 deltas when the plan asks), so it needs none of the mask formats.
//
//   node clients/node/device.js --broker mqtt://127.0.0.1:1883 --fleet default --id js-1 --data data.json
//
// data.json: {"x": [[...features], ...], "y": [class, ...]}. Options: --ack-timeout S (5), --heartbeat S (15),
// --grace S (30), --max-pace S (3600), --keepalive S (30).
'use strict';
const net = require('net');
const crypto = require('crypto');
const fs = require('fs');

// ------------------------------------------------------------------ msgpack (protocol.md section 3)
class F64 { constructor(v) { this.v = v; } } // a number that must travel as a float

function encode(value) {
  const parts = [];
  const u8 = (...b) => parts.push(Buffer.from(b));
  const len = (n, fix, fixMax, c8, c16, c32) => {
    if (fix !== null && n <= fixMax) u8(fix | n);
    else if (c8 !== null && n < 256) u8(c8, n);
    else if (n < 65536) { const b = Buffer.alloc(3); b[0] = c16; b.writeUInt16BE(n, 1); parts.push(b); }
    else { const b = Buffer.alloc(5); b[0] = c32; b.writeUInt32BE(n, 1); parts.push(b); }
  };
  const enc = (v) => {
    if (v === null || v === undefined) u8(0xc0);
    else if (v === false) u8(0xc2);
    else if (v === true) u8(0xc3);
    else if (v instanceof F64) { const b = Buffer.alloc(9); b[0] = 0xcb; b.writeDoubleBE(v.v, 1); parts.push(b); }
    else if (typeof v === 'bigint') { const b = Buffer.alloc(9); b[0] = 0xcf; b.writeBigUInt64BE(v, 1); parts.push(b); }
    else if (typeof v === 'number') {
      if (!Number.isInteger(v)) { enc(new F64(v)); return; }
      if (v >= 0 && v < 128) u8(v);
      else if (v < 0 && v >= -32) u8(v & 0xff);
      else if (v >= 0 && v < 2 ** 32) { const b = Buffer.alloc(5); b[0] = 0xce; b.writeUInt32BE(v, 1); parts.push(b); }
      else if (v < 0 && v >= -(2 ** 31)) { const b = Buffer.alloc(5); b[0] = 0xd2; b.writeInt32BE(v, 1); parts.push(b); }
      else { const b = Buffer.alloc(9); b[0] = 0xd3; b.writeBigInt64BE(BigInt(v), 1); parts.push(b); }
    } else if (typeof v === 'string') {
      const s = Buffer.from(v, 'utf8'); len(s.length, 0xa0, 31, 0xd9, 0xda, 0xdb); parts.push(s);
    } else if (v instanceof Uint8Array) {
      len(v.length, null, -1, 0xc4, 0xc5, 0xc6); parts.push(Buffer.from(v));
    } else if (Array.isArray(v)) { len(v.length, 0x90, 15, null, 0xdc, 0xdd); v.forEach(enc); }
    else if (typeof v === 'object') {
      const keys = Object.keys(v); len(keys.length, 0x80, 15, null, 0xde, 0xdf);
      for (const k of keys) { enc(k); enc(v[k]); }
    } else throw new Error(`cannot encode ${typeof v}`);
  };
  enc(value);
  return Buffer.concat(parts);
}

// Decodes one msgpack value; strings stay strings, bin becomes Buffer, 64-bit integers beyond 2^53 become
// BigInt, floats are tagged (F64) so a decoder can tell 1.0 from 1. Trailing bytes are an error.
function decode(buf) {
  let p = 0;
  const need = (n) => { if (p + n > buf.length) throw new Error('truncated msgpack'); };
  const int = (v) => (typeof v === 'bigint' && v >= -(2n ** 53n) && v <= 2n ** 53n ? Number(v) : v);
  const str = (n) => { need(n); const s = buf.toString('utf8', p, p + n); p += n; return s; };
  const bin = (n) => { need(n); const b = buf.subarray(p, p + n); p += n; return Buffer.from(b); };
  const arr = (n) => { const a = []; for (let i = 0; i < n; i++) a.push(dec()); return a; };
  const map = (n) => {
    const m = new Map();
    for (let i = 0; i < n; i++) {
      const k = dec(); if (typeof k !== 'string') throw new Error('map key is not a string');
      if (m.has(k)) throw new Error('duplicate map key'); m.set(k, dec());
    }
    return m;
  };
  const dec = () => {
    need(1); const b = buf[p++];
    if (b <= 0x7f) return b;
    if (b >= 0xe0) return b - 256;
    if ((b & 0xf0) === 0x80) return map(b & 0x0f);
    if ((b & 0xf0) === 0x90) return arr(b & 0x0f);
    if ((b & 0xe0) === 0xa0) return str(b & 0x1f);
    const rd = (n, f) => { need(n); const v = f(p); p += n; return v; };
    switch (b) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return bin(rd(1, (q) => buf.readUInt8(q)));
      case 0xc5: return bin(rd(2, (q) => buf.readUInt16BE(q)));
      case 0xc6: return bin(rd(4, (q) => buf.readUInt32BE(q)));
      case 0xca: return new F64(rd(4, (q) => buf.readFloatBE(q)));
      case 0xcb: return new F64(rd(8, (q) => buf.readDoubleBE(q)));
      case 0xcc: return rd(1, (q) => buf.readUInt8(q));
      case 0xcd: return rd(2, (q) => buf.readUInt16BE(q));
      case 0xce: return rd(4, (q) => buf.readUInt32BE(q));
      case 0xcf: return int(rd(8, (q) => buf.readBigUInt64BE(q)));
      case 0xd0: return rd(1, (q) => buf.readInt8(q));
      case 0xd1: return rd(2, (q) => buf.readInt16BE(q));
      case 0xd2: return rd(4, (q) => buf.readInt32BE(q));
      case 0xd3: return int(rd(8, (q) => buf.readBigInt64BE(q)));
      case 0xd9: return str(rd(1, (q) => buf.readUInt8(q)));
      case 0xda: return str(rd(2, (q) => buf.readUInt16BE(q)));
      case 0xdb: return str(rd(4, (q) => buf.readUInt32BE(q)));
      case 0xdc: return arr(rd(2, (q) => buf.readUInt16BE(q)));
      case 0xdd: return arr(rd(4, (q) => buf.readUInt32BE(q)));
      case 0xde: return map(rd(2, (q) => buf.readUInt16BE(q)));
      case 0xdf: return map(rd(4, (q) => buf.readUInt32BE(q)));
      default: throw new Error(`msgpack type 0x${b.toString(16)} is not used by fedge`);
    }
  };
  const v = dec();
  if (p !== buf.length) throw new Error('trailing bytes after the message');
  return v;
}

// ------------------------------------------------------------------ strict message checks (sections 3, 4, 7)
class WireError extends Error {}
const ID_RE = /^[A-Za-z0-9_.:-]{1,128}$/;
const isInt = (v) => (typeof v === 'number' && Number.isInteger(v)) || typeof v === 'bigint';
const isNum = (v) => (v instanceof F64 && Number.isFinite(v.v)) || isInt(v);
const num = (v) => (v instanceof F64 ? v.v : Number(v));
const FIELDS = {
  plan: ['task_id', 'round', 'device_id', 'deadline', 'strategy', 'runtime', 'program_hash', 'weights', 'hparams',
    'seed', 'upload', 'program'],
  ack: ['task_id', 'device_id', 'status', 'reason'],
  pace: ['device_id', 'after'],
  chunk: ['id', 'i', 'n', 't', 'b'],
};

function scalars(m, what) {
  if (!(m instanceof Map) || m.size > 256) throw new WireError(`${what}: not a small map`);
  const out = {};
  for (const [k, v] of m) {
    if (k.length > 256) throw new WireError(`${what}: key too long`);
    if (v instanceof F64) { if (!Number.isFinite(v.v)) throw new WireError(`${what}.${k} not finite`); out[k] = v; }
    else if (v === null || typeof v === 'boolean' || isInt(v)) out[k] = v;
    else if (typeof v === 'string') { if (v.length > 256) throw new WireError(`${what}.${k} too long`); out[k] = v; }
    else throw new WireError(`${what}.${k} is not a scalar`);
  }
  return out;
}

const DTYPE = { f4: [4, 'readFloatLE'], f8: [8, 'readDoubleLE'], f2: [2, null], u1: [1, 'readUInt8'],
  i4: [4, 'readInt32LE'], i8: [8, null] };

function array(m, what) {
  if (!(m instanceof Map) || m.size !== 3 || !m.has('d') || !m.has('s') || !m.has('b')) throw new WireError(`${what}: not an array record`);
  const d = m.get('d'), s = m.get('s'), b = m.get('b');
  if (!(d in DTYPE)) throw new WireError(`${what}: dtype ${d} not accepted by this device`);
  if (!Array.isArray(s) || s.length > 8 || !s.every((x) => typeof x === 'number' && Number.isInteger(x) && x >= 0 && x < 2 ** 31)) throw new WireError(`${what}: bad shape`);
  if (!Buffer.isBuffer(b)) throw new WireError(`${what}: data is not bytes`);
  const count = s.reduce((a, x) => a * x, 1);
  if (count * DTYPE[d][0] !== b.length) throw new WireError(`${what}: shape and data length disagree`);
  const values = new Float64Array(count);
  for (let i = 0; i < count; i++) {
    values[i] = d === 'f2' ? f16ToNumber(b.readUInt16LE(2 * i)) : d === 'i8' ? Number(b.readBigInt64LE(8 * i)) : b[DTYPE[d][1]](DTYPE[d][0] * i);
    if ((d[0] === 'f') && !Number.isFinite(values[i])) throw new WireError(`${what}: non-finite values`);
  }
  return { shape: s, values };
}

function checkMessage(m, expect) {
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
    if (!(i >= 0 && i < n && n <= 2 ** 20 && t > 0)) throw new WireError('chunk out of range');
    return { kind: k, id: id('id'), i, n, t, b: need('b', Buffer.isBuffer, 'bytes') };
  }
  // plan
  const prog = m.get('program');
  if (!m.has('program') || (prog !== null && !Buffer.isBuffer(prog))) throw new WireError('plan: program is not bytes or nil');
  const seed = need('seed', isInt, 'an int'), round = need('round', isInt, 'an int');
  if (seed < 0 || round < 0) throw new WireError('plan: seed or round out of range');
  const wmap = need('weights', (v) => v instanceof Map && v.size <= 4096, 'a map');
  const weights = {};
  for (const [name, rec] of wmap) weights[name] = array(rec, `plan.weights[${name}]`);
  return { kind: k, task_id: id('task_id'), round, device_id: id('device_id'), deadline: num(need('deadline', isNum, 'a number')),
    strategy: str('strategy'), runtime: str('runtime'), program_hash: id('program_hash'), weights,
    hparams: scalars(need('hparams', (v) => v instanceof Map, 'a map'), 'hparams'),
    seed, upload: scalars(need('upload', (v) => v instanceof Map, 'a map'), 'upload'), program: prog };
}

// ------------------------------------------------------------------ float16 (section 6: round to nearest even)
function f16ToNumber(h) {
  const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}
function numberToF16(x) {
  const sign = x < 0 || Object.is(x, -0) ? 0x8000 : 0;
  let a = Math.min(Math.abs(x), 65504); // saturate (section 6)
  if (a < 2 ** -24 / 2) return sign; // rounds to zero (exactly half rounds to even: zero)
  let e = Math.floor(Math.log2(a));
  if (2 ** e > a) e -= 1; else if (2 ** (e + 1) <= a) e += 1;
  if (e < -14) { // subnormal: units of 2^-24
    const q = roundEven(a / 2 ** -24);
    return sign | q; // q == 1024 carries into the smallest normal, which is the right bits
  }
  let m = roundEven((a / 2 ** e - 1) * 1024);
  if (m === 1024) { m = 0; e += 1; }
  return sign | ((e + 15) << 10) | m;
}
function roundEven(v) { const f = Math.floor(v), d = v - f; return d > 0.5 || (d === 0.5 && f % 2 === 1) ? f + 1 : f; }

// ------------------------------------------------------------------ FedAvg on an MLP (section 14)
function makeRng(seed) { // splitmix64 on BigInt: any seed below 2^63 (the batch order need not match Python's)
  let s = BigInt.asUintN(64, BigInt(seed));
  return () => {
    s = BigInt.asUintN(64, s + 0x9e3779b97f4a7c15n);
    let z = s;
    z = BigInt.asUintN(64, (z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n);
    z = BigInt.asUintN(64, (z ^ (z >> 27n)) * 0x94d049bb133111ebn);
    z ^= z >> 31n;
    return Number(z >> 11n) / 2 ** 53;
  };
}

const HPARAMS = { lr: (v) => isNum(v) && num(v) >= 0, epochs: (v) => isInt(v) && v >= 1 && v <= 10000,
  batch_size: (v) => isInt(v) && v >= 1 && v <= 2 ** 20 };

function train(plan, program, data) {
  if (plan.strategy !== 'fedavg') throw new Error(`strategy ${plan.strategy} is not implemented`);
  if (program.format !== 'fedge-torch/1' || program.objective !== 'ce' || program.model.arch !== 'mlp' || program.layout)
    throw new Error('only the fedge-torch/1 ce MLP program is implemented');
  for (const [k, v] of Object.entries(plan.hparams)) {
    if (!(k in HPARAMS)) throw new Error(`unknown hyperparameter ${k}`);
    if (!HPARAMS[k](v)) throw new Error(`hyperparameter ${k} out of range`);
  }
  const dtype = plan.upload.dtype === undefined ? 'f4' : plan.upload.dtype;
  if (dtype !== 'f4' && dtype !== 'f2') throw new Error(`upload dtype ${dtype} is not implemented`);
  const lr = num(plan.hparams.lr ?? new F64(0.05)), epochs = Number(plan.hparams.epochs ?? 1);
  const bs = Number(plan.hparams.batch_size ?? 20);
  const sizes = program.model.sizes, L = sizes.length - 1;
  const W = [], B = [];
  for (let l = 0; l < L; l++) {
    const w = plan.weights[`fc${l}.weight`], b = plan.weights[`fc${l}.bias`];
    if (!w || !b || w.shape[0] !== sizes[l + 1] || w.shape[1] !== sizes[l] || b.shape[0] !== sizes[l + 1])
      throw new Error(`weights do not fit the program at layer ${l}`);
    W.push(Float64Array.from(w.values)); B.push(Float64Array.from(b.values));
  }
  const f32 = (a) => { for (let i = 0; i < a.length; i++) a[i] = Math.fround(a[i]); };
  const rng = makeRng(plan.seed);
  const n = data.y.length;
  let steps = 0, lossSum = 0;
  for (let ep = 0; ep < epochs; ep++) {
    const perm = [...Array(n).keys()];
    for (let i = n - 1; i > 0; i--) { const j = Math.floor(rng() * (i + 1)); [perm[i], perm[j]] = [perm[j], perm[i]]; }
    for (let s0 = 0; s0 < n; s0 += bs) {
      const idx = perm.slice(s0, s0 + bs), m = idx.length;
      const gW = W.map((w) => new Float64Array(w.length)), gB = B.map((b) => new Float64Array(b.length));
      let loss = 0;
      for (const r of idx) {
        const acts = [Float64Array.from(data.x[r])];
        for (let l = 0; l < L; l++) { // a_{l+1} = relu(W_l a_l + b_l), no relu on the logits
          const out = new Float64Array(sizes[l + 1]);
          for (let o = 0; o < out.length; o++) {
            let z = B[l][o];
            for (let i = 0; i < sizes[l]; i++) z += W[l][o * sizes[l] + i] * acts[l][i];
            out[o] = l < L - 1 ? Math.max(0, z) : z;
          }
          acts.push(out);
        }
        const z = acts[L], mx = Math.max(...z);
        const ex = z.map((v) => Math.exp(v - mx)), se = ex.reduce((a, v) => a + v, 0);
        loss += -(z[data.y[r]] - mx - Math.log(se)) / m;
        let delta = ex.map((v, c) => (v / se - (c === data.y[r] ? 1 : 0)) / m); // d(mean CE)/dz
        for (let l = L - 1; l >= 0; l--) {
          const prev = new Float64Array(sizes[l]);
          for (let o = 0; o < sizes[l + 1]; o++) {
            gB[l][o] += delta[o];
            for (let i = 0; i < sizes[l]; i++) {
              gW[l][o * sizes[l] + i] += delta[o] * acts[l][i];
              prev[i] += W[l][o * sizes[l] + i] * delta[o];
            }
          }
          if (l > 0) delta = prev.map((v, i) => (acts[l][i] > 0 ? v : 0));
        }
      }
      for (let l = 0; l < L; l++) {
        for (let i = 0; i < W[l].length; i++) W[l][i] -= lr * gW[l][i];
        for (let i = 0; i < B[l].length; i++) B[l][i] -= lr * gB[l][i];
        f32(W[l]); f32(B[l]);
      }
      steps += 1; lossSum += loss;
    }
  }
  const delta = plan.upload.delta === true;
  const tensors = {};
  for (let l = 0; l < L; l++) {
    for (const [name, vals] of [[`fc${l}.weight`, W[l]], [`fc${l}.bias`, B[l]]]) {
      const shape = plan.weights[name].shape, orig = plan.weights[name].values;
      const b = Buffer.alloc(vals.length * (dtype === 'f2' ? 2 : 4));
      for (let i = 0; i < vals.length; i++) {
        const v = delta ? vals[i] - orig[i] : vals[i];
        if (dtype === 'f2') b.writeUInt16LE(numberToF16(v), 2 * i); else b.writeFloatLE(v, 4 * i);
      }
      tensors[name] = { s: shape, x: { d: dtype, s: shape, b } }; // dense: no mask field (section 5)
    }
  }
  return { tensors, metrics: { train_loss: new F64(steps ? lossSum / steps : 0), steps } };
}

// ------------------------------------------------------------------ MQTT 3.1.1 (section 1)
function mqttString(s) { const b = Buffer.from(s, 'utf8'); const l = Buffer.alloc(2); l.writeUInt16BE(b.length); return Buffer.concat([l, b]); }
function packet(type, body) {
  const len = []; let n = body.length;
  do { let d = n % 128; n = Math.floor(n / 128); if (n > 0) d |= 0x80; len.push(d); } while (n > 0);
  return Buffer.concat([Buffer.from([type, ...len]), body]);
}

class Mqtt {
  constructor(url, clientId, will, handlers, keepalive) {
    const u = new URL(url);
    this.host = u.hostname; this.port = Number(u.port || 1883);
    this.clientId = clientId; this.will = will; this.h = handlers; this.keepalive = keepalive;
    this.pid = 0; this.attempt = 0; this.sock = null; this.stopped = false;
  }
  start() {
    const sock = net.connect(this.port, this.host);
    sock.setNoDelay(true); // Nagle off: an ack or a check-in after a large report would wait for a delayed ACK
    this.sock = sock; let buf = Buffer.alloc(0); let up = false;
    sock.on('connect', () => {
      const flags = 0x04 | 0x08 | 0x20; // will, will QoS 1, will retained; clean session 0 (persistent)
      const ka = Buffer.alloc(2); ka.writeUInt16BE(this.keepalive);
      const body = Buffer.concat([mqttString('MQTT'), Buffer.from([4, flags]), ka, mqttString(this.clientId),
        mqttString(this.will.topic), (() => { const l = Buffer.alloc(2); l.writeUInt16BE(this.will.payload.length); return Buffer.concat([l, this.will.payload]); })()]);
      sock.write(packet(0x10, body));
    });
    sock.on('data', (d) => {
      buf = Buffer.concat([buf, d]);
      for (;;) {
        let n = 0, mul = 1, i = 1;
        for (;; i++) { if (i >= buf.length) return; n += (buf[i] & 0x7f) * mul; mul *= 128; if (!(buf[i] & 0x80)) break; }
        if (buf.length < i + 1 + n) return;
        const type = buf[0], body = buf.subarray(i + 1, i + 1 + n); buf = buf.subarray(i + 1 + n);
        if ((type >> 4) === 2) { // CONNACK
          if (body[1] !== 0) { console.error(`broker refused: ${body[1]}`); sock.destroy(); return; }
          up = true; this.attempt = 0;
          this.ping = setInterval(() => sock.write(Buffer.from([0xc0, 0])), this.keepalive * 500);
          const subs = Buffer.concat(this.h.subscriptions().map((t) => Buffer.concat([mqttString(t), Buffer.from([1])])));
          sock.write(packet(0x82, Buffer.concat([this.nextId(), subs])));
          this.h.connected();
        } else if ((type >> 4) === 3) { // PUBLISH
          const qos = (type >> 1) & 3, tl = body.readUInt16BE(0), topic = body.toString('utf8', 2, 2 + tl);
          let off = 2 + tl;
          if (qos > 0) { sock.write(Buffer.from([0x40, 2, body[off], body[off + 1]])); off += 2; }
          this.h.message(topic, Buffer.from(body.subarray(off)));
        } // SUBACK, PUBACK, PINGRESP: nothing to do
      }
    });
    const down = () => {
      if (this.sock !== sock) return;
      this.sock = null; clearInterval(this.ping);
      if (up) this.h.disconnected();
      if (this.stopped) return;
      const delay = Math.random() * Math.min(30, 0.2 * 2 ** this.attempt++); // full jitter (section 1)
      setTimeout(() => this.start(), delay * 1000);
    };
    sock.on('close', down); sock.on('error', () => {});
  }
  nextId() { this.pid = (this.pid % 65535) + 1; const b = Buffer.alloc(2); b.writeUInt16BE(this.pid); return b; }
  publish(topic, payload, retain = false) {
    if (!this.sock) return false;
    this.sock.write(packet(0x32 | (retain ? 1 : 0), Buffer.concat([mqttString(topic), this.nextId(), payload])));
    return true;
  }
}

// ------------------------------------------------------------------ the device (section 9)
class Device {
  constructor(o) {
    this.o = o; this.state = 'offline'; this.task = null; this.done = []; this.last = '';
    this.programs = new Map(); this.nextCheckin = Infinity; this.parts = new Map(); this.completed = new Map();
    const t = (k) => `fedge/v1/${o.fleet}/${k}/${o.id}`;
    this.t = t;
    this.mqtt = new Mqtt(o.broker, `dev-${o.id}`, { topic: t('status'), payload: this.status('offline', 0) }, this, o.keepalive);
  }
  now() { return Date.now() / 1000; }
  status(state, ts) { return encode({ v: 1, k: 'status', device_id: this.o.id, state, ts: new F64(ts) }); }
  subscriptions() { return ['plan', 'ack', 'pace'].map(this.t); }
  pubStatus(state) { this.mqtt.publish(this.t('status'), this.status(state, this.now()), true); }
  checkin() {
    const m = { v: 1, k: 'checkin', device_id: this.o.id, caps: { runtime: 'torch', charging: true, idle: true, network: 'wifi' },
      programs: [...this.programs.keys()].sort(), n: this.o.data.y.length };
    if (this.last) m.last = this.last;
    this.mqtt.publish(this.t('checkin'), encode(m));
    this.nextCheckin = this.now() + this.o.heartbeat;
  }
  connected() {
    this.pubStatus('online');
    if (this.state === 'reporting') this.retryAt = 0; // the old connection may have lost the report
    else if (this.state !== 'training') { this.state = 'idle'; this.checkin(); }
  }
  disconnected() { if (this.state === 'idle') this.state = 'offline'; }
  tick() {
    const now = this.now();
    for (const [id, p] of this.parts) if (now - p.last > 60) this.parts.delete(id);
    if (this.state === 'idle' && now >= this.nextCheckin) this.checkin();
    if (this.state === 'reporting' && now >= this.retryAt) {
      if (now >= this.task.deadline + this.o.grace) this.finish(); else this.sendReport();
    }
  }
  message(topic, payload) {
    const kind = topic.split('/')[3];
    if (!this.subscriptions().includes(topic)) return;
    let msg;
    try {
      msg = checkMessage(decode(payload), kind === 'pace' ? ['pace'] : [kind, 'chunk']);
      if (msg.kind === 'chunk') {
        const whole = this.reassemble(msg);
        if (!whole) return;
        msg = checkMessage(decode(whole), [kind]);
      }
    } catch (e) { console.error(`dropped a message on ${topic}: ${e.message}`); return; }
    if (msg.device_id !== this.o.id) { console.error(`dropped a ${msg.kind} for ${msg.device_id}`); return; }
    if (msg.kind === 'pace') this.nextCheckin = this.now() + Math.min(msg.after, this.o.maxPace);
    else if (msg.kind === 'ack') { if (this.state === 'reporting' && msg.task_id === this.task.task_id) this.finish(); }
    else this.onPlan(msg);
  }
  reassemble(c) { // section 8
    const now = this.now();
    if (this.completed.has(c.id) && now - this.completed.get(c.id) <= 60) return null;
    let p = this.parts.get(c.id);
    if (!p) {
      if (c.t > this.o.maxBytes || c.n > Math.max(1, Math.ceil(c.t / 256)) || this.parts.size >= 2) throw new WireError('chunked transfer refused');
      p = { n: c.n, t: c.t, got: new Map(), size: 0, last: now }; this.parts.set(c.id, p);
    }
    const bad = (why) => { this.parts.delete(c.id); throw new WireError(why); };
    if (c.n !== p.n || c.t !== p.t) bad('chunks disagree');
    if (!p.got.has(c.i)) {
      if (!c.b.length || (c.b.length < 256 && c.i !== c.n - 1)) bad('chunk too small');
      p.got.set(c.i, c.b); p.size += c.b.length; if (p.size > p.t) bad('chunks exceed the announced size');
    }
    p.last = now;
    if (p.got.size < p.n) return null;
    this.parts.delete(c.id); this.completed.set(c.id, now);
    const whole = Buffer.concat([...Array(p.n).keys()].map((i) => p.got.get(i)));
    if (whole.length !== p.t) throw new WireError('reassembled size differs');
    return whole;
  }
  onPlan(plan) { // section 9.3
    if (this.state === 'training' || this.state === 'reporting') return; // busy
    if (this.done.includes(plan.task_id)) return; // delivered again
    this.last = plan.task_id;
    if (plan.deadline <= this.now()) return;
    if (plan.program !== null) {
      if (crypto.createHash('sha256').update(plan.program).digest('hex') !== plan.program_hash) return;
      this.programs.set(plan.program_hash, plan.program);
    } else if (!this.programs.has(plan.program_hash)) { this.checkin(); return; }
    this.state = 'training'; this.task = plan; this.pubStatus('training');
    setImmediate(() => {
      let report;
      try {
        const prog = JSON.parse(this.programs.get(plan.program_hash).toString('utf8'));
        if (plan.runtime !== 'torch') throw new Error(`runtime ${plan.runtime}`);
        const r = train(plan, prog, this.o.data);
        report = encode({ v: 1, k: 'report', task_id: plan.task_id, device_id: this.o.id, n: this.o.data.y.length,
          metrics: r.metrics, tensors: r.tensors, extras: {} });
      } catch (e) { console.error(`plan ${plan.task_id} failed: ${e.message}`); this.finish(); return; }
      this.report = this.split(report, `r-${plan.task_id}`);
      this.state = 'reporting'; this.retries = 0; this.sendReport();
    });
  }
  split(payload, id) {
    const cb = this.o.chunkBytes;
    if (payload.length <= cb) return [payload];
    const n = Math.ceil(payload.length / cb), out = [];
    for (let i = 0; i < n; i++) out.push(encode({ v: 1, k: 'chunk', id, i, n, t: payload.length, b: payload.subarray(i * cb, (i + 1) * cb) }));
    return out;
  }
  sendReport() { // section 9.4: the same bytes each time, backoff ack_timeout * 2^min(r, 5)
    this.retryAt = this.now() + this.o.ackTimeout * 2 ** Math.min(this.retries++, 5);
    for (const p of this.report) this.mqtt.publish(this.t('report'), p);
  }
  finish() {
    if (this.task) this.done = [...this.done, this.task.task_id].slice(-64);
    this.task = null; this.report = null; this.state = 'idle';
    this.pubStatus('idle'); this.checkin();
  }
  start() { this.mqtt.start(); setInterval(() => this.tick(), 100); }
}

// --check-vectors DIR: decode every plan, ack and pace vector of firmware_tests/protocol (section 12); the valid
// ones must be accepted, the others refused. A chunk series (<name>.<i>.msgpack) goes through the device's own
// reassembler, in file order. Vectors that require an extension this device does not declare (section 6.1) are
// skipped. --f16 x,y,...: print each number's float16 bits (for the tests).
function tools(args) {
  if (args[0] === '--f16') { console.log(args[1].split(',').map((x) => numberToF16(Number(x))).join(',')); return true; }
  if (args[0] !== '--check-vectors') return false;
  let fails = 0, n = 0, skipped = 0;
  const read = (name) => fs.readFileSync(`${args[1]}/${name}.msgpack`);
  for (const f of fs.readdirSync(args[1]).filter((x) => x.endsWith('.json')).sort()) {
    const m = JSON.parse(fs.readFileSync(`${args[1]}/${f}`, 'utf8'));
    if (!['plan', 'ack', 'pace'].includes(m.kind)) continue;
    if ((m.requires || []).length) { skipped += 1; continue; } // sampled_upload, coded_downlink: not declared
    const expect = m.kind === 'pace' ? ['pace'] : [m.kind, 'chunk'];
    let err = null;
    try {
      if (m.chunks) {
        const dev = { o: { maxBytes: 64 * 1024 * 1024 }, parts: new Map(), completed: new Map(), now: () => 0 };
        let whole = null, first = null;
        for (let i = 0; i < m.chunks; i++) {
          try {
            const c = checkMessage(decode(read(`${m.name}.${i}`)), ['chunk']);
            const got = Device.prototype.reassemble.call(dev, c);
            if (got) whole = checkMessage(decode(got), [m.kind]);
          } catch (e) { if (!(e instanceof WireError)) throw e; first = first || e; }
        }
        if (first) throw first;
        if (!whole) throw new WireError('the series did not reassemble');
      } else checkMessage(decode(read(m.name)), expect);
    } catch (e) { err = e.message; }
    n += 1;
    if ((err === null) !== m.valid) { fails += 1; console.log(`FAIL ${m.name}: ${err === null ? 'accepted' : err}`); }
  }
  console.log(`${n - fails}/${n} vectors as expected (${skipped} of extensions skipped)`);
  process.exit(fails ? 1 : 0);
}

function main() {
  if (tools(process.argv.slice(2))) return;
  const args = process.argv.slice(2), o = { broker: 'mqtt://127.0.0.1:1883', fleet: 'default', ackTimeout: 5,
    heartbeat: 15, grace: 30, maxPace: 3600, keepalive: 30, chunkBytes: 1020 * 1024, maxBytes: 64 * 1024 * 1024 };
  const names = { '--broker': 'broker', '--fleet': 'fleet', '--id': 'id', '--data': 'data', '--ack-timeout': 'ackTimeout',
    '--heartbeat': 'heartbeat', '--grace': 'grace', '--max-pace': 'maxPace', '--keepalive': 'keepalive' };
  for (let i = 0; i < args.length; i += 2) {
    const k = names[args[i]];
    if (!k) { console.error(`unknown option ${args[i]}`); process.exit(2); }
    o[k] = ['broker', 'fleet', 'id', 'data'].includes(k) ? args[i + 1] : Number(args[i + 1]);
  }
  if (!o.id || !ID_RE.test(o.id) || !o.data) { console.error('--id (a valid id) and --data are required'); process.exit(2); }
  o.data = JSON.parse(fs.readFileSync(o.data, 'utf8'));
  new Device(o).start();
}

if (require.main === module) main();
module.exports = { encode, decode, checkMessage, numberToF16, f16ToNumber, train, F64 };
