// kvgen dashboard: reads /dashboard/events (server-sent events over fetch, so that the API key goes in
// an Authorization header, never in the URL) and draws the block pool, the steps and the sequences.
"use strict";

const MAX_CELLS = 8192;          // more blocks than this are drawn in bins
const STATES = { f: "free", c: "cached", u: "used", s: "shared", r: "released" };
const CSS = getComputedStyle(document.documentElement);
const COLOUR = { f: CSS.getPropertyValue("--free"), c: CSS.getPropertyValue("--cached"),
                 s: CSS.getPropertyValue("--shared"), r: CSS.getPropertyValue("--released") };
const COLOUR_PREFILL = CSS.getPropertyValue("--prefill");
const COLOUR_DECODE = CSS.getPropertyValue("--decode");
const COLOUR_BATCH = CSS.getPropertyValue("--batch");
const $ = (id) => document.getElementById(id);

let paused = false;
let latest = null;   // the last state received, drawn or not
let shown = null;    // the state on screen
let layout = null;   // how the pool grid maps cells to blocks

// -- the connection ------------------------------------------------------------------------------

function apiKey() { return sessionStorage.getItem("kvgen-api-key"); }

function headers() {
  const key = apiKey();
  return key ? { Authorization: "Bearer " + key } : {};
}

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + (kind || "");
}

function askForKey() {
  $("key-form").hidden = false;
  setStatus("needs the API key", "error");
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("kvgen-api-key", $("key").value.trim());
  $("key-form").hidden = true;
  connect();
});

// With data-parallel replicas the page shows one: /dashboard?replica=i (default 0).
function replicaQuery() {
  const replica = new URLSearchParams(location.search).get("replica");
  return replica === null ? "" : "?replica=" + encodeURIComponent(replica);
}

async function connect() {
  let response;
  try {
    response = await fetch("/dashboard/events" + replicaQuery(), { headers: headers(), cache: "no-store" });
  } catch (error) {
    return retry("server unreachable");
  }
  if (response.status === 401) return askForKey();
  if (!response.ok) return retry("HTTP " + response.status);
  setStatus("live", "live");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        onEvent(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
  } catch (error) { /* dropped: reconnect below */ }
  retry("reconnecting…");
}

function retry(why) {
  setStatus(why, "error");
  setTimeout(connect, 1000);
}

function onEvent(block) {
  const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
  if (!data) return;  // a keep-alive comment
  latest = decode(JSON.parse(data));
  if (!paused) show(latest);
}

// The compact pool (kvgen/server/dashboard/state.py): owners as indices into the sequences (all ones
// for none), reference counts as bytes.
function decode(state) {
  const pool = state.pool, ids = state.sequences.map((s) => s.seq_id);
  const raw = bytesOf(pool.owner);
  const indices = pool.owner_bytes === 4 ? new Uint32Array(raw.buffer) : new Uint16Array(raw.buffer);
  const none = pool.owner_bytes === 4 ? 0xFFFFFFFF : 0xFFFF;
  const owner = new Int32Array(indices.length);
  for (let b = 0; b < indices.length; b++) owner[b] = indices[b] === none ? -1 : ids[indices[b]];
  pool.owner = owner;
  pool.ref_count = bytesOf(pool.ref_count);
  return state;
}

function bytesOf(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return bytes;
}

$("pause").addEventListener("click", () => {
  paused = !paused;
  $("pause").textContent = paused ? "resume" : "pause";
  $("pause").classList.toggle("on", paused);
  if (!paused && latest) show(latest);
});

// -- drawing ---------------------------------------------------------------------------------------

function show(state) {
  const started = performance.now();
  shown = state;
  $("snapshot-id").textContent = state.snapshot;
  $("snapshot-step").textContent = state.step;
  const counts = state.pool.counts;
  $("free-blocks").textContent = counts.free;
  $("cached-blocks").textContent = counts.cached;
  $("used-blocks").textContent = counts.used + counts.shared;
  $("shared-blocks").textContent = counts.shared;
  $("released-blocks").textContent = counts.released;
  drawPool(state.pool);
  drawSteps(state.steps);
  showSequences(state.sequences);
  showMetrics(state.metrics);
  showTiers(state.tiers || []);
  drawExperts(state.experts || []);
  document.body.dataset.renderMs = (performance.now() - started).toFixed(1);
}

// Sequences get hues in 40..330 (no red: that is "released"; white is "shared"), spread by the golden
// ratio so that neighbouring ids look different.
function ownerColour(owner) {
  return `hsl(${40 + ((owner * 0.6180339887) % 1) * 290} 62% 52%)`;
}

