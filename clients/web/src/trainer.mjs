// The trainer: a fedge-ort/2 program (docs/protocol.md section 14) on ONNX Runtime Web. ORT Web's training API
// returns no gradients, so this runs the program's gradient_model.onnx (export/ort.py: gradient_model: the
// training graph with the gradients as outputs) as a plain InferenceSession of ORT Web's training build, which
// has ORT's gradient kernels for the programs that keep them (a CNN's ConvGrad; an MLP's graph is standard ONNX
// and any ORT build runs it). The client halves (algorithms.mjs) own the optimisers.
import { F64, decode } from './msgpack.mjs';
import { PlanError } from './algorithms.mjs';

export const FORMAT = 'fedge-ort/2';
export const GRADIENT_FILE = 'gradient_model.onnx';

/** Maps as objects and floats as numbers, for a program's metadata. */
export function plain(v) {
  if (v instanceof Map) return Object.fromEntries([...v].map(([k, x]) => [k, plain(x)]));
  if (Array.isArray(v)) return v.map(plain);
  if (v instanceof F64) return v.v;
  return v;
}

/** The program's metadata and its gradient graph; a PlanError when it is not a program this device runs. */
export function readProgram(bytes) {
  let body;
  try { body = decode(bytes); } catch (e) { throw new PlanError(`not a fedge program: ${e.message}`); }
  if (!(body instanceof Map) || body.get('format') !== FORMAT) throw new PlanError(`not a ${FORMAT} program`);
  const files = body.get('files');
  const graph = files instanceof Map ? files.get(GRADIENT_FILE) : undefined;
  if (!(graph instanceof Uint8Array)) throw new PlanError(`the program has no ${GRADIENT_FILE} (exported before the browser device; a coordinator of this version exports it)`);
  const meta = {};
  for (const k of ['objective', 'model', 'layout', 'params', 'shapes', 'inputs', 'outputs', 'padding']) if (body.has(k)) meta[k] = plain(body.get(k));
  if (!Array.isArray(meta.params) || !Array.isArray(meta.inputs) || !meta.shapes) throw new PlanError('the program lacks params, shapes or inputs');
  return { meta, graph };
}

/** Loss and gradients of one program with ``ort`` (the onnxruntime-web training build's module). */
export class OrtWebTrainer {
  static async load(ort, bytes) {
    const { meta, graph } = readProgram(bytes);
    const t = new OrtWebTrainer();
    t.ort = ort; t.meta = meta;
    t.session = await ort.InferenceSession.create(graph, { executionProviders: ['wasm'], graphOptimizationLevel: 'all' });
    const want = meta.params.map((p) => `${p}_grad`);
    const missing = want.filter((o) => !t.session.outputNames.includes(o));
    if (missing.length) throw new PlanError(`the gradient graph lacks outputs ${missing.slice(0, 3)}`);
    return t;
  }

  /** ``params``: {name: Float32Array}; ``inputs``: {name: {dtype, data, shape}}. Returns {loss, grads, aux}. */
  async lossAndGrads(params, inputs) {
    const T = this.ort.Tensor, feeds = {};
    for (const i of this.meta.inputs) {
      const v = inputs[i.name];
      if (!v) throw new PlanError(`the program needs input ${i.name}`);
      feeds[i.name] = new T(v.dtype, v.data, v.shape);
    }
    for (const p of this.meta.params) feeds[p] = new T('float32', params[p], this.meta.shapes[p]);
    const out = await this.session.run(feeds);
    const grads = {};
    for (const p of this.meta.params) grads[p] = out[`${p}_grad`].data;
    const aux = {};
    for (const name of (this.meta.outputs || []).slice(1)) if (out[name]) aux[name] = out[name].data;
    return { loss: Number(out.loss.data[0]), grads, aux };
  }

  async release() { if (this.session) await this.session.release(); this.session = null; }
}
