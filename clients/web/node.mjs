#!/usr/bin/env node
// The web device's core (src/device.mjs) in Node: the same code the page runs, headless, for tests and for a
// machine without Python. MQTT over WebSockets (ws://, wss://) or TCP (mqtt://, mqtts://) with MQTT.js; training on
// ONNX Runtime Web's training build (WebAssembly) as in the browser.
//
//   node clients/web/node.mjs --broker ws://127.0.0.1:9001 --fleet default --id web-1 --data data.npz
//
// Options: --fleet F (default), --ack-timeout S (5), --heartbeat S (15), --grace S (30), --max-pace S (3600),
// --keepalive S (30), --ca-file PEM (wss:// or mqtts:// with a private CA), --threads N (1),
// --caps JSON (capabilities added to the check-in, e.g. '{"charging": true, "network": "wifi"}'; default: charging
// and ethernet, as for a machine on mains power and a wire). The broker URL may carry user:password@ (fedge credentials).
// --check-vectors DIR: decode every plan, ack and pace vector of firmware_tests/protocol and exit.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Device } from './src/device.mjs';
import { loadData } from './src/data.mjs';
import { loadOrt } from './ort-node.mjs';

function fail(line) { console.error(`fedge-web-device: ${line}`); process.exit(2); }

async function main(argv) {
  if (argv[0] === '--check-vectors') { const { checkVectors } = await import('./tools.mjs'); process.exit(await checkVectors(argv[1])); }
  const o = { broker: 'ws://127.0.0.1:9001', fleet: 'default', threads: 1 };
  const names = { '--broker': 'broker', '--fleet': 'fleet', '--id': 'id', '--data': 'data', '--ack-timeout': 'ackTimeout',
    '--heartbeat': 'heartbeat', '--grace': 'grace', '--max-pace': 'maxPace', '--keepalive': 'keepalive',
    '--ca-file': 'caFile', '--threads': 'threads', '--caps': 'caps' };
  const text = new Set(['broker', 'fleet', 'id', 'data', 'caFile', 'caps']);
  for (let i = 0; i < argv.length; i += 2) {
    const k = names[argv[i]];
    if (!k) fail(`unknown option ${argv[i]} (see the head of clients/web/node.mjs)`);
    if (i + 1 >= argv.length) fail(`${argv[i]} needs a value`);
    o[k] = text.has(k) ? argv[i + 1] : Number(argv[i + 1]);
    if (!text.has(k) && !(o[k] >= 0)) fail(`${argv[i]} ${argv[i + 1]}: not a number >= 0`);
  }
  if (!o.id || !o.data) fail('--id and --data are required');
  let url;
  try { url = new URL(o.broker); } catch { fail(`--broker ${o.broker}: not a URL (ws://host:port, wss://, mqtt://, mqtts://)`); }
  if (!['ws:', 'wss:', 'mqtt:', 'mqtts:'].includes(url.protocol)) fail(`--broker ${o.broker}: ws://, wss://, mqtt:// or mqtts://`);
  let data, extra = {}, ca;
  try { data = await loadData(fs.readFileSync(o.data), o.data); } catch (e) { fail(`--data ${o.data}: ${e.message}`); }
  if (o.caps) { try { extra = JSON.parse(o.caps); } catch (e) { fail(`--caps: not JSON (${e.message})`); } }
  if (o.caFile) { try { ca = fs.readFileSync(o.caFile); } catch (e) { fail(`--ca-file ${o.caFile}: ${e.message}`); } }
  const { default: mqtt } = await import('mqtt');
  const ort = await loadOrt(o.threads || 1);
  const username = url.username ? decodeURIComponent(url.username) : undefined;
  const password = url.password ? decodeURIComponent(url.password) : undefined;
  url.username = ''; url.password = '';
  const log = (line) => console.error(`${new Date().toISOString()} ${o.id} ${line}`);
  let dev;
  try {
    dev = new Device({ id: o.id, fleet: o.fleet, broker: url.href, username, password, data, ort, log,
      connect: (u, opts) => mqtt.connect(u, { ...opts, ca, rejectUnauthorized: true }),
      caps: () => ({ charging: true, network: 'ethernet', memory_mb: Math.floor(os.totalmem() / 2 ** 20), ...extra }),
      ...Object.fromEntries(['ackTimeout', 'heartbeat', 'grace', 'maxPace', 'keepalive'].filter((k) => k in o).map((k) => [k, o[k]])),
      onEvent: (ev) => {
        if (ev.type === 'sent') log(`round ${ev.round}: report sent (${ev.bytes} bytes)`);
        else if (ev.type === 'ack') log(`round ${ev.round}: ${ev.status}${ev.reason ? ` (${ev.reason})` : ''}`);
        else if (ev.type === 'connected') log(`connected to ${url.host}`);
      } });
  } catch (e) { fail(e.message); }
  dev.start();
  const stop = async () => { await dev.stop(); process.exit(0); };
  process.on('SIGINT', stop); process.on('SIGTERM', stop);
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) main(process.argv.slice(2));
