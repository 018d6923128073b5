// pagedllm KV-cache dashboard: plain JavaScript, no dependencies.
// Reads /debug/kv/stream (server-sent events over fetch, so that an API key can be sent as a
// header) and /debug/kv/history; draws the block map, the selected request's block table
// (logical -> physical, the PagedAttention paper's figure 6), the queues and line charts.
"use strict";

const MAX_CELLS = 8192;          // above this many blocks the server aggregates them into cells
const INTERVAL = 0.25;           // seconds between snapshots
const CHART_WINDOW = 300;        // seconds shown in the charts
const TABLE_ROWS_MAX = 48;       // block-table rows drawn before eliding the middle
const STATE = { FREE: 0, USED: 1, USED_CACHED: 2, EVICTABLE: 3 };

const $ = (id) => document.getElementById(id);
const kv = (window.kvdash = {
  snapshot: null, history: [], selected: null, selectedSeq: 0, drawnUsed: 0, drawnCells: 0,
  numSnapshots: 0, tableFetched: null, layout: null,
});

// ---- API key ------------------------------------------------------------------------------
function apiKey() { return sessionStorage.getItem("pagedllm-api-key") || ""; }
function headers() { const k = apiKey(); return k ? { Authorization: "Bearer " + k } : {}; }
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("pagedllm-api-key", $("key-input").value.trim());
  $("key-form").hidden = true;
  start();
});
function needKey() { $("key-form").hidden = false; setStatus("API key required", true); }
function setStatus(text, err) { const s = $("status"); s.textContent = text; s.classList.toggle("err", !!err); }

// ---- colors ---------------------------------------------------------------------------------
function hue(arrival) { return (arrival * 137.508 + 210) % 360; }
function reqColor(req, light) {
  if (!req) return light ? "#dde3ec" : "#98a2b3";
  return `hsl(${hue(req.arrival_index).toFixed(1)} 65% ${light ? 86 : 46}%)`;
}

// ---- stream -----------------------------------------------------------------------------------
let streamAbort = null;
async function stream() {
  if (streamAbort) streamAbort.abort();
  const ctl = (streamAbort = new AbortController());
  try {
    const r = await fetch(`/debug/kv/stream?interval=${INTERVAL}&max_cells=${MAX_CELLS}`,
      { headers: headers(), signal: ctl.signal });
    if (r.status === 401) { needKey(); return; }
    if (!r.ok) throw new Error("HTTP " + r.status);
    setStatus("live");
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, i);
        buf = buf.slice(i + 2);
        onEvent(ev);
      }
    }
    setStatus("disconnected, retrying...", true);
  } catch (e) {
    if (ctl.signal.aborted) return;
    setStatus("disconnected (" + e.message + "), retrying...", true);
  }
  setTimeout(stream, 1500);
}