function cellColour(letter, owner) {
  return letter === "u" ? ownerColour(owner) : COLOUR[letter];
}

function fitCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(cssHeight * ratio);
  canvas.style.height = cssHeight + "px";
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { ctx, width };
}

function poolLayout(numBlocks, width) {
  const bin = Math.max(1, Math.ceil(numBlocks / MAX_CELLS));
  const cells = Math.ceil(numBlocks / bin);
  // The largest square cell (2..18 px) that fits every cell in at most 600 px of height.
  let size = 18;
  while (size > 2 && Math.ceil(cells / Math.floor(width / size)) * size > 600) size--;
  const cols = Math.max(1, Math.floor(width / size));
  return { bin, cells, size, cols, rows: Math.ceil(cells / cols) };
}

// A bin's colour is its most common state (ties go to the rarer kind: shared, used, released, cached).
const RANK = ["s", "u", "r", "c", "f"];

function binOf(pool, cell, bin) {
  const start = cell * bin, end = Math.min(start + bin, pool.num_blocks);
  const tally = { f: 0, c: 0, u: 0, s: 0, r: 0 };
  let owner = -1;
  for (let b = start; b < end; b++) {
    const letter = pool.codes[b];
    tally[letter]++;
    if (owner < 0 && letter === "u") owner = pool.owner[b];
  }
  let best = "f";
  for (const letter of RANK) if (tally[letter] > tally[best]) best = letter;
  return { letter: best, owner, tally, start, end };
}

function drawPool(pool) {
  const canvas = $("pool");
  layout = poolLayout(pool.num_blocks, canvas.clientWidth);
  const { ctx } = fitCanvas(canvas, layout.rows * layout.size);
  const gap = layout.size >= 6 ? 1 : 0;
  for (let cell = 0; cell < layout.cells; cell++) {
    let letter, owner;
    if (layout.bin === 1) {
      letter = pool.codes[cell];
      owner = pool.owner[cell];
    } else {
      ({ letter, owner } = binOf(pool, cell, layout.bin));
    }
    const x = (cell % layout.cols) * layout.size, y = Math.floor(cell / layout.cols) * layout.size;
    const side = layout.size - gap;
    if (letter === "c" && side >= 5) {  // a cached prefix: a hollow cell, unlike any sequence's solid one
      ctx.fillStyle = COLOUR.f;
      ctx.fillRect(x, y, side, side);
      ctx.strokeStyle = COLOUR.c;
      ctx.lineWidth = 1.5;
      ctx.strokeRect(x + 1.25, y + 1.25, side - 2.5, side - 2.5);
      continue;
    }
    ctx.fillStyle = cellColour(letter, owner);
    ctx.fillRect(x, y, side, side);
  }
  drawKindBorders(ctx, pool.kinds || [], gap);
  $("bin-size").textContent = layout.bin;
  $("pool-shape").textContent = `${pool.num_blocks} blocks × ${pool.block_size} tokens` + kindsText(pool.kinds || []);
}

// A hybrid cache's pools (one per kind of layer) are drawn one after the other: each after the first
// starts at a white bar on the left of its first cell.
function drawKindBorders(ctx, kinds, gap) {
  let first = 0;
  for (const kind of kinds.slice(0, -1)) {
    first += kind.num_blocks;
    const cell = Math.floor(first / layout.bin);
    const x = (cell % layout.cols) * layout.size, y = Math.floor(cell / layout.cols) * layout.size;
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(Math.max(x - gap - 1, 0), y, 2, layout.size);
  }
}

function kindsText(kinds) {
  let first = 0;
  const parts = kinds.map((kind) => {
    const text = `${kind.label}: blocks ${first}–${first + kind.num_blocks - 1}`;
    first += kind.num_blocks;
    return text;
  });
  return parts.length ? ` (hybrid cache — ${parts.join("; ")})` : "";
}

$("pool").addEventListener("mousemove", (event) => {
  const tip = $("tip");
  if (!shown || !layout) return;
  const rect = event.target.getBoundingClientRect();
  const col = Math.floor((event.clientX - rect.left) / layout.size);
  const row = Math.floor((event.clientY - rect.top) / layout.size);
  const cell = row * layout.cols + col;
  if (col >= layout.cols || cell >= layout.cells) { tip.hidden = true; return; }
  tip.textContent = describeCell(shown.pool, cell);
  tip.style.left = (event.target.offsetLeft + event.clientX - rect.left + 14) + "px";
  tip.style.top = (event.target.offsetTop + event.clientY - rect.top + 14) + "px";
  tip.hidden = false;
});
$("pool").addEventListener("mouseleave", () => { $("tip").hidden = true; });

