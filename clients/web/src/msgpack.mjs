// msgpack as fedge uses it (docs/protocol.md section 3), on Uint8Array so it runs in a page and in Node alike.
// Strings stay strings, bin becomes Uint8Array, maps become Map (keys must be strings, no duplicates), integers
// beyond 2^53 become BigInt, and floats are tagged (F64) so a receiver can tell 1.0 from 1 (a float is never an
// integer on the wire). Trailing bytes are an error.

/** A number that travels (and arrived) as a float. */
export class F64 { constructor(v) { this.v = v; } }

const te = new TextEncoder();
const td = new TextDecoder('utf-8', { fatal: true });

/** One value as msgpack bytes. Plain objects are maps in key order; Uint8Array is bin; F64 and non-integer
 * numbers are float 64; bigint is uint64. */
export function encode(value) {
  let buf = new Uint8Array(1024), view = new DataView(buf.buffer), p = 0;
  const room = (n) => {
    if (p + n <= buf.length) return;
    let size = buf.length * 2;
    while (size < p + n) size *= 2;
    const nb = new Uint8Array(size); nb.set(buf.subarray(0, p)); buf = nb; view = new DataView(buf.buffer);
  };
  const u8 = (...b) => { room(b.length); for (const x of b) buf[p++] = x; };
  const u16 = (c, n) => { room(3); buf[p++] = c; view.setUint16(p, n); p += 2; };
  const u32 = (c, n) => { room(5); buf[p++] = c; view.setUint32(p, n); p += 4; };
  const len = (n, fix, fixMax, c8, c16, c32) => {
    if (fix !== null && n <= fixMax) u8(fix | n);
    else if (c8 !== null && n < 256) u8(c8, n);
    else if (n < 65536) u16(c16, n);
    else u32(c32, n);
  };
  const raw = (bytes) => { room(bytes.length); buf.set(bytes, p); p += bytes.length; };
  const enc = (v) => {
    if (v === null || v === undefined) u8(0xc0);
    else if (v === false) u8(0xc2);
    else if (v === true) u8(0xc3);
    else if (v instanceof F64 || (typeof v === 'number' && !Number.isInteger(v))) {
      const x = v instanceof F64 ? v.v : v;
      if (!Number.isFinite(x)) throw new Error('non-finite float');
      room(9); buf[p++] = 0xcb; view.setFloat64(p, x); p += 8;
    } else if (typeof v === 'bigint') { room(9); buf[p++] = 0xcf; view.setBigUint64(p, BigInt.asUintN(64, v)); p += 8; }
    else if (typeof v === 'number') {
      if (v >= 0 && v < 128) u8(v);
      else if (v < 0 && v >= -32) u8(v & 0xff);
      else if (v >= 0 && v < 2 ** 32) u32(0xce, v);
      else if (v < 0 && v >= -(2 ** 31)) { room(5); buf[p++] = 0xd2; view.setInt32(p, v); p += 4; }
      else { room(9); buf[p++] = 0xd3; view.setBigInt64(p, BigInt(v)); p += 8; }
    } else if (typeof v === 'string') { const s = te.encode(v); len(s.length, 0xa0, 31, 0xd9, 0xda, 0xdb); raw(s); }
    else if (v instanceof Uint8Array) { len(v.length, null, -1, 0xc4, 0xc5, 0xc6); raw(v); }
    else if (Array.isArray(v)) { len(v.length, 0x90, 15, null, 0xdc, 0xdd); v.forEach(enc); }
    else if (v instanceof Map) { len(v.size, 0x80, 15, null, 0xde, 0xdf); for (const [k, x] of v) { enc(k); enc(x); } }
    else if (typeof v === 'object') {
      const keys = Object.keys(v).filter((k) => v[k] !== undefined);
      len(keys.length, 0x80, 15, null, 0xde, 0xdf);
      for (const k of keys) { enc(k); enc(v[k]); }
    } else throw new Error(`cannot encode ${typeof v}`);
  };
  enc(value);
  return buf.slice(0, p);
}

/** One msgpack value from ``bytes`` (the whole of it). */
export function decode(bytes) {
  const buf = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  let p = 0;
  const need = (n) => { if (p + n > buf.length) throw new Error('truncated msgpack'); };
  const int = (v) => (v >= -(2n ** 53n) && v <= 2n ** 53n ? Number(v) : v);
  const str = (n) => { need(n); const s = td.decode(buf.subarray(p, p + n)); p += n; return s; };
  const bin = (n) => { need(n); const b = buf.slice(p, p + n); p += n; return b; };
  const arr = (n) => { if (n > buf.length - p) throw new Error('truncated msgpack'); const a = []; for (let i = 0; i < n; i++) a.push(dec()); return a; };
  const map = (n) => {
    if (n > buf.length - p) throw new Error('truncated msgpack');
    const m = new Map();
    for (let i = 0; i < n; i++) {
      const k = dec();
      if (typeof k !== 'string') throw new Error('map key is not a string');
      if (m.has(k)) throw new Error('duplicate map key');
      m.set(k, dec());
    }
    return m;
  };
  const rd = (n, f) => { need(n); const v = f(p); p += n; return v; };
  const dec = () => {
    need(1);
    const b = buf[p++];
    if (b <= 0x7f) return b;
    if (b >= 0xe0) return b - 256;
    if ((b & 0xf0) === 0x80) return map(b & 0x0f);
    if ((b & 0xf0) === 0x90) return arr(b & 0x0f);
    if ((b & 0xe0) === 0xa0) return str(b & 0x1f);
    switch (b) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return bin(rd(1, (q) => view.getUint8(q)));
      case 0xc5: return bin(rd(2, (q) => view.getUint16(q)));
      case 0xc6: return bin(rd(4, (q) => view.getUint32(q)));
      case 0xca: return new F64(rd(4, (q) => view.getFloat32(q)));
      case 0xcb: return new F64(rd(8, (q) => view.getFloat64(q)));
      case 0xcc: return rd(1, (q) => view.getUint8(q));
      case 0xcd: return rd(2, (q) => view.getUint16(q));
      case 0xce: return rd(4, (q) => view.getUint32(q));
      case 0xcf: return int(rd(8, (q) => view.getBigUint64(q)));
      case 0xd0: return rd(1, (q) => view.getInt8(q));
      case 0xd1: return rd(2, (q) => view.getInt16(q));
      case 0xd2: return rd(4, (q) => view.getInt32(q));
      case 0xd3: return int(rd(8, (q) => view.getBigInt64(q)));
      case 0xd9: return str(rd(1, (q) => view.getUint8(q)));
      case 0xda: return str(rd(2, (q) => view.getUint16(q)));
      case 0xdb: return str(rd(4, (q) => view.getUint32(q)));
      case 0xdc: return arr(rd(2, (q) => view.getUint16(q)));
      case 0xdd: return arr(rd(4, (q) => view.getUint32(q)));
      case 0xde: return map(rd(2, (q) => view.getUint16(q)));
      case 0xdf: return map(rd(4, (q) => view.getUint32(q)));
      default: throw new Error(`msgpack type 0x${b.toString(16)} is not used by fedge`);
    }
  };
  const v = dec();
  if (p !== buf.length) throw new Error('trailing bytes after the message');
  return v;
}
