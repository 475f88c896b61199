// The actor dashboard: draws each /debug/live event ({actors, steps, requests}: the bodies of
// /debug/actors, /debug/steps and /debug/requests, about once a second) and, on demand, one
// request's hops from /debug/requests/{id}. Plain ES2020, no dependencies; every failure to
// fetch or draw shows in the banner instead of escaping as an exception.
"use strict";

const $ = (selector) => document.querySelector(selector);
const SVG_NS = "http://www.w3.org/2000/svg";
const HEALTH = ["ok", "growing", "slow", "restarted", "error"];
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
  "#ff9da7", "#9c755f", "#86bcb6", "#d37295", "#a0cbe8"];
const state = {
  paused: false, now: Date.now() / 1000, nodes: [], requests: [], expanded: new Set(),
  selected: null, drawnHops: -1, loadSeq: 0, colours: new Map(), banners: new Map(),
};

// -- small helpers -------------------------------------------------------------------------

function build(ns, tag, attrs, children) {
  const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) e.setAttribute(k, v);
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}
const h = (tag, attrs, ...children) => build(null, tag, attrs, children);
const s = (tag, attrs, ...children) => build(SVG_NS, tag, attrs, children);

const num = (x) => typeof x === "number" && Number.isFinite(x);
const fmt = (x, digits = 1) => (num(x) ? x.toFixed(digits) : "–");
const ms = (x) => (!num(x) ? "–" : x < 1 ? x.toFixed(2) : x < 100 ? x.toFixed(1) : x.toFixed(0));
const pct = (x) => (num(x) ? `${(100 * x).toFixed(0)}%` : "–");
const int = (x) => (num(x) ? Math.round(x).toLocaleString("en") : "–");

function colour(key) {          // one colour per key for the page's lifetime
  if (!state.colours.has(key)) state.colours.set(key, PALETTE[state.colours.size % PALETTE.length]);
  return state.colours.get(key);
}

function banner(source, message) {   // one line per source; null clears it
  if (message) state.banners.set(source, message); else state.banners.delete(source);
  const b = $("#banner");
  b.textContent = [...state.banners.values()].join(" · ");
  b.hidden = state.banners.size === 0;
}

function guarded(source, draw) {
  try { draw(); banner(source, null); } catch (err) { banner(source, `could not draw ${source}: ${err.message}`); }
}

async function getJSON(url) {
  const resp = await fetch(url);
  const body = await resp.json().catch(() => null);
  if (!resp.ok) throw new Error(body?.error?.message ?? `HTTP ${resp.status}`);
  return body;
}

function legend(target, items) {
  $(target).replaceChildren(...items.map(([label, col, cls]) =>
    h("span", { class: cls || "" }, h("i", { style: `background:${col}` }), label)));
}

// -- live stream ---------------------------------------------------------------------------

function connect() {
  const source = new EventSource("debug/live");
  source.onmessage = (event) => {
    banner("live", null);
    if (state.paused) return;
    let data;
    try { data = JSON.parse(event.data); } catch (err) { banner("live", `bad event: ${err.message}`); return; }
    render(data);
  };
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {   // refused (401, 404...): retry by hand
      banner("live", "/debug/live refused the connection; retrying in 5 s");
      source.close();
      setTimeout(connect, 5000);
    } else {
      banner("live", "/debug/live interrupted; reconnecting…");
    }
  };
}

function render({ actors, steps, requests } = {}) {
  if (actors) {
    state.now = actors.now ?? Date.now() / 1000;
    guarded("status", () => drawStatus(actors));
    guarded("graph", () => drawGraph(actors));
    guarded("table", () => drawTable(actors));
  }
  if (steps) {
    guarded("steps", () => drawSteps(steps.steps || []));
    guarded("series", () => drawSeries(steps.series || []));
  }
  if (requests) guarded("requests", () => drawRequests(requests.requests || []));
}

function drawStatus({ processes = [], actors = [], window_s, dropped }) {
  const time = new Date(state.now * 1000).toLocaleTimeString("en-GB");
  const parts = [`updated ${time}`, `${processes.length} processes`, `${actors.length} actors`];
  if (num(window_s)) parts.push(`window ${window_s} s`);
  if (dropped) parts.push(`${int(dropped)} spans dropped`);
  $("#status").textContent = parts.join(" · ");
}

// -- 1. actor graph: a box per process, a pill per actor, an arrow per sender -> receiver ---

const BOX_W = 200, GAP = 150, ROW = 30, PAD = 24, HEAD = 34;

