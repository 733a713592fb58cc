// The fedge device core shared by the page (page.mjs) and Node (node.mjs): the device's behaviour of
// docs/protocol.md section 9 (status, check-in and heartbeat, pace, plans accepted, trained, refused, reports
// resent until acked) over an MQTT.js client (MQTT 3.1.1 over WebSockets, or TCP in Node), training fedge-ort/2
// programs on ONNX Runtime Web with the client halves of algorithms.mjs. Everything environment-specific comes in
// through the options: the MQTT.js ``connect``, the ``ort`` module, the capabilities, a clock, a logger.
import { F64, encode } from './msgpack.mjs';
import { PlanError, encodeUpdate, evaluate, trainPlan } from './algorithms.mjs';
import { OrtWebTrainer } from './trainer.mjs';
import { ID_RE, Reassembler, WireError, receive, split, statusMessage } from './wire.mjs';
import { sha256hex } from './sha256.mjs';

export const DEFAULTS = { fleet: 'default', ackTimeout: 5, heartbeat: 15, grace: 30, maxPace: 3600, keepalive: 30,
  chunkBytes: 1020 * 1024, maxBytes: 64 * 1024 * 1024, tick: 0.2, backoffBase: 0.2, backoffCap: 30 };

/**
 * One device. ``o``: {id, fleet, broker (ws://, wss://, mqtt:// URL), username, password, data ({x, y, n, features}),
 * caps() -> capabilities, connect (MQTT.js's connect), ort (onnxruntime-web training build), onEvent(ev), log(line),
 * now() -> Unix seconds, and the times of DEFAULTS}. ``start()`` connects; ``stop()`` says offline and disconnects.
 */
export class Device {
  constructor(o) {
    this.o = { ...DEFAULTS, now: () => Date.now() / 1000, log: () => {}, onEvent: () => {}, ...o };
    if (!ID_RE.test(this.o.id || '')) throw new Error('the device id must be 1 to 128 of A-Z a-z 0-9 _ . : -');
    if (!ID_RE.test(this.o.fleet)) throw new Error('the fleet must be 1 to 128 of A-Z a-z 0-9 _ . : -');
    this.state = 'offline'; this.task = null; this.done = []; this.last = ''; this.report = null;
    this.programs = new Map(); this.trainers = new Map(); this.nextCheckin = Infinity; this.attempt = 0;
    this.reasm = new Reassembler(this.o.maxBytes); this.stopped = false; this.connected = false;
    this.topic = (k) => `fedge/v1/${this.o.fleet}/${k}/${this.o.id}`;
    this.subs = ['plan', 'ack', 'pace'].map(this.topic);
    this.counts = { sent: 0, received: 0, dropped: 0, reports: 0, acks: {} };
  }

  emit(type, extra = {}) { try { this.o.onEvent({ type, state: this.state, ...extra }); } catch (e) { this.o.log(`event handler: ${e.message}`); } }

  start() {
    const o = this.o;
    this.client = o.connect(o.broker, {
      clientId: `dev-${o.id}`, clean: false, keepalive: o.keepalive, protocolVersion: 4, reconnectPeriod: 0,
      connectTimeout: 10000, username: o.username, password: o.password, resubscribe: false,
      will: { topic: this.topic('status'), payload: statusMessage(o.id, 'offline', 0), qos: 1, retain: true },
    });
    this.client.on('connect', () => this.onConnect());
    this.client.on('message', (topic, payload) => this.onMessage(topic, new Uint8Array(payload.buffer, payload.byteOffset, payload.byteLength)));
    this.client.on('close', () => this.onClose());
    this.client.on('error', (e) => o.log(`mqtt: ${e.message}`));
    this.timer = setInterval(() => this.tick(), o.tick * 1000);
  }

  async stop() {
    this.stopped = true; clearInterval(this.timer); clearTimeout(this.retry);
    if (this.client && this.connected) await new Promise((r) => this.client.publish(this.topic('status'), statusMessage(this.o.id, 'offline', this.o.now()), { qos: 1, retain: true }, r));
    if (this.client) await new Promise((r) => this.client.end(false, {}, r));
    for (const t of this.trainers.values()) await t.release();
  }

