// The official openai npm client (the version package-lock.json pins) against the gateway; run by
// tests/e2e/test_node_client.py, which checks what this prints.
//
//   node images.mjs BASE_URL generate MODEL SIZE N
//   node images.mjs BASE_URL edit N FILE [FILE ...]    one file: `image`; several: an array (see below)
//   node images.mjs BASE_URL stream-edit FILE
//
// Prints one JSON object on stdout: the answer's `size` and `images` (base64 PNGs), or `events` for a stream. An API
// error prints {"error": {name, badRequest, status, message}} and exits 1, so the caller sees the client's own error.
import fs from "node:fs";
import path from "node:path";

import OpenAI, { toFile } from "openai";

const [baseURL, action, ...rest] = process.argv.slice(2);
// The gateway is open; the client insists on a key. No retries: a failure shows at once.
const client = new OpenAI({ baseURL, apiKey: "sk-anything", maxRetries: 0, timeout: 300_000 });
// ardit's knobs go as extra properties of the body: JSON for generate, form fields for edit.
const knobs = { seed: 4, num_inference_steps: 2 };

const upload = (file) => toFile(fs.createReadStream(file), path.basename(file), { type: "image/png" });
const images = (answer) => ({ size: answer.size, images: answer.data.map((item) => item.b64_json) });

async function main() {
  if (action === "generate") {
    const [model, size, n] = rest;
    return images(await client.images.generate({
      model, prompt: "a red circle", size, n: Number(n), response_format: "b64_json", ...knobs,
    }));
  }
  if (action === "edit") {
    // toFile reads each stream to a File first. An array is sent as one `image[]` part per entry (6.49's
    // internal/uploads.js addFormValue appends key + "[]" for each element), File parts appended synchronously,
    // so in the array's order: the order the gateway reads as "last image sets the size".
    const [n, ...paths] = rest;
    const files = await Promise.all(paths.map(upload));
    return images(await client.images.edit({
      image: files.length === 1 ? files[0] : files, prompt: "make it blue", n: Number(n),
      response_format: "b64_json", ...knobs,
    }));
  }
  if (action === "stream-edit") {
    const stream = await client.images.edit({
      image: await upload(rest[0]), prompt: "add a moon", stream: true, partial_images: 1, ...knobs,
    });
    const events = [];
    for await (const event of stream) {
      events.push({ type: event.type, size: event.size, b64_json: event.b64_json });
    }
    return { events };
  }
  throw new Error(`unknown action ${JSON.stringify(action)}: generate, edit or stream-edit`);
}

try {
  console.log(JSON.stringify(await main()));
} catch (error) {
  if (!(error instanceof OpenAI.APIError)) throw error;
  console.log(JSON.stringify({ error: {
    name: error.constructor.name, badRequest: error instanceof OpenAI.BadRequestError, status: error.status,
    message: error.message,
  } }));
  process.exitCode = 1;
}