function nodeOrder({ processes = [], actors = [] }) {
  const nodes = processes.map((p) => p.node);
  for (const a of actors) if (!nodes.includes(a.node)) nodes.push(a.node);
  return nodes;
}

function drawGraph(data) {
  const { processes = [], actors = [], edges = [] } = data;
  const nodes = nodeOrder(data), pos = new Map(), boxes = [], pills = [];
  let height = 0;
  nodes.forEach((node, col) => {
    const x = PAD + col * (BOX_W + GAP), members = actors.filter((a) => a.node === node);
    const proc = processes.find((p) => p.node === node) || {};
    const boxH = HEAD + members.length * ROW + 8;
    height = Math.max(height, PAD + boxH);
    const label = `${node}${proc.pid ? `  pid ${proc.pid}` : ""}${proc.restarts ? `  ↻${proc.restarts}` : ""}`;
    boxes.push(s("g", { class: `process${proc.alive === false ? " dead" : ""}`, "data-node": node },
      s("rect", { x, y: PAD, width: BOX_W, height: boxH, rx: 8 }),
      s("text", { x: x + 10, y: PAD + 21, class: "process-name" }, label)));
    members.forEach((a, i) => {
      const y = PAD + HEAD + i * ROW + ROW / 2;
      pos.set(`${node}/${a.actor}`, { x, y, col });
      const health = HEALTH.includes(a.health) ? a.health : "error";
      pills.push(s("g", { class: `actor health-${health}`, "data-node": node, "data-actor": a.actor, "data-health": health },
        s("title", {}, `${node}/${a.actor}: ${a.health}; mailbox ${a.depth} (max ${a.max_depth}); ` +
          `handler p99 ${ms(a.handler_p99_ms)} ms; ${fmt(a.msgs_per_s)} msgs/s`),
        s("rect", { x: x + 12, y: y - 11, width: BOX_W - 24, height: 22, rx: 11 }),
        s("text", { x: x + 24, y: y + 4 }, a.actor),
        s("text", { x: x + BOX_W - 22, y: y + 4, class: "depth" }, a.depth ? `✉ ${a.depth}` : "")));
    });
  });
  const paths = [], labels = [];
  for (const e of edges) {
    const a = pos.get(e.src), b = pos.get(e.dst);
    if (!a || !b) continue;
    const { d, lx, ly } = edgePath(a, b);
    const rate = num(e.msgs_per_s) ? e.msgs_per_s : 0;
    paths.push(s("path", { d, class: rate > 0 ? "edge" : "edge idle", "data-src": e.src, "data-dst": e.dst,
      "stroke-width": 1 + Math.min(4, 2 * Math.log10(1 + rate)), "marker-end": "url(#arrow)" },
      s("title", {}, `${e.src} → ${e.dst}: ${fmt(rate)} msgs/s, ${int(e.count)} in the window`)));
    labels.push(s("text", { x: lx, y: ly, class: "edge-label" }, `${fmt(rate)}/s`));
  }
  const width = PAD * 2 + nodes.length * BOX_W + Math.max(0, nodes.length - 1) * GAP + 50;
  const arrow = s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
    markerWidth: 8, markerHeight: 8, markerUnits: "userSpaceOnUse", orient: "auto" }, s("path", { d: "M0,0 L10,5 L0,10 z" })));
  const svg = $("#graph");
  svg.setAttribute("viewBox", `0 0 ${width} ${height + PAD}`);
  svg.setAttribute("width", width);
  svg.replaceChildren(arrow, ...boxes, ...paths, ...pills, ...labels);
  legend("#graph-legend", HEALTH.map((k) => [k, "", `swatch health-${k}`]));
}

