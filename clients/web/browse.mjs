#!/usr/bin/env node
// Opens the device page in headless Chromium (Debian's /usr/bin/chromium through playwright-core) and keeps it open
// until stdin closes, for the tests and the benchmark. Prints one JSON object per line: {"event": "browser",
// "version"}, {"event": "console", "text"}, {"event": "screenshot", "path", "state"} (taken once a report of the page
// was accepted and it shows ``--shot-when`` text, default any), {"event": "accepted", "count"} each time the page's count
// of accepted reports grows, and at the end {"event": "final", "state"}.
//   node clients/web/browse.mjs --url URL [--data FILE (picked in the page, then Join)] [--screenshot PNG [--shot-when TEXT]]
//     [--chromium /usr/bin/chromium]
import { chromium } from 'playwright-core';

const args = Object.fromEntries(process.argv.slice(2).reduce((a, v, i, all) => (i % 2 ? a : [...a, [v.replace(/^--/, ''), all[i + 1]]]), []));
const out = (o) => process.stdout.write(`${JSON.stringify(o)}\n`);
const browser = await chromium.launch({ executablePath: args.chromium || '/usr/bin/chromium', headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'] });
out({ event: 'browser', version: browser.version() });  // playwright gives it a new empty profile
const context = await browser.newContext({ viewport: { width: 420, height: 860 }, deviceScaleFactor: 1 });
const page = await context.newPage();
page.on('console', (m) => out({ event: 'console', text: m.text() }));
page.on('pageerror', (e) => out({ event: 'console', text: `page error: ${e.message}` }));
const t0 = Date.now();
await page.goto(args.url, { waitUntil: 'load' });
out({ event: 'loaded', seconds: (Date.now() - t0) / 1000 });
if (args.data) {  // as a person does: pick the file, then join
  await page.setInputFiles('#file', args.data);
  await page.waitForFunction(() => !document.getElementById('start').disabled, null, { timeout: 30000 });
  await page.click('#start');
}
const snapshot = () => page.evaluate(() => ({ state: document.getElementById('state').textContent, conn: document.getElementById('conn').textContent,
  round: document.getElementById('round').textContent, acc: document.getElementById('acc').textContent, accepted: window.fedge.accepted,
  caps: window.fedge.caps, firstCheckin: window.fedge.firstCheckin ?? null, counts: window.fedge.device ? window.fedge.device.counts : null,
  lastTrain: window.fedge.device ? window.fedge.device.lastTrain ?? null : null, stepMs: window.fedge.stepMs ?? null }));
let done = false;
process.stdin.on('end', () => { done = true; });
process.stdin.resume();
let shot = !args.screenshot;
let accepted = 0;
while (!done) {
  await new Promise((r) => setTimeout(r, 100));
  const s = await snapshot();
  if (s.accepted > accepted) {
    accepted = s.accepted;
    out({ event: 'accepted', count: accepted });
  }
  if (!shot) {
    if (s.accepted >= 1 && s.state.includes(args['shot-when'] || '')) {  // mid-run: after the first accepted report
      await page.screenshot({ path: args.screenshot, fullPage: true });
      out({ event: 'screenshot', path: args.screenshot, state: s });
      shot = true;
    }
  }
}
out({ event: 'final', state: await snapshot() });
await browser.close();
