// A person's local data, read where it is (the page or Node), never sent: an .npz (x, y; as fedge's own devices
// read it, edge/runtime/data.py) or JSON {"x": [[features...], ...], "y": [labels...]}. Returns
// {x: Float32Array (rows x features), y: Int32Array, n, features}.

/** Data from the bytes of a file named ``name`` (.npz, else JSON); an Error with one line saying what is wrong. */
export async function loadData(bytes, name = 'data') {
  // a plain Uint8Array view (a Node Buffer's slice() shares memory, where a Uint8Array's copies)
  const u8 = ArrayBuffer.isView(bytes) ? new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength) : new Uint8Array(bytes);
  if (/\.npz$/i.test(name) || (u8[0] === 0x50 && u8[1] === 0x4b)) {
    const files = await unzip(u8);
    const x = files.get('x.npy'), y = files.get('y.npy');
    if (!x || !y) throw new Error(`${name}: an .npz needs arrays x and y`);
    return fromArrays(npy(x, `${name}: x`), npy(y, `${name}: y`), name);
  }
  let obj;
  try { obj = JSON.parse(new TextDecoder().decode(u8)); } catch (e) { throw new Error(`${name}: neither an .npz nor JSON (${e.message})`); }
  if (!obj || !Array.isArray(obj.x) || !Array.isArray(obj.y)) throw new Error(`${name}: JSON data needs "x" (rows of features) and "y" (labels)`);
  const n = obj.x.length, rows = obj.x.map((r) => (Array.isArray(r) ? r.flat(Infinity) : [r]));
  const features = n ? rows[0].length : 0;
  if (rows.some((r) => r.length !== features)) throw new Error(`${name}: every row of x needs ${features} features`);
  return fromArrays({ data: Float64Array.from(rows.flat()), shape: [n, features] }, { data: Float64Array.from(obj.y), shape: [obj.y.length] }, name);
}

function fromArrays(x, y, name) {
  if (x.shape.length < 2) throw new Error(`${name}: x must be examples x features, got shape [${x.shape}]`);
  if (y.shape.length !== 1 || y.shape[0] !== x.shape[0]) throw new Error(`${name}: y must be one label per example (${x.shape[0]})`);
  const n = x.shape[0];
  if (!n) throw new Error(`${name}: no examples`);
  const features = x.shape.slice(1).reduce((a, d) => a * d, 1);
  const xs = Float32Array.from(x.data, Number);
  if (!xs.every(Number.isFinite)) throw new Error(`${name}: x has non-finite values`);
  const ys = new Int32Array(n);
  for (let i = 0; i < n; i++) {
    const v = Number(y.data[i]);
    if (!Number.isInteger(v) || v < 0) throw new Error(`${name}: labels must be integers 0..C-1, found ${y.data[i]}`);
    ys[i] = v;
  }
  return { x: xs, y: ys, n, features };
}

/** A .npy array: {data (typed array), shape}; little-endian numeric dtypes in C order. */
export function npy(b, what = 'array') {
  if (b[0] !== 0x93 || String.fromCharCode(...b.subarray(1, 6)) !== 'NUMPY') throw new Error(`${what}: not a .npy array`);
  const dv = new DataView(b.buffer, b.byteOffset, b.byteLength), major = b[6];
  const hlen = major === 1 ? dv.getUint16(8, true) : dv.getUint32(8, true), start = major === 1 ? 10 : 12;
  const header = new TextDecoder().decode(b.subarray(start, start + hlen));
  const descr = /'descr':\s*'([^']+)'/.exec(header), fortran = /'fortran_order':\s*(True|False)/.exec(header), shape = /'shape':\s*\(([^)]*)\)/.exec(header);
  if (!descr || !fortran || !shape) throw new Error(`${what}: unreadable .npy header`);
  if (fortran[1] === 'True') throw new Error(`${what}: Fortran-ordered arrays are not read; save it C-ordered`);
  const dims = shape[1].split(',').map((s) => s.trim()).filter(Boolean).map(Number);
  const count = dims.reduce((a, d) => a * d, 1), off = start + hlen;
  const types = { '<f4': [Float32Array, 4], '<f8': [Float64Array, 8], '<i8': [BigInt64Array, 8], '<i4': [Int32Array, 4], '<i2': [Int16Array, 2],
    '|i1': [Int8Array, 1], '|u1': [Uint8Array, 1], '<u2': [Uint16Array, 2], '<u4': [Uint32Array, 4], '<u8': [BigUint64Array, 8], '|b1': [Uint8Array, 1] };
  const t = types[descr[1]];
  if (!t) throw new Error(`${what}: dtype ${descr[1]} is not read (use float32/float64 x and integer y)`);
  if (b.length - off < count * t[1]) throw new Error(`${what}: truncated`);
  const copy = Uint8Array.prototype.slice.call(b, off, off + count * t[1]);
  return { data: new t[0](copy.buffer, 0, count), shape: dims };
}

