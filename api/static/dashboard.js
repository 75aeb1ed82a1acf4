// NeuroShard dashboard: polls the verifier's JSON API and draws with plain canvas. No dependencies.
"use strict";

const POLL_MS = 5000;
const $ = (id) => document.getElementById(id);

function fmt(x, digits = 3) {
  return x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits);
}
function pct(x) {
  return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
}
function count(x) {
  return x === null || x === undefined ? "–" : Number(x).toLocaleString("en-US");
}
function ago(t) {
  if (t === null || t === undefined) return "–";
  const s = Math.max(0, Date.now() / 1000 - t);
  return s < 90 ? `${s.toFixed(0)} s ago` : `${(s / 60).toFixed(0)} min ago`;
}
function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

async function getJSON(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

// The node table is paged by the server (/api/nodes?limit&offset, total in X-Total-Count):
// a thousand rows would make a 33,000-pixel page and a 430 KB poll.
const NODES_PER_PAGE = 50;
let nodeOffset = 0;
let nodeTotal = 0;

async function getNodes() {
  const path = `/api/nodes?limit=${NODES_PER_PAGE}&offset=${nodeOffset}`;
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  nodeTotal = Number(response.headers.get("X-Total-Count") || 0);
  return response.json();
}

// A line chart on a canvas: series = [{points: [[x, y], ...], color, label}], y range from the data.
function drawChart(canvas, series, opts) {
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, pad = { l: 52, r: 12, t: 12, b: 28 };
  ctx.clearRect(0, 0, W, H);
  const all = series.flatMap((s) => s.points);
  ctx.fillStyle = "#8a96a3";
  ctx.font = "12px system-ui, sans-serif";
  if (all.length === 0) {
    ctx.fillText(opts.empty || "no data yet", pad.l, H / 2);
    canvas.dataset.points = "0";
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = opts.yRange || [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * (W - pad.l - pad.r);
  const Y = (y) => H - pad.b - ((y - y0) / (y1 - y0)) * (H - pad.t - pad.b);
  ctx.strokeStyle = "#2a3540";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    ctx.beginPath(); ctx.moveTo(pad.l, Y(y)); ctx.lineTo(W - pad.r, Y(y)); ctx.stroke();
    ctx.fillText(opts.yFormat ? opts.yFormat(y) : y.toFixed(2), 4, Y(y) + 4);
  }
  ctx.fillText(`round ${x0}`, pad.l, H - 8);
  const right = `round ${x1}`;
  ctx.fillText(right, W - pad.r - ctx.measureText(right).width, H - 8);
  for (const s of series) {
    if (s.points.length === 0) continue;
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    s.points.forEach(([x, y], i) => (i === 0 ? ctx.moveTo(X(x), Y(y)) : ctx.lineTo(X(x), Y(y))));
    ctx.stroke();
    for (const [x, y] of s.points) { ctx.beginPath(); ctx.arc(X(x), Y(y), 2.5, 0, 2 * Math.PI); ctx.fill(); }
  }
  canvas.dataset.points = String(all.length);
}

function renderVerdict(v) {
  const box = $("verdict");
  box.className = "verdict " + (v.training_verified ? "verified" : "unverified");
  $("verdict-label").textContent = v.training_verified ? "Training verified" : "Not verified";
  $("verdict-reason").textContent = v.reason;
}

function renderGlobal(g) {
  $("network-name").textContent = g.network;
  $("nodes-training").textContent = count(g.nodes_training);
  $("nodes-detail").textContent = `${count(g.nodes_registered)} registered · ${count(g.nodes_refused)} refused`;
  $("loss-measured").textContent = fmt(g.global_loss_measured);
  $("loss-reported").textContent = fmt(g.global_loss_reported);
  $("total-steps").textContent = count(g.total_inner_steps);
  $("total-tokens").textContent = `${count(g.total_tokens)} tokens`;
  $("shards").textContent = count(g.data_shards_covered);
  $("agreement").textContent = pct(g.hash_agreement_rate);
  $("sync").textContent = `hash agreement · sync ${pct(g.sync_success_rate)}`;
  const d = g.diloco;
  $("outer-rounds").textContent = count(d.outer_rounds);
  $("inner-h").textContent = count(d.inner_steps_per_round);
  const progress = d.inner_progress === null ? 0 : d.inner_progress;
  $("inner-progress").style.width = `${(100 * progress).toFixed(1)}%`;
  $("inner-progress-text").textContent = d.inner_progress === null ? "–" : pct(d.inner_progress);
  $("aggregation").textContent = `${d.aggregation_rule} (f=${d.aggregation_f})`;
  $("outer-opt").textContent = `SGD lr ${d.outer_lr}, Nesterov ${d.outer_momentum}`;
  const body = $("stages-table").querySelector("tbody");
  body.replaceChildren();
  for (const s of g.stages) {
    const row = document.createElement("tr");
    cell(row, String(s.stage));
    cell(row, String(s.replicas_alive));
    cell(row, s.latest_round === null ? "–" : String(s.latest_round));
    cell(row, s.majority_hash ? s.majority_hash.slice(0, 16) + "…" : "–", "mono");
    cell(row, pct(s.hash_agreement_rate));
    cell(row, String(s.accepted_contributions));
    cell(row, String(s.rejected_contributions));
    body.appendChild(row);
  }
}

function renderTrend(v) {
  const slope = v.loss_slope_per_round === null ? "" : ` (${fmt(v.loss_slope_per_round, 4)}/round)`;
  $("loss-trend").textContent = `${v.evaluations} evaluations · ${v.loss_trend}${slope}`;
}

const STAGE_COLORS = ["#3fb950", "#58a6ff", "#f0883e", "#d2a8ff", "#ff7b72", "#79c0ff", "#e3b341", "#8b949e"];

function renderHistory(h) {
  const measured = h.evaluations.map((e) => [e.round, e.loss]);
  const reportedByRound = new Map();
  for (const r of h.rounds) {
    if (r.reported_loss === null) continue;
    const prev = reportedByRound.get(r.round) || [];
    prev.push(r.reported_loss);
    reportedByRound.set(r.round, prev);
  }
  const reported = [...reportedByRound.entries()]
    .sort((a, b) => a[0] - b[0])
    .map(([round, xs]) => [round, xs.reduce((a, b) => a + b, 0) / xs.length]);
  drawChart($("loss-chart"), [
    { points: measured, color: "#58a6ff", label: "measured" },
    { points: reported, color: "#d2a8ff", label: "reported" },
  ], { empty: "no losses yet" });
  // One line per stage (never per node): a thousand replicas are a handful of stages.
  const byStage = new Map();
  for (const r of h.rounds) {
    if (r.agreement_rate === null) continue;
    if (!byStage.has(r.stage)) byStage.set(r.stage, []);
    byStage.get(r.stage).push([r.round, r.agreement_rate]);
  }
  const series = [...byStage.entries()].sort((a, b) => a[0] - b[0]).map(([stage, points], i) => ({
    points, color: STAGE_COLORS[i % STAGE_COLORS.length], label: `stage ${stage}`,
  }));
  drawChart($("agreement-chart"), series,
    { yRange: [0, 1], yFormat: (y) => `${(100 * y).toFixed(0)}%`, empty: "no rounds yet" });
  $("agreement-chart").dataset.series = String(series.length);
  $("agreement-legend").textContent = series.length > 1
    ? `one line per stage: ${series.map((s) => s.label).join(", ")} (colours in order: green, blue, orange, purple, …)`
    : "votes agreeing with the round's most common θ hash";
}

function renderNodes(nodes) {
  const body = $("nodes-table").querySelector("tbody");
  body.replaceChildren();
  for (const n of nodes) {
    const row = document.createElement("tr");
    row.dataset.wallet = n.wallet_id;
    cell(row, n.wallet_id, "mono");
    cell(row, n.stage === null ? "–" : String(n.stage));
    cell(row, n.status, "status-" + n.status);
    const rep = cell(row, "");
    const bar = document.createElement("span");
    bar.className = "rep";
    bar.style.width = `${Math.round(60 * n.reputation)}px`;
    rep.append(bar, document.createTextNode(fmt(n.reputation, 2)));
    cell(row, n.round === null ? "–" : `${n.round} (${n.steps_in_round ?? 0} steps)`);
    cell(row, ago(n.last_heartbeat));
    cell(row, n.software_version);
    body.appendChild(row);
  }
  const last = Math.min(nodeOffset + nodes.length, nodeTotal);
  $("nodes-page").textContent = nodeTotal ? `${nodeOffset + 1}–${last} of ${count(nodeTotal)}` : "none";
  $("nodes-prev").disabled = nodeOffset === 0;
  $("nodes-next").disabled = nodeOffset + NODES_PER_PAGE >= nodeTotal;
}

// Replay coverage under the node table: who was checked lately and what a liar's odds are.
function renderSpotChecks(c) {
  if (c.mode === "off") {
    $("spot-checks").textContent = "replay spot checks: off";
    return;
  }
  const bound = c.unnoticed.find((u) => u.lie_fraction === 0.1 && u.rounds === 100);
  const drawn = c.mode === "budget" ? `budget ${c.budget_replicas} replays/round` : `rate ${c.sample_rate}`;
  $("spot-checks").textContent =
    `replay spot checks (${drawn}): ${count(c.wallets_checked)} of ${count(c.wallets_reporting)} wallets ` +
    `checked in the last ${c.window_rounds} rounds` +
    (c.max_gap_rounds === null ? "" : `; every wallet within ${count(c.max_gap_rounds)} rounds`) +
    (bound ? `; a wallet lying in 10% of its rounds goes 100 rounds unnoticed with p ≤ ${fmt(bound.probability, 3)}` : "");
}

// A short text the verifier generated from the latest measured model. Model output is
// untrusted: it only ever goes into textContent, so "<script>" shows as those characters.
function renderSample(s) {
  const every = s.every_evaluations;
  if (s.sample === null) {
    $("sample-prompt").textContent = "";
    $("sample-text").textContent = "no sample yet";
    $("sample-round").textContent = "";
    $("sample-note").textContent = every === null ? "this verifier writes no samples"
      : `the verifier writes one after its first evaluation, then every ${every} evaluations`;
    return;
  }
  const x = s.sample;
  $("sample-round").textContent = `(round ${x.round})`;
  $("sample-prompt").textContent = x.prompt;
  $("sample-text").textContent = x.text;
  $("sample-note").textContent =
    `${x.max_new_tokens} tokens at most, temperature ${x.temperature}` +
    (x.seed === null ? "" : `, seed ${x.seed}`) + `; written ${ago(x.created_at)}` +
    (every === null ? "" : `, a new one every ${every} evaluations`);
}

async function refresh() {
  try {
    const [verify, global, history, nodes] = await Promise.all([
      getJSON("/api/training/verify"),
      getJSON("/api/training/global"),
      getJSON("/api/training/history"),
      getNodes(),
    ]);
    // Optional: a failure here must not blank the rest of the page.
    getJSON("/api/training/spot-checks?limit=1").then(renderSpotChecks, () => {});
    getJSON("/api/training/sample").then(renderSample, () => {});
    renderVerdict(verify);
    renderTrend(verify);
    renderGlobal(global);
    renderHistory(history);
    renderNodes(nodes);
    $("updated").textContent = new Date().toLocaleTimeString();
    if (!document.body.dataset.loaded) document.body.dataset.loadMs = String(Math.round(performance.now()));
    document.body.dataset.loaded = "true";
  } catch (err) {
    $("updated").textContent = `failed: ${err.message}`;
  }
}

$("nodes-prev").addEventListener("click", () => {
  nodeOffset = Math.max(0, nodeOffset - NODES_PER_PAGE);
  refresh();
});
$("nodes-next").addEventListener("click", () => {
  if (nodeOffset + NODES_PER_PAGE < nodeTotal) nodeOffset += NODES_PER_PAGE;
  refresh();
});
refresh();
setInterval(refresh, POLL_MS);
