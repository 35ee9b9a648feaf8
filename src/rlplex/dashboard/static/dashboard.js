// The rlplex dashboard's page: polls /api/view once a second and redraws in place.
// Curves arrive incrementally: the page says how many points of each run it holds (`have`) and
// gets the rest. Every text from the job (run ids, reasons, causes) goes in through textContent,
// never as HTML: a run's eviction reason is the user's text.
"use strict";

const POLL_MS = 1000;
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#8c6d31", "#7b4173", "#3182bd"];

const page = {
  curves: new Map(),  // run id -> {step: [], value: []}, as sent
  evals: new Map(),   // run id -> {step: [], value: []}
  colours: new Map(), // run id -> colour, kept as runs come and go
  charts: {},         // "curves" / "eval-curves" -> {plot, key}
  smoothing: 0.6,
  actions: false,
  updates: 0,
};

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function fmt(value, digits) {
  return value === null || value === undefined ? "—" : Number(value).toFixed(digits);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined || seconds < 0) return "—";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d${String(Math.floor(s % 86400 / 3600)).padStart(2, "0")}h`;
}

function colour(run) {
  if (!page.colours.has(run)) page.colours.set(run, PALETTE[page.colours.size % PALETTE.length]);
  return page.colours.get(run);
}

function haveParam() {
  return [...page.curves].map(([run, curve]) => `${run}:${curve.step.length}`).join(",");
}

// Exponential moving average with TensorBoard's debiasing: the first points are not pulled to 0.
function smooth(values, weight) {
  const out = new Array(values.length);
  let last = 0, count = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v === null) { out[i] = null; continue; }
    last = last * weight + (1 - weight) * v;
    count++;
    out[i] = weight > 0 ? last / (1 - Math.pow(weight, count)) : v;
  }
  return out;
}

function takeCurves(runs) {
  for (const run of runs) {
    const sent = run.curve;
    const held = page.curves.get(run.id);
    if (!held || sent.from === 0 || sent.from !== held.step.length) {
      page.curves.set(run.id, {step: sent.step.slice(), value: sent.value.slice()});
    } else {
      held.step.push(...sent.step);
      held.value.push(...sent.value);
    }
    if (run.eval_curve) page.evals.set(run.id, run.eval_curve);
  }
  const present = new Set(runs.map((run) => run.id));
  for (const run of [...page.curves.keys()]) if (!present.has(run)) page.curves.delete(run);
}

// uPlot wants one x array: the union of the runs' own steps, each run's y null where it has none.
function aligned(curves, weight) {
  const runs = [...curves.keys()].filter((run) => curves.get(run).step.length > 0);
  const xs = [...new Set(runs.flatMap((run) => curves.get(run).step))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const ys = runs.map((run) => {
    const curve = curves.get(run);
    const y = new Array(xs.length).fill(null);
    const values = smooth(curve.value, weight);
    curve.step.forEach((x, i) => { y[index.get(x)] = values[i]; });
    return y;
  });
  return {runs, data: [xs, ...ys]};
}

function drawChart(id, curves, weight, label) {
  const target = $(id);
  const {runs, data} = aligned(curves, weight);
  target.dataset.points = String(data[0].length ? runs.reduce((n, run) => n + curves.get(run).step.length, 0) : 0);
  const key = runs.join(",");
  const held = page.charts[id];
  if (held && held.key === key) {
    held.plot.setData(data);
    return;
  }
  if (held) held.plot.destroy();
  delete page.charts[id];
  if (!runs.length) return;
  const width = Math.max(400, Math.min(1200, document.body.clientWidth - 40));
  const options = {
    width, height: 320,
    scales: {x: {time: false}},
    axes: [{label: "step (of the run)"}, {label}],
    series: [{label: "step"}, ...runs.map((run) => ({label: run, stroke: colour(run), width: 1.5, spanGaps: true,
      points: {show: false}}))],
  };
  page.charts[id] = {plot: new uPlot(options, data, target), key};
}

function drawCurves() {
  drawChart("curves", page.curves, page.smoothing, "reward (smoothed)");
  $("eval-title").hidden = page.evals.size === 0;
  drawChart("eval-curves", page.evals, 0, "held-out score");
}

function cells(row, values) {
  for (const [text, cls] of values) row.append(el("td", text, cls));
}

function settingsText(settings) {
  return Object.entries(settings).map(([k, v]) => `${k}=${v}`).join(" ");
}

function drawRuns(runs) {
  const body = $("runs").tBodies[0];
  const rows = runs.map((run) => {
    const row = el("tr", null, run.state);
    row.dataset.run = run.id;
    row.dataset.state = run.state;
    row.dataset.restarts = String(run.restarts);
    row.dataset.doing = run.doing || "";
    row.dataset.points = String((page.curves.get(run.id) || {step: []}).step.length);
    const name = el("td");
    const swatch = el("span", null, "swatch");
    swatch.style.background = colour(run.id);
    name.append(swatch, document.createTextNode(run.id));
    row.append(name);
    cells(row, [
      // What its orchestrator is doing (loading the model, generating step 3) beside the state.
      [run.doing ? `${run.state} · ${run.doing}` : run.state, "state"], [`${run.step}/${run.max_steps}`, "num step"], [fmt(run.reward, 3), "num"],
      [fmt(run.reward_start, 3), "num"], [fmt(run.eval, 3), "num"], [fmt(run.tokens_per_s, 0), "num"],
      [fmt(run.staleness, 0), "num"], [run.restarts, "num restarts"], [duration(run.elapsed_s), "num"],
      [run.state === "finished" ? "done" : duration(run.eta_s), "num"],
    ]);
    const settings = settingsText(run.settings);
    const cell = el("td", settings, "settings");
    cell.title = settings;
    row.append(cell);
    if (page.actions) {
      const action = el("td");
      if (["running", "waiting", "evaluating"].includes(run.state)) {
        const button = el("button", "Evict…");
        button.addEventListener("click", () => evict(run.id));
        action.append(button);
      }
      row.append(action);
    }
    return row;
  });
  body.replaceChildren(...rows);
  document.querySelectorAll(".action-col").forEach((th) => { th.hidden = !page.actions; });
}

function drawNodes(nodes) {
  $("nodes").tBodies[0].replaceChildren(...nodes.map((node) => {
    const row = el("tr", null, node.state);
    row.dataset.node = node.id;
    row.dataset.restarts = String(node.restarts);
    const progress = Object.entries(node.progress).slice(0, 4).map(([k, v]) => `${k}=${v}`).join(", ");
    cells(row, [
      [node.role], [node.rank, "num"], [node.run || ""], [node.state], [node.restarts, "num restarts"],
      [node.heartbeat_age_s === null ? "—" : `${node.heartbeat_age_s.toFixed(1)} s`, "num"], [progress || "—"],
      [node.cause || ""],
    ]);
    return row;
  }));
}

function drawEvents(events) {
  $("events").tBodies[0].replaceChildren(...events.slice().reverse().map((event) => {
    const row = el("tr", null, event.kind);
    row.dataset.kind = event.kind;
    cells(row, [[new Date(event.at * 1000).toLocaleTimeString()], [event.text], [event.cause]]);
    return row;
  }));
}

function drawList(id, items) {
  $(id).replaceChildren(...items.map((item) => el("li", item)));
}

function draw(data) {
  const job = data.job;
  const badge = $("job-state");
  badge.textContent = job.state + (job.master_gone ? " (its master is gone)" : "");
  badge.className = `badge ${job.state.split(" ")[0]}${job.master_gone ? " gone" : ""}`;
  $("job-elapsed").textContent = duration(job.elapsed_s);
  $("job-eta").textContent = duration(job.eta_s);
  $("job-tokens").textContent = job.tokens_per_s === null ? "" :
    `trainer ${job.tokens_per_s.toFixed(0)} tokens/s (last ${job.tokens_window_s} s)`;
  $("job-folder").textContent = `${data.kind} job · ${data.folder}`;
  $("updated").textContent = `read ${new Date(data.read_at * 1000).toLocaleTimeString()}`;
  page.actions = data.actions && data.kind !== "train";
  $("stop-job").hidden = !page.actions;
  $("add-run").hidden = !(page.actions && data.kind === "main");
  takeCurves(data.runs);
  drawRuns(data.runs);
  drawCurves();
  drawNodes(data.nodes);
  drawEvents(data.events);
  drawList("notes", data.notes);
  drawList("messages", data.messages || []);
  drawList("lines", data.lines);
}

function problem(text) {
  $("problem").hidden = !text;
  $("problem").textContent = text || "";
}

async function poll() {
  try {
    const answer = await fetch(`/api/view?have=${encodeURIComponent(haveParam())}`,
      {credentials: "same-origin", cache: "no-store"});
    if (answer.status === 401) {
      problem("This dashboard needs its token: open the link `rlplex dashboard` printed.");
    } else if (!answer.ok) {
      problem(`The dashboard answered ${answer.status}: ${await answer.text()}`);
    } else {
      draw(await answer.json());
      problem("");
      page.updates++;
      document.body.dataset.updates = String(page.updates);
      if (page.updates === 1) document.body.dataset.firstPaintMs = String(performance.now());
    }
  } catch (error) {
    problem(`No answer from the dashboard (${error}); trying again.`);
  }
  setTimeout(poll, document.hidden ? 5 * POLL_MS : POLL_MS);
}

function confirmAction(text, askReason) {
  return new Promise((resolve) => {
    const dialog = $("confirm");
    $("confirm-text").textContent = text;
    $("reason-label").hidden = !askReason;
    $("confirm-reason").value = "";
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok" ? $("confirm-reason").value : null),
      {once: true});
    dialog.showModal();
  });
}

async function post(path, body) {
  const answer = await fetch(path, {method: "POST", credentials: "same-origin",
    headers: {"content-type": "application/json", "x-rlplex-action": "1"}, body: JSON.stringify(body)});
  const data = await answer.json().catch(() => ({error: `${answer.status}`}));
  problem(data.error ? `${path}: ${data.error}` : "");
  return !data.error;
}

async function evict(run) {
  const reason = await confirmAction(`Evict ${run}? Its orchestrator stops and the trainer frees its slot.`, true);
  if (reason !== null) await post("/api/evict", {run, reason: reason || "evicted from the dashboard"});
}

$("stop-job").addEventListener("click", async () => {
  const ok = await confirmAction("Stop the job? The trainer checkpoints, the report is written; " +
    "`rlplex resume` continues it.", false);
  if (ok !== null) await post("/api/stop", {});
});

// A local file fills the textarea (read here, sent as text: the server never opens a path the
// page names); an empty id becomes `run_<file stem>`, as `rlplex runs add` names it.
$("add-file").addEventListener("change", (event) => {
  const file = event.target.files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.addEventListener("load", () => {
    $("add-toml").value = reader.result;
    if (!$("add-id").value.trim()) $("add-id").value = `run_${file.name.replace(/\.[^.]*$/, "")}`;
  });
  reader.addEventListener("error", () => problem(`${file.name}: ${reader.error}`));
  reader.readAsText(file);
});

$("add-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const run = $("add-id").value.trim();
  const ok = await confirmAction(`Add ${run} to the job? Its master starts an orchestrator for it; ` +
    "the trainer then admits or rejects it (its row says which).", false);
  if (ok === null) return;
  const button = $("add-button");
  button.disabled = true;
  button.textContent = "Waiting for the job…";
  try {
    if (await post("/api/add", {run, toml: $("add-toml").value})) $("add-id").value = "";
  } finally {
    button.disabled = false;
    button.textContent = "Add the run…";
  }
});

$("smoothing").addEventListener("input", (event) => {
  page.smoothing = Number(event.target.value);
  $("smoothing-value").textContent = page.smoothing.toFixed(2);
  drawCurves();
});

poll();