function describeCell(pool, cell) {
  if (layout.bin === 1) {
    const letter = pool.codes[cell], owner = pool.owner[cell];
    let text = `block ${cell}: ${STATES[letter]}`;
    if (owner >= 0) text += `\nsequence ${owner}`;
    if (pool.ref_count[cell] > 0) text += `\nref_count ${refCount(pool.ref_count[cell])}`;
    return text;
  }
  const { tally, start, end } = binOf(pool, cell, layout.bin);
  const parts = RANK.filter((l) => tally[l]).map((l) => `${STATES[l]} ${tally[l]}`);
  let maxRef = 0;
  for (let b = start; b < end; b++) maxRef = Math.max(maxRef, pool.ref_count[b]);
  return `blocks ${start}–${end - 1}\n${parts.join("\n")}` + (maxRef > 1 ? `\nmax ref_count ${refCount(maxRef)}` : "");
}

function refCount(count) {
  return count === 255 ? "255 or more" : `${count}`;  // the compact pool's counts are bytes
}

function drawSteps(steps) {
  const canvas = $("steps");
  const { ctx, width } = fitCanvas(canvas, 140);
  const height = 140, last = steps.slice(-Math.floor(width / 3));
  const maxTokens = Math.max(1, ...last.map((s) => s.prefill_tokens + s.decode_tokens));
  const maxBatch = Math.max(1, ...last.map((s) => s.batch_size));
  const bar = width / Math.max(last.length, 1);
  last.forEach((s, i) => {
    const decode = (s.decode_tokens / maxTokens) * (height - 4);
    const prefill = (s.prefill_tokens / maxTokens) * (height - 4);
    ctx.fillStyle = COLOUR_DECODE;
    ctx.fillRect(i * bar, height - decode, Math.max(bar - 1, 1), decode);
    ctx.fillStyle = COLOUR_PREFILL;
    ctx.fillRect(i * bar, height - decode - prefill, Math.max(bar - 1, 1), prefill);
  });
  ctx.strokeStyle = COLOUR_BATCH;
  ctx.beginPath();
  last.forEach((s, i) => {
    const y = height - 2 - (s.batch_size / maxBatch) * (height - 6);
    if (i === 0) ctx.moveTo(i * bar, y); else ctx.lineTo(i * bar + bar / 2, y);
  });
  ctx.stroke();
  const tail = last.slice(-50);
  const ms = tail.length ? tail.reduce((a, s) => a + s.ms, 0) / tail.length : 0;
  $("steps-summary").textContent = last.length
    ? `last ${last.length} steps · up to ${maxTokens} tokens and ${maxBatch} sequences a step · ` +
      `${ms.toFixed(1)} ms a step (mean of the last ${tail.length})`
    : "no step yet";
}
// A heat map of expert load: a row per MoE layer, a cell per expert, its shade the expert's share of
// the layer's tokens against an even spread (white: idle, full colour: twice the mean or more).
function drawExperts(experts) {
  $("experts-panel").hidden = experts.length === 0;
  if (!experts.length) return;
  const rows = experts.length, cols = experts[0].tokens.length;
  const cell = Math.max(2, Math.min(14, Math.floor(600 / cols)));
  const { ctx } = fitCanvas($("experts"), rows * cell);
  for (const [r, layer] of experts.entries()) {
    const total = layer.tokens.reduce((a, n) => a + n, 0);
    const mean = total / cols || 1;
    layer.tokens.forEach((n, c) => {
      const load = Math.min(n / mean / 2, 1);
      ctx.fillStyle = `hsl(20 85% ${Math.round(97 - 55 * load)}%)`;
      ctx.fillRect(c * cell, r * cell, cell - 1, cell - 1);
    });
  }
  $("experts-shape").textContent = `${rows} layers × ${cols} experts`;
}

