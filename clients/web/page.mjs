// The device page's UI: reads the settings (form or URL: ?broker=&fleet=&id=&demo=1&start=1), the person's data file
// (read here; it never leaves the page), what the browser tells about the device (battery and charging, network
// type, memory), and runs the shared device core (src/device.mjs) over MQTT.js's browser build and ONNX Runtime
// Web's training build, showing what it does.
import mqtt from './vendor/mqtt.esm.js';
import * as ort from './vendor/ort.training.wasm.min.mjs';
import { Device } from './src/device.mjs';
import { loadData } from './src/data.mjs';

ort.env.wasm.wasmPaths = new URL('./vendor/', import.meta.url).href;
ort.env.wasm.numThreads = 1;  // threads need cross-origin isolation, which a simply hosted page does not have
ort.env.logLevel = 'error';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const state = { data: null, device: null, caps: { runtime: 'ort' }, accepted: 0, loadedAt: performance.now() };
window.fedge = state;  // for a person's console (and the tests): what the page knows

function log(line) {
  const el = $('log');
  el.textContent = `${new Date().toLocaleTimeString()} ${line}\n${el.textContent}`.split('\n').slice(0, 40).join('\n');
  console.log(line);
}

// ------------------------------------------------------------------ settings
const saved = JSON.parse(localStorage.getItem('fedge-device') || '{}');
const defaultBroker = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.hostname || '127.0.0.1'}:9001`;
$('broker').value = params.get('broker') || saved.broker || defaultBroker;
$('fleet').value = params.get('fleet') || saved.fleet || 'default';
$('id').value = params.get('id') || saved.id || `web-${Math.random().toString(36).slice(2, 8)}`;

// ------------------------------------------------------------------ capabilities: only what the browser says
let battery = null;
async function readCapabilities() {
  const c = { runtime: 'ort' };
  if (!battery && navigator.getBattery) { try { battery = await navigator.getBattery(); } catch { battery = null; } }
  if (battery) {
    c.charging = !!battery.charging;
    if (Number.isFinite(battery.level)) c.battery = Math.min(1, Math.max(0, battery.level));
  }
  const conn = navigator.connection;
  if (conn && typeof conn.type === 'string' && !['unknown', 'none', 'other'].includes(conn.type)) c.network = conn.type.slice(0, 32);
  if (conn && Number.isFinite(conn.downlink) && conn.downlink > 0) c.link_kbps = conn.downlink * 1000;
  if (Number.isFinite(navigator.deviceMemory)) c.memory_mb = Math.round(navigator.deviceMemory * 1024);
  state.caps = c;
  $('caps').textContent = Object.entries(c).map(([k, v]) => `${k} ${typeof v === 'number' && !Number.isInteger(v) ? v.toFixed(2) : v}`).join(', ');
  return c;
}
async function capabilitiesChanged() {
  const before = JSON.stringify([state.caps.charging, state.caps.network]);
  await readCapabilities();
  if (state.device && JSON.stringify([state.caps.charging, state.caps.network]) !== before) state.device.updateCapabilities();
}
readCapabilities().then(() => {
  if (battery) { battery.addEventListener('chargingchange', capabilitiesChanged); battery.addEventListener('levelchange', readCapabilities); }
  if (navigator.connection) navigator.connection.addEventListener('change', capabilitiesChanged);
});

// ------------------------------------------------------------------ data
async function useData(bytes, name) {
  try {
    state.data = await loadData(bytes, name);
    $('datainfo').textContent = `${name}: ${state.data.n} examples of ${state.data.features} features (kept in this page)`;
    $('start').disabled = false;
    return true;
  } catch (e) {
    state.data = null;
    $('datainfo').textContent = e.message;
    $('start').disabled = true;
    return false;
  }
}
$('file').addEventListener('change', async () => {
  const f = $('file').files[0];
  if (f) await useData(await f.arrayBuffer(), f.name);
});
async function demo() {
  const r = await fetch(new URL('demo.npz', location.href));
  if (!r.ok) { $('datainfo').textContent = `no demo shard here (${r.status})`; return false; }
  return useData(await r.arrayBuffer(), 'demo shard (60 digits)');
}
$('demo').addEventListener('click', demo);

// ------------------------------------------------------------------ the device
function show(text) { $('state').textContent = text; }
function onEvent(ev) {
  if (ev.type === 'connected') { $('conn').textContent = 'connected'; $('conn').className = 'pill on'; if (ev.state === 'idle') show('waiting for a round'); }
  else if (ev.type === 'disconnected') { $('conn').textContent = 'disconnected'; $('conn').className = 'pill off'; show('reconnecting'); }
  else if (ev.type === 'checkin') { if (ev.state === 'idle' && !state.firstCheckin) state.firstCheckin = (performance.now() - state.loadedAt) / 1000; }
  else if (ev.type === 'training') { $('round').textContent = ev.round; show(`training round ${ev.round}`); $('progress').value = 0; log(`round ${ev.round}: training (${ev.strategy})`); }
  else if (ev.type === 'evaluated' && ev.accuracy !== null) { $('acc').textContent = `${(100 * ev.accuracy).toFixed(1)} % (round ${ev.round})`; state.accuracy = ev.accuracy; }
  else if (ev.type === 'progress') { $('progress').max = ev.total; $('progress').value = ev.done; show(`training round ${ev.round}: step ${ev.done} of ${ev.total}`); }
  else if (ev.type === 'sent') {
    const t = state.device.lastTrain;  // the mean time per training step over the plans so far (shown in the console)
    state.steps = (state.steps || 0) + t.steps; state.stepTotal = (state.stepTotal || 0) + t.step_ms * t.steps;
    state.stepMs = state.stepTotal / Math.max(1, state.steps);
    show(`sent round ${ev.round}`); log(`round ${ev.round}: update sent (${ev.bytes} bytes)`); }
  else if (ev.type === 'ack') {
    if (ev.status === 'accepted' || ev.status === 'duplicate') state.accepted += 1;
    $('accepted').textContent = state.accepted;
    show(ev.status === 'accepted' ? `accepted round ${ev.round}` : `round ${ev.round}: ${ev.status}`);
    log(`round ${ev.round}: ${ev.status}${ev.reason ? ` (${ev.reason})` : ''}`);
    state.lastAck = ev;
  } else if (ev.type === 'failed') { show(`round ${ev.round}: could not train`); log(`round ${ev.round}: ${ev.reason}`); }
}

function setEditable(on) {
  for (const k of ['broker', 'fleet', 'id', 'file', 'demo']) $(k).disabled = !on;
  $('stop').hidden = on; $('start').hidden = !on;
}

async function start() {
  const broker = $('broker').value.trim(), fleet = $('fleet').value.trim(), id = $('id').value.trim();
  if (!/^wss?:\/\//.test(broker)) { log('the broker must be a ws:// or wss:// URL'); return; }
  if (!state.data) { log('pick your data first (or the demo shard)'); return; }
  localStorage.setItem('fedge-device', JSON.stringify({ broker, fleet, id }));
  await readCapabilities();
  const url = new URL(broker);
  const username = url.username ? decodeURIComponent(url.username) : undefined, password = url.password ? decodeURIComponent(url.password) : undefined;
  url.username = ''; url.password = '';
  try {
    state.device = new Device({ id, fleet, broker: url.href, username, password, data: state.data, ort, log, onEvent,
      evaluate: true, caps: () => state.caps, connect: (u, o) => mqtt.connect(u, o) });
  } catch (e) { log(e.message); return; }
  setEditable(false);
  show('connecting');
  state.device.start();
}
$('start').addEventListener('click', start);
$('stop').addEventListener('click', async () => {
  if (state.device) await state.device.stop();
  state.device = null; setEditable(true);
  $('conn').textContent = 'disconnected'; $('conn').className = 'pill off'; show('stopped');
});

if (params.get('demo') === '1') await demo();
if (params.get('start') === '1' && state.data) await start();