function onEvent(text) {
  let type = "message", data = "";
  for (const line of text.split("\n")) {
    if (line.startsWith("event: ")) type = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (type === "error") { setStatus("engine: " + JSON.parse(data).error, true); return; }
  if (type !== "snapshot") return;
  const snap = JSON.parse(data);
  kv.snapshot = snap;
  kv.numSnapshots += 1;
  const h = snap.history_last;
  if (h && (!kv.history.length || h.time > kv.history[kv.history.length - 1].time)) {
    kv.history.push(h);
    if (kv.history.length > 1200) kv.history.shift();
    drawCharts();
  }
  render();
}

async function loadHistory() {
  try {
    const r = await fetch("/debug/kv/history", { headers: headers() });
    if (r.status === 401) { needKey(); return false; }
    const j = await r.json();
    const known = new Set(kv.history.map((s) => s.time));
    kv.history = j.samples.filter((s) => !known.has(s.time)).concat(kv.history)
      .sort((a, b) => a.time - b.time);
    drawCharts();
  } catch (e) { /* the stream reports connection problems */ }
  return true;
}

// ---- render ---------------------------------------------------------------------------------
function render() {
  const s = kv.snapshot;
  const c = s.counters;
  $("c-used").textContent = c.blocks_used;
  $("c-free").textContent = c.blocks_free;
  $("c-total").textContent = c.blocks_total;
  $("c-cached").textContent = c.blocks_cached;
  $("c-evictable").textContent = c.blocks_evictable;
  $("c-shared").textContent = c.blocks_shared;
  $("c-useful").textContent = (100 * c.useful_token_fraction).toFixed(1) + "%";
  $("c-hit").textContent = (100 * c.prefix_cache_hit_rate).toFixed(1) + "%";
  $("c-preempt").textContent = `${c.preemptions} (${c.preemptions_swap} swap)`;
  $("c-swap").textContent = `${c.swap_blocks_used} / ${c.swap_blocks_total}`;
  setStatus(`live - step ${c.num_steps}, ${c.num_running} running, ${c.num_waiting} waiting, ` +
    `${c.num_swapped} swapped - block size ${s.config.block_size}`);
  if (kv.selected && !s.requests.some((r) => r.request_id === kv.selected)) {
    kv.selected = null;
  }
  drawGrid();
  drawQueues();
  drawTable();
}

function selectedReq() {
  const s = kv.snapshot;
  return s && kv.selected ? s.requests.find((r) => r.request_id === kv.selected) : null;
}

// Block map: one square per physical block, or per cell of `group` blocks for big pools.
function drawGrid() {
  const s = kv.snapshot, b = s.blocks, canvas = $("grid");
  const dpr = window.devicePixelRatio || 1;
  const W = Math.max(200, canvas.clientWidth || 760);
  const perBlock = b.mode === "blocks";
  const n = perBlock ? b.num_blocks : b.cells.num_cells;
  // Square cells filling about W x 420 px.
  let size = Math.floor(Math.sqrt((W * 420) / Math.max(1, n)));
  size = Math.max(2, Math.min(40, size));
  const cols = Math.max(1, Math.floor(W / size));
  const rows = Math.ceil(n / cols);
  const H = Math.max(size, rows * size);
  if (canvas.width !== Math.round(W * dpr) || canvas.height !== Math.round(H * dpr)) {
    canvas.width = Math.round(W * dpr);
    canvas.height = Math.round(H * dpr);
    canvas.style.height = H + "px";
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, W, H);
  kv.layout = { size, cols, n, perBlock, group: perBlock ? 1 : b.cells.group };
  const reqs = s.requests;
  const sel = selectedReq();
  const selBlocks = new Set();
  if (sel) for (const q of sel.seqs) if (q.pool === "device" && q.block_table) q.block_table.forEach((x) => selBlocks.add(x));
  const bs = b.block_size;
  const gap = size >= 6 ? 1 : 0;
  let drawnUsed = 0;
  for (let i = 0; i < n; i++) {
    const x = (i % cols) * size, y = Math.floor(i / cols) * size, w = size - gap;
    let used, frac, shared, cached, evictable, owner, ref = 0;
    if (perBlock) {
      ref = b.ref_count[i];
      used = ref > 0;
      const st = b.state[i];
      cached = st === STATE.USED_CACHED || st === STATE.EVICTABLE;
      evictable = st === STATE.EVICTABLE;
      shared = ref > 1;
      frac = b.filled[i] / bs;
      owner = reqs[b.owner_request[i]];
    } else {
      const c = b.cells;
      used = c.used[i] > 0;
      cached = c.cached[i] > 0;
      evictable = !used && c.evictable[i] > 0;
      shared = c.shared[i] > 0;
      frac = c.filled[i] / (c.size[i] * bs);
      owner = reqs[c.owner_request[i]];
    }
    if (used) {
      drawnUsed += perBlock ? 1 : b.cells.used[i];
      ctx.fillStyle = reqColor(owner, true);
      ctx.fillRect(x, y, w, w);
      ctx.fillStyle = reqColor(owner, false);
      const fh = Math.max(frac > 0 ? 1 : 0, Math.round(w * Math.min(1, frac)));
      ctx.fillRect(x, y + w - fh, w, fh);
      if (!perBlock) { // share of the cell's blocks in use: fade
        ctx.fillStyle = `rgba(255,255,255,${(1 - b.cells.used[i] / b.cells.size[i]) * 0.6})`;
        ctx.fillRect(x, y, w, w);
      }
    } else {
      ctx.fillStyle = evictable ? "#c9ced8" : "#e9ecf1";
      ctx.fillRect(x, y, w, w);
    }
    if (cached && size >= 4) {
      ctx.fillStyle = "#facc15";
      ctx.fillRect(x, y, w, Math.max(1, Math.round(w / 5)));
    }
    if (shared) {
      if (size >= 8) {
        ctx.strokeStyle = "#fff"; ctx.lineWidth = 2;
        ctx.strokeRect(x + 2, y + 2, w - 4, w - 4);
        if (perBlock && size >= 16) {
          ctx.fillStyle = "#111"; ctx.font = `${Math.floor(size * 0.45)}px sans-serif`;
          ctx.textAlign = "center"; ctx.textBaseline = "middle";
          ctx.fillText(String(ref), x + w / 2, y + w / 2);
        }
      } else {
        ctx.fillStyle = "#111";
        ctx.fillRect(x + w / 2 - 0.5, y + w / 2 - 0.5, Math.max(1, w / 3), Math.max(1, w / 3));
      }
    }
    if (perBlock && selBlocks.has(i)) {
      ctx.strokeStyle = "#111"; ctx.lineWidth = size >= 8 ? 2 : 1;
      ctx.strokeRect(x + 0.5, y + 0.5, w - 1, w - 1);
    }
  }
  kv.drawnUsed = drawnUsed;
  kv.drawnCells = n;
  canvas.dataset.usedDrawn = String(drawnUsed);
  canvas.dataset.step = String(s.counters.num_steps);
  $("grid-note").textContent = perBlock
    ? `${b.num_blocks} blocks x ${bs} tokens, one square per block`
    : `${b.num_blocks} blocks x ${bs} tokens, one square per ${b.cells.group} blocks (aggregated)`;
}

$("grid").addEventListener("mousemove", (e) => {
  const L = kv.layout, s = kv.snapshot, tip = $("tip");
  if (!L || !s) return;
  const r = e.target.getBoundingClientRect();
  const i = Math.floor((e.clientY - r.top) / L.size) * L.cols + Math.floor((e.clientX - r.left) / L.size);
  if (i < 0 || i >= L.n || (e.clientX - r.left) >= L.cols * L.size) { tip.hidden = true; return; }
  const b = s.blocks;
  let text;
  if (L.perBlock) {
    const owner = s.requests[b.owner_request[i]];
    text = `block ${i}: ${b.state_names[b.state[i]]}\nref count ${b.ref_count[i]}, ` +
      `${b.filled[i]}/${b.block_size} tokens` + (owner ? `\nrequest ${owner.request_id}` : "");
  } else {
    const c = b.cells, lo = i * c.group, hi = lo + c.size[i] - 1;
    const owner = s.requests[c.owner_request[i]];
    text = `blocks ${lo}-${hi}: ${c.used[i]} used, ${c.shared[i]} shared\n` +
      `${c.cached[i]} cached (${c.evictable[i]} evictable), ${c.filled[i]} tokens` +
      (owner ? `\nmostly ${owner.request_id}` : "");
  }
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = (e.clientX - r.left + 12) + "px";
  tip.style.top = (e.clientY - r.top + 12) + "px";
});
$("grid").addEventListener("mouseleave", () => { $("tip").hidden = true; });
$("grid").addEventListener("click", (e) => {
  const L = kv.layout, s = kv.snapshot;
  if (!L || !s) return;
  const r = e.target.getBoundingClientRect();
  const i = Math.floor((e.clientY - r.top) / L.size) * L.cols + Math.floor((e.clientX - r.left) / L.size);
  const b = s.blocks;
  const ri = L.perBlock ? b.owner_request[i] : b.cells.owner_request[i];
  if (ri >= 0 && s.requests[ri]) select(s.requests[ri].request_id);
});

let queuesKey = "";
function drawQueues() {
  const s = kv.snapshot;
  // Rebuild the lists only when they change (keeps hover and clicks steady).
  const key = kv.selected + "|" + s.requests.map((r) => `${r.request_id}:${r.state}:${r.output_tokens}:` +
    r.seqs.reduce((a, q) => a + q.num_blocks, 0)).join(",");
  if (key === queuesKey) return;
  queuesKey = key;
  for (const state of ["running", "swapped", "waiting"]) {
    const ul = $("q-" + state);
    const reqs = s.requests.filter((r) => r.state === state);
    $(`q-${state}-n`).textContent = String(reqs.length);
    const items = [];
    for (const r of reqs.slice(0, 300)) {
      const li = document.createElement("li");
      li.dataset.rid = r.request_id;
      if (r.request_id === kv.selected) li.classList.add("selected");
      const dot = document.createElement("span");
      dot.className = "dot";
      dot.style.background = reqColor(r, false);
      const rid = document.createElement("span");
      rid.className = "rid";
      rid.textContent = r.request_id;
      const meta = document.createElement("span");
      meta.className = "meta";
      const nb = r.seqs.reduce((a, q) => a + q.num_blocks, 0);
      meta.textContent = `n=${r.n} p=${r.prompt_tokens} o=${r.output_tokens} ${nb}b` +
        (r.cached_tokens ? ` c=${r.cached_tokens}` : "");
      li.append(dot, rid, meta);
      items.push(li);
    }
    if (reqs.length > 300) {
      const li = document.createElement("li");
      li.textContent = `... ${reqs.length - 300} more`;
      items.push(li);
    }
    ul.replaceChildren(...items);
  }
}
for (const id of ["q-running", "q-swapped", "q-waiting"]) {
  $(id).addEventListener("click", (e) => {
    const li = e.target.closest("li[data-rid]");
    if (li) select(li.dataset.rid);
  });
}

function select(rid) {
  if (kv.selected !== rid) kv.selectedSeq = 0;
  kv.selected = rid;
  kv.tableFetched = null;
  if (kv.snapshot) { drawGrid(); drawQueues(); drawTable(); }
}

// The table of the selected sequence: logical blocks (left) -> physical blocks (right).
async function fetchTables(rid) {
  try {
    const r = await fetch(`/debug/kv?tables=${encodeURIComponent(rid)}&max_cells=1&owners=false`,
      { headers: headers() });
    const j = await r.json();
    const req = j.requests.find((q) => q.request_id === rid);
    if (req && kv.selected === rid) { kv.tableFetched = { at: Date.now(), req }; drawTable(); }
  } catch (e) { /* next snapshot retries */ }
}

function drawTable() {
  const svg = $("bt-svg");
  const NS = "http://www.w3.org/2000/svg";
  let req = selectedReq();
  const tabs = $("bt-seqs");
  if (!req) {
    $("bt-title").textContent = "click a request (queue or block map)";
    tabs.replaceChildren();
    svg.replaceChildren();
    svg.setAttribute("height", "20");
    svg.dataset.arrows = "0";
    return;
  }
  if (req.seqs.some((q) => q.block_table === null)) { // tables left out of big snapshots
    const f = kv.tableFetched;
    if (!f || f.req.request_id !== req.request_id || Date.now() - f.at > 1000) fetchTables(req.request_id);
    if (f && f.req.request_id === req.request_id) req = f.req; else return;
  }
  const si = Math.min(kv.selectedSeq, req.seqs.length - 1);
  tabs.replaceChildren(...req.seqs.map((q, i) => {
    const bt = document.createElement("button");
    bt.textContent = `seq ${q.seq_id} (${q.status}, ${q.pool})`;
    if (i === si) bt.classList.add("on");
    bt.addEventListener("click", () => { kv.selectedSeq = i; drawTable(); });
    return bt;
  }));
  const seq = req.seqs[si];
  const table = seq.block_table || [];
  const s = kv.snapshot, bs = s.config.block_size;
  const pool = seq.pool === "swap" ? s.swap_blocks : s.blocks;
  $("bt-title").textContent = `${req.request_id} - ${req.state}, seq ${seq.seq_id}: ` +
    `${seq.num_tokens} tokens (${seq.num_computed_tokens} computed) in ${table.length} ` +
    `${seq.pool === "swap" ? "swap" : "device"} blocks`;
  // Rows: all of them, or the head and tail when the table is long.
  let rows = table.map((p, i) => i);
  if (rows.length > TABLE_ROWS_MAX) {
    const head = rows.slice(0, TABLE_ROWS_MAX - 12), tail = rows.slice(-11);
    rows = head.concat([-1], tail);
  }
  const rowH = 20, top = 22, W = svg.clientWidth || 700;
  const lx = 20, lw = 170, px = Math.max(lx + lw + 140, W - 240), pw = 200;
  const kids = [];
  const txt = (x, y, s, cls, anchor) => {
    const t = document.createElementNS(NS, "text");
    t.setAttribute("x", x); t.setAttribute("y", y);
    if (cls) t.setAttribute("class", cls);
    if (anchor) t.setAttribute("text-anchor", anchor);
    t.textContent = s;
    return t;
  };
  const rect = (x, y, w, h, fill, stroke) => {
    const r = document.createElementNS(NS, "rect");
    r.setAttribute("x", x); r.setAttribute("y", y); r.setAttribute("width", w); r.setAttribute("height", h);
    r.setAttribute("fill", fill); r.setAttribute("rx", 3);
    if (stroke) r.setAttribute("stroke", stroke);
    return r;
  };
  const defs = document.createElementNS(NS, "defs");
  const marker = document.createElementNS(NS, "marker");
  marker.setAttribute("id", "arrowhead"); marker.setAttribute("markerWidth", "8");
  marker.setAttribute("markerHeight", "8"); marker.setAttribute("refX", "7"); marker.setAttribute("refY", "4");
  marker.setAttribute("orient", "auto");
  const mp = document.createElementNS(NS, "path");
  mp.setAttribute("d", "M0,0 L8,4 L0,8 z"); mp.setAttribute("fill", "#444");
  marker.append(mp); defs.append(marker); kids.push(defs);
  kids.push(txt(lx, 14, "logical blocks", "hdr"));
  kids.push(txt(px, 14, seq.pool === "swap" ? "physical blocks (swap pool)" : "physical blocks", "hdr"));
  const light = reqColor(req, true), dark = reqColor(req, false);
  // Physical rows sorted by block id (the paper draws the physical pool in id order).
  const shown = rows.filter((i) => i >= 0);
  const phys = Array.from(new Set(shown.map((i) => table[i]))).sort((a, b) => a - b);
  const pRow = new Map(phys.map((p, k) => [p, k]));
  let arrows = 0;
  rows.forEach((i, k) => {
    const y = top + k * rowH;
    if (i < 0) { kids.push(txt(lx + lw / 2, y + 14, "...", null, "middle")); return; }
    const filled = Math.max(0, Math.min(bs, seq.num_computed_tokens - i * bs));
    kids.push(rect(lx, y, lw, rowH - 4, light));
    kids.push(rect(lx, y, Math.round((lw * filled) / bs), rowH - 4, dark));
    kids.push(txt(lx + 6, y + 12, `#${i}  ${filled}/${bs}`));
  });
  phys.forEach((p, k) => {
    const y = top + k * rowH;
    const ref = pool && pool.mode === "blocks" ? pool.ref_count[p] : null;
    const fill = pool && pool.mode === "blocks" ? pool.filled[p] : null;
    const g = document.createElementNS(NS, "g");
    g.setAttribute("class", "phys");
    g.dataset.block = String(p);
    g.append(rect(px, y, pw, rowH - 4, ref > 1 ? "#fde68a" : "#eef2f7", ref > 1 ? "#b45309" : null));
    g.append(txt(px + 6, y + 12, `block ${p}` + (ref !== null ? `  ref ${ref}` : "") +
      (fill !== null ? `  ${fill}/${bs}` : "") + (ref > 1 ? "  shared" : "")));
    kids.push(g);
  });
  rows.forEach((i, k) => {
    if (i < 0) return;
    const p = table[i];
    const y1 = top + k * rowH + (rowH - 4) / 2, y2 = top + pRow.get(p) * rowH + (rowH - 4) / 2;
    const path = document.createElementNS(NS, "path");
    const x1 = lx + lw + 2, x2 = px - 4, mx = (x1 + x2) / 2;
    path.setAttribute("d", `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`);
    path.setAttribute("fill", "none");
    path.setAttribute("stroke", "#444");
    path.setAttribute("stroke-width", "1.2");
    path.setAttribute("marker-end", "url(#arrowhead)");
    path.setAttribute("class", "arrow");
    path.dataset.logical = String(i);
    path.dataset.physical = String(p);
    kids.push(path);
    arrows += 1;
  });
  svg.replaceChildren(...kids);
  svg.setAttribute("height", String(top + Math.max(rows.length, phys.length) * rowH + 6));
  svg.dataset.arrows = String(arrows);
  svg.dataset.seq = String(seq.seq_id);
}

// ---- charts ---------------------------------------------------------------------------------
function lineChart(id, series, fixedMax) {
  const canvas = $(id), dpr = window.devicePixelRatio || 1;
  const W = canvas.clientWidth || 360, H = canvas.clientHeight || 120;
  if (canvas.width !== Math.round(W * dpr)) { canvas.width = Math.round(W * dpr); canvas.height = Math.round(H * dpr); }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, W, H);
  const hist = kv.history;
  const now = hist.length ? hist[hist.length - 1].time : Date.now() / 1000;
  const t0 = now - CHART_WINDOW;
  const pts = hist.filter((h) => h.time >= t0);
  let ymax = fixedMax || 0;
  if (!fixedMax) for (const sr of series) for (const h of pts) ymax = Math.max(ymax, sr.get(h) || 0);
  ymax = ymax || 1;
  const padL = 34, padB = 14, pw = W - padL - 4, ph = H - padB - 6;
  ctx.strokeStyle = "#e3e6eb"; ctx.fillStyle = "#6b7280"; ctx.font = "10px sans-serif";
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (const f of [0, 0.5, 1]) {
    const y = 6 + ph * (1 - f);
    ctx.beginPath(); ctx.moveTo(padL, y); ctx.lineTo(W - 4, y); ctx.stroke();
    const v = ymax * f;
    ctx.fillText(fixedMax === 1 ? `${Math.round(v * 100)}%` : v >= 100 ? v.toFixed(0) : +v.toFixed(1) + "", padL - 3, y);
  }
  ctx.textAlign = "left"; ctx.textBaseline = "alphabetic";
  ctx.fillText(`-${CHART_WINDOW / 60} min`, padL, H - 2);
  ctx.textAlign = "right"; ctx.fillText("now", W - 4, H - 2);
  for (const sr of series) {
    ctx.strokeStyle = sr.color; ctx.lineWidth = 1.5; ctx.beginPath();
    let pen = false;
    for (const h of pts) {
      const v = sr.get(h);
      if (v === null || v === undefined) { pen = false; continue; }
      const x = padL + pw * ((h.time - t0) / CHART_WINDOW), y = 6 + ph * (1 - Math.min(1, v / ymax));
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    }
    ctx.stroke();
  }
  canvas.dataset.points = String(pts.length);
  canvas.dataset.lastTime = pts.length ? String(pts[pts.length - 1].time) : "";
}

function drawCharts() {
  lineChart("ch-usage", [{ get: (h) => h.kv_usage, color: "#2563eb" }], 1);
  lineChart("ch-useful", [{ get: (h) => h.useful_token_fraction, color: "#059669" }], 1);
  lineChart("ch-reqs", [
    { get: (h) => h.running, color: "#2563eb" },
    { get: (h) => h.waiting, color: "#d97706" },
    { get: (h) => h.swapped, color: "#9333ea" },
  ]);
  lineChart("ch-tput", [
    { get: (h) => h.generation_tokens_per_s, color: "#059669" },
    { get: (h) => h.prompt_tokens_per_s, color: "#6b7280" },
  ]);
}

window.addEventListener("resize", () => { if (kv.snapshot) { drawGrid(); drawTable(); } drawCharts(); });

async function start() {
  if (await loadHistory()) stream();
}
start();