  publish(topic, payload, retain = false) {
    if (!this.connected) return false;
    this.client.publish(topic, payload, { qos: 1, retain });
    this.counts.sent += 1;
    return true;
  }

  onConnect() {
    this.connected = true; this.attempt = 0;
    this.client.subscribe(this.subs, { qos: 1 });  // on every connection: a broker may have lost the session
    this.publish(this.topic('status'), statusMessage(this.o.id, 'online', this.o.now()), true);
    if (this.state === 'reporting') this.retryAt = 0;  // the old connection may have lost the report
    else if (this.state !== 'training') { this.state = 'idle'; this.checkin(); }
    this.emit('connected');
  }

  onClose() {
    const was = this.connected;
    this.connected = false;
    if (this.state === 'idle') this.state = 'offline';
    if (was) this.emit('disconnected');
    if (this.stopped) return;
    // full jitter (section 1): uniform in [0, min(cap, base * 2^n))
    const delay = Math.random() * Math.min(this.o.backoffCap, this.o.backoffBase * 2 ** this.attempt++);
    clearTimeout(this.retry);
    this.retry = setTimeout(() => { if (!this.stopped && !this.connected) this.client.reconnect(); }, delay * 1000);
  }

  caps() {
    const c = { runtime: 'ort', sampled_upload: true, ...(this.o.caps ? this.o.caps() : {}) };
    for (const k of Object.keys(c)) if (c[k] === undefined || c[k] === null) delete c[k];
    for (const k of ['battery', 'link_kbps']) if (typeof c[k] === 'number' && !Number.isInteger(c[k])) c[k] = new F64(c[k]);
    return c;
  }

  checkin() {
    const m = { v: 1, k: 'checkin', device_id: this.o.id, caps: this.caps(), programs: [...this.programs.keys()].sort(), n: this.o.data.n };
    if (this.last) m.last = this.last;
    this.publish(this.topic('checkin'), encode(m));
    this.nextCheckin = this.o.now() + this.o.heartbeat;
    this.emit('checkin');
  }

  /** The capabilities changed (charger, network): check in at once when idle (section 9.2). */
  updateCapabilities() { if (this.state === 'idle' && this.connected) this.checkin(); }

  tick() {
    const now = this.o.now();
    this.reasm.expire(now);
    if (this.state === 'idle' && now >= this.nextCheckin) this.checkin();
    if (this.state === 'reporting' && now >= this.retryAt) {
      if (now >= this.task.deadline + this.o.grace) { this.o.log(`gave up on ${this.task.task_id}: no ack by its deadline`); this.finish(); }
      else this.sendReport();
    }
  }

  onMessage(topic, payload) {
    if (!this.subs.includes(topic)) return;  // some brokers deliver retained messages of other topics
    const kind = topic.split('/')[3];
    let msg;
    try {
      msg = receive(kind, payload, this.reasm, this.o.now());
      if (!msg) return;
    } catch (e) {
      this.counts.dropped += 1;
      this.o.log(`dropped a message on ${topic}: ${e instanceof WireError ? e.message : `malformed (${e.message})`}`);
      return;
    }
    this.counts.received += 1;
    if (msg.device_id !== this.o.id) { this.counts.dropped += 1; this.o.log(`dropped a ${msg.kind} for ${msg.device_id}`); return; }
    if (msg.kind === 'pace') this.nextCheckin = this.o.now() + Math.min(msg.after, this.o.maxPace);
    else if (msg.kind === 'ack') {
      if (this.state === 'reporting' && msg.task_id === this.task.task_id) {
        this.counts.acks[msg.status] = (this.counts.acks[msg.status] || 0) + 1;
        this.emit('ack', { status: msg.status, reason: msg.reason, round: this.task.round, task: msg.task_id });
        this.finish();
      }
    } else this.onPlan(msg);
  }

