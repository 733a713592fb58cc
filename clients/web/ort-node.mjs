// onnxruntime-web's training build in Node (the page loads the same files from the server).
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const HERE = path.dirname(fileURLToPath(import.meta.url));

/** onnxruntime-web's training build, by path (its package export "./training" is browser-only), single-threaded. */
export async function loadOrt(threads = 1) {
  const file = path.join(HERE, 'node_modules', 'onnxruntime-web', 'dist', 'ort.training.wasm.mjs');
  if (!fs.existsSync(file)) throw new Error(`${file} is missing: run npm ci --prefix clients/web`);
  const ort = await import(pathToFileURL(file).href);
  ort.env.wasm.numThreads = threads;
  ort.env.logLevel = 'error';
  return ort;
}

