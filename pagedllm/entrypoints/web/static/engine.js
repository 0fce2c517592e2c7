// The engine view: the feed of /v1/engine/state (server-sent events, one message per engine
// snapshot) drawn as the KV block grid, the queues, the step budget and time series.
"use strict";

(function () {
  const api = window.pagedllmApi;
  const $ = (id) => document.getElementById(id);
  const FREE = 0, CACHED = 1, USED = 2, SHARED = 3, SWAPPED = 4;
  const QUEUES = ["waiting", "running", "swapped"];
  const state = { hello: null, snapshot: null, history: [], cells: [], swapCells: [], controller: null,
                  counts: {}, layout: null, swapLayout: null };

  function decode(runs) {
    const cells = [];
    for (let i = 0; i < runs.length; i += 4) {
      const [s, owner, first, len] = runs.slice(i, i + 4);
      for (let k = 0; k < len; k++) cells.push([s, owner, owner >= 0 ? first + k : -1]);
    }
    return cells;
  }

  function hue(id) {
    let h = 0;
    for (let i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
    return h % 360;
  }

  function colour(cell, reqs) {
    const [s, owner] = cell;
    if (s === FREE) return "#e4e7eb";
    if (s === CACHED) return "#b9d3ee";
    if (s === SHARED) return "#5b3a91";
    const r = reqs[owner];
    return r ? "hsl(" + hue(r.id) + ",65%," + (s === SWAPPED ? "35%" : "52%") + ")" : "#888";
  }

  function drawGrid(canvas, cells, reqs) {
    const style = getComputedStyle(canvas.parentElement);
    const width = canvas.parentElement.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    const n = Math.max(cells.length, 1);
    let size = Math.max(1, Math.min(18, Math.floor(Math.sqrt(width * 240 / n))));
    const cols = Math.max(1, Math.floor(width / size));
    const rows = Math.ceil(n / cols);
    canvas.width = cols * size;
    canvas.height = rows * size;
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const gap = size > 5 ? 1 : 0;
    for (let i = 0; i < cells.length; i++) {
      ctx.fillStyle = colour(cells[i], reqs);
      ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
    }
    return { size: size, cols: cols };
  }

  function tip(canvas, layout, cells, ev) {
    const box = $("block-tip");
    if (!layout || !state.snapshot) { box.hidden = true; return; }
    const rect = canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - rect.left) / layout.size), row = Math.floor((ev.clientY - rect.top) / layout.size);
    const i = row * layout.cols + col;
    if (col >= layout.cols || i < 0 || i >= cells.length) { box.hidden = true; return; }
    const [s, owner, index] = cells[i];
    const snap = state.snapshot, bs = snap.block_size;
    const names = ["free", "cached (free): holds a prefix a later request may reuse", "in use", "shared by several requests", "swapped to host"];
    let text = (canvas.id === "swap-grid" ? "host block " : "block ") + i + ": " + names[s];
    const r = snap.requests[owner];
    if (r) text += "\n" + r.id + "\ntokens " + index * bs + "–" + ((index + 1) * bs - 1);
    box.textContent = text;
    box.hidden = false;
    box.style.left = (ev.pageX + 12) + "px";
    box.style.top = (ev.pageY + 12) + "px";
  }

  function bar(done, total, cls) {
    const outer = document.createElement("div");
    outer.className = "progress " + cls;
    const inner = document.createElement("div");
    inner.style.width = (total > 0 ? Math.min(100, 100 * done / total) : 0) + "%";
    outer.appendChild(inner);
    return outer;
  }

  function drawQueues(reqs) {
    const lists = { waiting: [], running: [], swapped: [] };
    for (const r of reqs) lists[QUEUES[r.queue]].push(r);
    for (const q of QUEUES) {
      $("q-" + q + "-count").textContent = lists[q].length;
      const ul = $("q-" + q);
      ul.replaceChildren(...lists[q].slice(0, 50).map((r) => {
        const li = document.createElement("li");
        const name = document.createElement("div");
        name.className = "rid";
        name.textContent = r.id;
        name.style.borderColor = "hsl(" + hue(r.id) + ",65%,52%)";
        const text = document.createElement("div");
        text.className = "muted";
        text.textContent = "prompt " + r.prompt_done + "/" + r.prompt_total + " · out " + r.output + "/" + r.max_tokens +
          " · prio " + r.priority + " · " + r.blocks + " blocks" + (r.preemptions ? " · preempted " + r.preemptions + "×" : "");
        li.append(name, bar(r.prompt_done, r.prompt_total, "prompt"), bar(r.output, r.max_tokens, "output"), text);
        return li;
      }));
    }
  }

  function drawBudget(snap) {
    const b = snap.budget || 1;
    const parts = $("budget-bar").children;
    parts[0].style.width = Math.min(100, 100 * snap.step_prefill_tokens / b) + "%";
    parts[1].style.width = Math.min(100, 100 * snap.step_decode_tokens / b) + "%";
    $("budget-text").textContent = "last step: " + snap.step_prefill_tokens + " prefill + " + snap.step_decode_tokens +
      " decode of " + snap.budget + " tokens (" + (snap.step_time * 1000).toFixed(1) + " ms) · policy " + snap.policy;
  }

  function drawChart(canvas) {
    const key = canvas.dataset.key;
    const w = canvas.clientWidth || 300, h = canvas.clientHeight || 90;
    canvas.width = w; canvas.height = h;
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, w, h);
    const pts = state.history.filter((p) => p[key] !== null && p[key] !== undefined);
    if (!pts.length) return;
    const t1 = state.history[state.history.length - 1].t, t0 = Math.max(t1 - 300, state.history[0].t);
    const span = Math.max(t1 - t0, 1);
    let max = Number(canvas.dataset.max) || 0;
    for (const p of pts) max = Math.max(max, p[key]);
    max = max || 1;
    ctx.strokeStyle = "#2b6cb0"; ctx.lineWidth = 1.5; ctx.beginPath();
    let prev = null;
    for (const p of pts) {
      if (p.t < t0) continue;
      const x = (p.t - t0) / span * (w - 2) + 1, y = h - 14 - (p[key] / max) * (h - 20);
      // A gap (nobody watched, or the figure had no value) is left blank.
      if (prev === null || p.t - prev.t > 2) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      prev = p;
    }
    ctx.stroke();
    ctx.fillStyle = "#555"; ctx.font = "11px sans-serif";
    const lastv = pts[pts.length - 1][key];
    ctx.fillText("max " + (+max.toPrecision(3)) + " · now " + (+lastv.toPrecision(3)) + " · last " + Math.round(span) + " s", 4, h - 2);
  }

  function draw() {
    const snap = state.snapshot;
    if (!snap) return;
    const reqs = snap.requests;
    state.layout = drawGrid($("block-grid"), state.cells, reqs);
    const c = state.counts;
    $("block-summary").textContent = snap.num_blocks + " blocks of " + snap.block_size + " tokens: " + (c[USED] || 0) +
      " in use, " + (c[SHARED] || 0) + " shared, " + (c[CACHED] || 0) + " cached, " + (c[FREE] || 0) + " free";
    const swap = snap.num_swap_blocks > 0;
    $("swap-grid").hidden = $("swap-title").hidden = !swap;
    if (swap) state.swapLayout = drawGrid($("swap-grid"), state.swapCells, reqs);
    drawQueues(reqs);
    drawBudget(snap);
    document.querySelectorAll("canvas.chart").forEach(drawChart);
  }

  function onSnapshot(msg) {
    const snap = msg.snapshot;
    state.snapshot = snap;
    state.cells = decode(snap.blocks);
    state.swapCells = decode(snap.swap_blocks);
    const counts = {};
    for (const cell of state.cells) counts[cell[0]] = (counts[cell[0]] || 0) + 1;
    state.counts = counts;
    state.history.push(msg.point);
    if (state.history.length > 1200) state.history.shift();
    if (!$("view-engine").hidden) draw();
    const g = $("block-grid");
    g.dataset.used = (counts[USED] || 0) + (counts[SHARED] || 0);
    g.dataset.time = snap.time;
    g.dataset.snapshots = (Number(g.dataset.snapshots) || 0) + 1;
  }

  async function connect() {
    if (state.controller) return;
    const controller = new AbortController();
    state.controller = controller;
    $("feed-status").textContent = "connecting…";
    try {
      const resp = await api.call("/v1/engine/state", { signal: controller.signal });
      $("feed-status").textContent = "live";
      await api.readEvents(resp, (name, data) => {
        const msg = JSON.parse(data);
        if (name === "hello") { state.hello = msg; state.history = msg.history || []; }
        else onSnapshot(msg);
      });
      $("feed-status").textContent = "the server closed the feed";
    } catch (e) {
      if (e.name !== "AbortError") $("feed-status").textContent = "feed failed: " + e.message;
    }
    if (state.controller === controller) {
      state.controller = null;
      if (!$("view-engine").hidden) setTimeout(connect, 2000);
    }
  }

  function disconnect() {
    if (state.controller) { const c = state.controller; state.controller = null; c.abort(); $("feed-status").textContent = "paused"; }
  }

  function show(view) {
    for (const b of document.querySelectorAll("nav .tab")) b.classList.toggle("active", b.dataset.view === view);
    $("view-chat").hidden = view !== "chat";
    $("view-engine").hidden = view !== "engine";
    if (view === "engine") { connect(); draw(); } else disconnect();  // no viewer, no cost to the engine
    if (location.hash !== "#" + view) history.replaceState(null, "", "#" + view);
  }

  for (const b of document.querySelectorAll("nav .tab")) b.addEventListener("click", () => show(b.dataset.view));
  for (const id of ["block-grid", "swap-grid"]) {
    const canvas = $(id);
    canvas.addEventListener("mousemove", (ev) => tip(canvas, id === "block-grid" ? state.layout : state.swapLayout,
                                                     id === "block-grid" ? state.cells : state.swapCells, ev));
    canvas.addEventListener("mouseleave", () => { $("block-tip").hidden = true; });
  }
  window.addEventListener("resize", draw);
  show(location.hash === "#engine" ? "engine" : "chat");

  window.pagedllmEngine = { state: state, decode: decode, show: show };
})();