/** The members of a zip file (stored or deflated; zip64 sizes as numpy writes them), by name. */
export async function unzip(b) {
  const dv = new DataView(b.buffer, b.byteOffset, b.byteLength);
  let eocd = -1;
  for (let i = b.length - 22; i >= Math.max(0, b.length - 65557); i--) if (dv.getUint32(i, true) === 0x06054b50) { eocd = i; break; }
  if (eocd < 0) throw new Error('not a zip file');
  let count = dv.getUint16(eocd + 10, true), cdOff = dv.getUint32(eocd + 16, true);
  if (cdOff === 0xffffffff || count === 0xffff) {  // zip64 end of central directory
    const loc = eocd - 20;
    if (dv.getUint32(loc, true) !== 0x07064b50) throw new Error('zip64 locator missing');
    const z = Number(dv.getBigUint64(loc + 8, true));
    count = Number(dv.getBigUint64(z + 32, true)); cdOff = Number(dv.getBigUint64(z + 48, true));
  }
  const out = new Map();
  let p = cdOff;
  for (let e = 0; e < count; e++) {
    if (dv.getUint32(p, true) !== 0x02014b50) throw new Error('bad zip central directory');
    const method = dv.getUint16(p + 10, true), nlen = dv.getUint16(p + 28, true), xlen = dv.getUint16(p + 30, true), clen = dv.getUint16(p + 32, true);
    let csize = dv.getUint32(p + 20, true), usize = dv.getUint32(p + 24, true), lho = dv.getUint32(p + 42, true);
    const name = new TextDecoder().decode(b.subarray(p + 46, p + 46 + nlen));
    for (let q = p + 46 + nlen; q < p + 46 + nlen + xlen;) {  // zip64 extra: the fields that are 0xffffffff, in order
      const id = dv.getUint16(q, true), size = dv.getUint16(q + 2, true);
      if (id === 1) {
        let r = q + 4;
        if (usize === 0xffffffff) { usize = Number(dv.getBigUint64(r, true)); r += 8; }
        if (csize === 0xffffffff) { csize = Number(dv.getBigUint64(r, true)); r += 8; }
        if (lho === 0xffffffff) { lho = Number(dv.getBigUint64(r, true)); r += 8; }
      }
      q += 4 + size;
    }
    const start = lho + 30 + dv.getUint16(lho + 26, true) + dv.getUint16(lho + 28, true);
    const raw = b.subarray(start, start + csize);
    let data;
    if (method === 0) data = Uint8Array.prototype.slice.call(raw);
    else if (method === 8) data = new Uint8Array(await new Response(new Blob([raw]).stream().pipeThrough(new DecompressionStream('deflate-raw'))).arrayBuffer());
    else throw new Error(`zip member ${name}: compression method ${method} is not read`);
    if (data.length !== usize) throw new Error(`zip member ${name}: size differs`);
    out.set(name, data);
    p += 46 + nlen + xlen + clen;
  }
  return out;
}