  onPlan(plan) {  // section 9.3
    if (this.state === 'training' || this.state === 'reporting') return;  // one plan at a time
    if (this.done.includes(plan.task_id) || (this.task && this.task.task_id === plan.task_id)) return;  // delivered again
    this.last = plan.task_id;
    this.done = [...this.done, plan.task_id].slice(-64);
    if (plan.deadline <= this.o.now()) { this.o.log(`dropped plan ${plan.task_id}: its deadline passed`); return; }
    if (plan.program !== null) {
      if (sha256hex(plan.program) !== plan.program_hash) { this.o.log(`dropped plan ${plan.task_id}: its program does not match its hash`); return; }
      this.programs.set(plan.program_hash, plan.program);
    } else if (!this.programs.has(plan.program_hash)) { this.checkin(); return; }
    this.state = 'training'; this.task = plan;
    this.publish(this.topic('status'), statusMessage(this.o.id, 'training', this.o.now()), true);
    this.emit('training', { round: plan.round, task: plan.task_id, strategy: plan.strategy, done: 0, total: 0 });
    this.train(plan).then((report) => {
      if (!report) { this.finish(); return; }
      this.report = split(report, `r-${plan.task_id}`, this.o.chunkBytes);
      this.state = 'reporting'; this.retries = 0; this.counts.reports += 1;
      this.sendReport();
      this.emit('sent', { round: plan.round, task: plan.task_id, bytes: report.length });
    });
  }

  async trainer(hash) {
    let t = this.trainers.get(hash);
    if (!t) {
      for (const [h, old] of this.trainers) { await old.release(); this.trainers.delete(h); }  // one program's session at a time
      t = await OrtWebTrainer.load(this.o.ort, this.programs.get(hash));
      this.trainers.set(hash, t);
    }
    return t;
  }

  /** The report's bytes, or null when the plan cannot be trained (it fails: check in, no report). */
  async train(plan) {
    const t0 = this.o.now();
    try {
      if (plan.runtime !== 'ort') throw new PlanError(`runtime ${plan.runtime} (this device runs ort programs)`);
      const trainer = await this.trainer(plan.program_hash);
      if (this.o.evaluate) {  // the page shows how the model it received does on the person's data
        try { this.emit('evaluated', { round: plan.round, accuracy: await evaluate(plan, trainer, this.o.data) }); } catch (e) { this.o.log(`evaluation: ${e.message}`); }
      }
      const t1 = this.o.now();
      let lastYield = t1;
      const r = await trainPlan(plan, trainer, this.o.data, async (done, total) => {
        const now = this.o.now();
        if (now - lastYield > 0.05 || done === total) {  // let the page repaint and the MQTT client breathe (20 Hz)
          this.emit('progress', { round: plan.round, task: plan.task_id, done, total });
          await new Promise((res) => setTimeout(res, 0));
          lastYield = this.o.now();
        }
      });
      const tensors = encodeUpdate(r.weights, r.shapes, plan, r.masks, true);
      const report = encode({ v: 1, k: 'report', task_id: plan.task_id, device_id: this.o.id, n: this.o.data.n,
        metrics: r.metrics, tensors, extras: {} });
      this.lastTrain = { step_ms: r.stepMs / Math.max(1, r.metrics.steps), steps: r.metrics.steps, seconds: this.o.now() - t1,
        plan_seconds: this.o.now() - t0 };
      return report;
    } catch (e) {
      this.o.log(`plan ${plan.task_id} failed: ${e.message}`);
      this.emit('failed', { round: plan.round, task: plan.task_id, reason: e.message });
      return null;
    }
  }

  sendReport() {  // section 9.4: the same bytes each time, next send ack_timeout * 2^min(r, 5) later
    this.retryAt = this.o.now() + this.o.ackTimeout * 2 ** Math.min(this.retries++, 5);
    for (const p of this.report) this.publish(this.topic('report'), p);
  }

  finish() {
    this.task = null; this.report = null; this.state = 'idle';
    this.publish(this.topic('status'), statusMessage(this.o.id, 'idle', this.o.now()), true);
    if (this.connected) this.checkin(); else this.state = 'offline';
    this.emit('idle');
  }
}