function edgePath(a, b) {
  if (a.col === b.col) {            // inside one process: an arc out of the box's right side
    const x = a.x + BOX_W - 12, bulge = 30 + 6 * Math.abs(a.y - b.y) / ROW;
    return { d: `M${x},${a.y} C${x + bulge},${a.y} ${x + bulge},${b.y} ${x},${b.y}`,
      lx: x + bulge * 0.75, ly: (a.y + b.y) / 2 + 4 };
  }
  const forward = b.col > a.col, shift = forward ? -5 : 5;   // the two directions side by side
  const x1 = forward ? a.x + BOX_W - 12 : a.x + 12, x2 = forward ? b.x + 12 : b.x + BOX_W - 12;
  const y1 = a.y + shift, y2 = b.y + shift, mx = (x1 + x2) / 2;
  return { d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`, lx: mx, ly: (y1 + y2) / 2 + shift * 1.6 };
}

// -- 2. actor table; a click on a row shows its figures by message type ----------------------

const COLUMNS = [
  ["node", (a) => a.node], ["pid", (a) => a.pid ?? "–"], ["actor", (a) => a.actor],
  ["depth", (a) => `${int(a.depth)} / ${int(a.max_depth)}`],
  ["wait", (a) => `${ms(a.wait_p50_ms)} / ${ms(a.wait_p99_ms)}`],
  ["handler", (a) => `${ms(a.handler_p50_ms)} / ${ms(a.handler_p99_ms)}`],
  ["utilisation", (a) => pct(a.utilisation)], ["handled", (a) => int(a.handled)],
  ["msgs_per_s", (a) => fmt(a.msgs_per_s)], ["errors", (a) => int(a.errors)],
  ["restarts", (a) => int(a.restarts)], ["last_error", (a) => a.last_error || ""],
];

function drawTable(data) {
  const nodes = nodeOrder(data);
  const actors = [...(data.actors || [])].sort((a, b) => nodes.indexOf(a.node) - nodes.indexOf(b.node));
  const rows = [];
  for (const a of actors) {
    const key = `${a.node}/${a.actor}`, health = HEALTH.includes(a.health) ? a.health : "error";
    const row = h("tr", { "data-node": a.node, "data-actor": a.actor, "data-health": health, class: `health-${health}` },
      ...COLUMNS.map(([col, cell]) => h("td", { "data-col": col }, String(cell(a)))));
    row.querySelector('[data-col="actor"]').prepend(h("i", { class: "dot", title: health }));
    row.addEventListener("click", () => {
      state.expanded.has(key) ? state.expanded.delete(key) : state.expanded.add(key);
      guarded("table", () => drawTable(data));
    });
    rows.push(row);
    if (state.expanded.has(key)) rows.push(byType(a));
  }
  $("#actors-table tbody").replaceChildren(...rows);
}

function byType(a) {
  const types = (a.by_type || []).map((t) => h("tr", {},
    h("td", {}, t.msg_type), h("td", {}, int(t.count)), h("td", {}, `${ms(t.wait_p50_ms)} / ${ms(t.wait_p99_ms)}`),
    h("td", {}, `${ms(t.handler_p50_ms)} / ${ms(t.handler_p99_ms)}`)));
  const inner = h("table", { class: "by-type" },
    h("thead", {}, h("tr", {}, h("th", {}, "message"), h("th", {}, "count"), h("th", {}, "wait p50 / p99 ms"),
      h("th", {}, "handler p50 / p99 ms"))), h("tbody", {}, ...types));
  return h("tr", { class: "by-type-row" }, h("td", { colspan: COLUMNS.length }, types.length ? inner : "no messages in the window"));
}

// -- 3. engine steps: stacked phase bars over the gap before each step; tokens and batch below

const STEPS_W = 960, TOP = 18, BARS_H = 190, LOWER_H = 60, LEFT = 56;  // BARS_H: the bars' baseline

function drawSteps(steps) {
  const recent = steps.slice(-120), keys = [];
  for (const st of recent) for (const k of Object.keys(st.phases || {})) if (!keys.includes(k)) keys.push(k);
  const dur = (st) => (num(st.duration_ms) ? st.duration_ms : 0), gap = (st) => (num(st.gap_ms) ? st.gap_ms : 0);
  // The scale fits the steps and gaps up to a step's length: an idle engine's long gap is cut at the top.
  const maxMs = Math.max(1e-3, ...recent.map((st) => dur(st) + Math.min(gap(st), dur(st))));
  const maxTok = Math.max(1, ...recent.map((st) => Math.max(st.tokens || 0, st.batch || 0)));
  const bw = (STEPS_W - LEFT) / Math.max(recent.length, 60), lowerTop = BARS_H + 16;
  const bars = recent.map((st, i) => {
    const x = LEFT + i * bw, w = Math.max(1, bw - 1), parts = [];
    let y = BARS_H, sum = 0;
    const seg = (value, cls, fill) => {
      const hh = Math.min(y - TOP, (value / maxMs) * (BARS_H - TOP));
      y -= hh;
      parts.push(s("rect", { x, y, width: w, height: hh, class: cls, fill }));
    };
    for (const k of keys) {
      const v = st.phases?.[k];
      if (num(v) && v > 0) { seg(v, "phase", colour(k)); sum += v; }
    }
    if (num(st.duration_ms) && st.duration_ms > sum) seg(st.duration_ms - sum, "phase other");
    if (num(st.gap_ms) && st.gap_ms > 0) seg(st.gap_ms, "gap");
    const tokH = ((st.tokens || 0) / maxTok) * LOWER_H, batchY = lowerTop + LOWER_H - ((st.batch || 0) / maxTok) * LOWER_H;
    parts.push(s("rect", { x, y: lowerTop + LOWER_H - tokH, width: w, height: tokH, class: "tokens" }));
    parts.push(s("rect", { x, y: batchY - 1, width: w, height: 2, class: "batch" }));
    const phases = keys.filter((k) => num(st.phases?.[k])).map((k) => `${k} ${ms(st.phases[k])}`).join(", ");
    return s("g", { class: "step", "data-step": st.step },
      s("title", {}, `step ${st.step}: batch ${st.batch}, ${st.tokens} tokens, ${ms(st.duration_ms)} ms ` +
        `(${phases}); gap before ${ms(st.gap_ms)} ms`), ...parts);
  });
  const axis = [[4, TOP + 4, `${ms(maxMs)} ms`], [4, BARS_H, "0"], [4, lowerTop + 10, `${int(maxTok)}`], [4, lowerTop + LOWER_H, "0"]]
    .map(([x, y, t]) => s("text", { x, y, class: "axis" }, t));
  const last = recent[recent.length - 1];
  const caption = last ? `step ${last.step}: ${ms(last.duration_ms)} ms, batch ${last.batch}, ${last.tokens} tokens`
    : "no steps yet";
  const svg = $("#steps");
  svg.setAttribute("viewBox", `0 0 ${STEPS_W} ${lowerTop + LOWER_H + 6}`);
  svg.replaceChildren(...axis, s("line", { x1: LEFT, x2: STEPS_W, y1: BARS_H, y2: BARS_H, class: "baseline" }),
    s("text", { x: STEPS_W - 4, y: 10, class: "axis end" }, caption), ...bars);
  legend("#steps-legend", [...keys.map((k) => [k, colour(k)]), ["other", "", "swatch other"],
    ["gap before the step", "", "swatch gap"], ["tokens scheduled", "", "swatch tokens"], ["batch size", "", "swatch batch"]]);
}

// -- 4. time series: KV cache usage, prefix-cache hit rate, running and waiting requests ----

const CHARTS = [
  { id: "kv_usage", title: "KV cache usage", lines: ["kv_usage"], max: 1, fmt: pct },
  { id: "prefix_hit_rate", title: "prefix-cache hit rate", lines: ["prefix_hit_rate"], max: 1, fmt: pct },
  { id: "requests", title: "running / waiting requests", lines: ["running", "waiting"], fmt: int },
];
const CHART_W = 320, CHART_H = 90;

function drawSeries(series) {
  const t1 = series.length ? series[series.length - 1].t : state.now, t0 = series.length ? series[0].t : t1 - 60;
  const span = Math.max(1, t1 - t0);
  $("#series").replaceChildren(...CHARTS.map((c) => {
    const max = c.max ?? Math.max(1, ...series.flatMap((p) => c.lines.map((k) => p[k] ?? 0)));
    const lines = c.lines.map((k) => s("polyline", { class: "line", stroke: colour(`series:${k}`), "data-key": k,
      points: series.filter((p) => num(p[k])).map((p) =>
        `${(((p.t - t0) / span) * CHART_W).toFixed(1)},${(CHART_H - (p[k] / max) * CHART_H).toFixed(1)}`).join(" ") }));
    const last = series[series.length - 1] || {};
    const now = c.lines.map((k) => h("span", { style: `color:${colour(`series:${k}`)}` },
      `${c.lines.length > 1 ? `${k} ` : ""}${c.fmt(last[k])}`));
    return h("div", { class: "chart", "data-series": c.id },
      h("div", { class: "chart-title" }, c.title, " ", ...now),
      s("svg", { viewBox: `0 -4 ${CHART_W} ${CHART_H + 18}`, role: "img", "aria-label": c.title },
        s("line", { x1: 0, x2: CHART_W, y1: CHART_H, y2: CHART_H, class: "baseline" }), ...lines,
        s("text", { x: 2, y: 8, class: "axis" }, c.fmt(max)),
        s("text", { x: 2, y: CHART_H + 13, class: "axis" }, `-${Math.round(span)} s`),
        s("text", { x: CHART_W - 2, y: CHART_H + 13, class: "axis end" }, "now")));
  }));
}

// -- 5. requests and the waterfall of one request's hops ------------------------------------

function drawRequests(list) {
  state.requests = list;
  const q = $("#request-search").value.trim(), ul = $("#requests");
  const shown = q ? list.filter((r) => String(r.id).includes(q) || String(r.request_id).includes(q)) : list;
  const old = new Map([...ul.children].map((li) => [li.dataset.id, li]));
  const items = shown.map((r) => {            // items are reused so a click is never lost mid-update
    const li = old.get(r.id) || h("li", { "data-id": r.id });
    li.dataset.status = r.status;
    li.className = `status-${r.status}${isSelected(r) ? " selected" : ""}`;
    const age = num(r.t) ? `${Math.max(0, Math.round(state.now - r.t))} s ago` : "";
    li.replaceChildren(h("span", { class: "rid" }, r.id), h("span", { class: "meta" }, `${r.status} · ${r.hops} hops · ${age}`));
    return li;
  });
  if (items.length !== ul.children.length || items.some((li, i) => ul.children[i] !== li)) ul.replaceChildren(...items);
  if (!shown.length) ul.replaceChildren(h("li", { class: "muted empty" }, q ? "no match in the recent list (Enter looks it up)" : "no requests yet"));
  const sel = list.find(isSelected);
  if (sel && sel.hops !== state.drawnHops) loadRequest(state.selected);   // it grew: draw it again
}

const isSelected = (r) => state.selected !== null && (r.id === state.selected || r.request_id === state.selected);

async function loadRequest(id) {
  state.selected = id;
  const seq = ++state.loadSeq;
  for (const li of $("#requests").children) li.classList.toggle("selected", li.dataset.id === id);
  try {
    const body = await getJSON(`debug/requests/${encodeURIComponent(id)}`);
    if (seq !== state.loadSeq) return;          // a later choice won
    guarded("waterfall", () => drawWaterfall(body));
    banner("request", null);
  } catch (err) {
    if (seq === state.loadSeq) banner("request", `request ${id}: ${err.message}`);
  }
}

function drawWaterfall({ id, request_id, hops = [] }) {
  const end = Math.max(1e-3, ...hops.map((p) => (p.start_ms || 0) + (p.wait_ms || 0) + (p.run_ms || 0)));
  const x = (t) => `${((100 * t) / end).toFixed(3)}%`;
  state.drawnHops = (state.requests.find((r) => r.id === id || r.request_id === request_id) || {}).hops ?? hops.length;
  const rows = hops.map((p) => {
    const start = p.start_ms || 0, wait = p.wait_ms || 0, run = p.run_ms || 0, col = colour(`node:${p.node}`);
    return h("div", { class: `hop${p.status && p.status !== "ok" ? " failed" : ""}`, "data-name": p.name,
      "data-node": p.node, "data-actor": p.actor, "data-start": start, "data-wait": wait, "data-run": run,
      title: `${p.node}/${p.actor} ${p.msg_type || ""}: starts at ${ms(start)} ms, waits ${ms(wait)} ms, runs ${ms(run)} ms (${p.status})` },
      h("span", { class: "hop-name" }, p.name, h("small", {}, ` ${p.node}/${p.actor}`)),
      h("span", { class: "track" },
        h("span", { class: "wait", style: `left:${x(start)};width:${x(wait)};background:${col}` }),
        h("span", { class: "run", style: `left:${x(start + wait)};width:${x(run)};background:${col}` })),
      h("span", { class: "hop-time" }, `+${ms(start)} · ${ms(wait)} + ${ms(run)} ms`));
  });
  const w = $("#waterfall");
  w.dataset.id = id;
  w.dataset.requestId = request_id;
  w.replaceChildren(h("h3", {}, id, h("small", { class: "muted" },
    ` ${request_id && request_id !== id ? `(${request_id}) ` : ""}${hops.length} hops over ${ms(end)} ms; light: queued in the mailbox, dark: handling`)),
    ...rows);
}

// -- wiring ----------------------------------------------------------------------------------

$("#search-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const q = $("#request-search").value.trim();
  if (q) loadRequest(q);
});
$("#request-search").addEventListener("input", () => guarded("requests", () => drawRequests(state.requests)));
$("#requests").addEventListener("click", (event) => {
  const li = event.target.closest("li[data-id]");
  if (li) loadRequest(li.dataset.id);
});
$("#pause").addEventListener("click", () => {
  state.paused = !state.paused;
  $("#pause").textContent = state.paused ? "resume" : "pause";
  $("#status").classList.toggle("paused", state.paused);
});
window.addEventListener("unhandledrejection", (event) => {
  event.preventDefault();
  banner("script", String(event.reason));
});
connect();