function showSequences(sequences) {
  const rows = sequences.map((s) => {
    const phase = s.phase === "decode" ? "decode"
      : `prefill ${Math.min(s.computed_tokens, s.prompt_tokens)}/${s.prompt_tokens}`;
    return `<tr class="${s.status}"><td><i class="sw" style="background:${ownerColour(s.seq_id)}"></i></td>` +
      `<td class="num">${s.seq_id}</td><td>${escapeHtml(s.request_id)}</td><td>${s.status}</td><td>${phase}</td>` +
      `<td class="num">${s.prompt_tokens}</td><td class="num">${s.output_tokens}</td>` +
      `<td class="num">${s.num_blocks}</td><td>${s.kv_policy}</td><td class="num">${s.preemptions}</td></tr>`;
  });
  $("sequences").innerHTML = rows.join("");
  const running = sequences.filter((s) => s.status === "running").length;
  $("seq-counts").textContent = `${running} running, ${sequences.length - running} waiting`;
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

const ms = (v) => (v * 1000).toFixed(1) + " ms";
const METRICS = [
  ["Requests", null],
  ["running", "kvgen_num_requests_running"],
  ["waiting", "kvgen_num_requests_waiting"],
  ["tokens generated", "kvgen_generation_tokens_total"],
  ["KV cache", null],
  ["blocks used", "kvgen_kv_cache_blocks_used"],
  ["blocks in the pool", "kvgen_kv_cache_blocks_total"],
  ["usage", "kvgen_kv_cache_usage_ratio", (v) => (v * 100).toFixed(1) + " %"],
  ["prefix-cache hit rate", "kvgen_prefix_cache_hit_rate", (v) => (v * 100).toFixed(1) + " %"],
  ["preemptions", "kvgen_num_preemptions_total"],
  ["Recurrent state", null, null, "kvgen_state_slots_total"],
  ["slots used", "kvgen_state_slots_used"],
  ["slots in the pool", "kvgen_state_slots_total"],
  ["state held", "kvgen_state_bytes_used", (v) => (v / 1e6).toFixed(1) + " MB"],
  ["state pool", "kvgen_state_bytes_total", (v) => (v / 1e6).toFixed(1) + " MB"],
  ["prefix snapshots", "kvgen_state_snapshots"],
  ["Time to first token", null],
  ["p50", "kvgen_time_to_first_token_seconds_p50", ms],
  ["p90", "kvgen_time_to_first_token_seconds_p90", ms],
  ["p99", "kvgen_time_to_first_token_seconds_p99", ms],
  ["Inter-token latency", null],
  ["p50", "kvgen_inter_token_latency_seconds_p50", ms],
  ["p90", "kvgen_inter_token_latency_seconds_p90", ms],
  ["p99", "kvgen_inter_token_latency_seconds_p99", ms],
];

function showMetrics(metrics) {
  $("metrics").innerHTML = METRICS.map(([label, name, format, needs]) => {
    if (name === null) return needs && metrics[needs] === undefined ? "" : `<dt class="group">${label}</dt>`;
    if (name.startsWith("kvgen_state_") && metrics[name] === undefined) return "";  // no recurrent layers
    const value = metrics[name];
    const histogram = name.replace(/_p\d+$/, "");
    if (histogram !== name && !metrics[histogram + "_count"]) return `<dt>${label}</dt><dd>–</dd>`;
    const text = value === undefined ? "–" : format ? format(value) : String(Math.round(value));
    return `<dt>${label}</dt><dd>${text}</dd>`;
  }).join("");
}

// The KV tiers below the pool: per tier a bar of its budget filled, and what it holds and served.
const TIER_NAMES = { host: "host tier (RAM)", disk: "disk tier" };

function size(bytes) {
  const [unit, scale] = bytes >= 2 ** 30 ? ["GiB", 2 ** 30] : bytes >= 2 ** 20 ? ["MiB", 2 ** 20] : ["KiB", 2 ** 10];
  return (bytes / scale).toFixed(1) + " " + unit;
}

function showTiers(tiers) {
  $("tiers").hidden = tiers.length === 0;
  $("tier-rows").innerHTML = tiers.map((t) => {
    const fill = t.capacity ? Math.min(100, (100 * t.bytes) / t.capacity) : 0;
    const state = t.enabled ? "" : ` <b class="off">off</b>`;
    return `<div class="tier" id="tier-${t.tier}"><span class="name">${TIER_NAMES[t.tier] || t.tier}${state}</span>` +
      `<span class="bar"><i style="width:${fill.toFixed(1)}%"></i></span>` +
      `<span><b class="blocks">${t.blocks}</b> blocks · ${size(t.bytes)} of ${size(t.capacity)}</span>` +
      `<span>hits <b class="hits">${t.hits}</b> · stored <b class="stored">${t.stored}</b> · ` +
      `${size(t.bytes_out)} out · ${(t.seconds * 1000).toFixed(0)} ms</span></div>`;
  }).join("");
}

window.addEventListener("resize", () => { if (shown) show(shown); });
connect();
