// legorl view: curves, rollouts and trajectories of one run, polled live.
// Everything the run wrote is agent output and may be hostile: it reaches the
// page only as text nodes and attributes, never as HTML.
"use strict";

const POLL_MS = 2000;
// Sampled tokens below this probability are marked: where a trajectory took an unlikely turn.
const UNLIKELY_LOGPROB = Math.log(0.1);
// Sampled tokens whose learner logprob differs from the engine's by more than this (in nats) are marked:
// where the two policies (or their numerics) disagree, importance ratios move far from 1.
const DISAGREE_NATS = 0.5;
const MAX_ROWS = 1000;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

// What each chart plots: fixed keys, or every key a test function accepts.
const CHARTS = [
  { title: "Train reward and pass rate", keys: ["reward/mean", "pass_rate"] },
  { title: "Held-out pass rate per harness configuration", test: (k) => k === "eval_pass_rate" || k.startsWith("eval_pass_rate/") },
  { title: "Train pass rate per harness configuration", test: (k) => k.startsWith("pass_rate/") },
  { title: "Groups kept and dropped", keys: ["groups/kept", "groups/dropped_zero_variance", "groups/dropped_too_few_graded"] },
  { title: "Env failures and ungraded", keys: ["rollout/env_failures", "rollout/verifier_no_reward", "trajectories/ungraded", "trajectories/stale"] },
  { title: "Loss", keys: ["loss"] },
  { title: "Gradient norm and learning rate", keys: ["grad_norm", "learning_rate"] },
  { title: "Update size (update norm / weight norm)", keys: ["update_ratio"] },
  { title: "Clip fractions", keys: ["clip_frac_low", "clip_frac_high"] },
  { title: "IS ratio and MIS rejections", keys: ["ratio_mean", "ratio_max", "mis_rejected_frac"] },
  { title: "Learner–engine logprob difference", keys: ["logprob_diff_mean", "logprob_diff_max", "prob_diff_mean", "prob_diff_max"] },
  { title: "Policy lag (versions, from rollouts)", keys: ["policy_lag/max", "policy_lag/mean"] },
  { title: "Time split (s)", keys: ["time/rollout_s", "time/learner_s", "time/publish_s", "time/reload_s"] },
  { title: "Entropy", keys: ["entropy"] },
];

const state = {
  metrics: { records: [], derived: [] },
  metricsEpoch: null,
  metricsSig: "",
  rows: [],
  epoch: null,
  rowsSig: "",
  trajectory: null,
};

// ------------------------------------------------------------------ utils --

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(v, digits = 3) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return v.toFixed(digits);
}

async function getJSON(url) {
  const res = await fetch(url, { cache: "no-store" });
  if (!res.ok && res.status !== 404) throw new Error(`${url}: HTTP ${res.status}`);
  return res.json();
}

function parseHash() {
  const hash = location.hash.replace(/^#\/?/, "");
  const [path, query] = hash.split("?");
  return { parts: path.split("/").filter(Boolean), params: new URLSearchParams(query || "") };
}

function notice(messages) {
  const box = document.getElementById("notice");
  box.replaceChildren(...messages.map((m) => el("div", { class: "msg", text: m })));
}

// ----------------------------------------------------------------- curves --

function seriesFor(chart, records) {
  const keys = new Set();
  for (const r of records) for (const k of Object.keys(r)) if (chart.keys ? chart.keys.includes(k) : chart.test(k)) keys.add(k);
  const ordered = chart.keys ? chart.keys.filter((k) => keys.has(k)) : [...keys].sort();
  return ordered.map((key) => ({
    key,
    points: records
      .filter((r) => typeof r[key] === "number" && Number.isFinite(r[key]) && typeof r.step === "number")
      .map((r) => [r.step, r[key]]),
  }));
}

function niceTicks(lo, hi, count) {
  const span = hi - lo || 1;
  const raw = span / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => span / s <= count) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

function drawChart(chart, records) {
  const box = el("div", { class: "chart", "data-title": chart.title }, el("h2", { text: chart.title }));
  const series = seriesFor(chart, records).filter((s) => s.points.length);
  if (!series.length) {
    box.append(el("div", { class: "none", text: "not recorded yet" }));
    return box;
  }
  const W = 440, H = 190, L = 48, R = 10, T = 8, B = 24;
  const xs = series.flatMap((s) => s.points.map((p) => p[0]));
  const ys = series.flatMap((s) => s.points.map((p) => p[1]));
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  for (const t of niceTicks(y0, y1, 4)) {
    root.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: py(t), y2: py(t) }));
    root.append(svg("text", { class: "tick", x: L - 4, y: py(t) + 3, "text-anchor": "end" }, fmt(t, 2)));
  }
  for (const t of niceTicks(x0, x1, 6).filter(Number.isInteger)) {
    root.append(svg("text", { class: "tick", x: px(t), y: H - B + 14, "text-anchor": "middle" }, String(t)));
  }
  root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  root.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  root.append(svg("text", { class: "tick", x: W - R, y: H - 2, "text-anchor": "end" }, "step"));
  const legend = el("div", { class: "legend" });
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = s.points.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ");
    root.append(svg("polyline", { points: pts, fill: "none", stroke: color, "stroke-width": 1.8, "data-key": s.key }));
    for (const [x, y] of s.points) {
      const dot = svg("circle", { cx: px(x), cy: py(y), r: 2.6, fill: color });
      dot.append(svg("title", {}, `${s.key} @ step ${x}: ${fmt(y, 4)}`));
      root.append(dot);
    }
    const last = s.points[s.points.length - 1];
    legend.append(el("span", {}, el("i", { style: `background:${color}` }), `${s.key} (${fmt(last[1])})`));
  });
  box.append(root, legend);
  return box;
}

function renderCurves(main) {
  const { records, derived } = state.metrics;
  if (!records.length && !derived.length) {
    main.replaceChildren(el("div", { class: "empty", id: "no-steps", text: "No steps recorded yet: metrics.jsonl is empty or missing. The page updates when the run writes its first step." }));
    return;
  }
  // Policy lag comes from rollouts.jsonl; it joins the metric records by step.
  const all = records.concat(derived);
  const train = records.filter((r) => r.kind === "train");
  const last = train.length ? train[train.length - 1].step : 0;
  main.replaceChildren(
    el("div", { class: "count", id: "step-count", text: `${train.length} train steps (latest step ${last}); ${records.length - train.length} evaluations` }),
    el("div", { class: "charts" }, ...CHARTS.map((c) => drawChart(c, all))),
  );
}

// --------------------------------------------------------------- rollouts --

const FILTERS = ["step", "kind", "task", "harness", "status", "reward"];

function stepMatches(spec, step) {
  if (!spec) return true;
  const m = spec.match(/^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$/);
  if (!m) return true; // an unreadable range filters nothing
  const lo = Number(m[1]), hi = m[2] === undefined ? lo : Number(m[2]);
  return step >= lo && step <= hi;
}

function rewardMatches(spec, reward) {
  if (spec === "pass") return reward !== null && reward >= 1 - 1e-6;
  if (spec === "fail") return reward !== null && reward < 1 - 1e-6;
  if (spec === "ungraded") return reward === null;
  return true;
}

function filteredRows(params) {
  const f = Object.fromEntries(FILTERS.map((k) => [k, params.get(k) || ""]));
  const out = [];
  state.rows.forEach((row, index) => {
    if (!stepMatches(f.step, row.step)) return;
    for (const k of ["kind", "task", "harness", "status"]) if (f[k] && row[k] !== f[k]) return;
    if (!rewardMatches(f.reward, row.reward)) return;
    out.push([index, row]);
  });
  return out;
}

function setFilter(name, value) {
  const { params } = parseHash();
  if (value) params.set(name, value); else params.delete(name);
  const query = params.toString();
  location.hash = "#/rollouts" + (query ? "?" + query : "");
}

function selectFilter(name, label, options, current) {
  const select = el("select", { id: `filter-${name}`, name });
  select.append(el("option", { value: "", text: "any" }));
  for (const [value, text] of options) {
    const opt = el("option", { value, text });
    if (value === current) opt.selected = true;
    select.append(opt);
  }
  select.addEventListener("change", () => setFilter(name, select.value));
  return el("label", {}, label, select);
}

function distinct(key) {
  return [...new Set(state.rows.map((r) => r[key]).filter((v) => v !== null && v !== undefined))].sort().map((v) => [String(v), String(v)]);
}

function renderRollouts(main, params) {
  if (!state.rows.length) {
    main.replaceChildren(el("div", { class: "empty", id: "no-rollouts", text: "No rollouts recorded yet: rollouts.jsonl is empty or missing." }));
    return;
  }
  const stepInput = el("input", { id: "filter-step", name: "step", placeholder: "3 or 2-5", value: params.get("step") || "" });
  stepInput.addEventListener("change", () => setFilter("step", stepInput.value.trim()));
  const filters = el(
    "div", { class: "filters" },
    el("label", {}, "step", stepInput),
    selectFilter("kind", "train / eval", [["train", "train"], ["eval", "eval"]], params.get("kind")),
    selectFilter("task", "task", distinct("task"), params.get("task")),
    selectFilter("harness", "harness configuration", distinct("harness"), params.get("harness")),
    selectFilter("status", "status", distinct("status"), params.get("status")),
    selectFilter("reward", "reward", [["pass", "passed (1)"], ["fail", "graded below 1"], ["ungraded", "ungraded"]], params.get("reward")),
  );
  const rows = filteredRows(params);
  const table = el("table", { id: "rollouts" });
  table.append(el("thead", {}, el("tr", {}, ...["#", "step", "kind", "task", "harness", "status", "reward", "advantage", "sampled tokens", "error"].map((h) => el("th", { text: h })))));
  const body = el("tbody");
  for (const [index, r] of rows.slice(0, MAX_ROWS)) {
    body.append(el(
      "tr", { "data-index": index },
      el("td", {}, el("a", { href: `#/t/${index}`, text: String(index) })),
      el("td", { class: "num", text: fmt(r.step) }),
      el("td", { text: r.kind || "" }),
      el("td", {}, el("a", { href: `#/t/${index}`, text: r.task || "" })),
      el("td", { text: r.harness || "" }),
      el("td", { class: `status-${r.status}`, text: r.status || "" }),
      el("td", { class: "num", text: fmt(r.reward) }),
      el("td", { class: "num", text: fmt(r.advantage) }),
      el("td", { class: "num", text: fmt(r.sampled_tokens) }),
      el("td", { class: "err", title: r.error || "", text: r.error || "" }),
    ));
  }
  table.append(body);
  const shown = Math.min(rows.length, MAX_ROWS);
  const count = `${rows.length} of ${state.rows.length} trajectories match` + (shown < rows.length ? ` (first ${shown} shown: narrow the filters)` : "");
  main.replaceChildren(filters, el("div", { class: "count", id: "match-count", text: count }), table);
}

// ------------------------------------------------------------- trajectory --

// Character ranges of tool calls and tool results in a sequence's text (Qwen3's chat format). A call
// counts only where the model wrote it and a result only where the harness did: the system prompt quotes both tags.
function markupRanges(text) {
  const out = [];
  for (const [re, cls] of [[/<tool_call>[\s\S]*?(<\/tool_call>|$)/g, "toolcall"], [/<tool_response>[\s\S]*?(<\/tool_response>|$)/g, "toolresult"]]) {
    for (const m of text.matchAll(re)) out.push([m.index, m.index + m[0].length, cls]);
  }
  return out;
}

// Pieces that draw nothing and take no width (a lone "\r", other control characters,
// zero-width characters): the stylesheet gives them a sliver to hover or click.
const INKLESS = /^[\u0000-\u0008\u000b-\u001f\u007f\u200b-\u200d\ufeff]+$/;
// Pieces of blanks that break the line: the stylesheet shows a return mark to hover or click.
const LINE_BREAK = /^[ \t\r]*\n\s*$/;

// Each sampled token's policy version, from the sequence's [version, count] runs over its sampled tokens
// (a completion that a weight update split has two); null when the runs are missing or do not cover them.
function sampledVersions(seq) {
  const runs = seq.versions || [];
  const out = runs.flatMap(([version, count]) => Array(count).fill(version));
  const sampled = (seq.spans || []).reduce((n, [start, end]) => n + end - start, 0);
  return runs.length && out.length === sampled ? out : null;
}

function tokenSpan(seq, i, offset, ranges, sampledIndex, version) {
  const piece = seq.pieces[i];
  const cls = ["tok"];
  if (INKLESS.test(piece)) cls.push("blank");
  else if (LINE_BREAK.test(piece)) cls.push("newline");
  const mid = offset + piece.length / 2;
  const wanted = sampledIndex !== null ? "toolcall" : "toolresult";
  for (const [s, e, c] of ranges) if (c === wanted && mid >= s && mid <= e) cls.push(c);
  let title = `token ${i} · id ${seq.ids[i]} · ${JSON.stringify(piece)}`;
  if (sampledIndex !== null) {
    cls.push("sampled");
    const lp = seq.logprobs[sampledIndex];
    if (typeof lp === "number") {
      title += ` · behaviour logprob ${lp.toFixed(4)} (p=${Math.exp(lp).toFixed(3)})`;
      if (lp < UNLIKELY_LOGPROB) cls.push("unlikely");
    }
    if (version !== null) title += ` · policy version ${version}`;
    const learner = (seq.learner_logprobs || [])[sampledIndex];
    if (typeof learner === "number") {
      title += ` · learner logprob ${learner.toFixed(4)}`;
      if (typeof lp === "number") {
        const diff = learner - lp;
        title += ` · learner − behaviour ${diff >= 0 ? "+" : ""}${diff.toFixed(4)}`;
        if (Math.abs(diff) > DISAGREE_NATS) cls.push("disagree");
      }
    }
  }
  // Sampled tokens take keyboard focus: focusing one shows its details like hovering does.
  const attrs = { class: cls.join(" "), title, "data-i": i, "data-version": version, tabindex: sampledIndex !== null ? "0" : null };
  return el("span", attrs, piece);
}

// |learner − behaviour| over the sampled tokens both logprobs are recorded for.
function disagreement(seq) {
  const learner = seq.learner_logprobs || [];
  const diffs = (seq.logprobs || [])
    .map((lp, j) => (typeof lp === "number" && typeof learner[j] === "number" ? Math.abs(learner[j] - lp) : null))
    .filter((d) => d !== null);
  if (!diffs.length) return null;
  return { max: Math.max(...diffs), mean: diffs.reduce((a, b) => a + b, 0) / diffs.length, count: diffs.length };
}

// The sequence as alternating context (prompt, tool results) and sampled completions: one completion per model call.
// Without a token record (logging.rollout_tokens) it shows the completions' text, `texts`, one per span.
function renderSequence(seq, k, total, texts) {
  const pieces = seq.pieces || [];
  const spans = seq.spans || [];
  const text = pieces.join("");
  const ranges = markupRanges(text);
  const offsets = [];
  let acc = 0;
  for (const p of pieces) { offsets.push(acc); acc += p.length; }
  const notes = [];
  notes.push(seq.advantage === null || seq.advantage === undefined ? "not trained" : `trained with advantage ${fmt(seq.advantage, 4)}`);
  const versions = sampledVersions(seq);
  const distinctVersions = versions ? [...new Set(versions)] : [];
  notes.push(distinctVersions.length > 1
    ? `sampled by policy versions ${distinctVersions.join(", ")} (a weight update landed mid-sequence)`
    : `policy version ${distinctVersions.length ? distinctVersions[0] : seq.policy_version}`);
  if (seq.model_calls > 1) notes.push(`the proxy merged ${seq.model_calls} model calls into this sequence`);
  const forks = {
    history_rewritten: "forked: the harness rewrote earlier turns, so the history did not extend the previous sequence",
    restart: "forked: the harness started over without earlier turns",
    side_call: "side call (another system prompt or tool set)",
  };
  if (forks[seq.root_reason]) notes.push(forks[seq.root_reason]);
  else if (k > 0 && !seq.root_reason) notes.push("forked: a new sequence because the history did not extend the previous one");
  else if (seq.side_call) notes.push("side call");
  if (seq.recomputed_tokens > 0) notes.push(`${seq.recomputed_tokens} reused tokens trained with logprobs the engine recomputed`);
  const gap = disagreement(seq);
  if (gap) notes.push(`learner − behaviour logprob |Δ| max ${gap.max.toFixed(4)}, mean ${gap.mean.toFixed(4)} over ${gap.count} tokens`);
  const box = el("section", { class: "sequence", id: `seq-${k}` },
    el("h3", {}, `sequence ${k + 1} of ${total}`, el("span", { class: "note", text: notes.join(" · ") })));
  if (!seq.pieces) {
    box.append(el("div", { class: "segment untracked", text: "No token record for this sequence (logging.rollout_tokens); its sampled text:" }));
    texts.forEach((text, call) => box.append(el("div", { class: "segment completion" },
      el("div", { class: "label", text: `model call ${call + 1}` }), el("div", { class: "tokens", text }))));
    return box;
  }
  let pos = 0;
  let sampledIndex = 0;
  const segment = (start, end, sampled, label) => {
    const tokens = el("div", { class: "tokens" });
    for (let i = start; i < end; i++) {
      const version = sampled && versions ? versions[sampledIndex] : null;
      // Where the policy changes inside a completion, a mark (drawn by the stylesheet, not part of the text).
      if (version !== null && i > start && version !== versions[sampledIndex - 1]) {
        tokens.append(el("span", { class: "version-change", "data-version": version, title: `policy version ${version} from here` }));
      }
      tokens.append(tokenSpan(seq, i, offsets[i], ranges, sampled ? sampledIndex++ : null, version));
    }
    const seg = el("div", { class: "segment " + (sampled ? "completion" : "prompt") }, el("div", { class: "label", text: label }));
    // Long context (the system prompt, the tool list) is folded; what the model wrote never is.
    if (!sampled && end - start > 400) {
      seg.append(el("details", {}, el("summary", { text: `${end - start} context tokens` }), tokens));
    } else {
      seg.append(tokens);
    }
    box.append(seg);
  };
  spans.forEach(([start, end], call) => {
    if (start > pos) segment(pos, start, false, call === 0 ? "prompt" : "context: tool results and the harness's next message");
    const first = versions ? sampledIndex : null;
    const callVersions = versions ? [...new Set(versions.slice(first, first + end - start))] : [];
    const by = callVersions.length > 1 ? ` by policy versions ${callVersions.join(" → ")}` : "";
    segment(start, end, true, `model call ${call + 1}: sampled ${end - start} tokens${by}`);
    pos = end;
  });
  if (pos < pieces.length) segment(pos, pieces.length, false, "context after the last sampled token");
  return box;
}

function renderTrajectory(main, t) {
  if (t.step === undefined) {
    main.replaceChildren(el("div", { class: "empty", id: "no-trajectory", text: t.error || "No such trajectory." }));
    return;
  }
  const m = t.metrics || {};
  const dl = el("dl");
  const row = (k, v) => dl.append(el("dt", { text: k }), el("dd", { text: v }));
  row("step", `${t.step} (${t.kind})`);
  row("task", t.task || "");
  row("harness configuration", t.harness || "");
  row("status", t.status || "");
  row("reward", t.reward === null ? "none (ungraded)" : fmt(t.reward, 4));
  row("model calls / tool calls", `${fmt(m.model_calls)} / ${fmt(m.tool_calls)}`);
  row("history rewrites / tool parse errors", `${fmt(m.history_rewrites)} / ${fmt(m.tool_parse_errors)}`);
  row("agent / verifier time (s)", `${fmt(m.agent_s, 1)} / ${fmt(m.verify_s, 1)}`);
  const summary = el("div", { class: "summary", id: "trajectory-summary" },
    el("div", {}, el("a", { href: "#/rollouts", text: "← rollouts" })), dl);
  if (t.error || m.verifier_no_reward) {
    const what = m.verifier_no_reward ? "verifier wrote no reward (graded 0): " : "error: ";
    summary.append(el("div", { class: "verifier", id: "verifier" }, what + (t.error || "")));
  }
  const key = el("p", { class: "key", id: "token-key" },
    el("span", { class: "tok sampled", text: "sampled (trained)" }),
    el("span", { class: "tok sampled unlikely", text: "sampled with p < 0.1" }),
    el("span", { class: "tok sampled disagree", text: `learner and behaviour logprob differ by more than ${DISAGREE_NATS} nats` }),
    el("span", { class: "version-change", "data-version": "N", title: "policy version N from here" }, "the policy changed (a weight update landed mid-completion)"),
    el("span", { class: "tok toolcall", text: "tool call" }),
    el("span", { class: "tok toolresult", text: "tool result" }));
  const info = el("div", { class: "token-info", id: "token-info", text: "hover, click or focus a token for its position, id, and behaviour and learner logprobs" });
  const seqs = t.sequences || [];
  const sampled = t.sampled || [];
  let used = 0;  // `sampled` holds every sequence's span texts in order
  const body = seqs.length
    ? seqs.map((s, k) => {
      const texts = sampled.slice(used, used + (s.spans || []).length);
      used += (s.spans || []).length;
      return renderSequence(s, k, seqs.length, texts);
    })
    : [el("div", { class: "empty", text: (t.sampled && t.sampled.length) ? "This run's log has sampled text only (written before token records): " + t.sampled.join(" ⏎ ") : "No token sequences recorded for this trajectory." })];
  main.replaceChildren(summary, key, ...body, info);
}

// ------------------------------------------------------------------- main --

async function render() {
  const main = document.getElementById("main");
  const { parts, params } = parseHash();
  const view = parts[0] || "curves";
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.id === `nav-${view === "t" ? "rollouts" : view}`);
  if (view === "t") {
    const index = Number(parts[1]);
    if (!state.trajectory || state.trajectory.index !== index) {
      state.trajectory = { index, record: await getJSON(`/api/rollouts/${index}`) };
    }
    renderTrajectory(main, state.trajectory.record);
  } else if (view === "rollouts") {
    renderRollouts(main, params);
  } else {
    renderCurves(main);
  }
}

// The rows of a growing file: only what was appended since the last poll, or all of them after a rewrite.
async function fetchPage(url, rows, epoch) {
  const since = epoch === null ? 0 : rows.length;
  const page = await getJSON(`${url}?since=${since}&epoch=${epoch === null ? "" : epoch}`);
  return { page, epoch: page.epoch, rows: (page.start === 0 ? [] : rows).concat(page.rows) };
}

async function poll() {
  try {
    const run = await getJSON("/api/run");
    document.getElementById("run-name").textContent = run.name;
    const messages = [];
    if (!run.exists) messages.push(`${run.run_dir} does not exist (yet).`);
    for (const [file, n] of Object.entries(run.malformed)) if (n) messages.push(`${n} malformed line(s) in ${file} skipped.`);
    notice(messages);

    const metrics = await fetchPage("/api/metrics", state.metrics.records, state.metricsEpoch);
    state.metrics = { records: metrics.rows, derived: metrics.page.derived };
    state.metricsEpoch = metrics.epoch;
    const rollouts = await fetchPage("/api/rollouts", state.rows, state.epoch);
    if (rollouts.epoch !== state.epoch) state.trajectory = null; // a rewritten file: indices may name other records
    state.rows = rollouts.rows;
    state.epoch = rollouts.epoch;
    const metricsSig = `${metrics.epoch}:${metrics.rows.length}:${metrics.page.derived.length}`;
    const rowsSig = `${state.epoch}:${state.rows.length}`;
    const view = parseHash().parts[0] || "curves";
    const changed = (view === "curves" && metricsSig !== state.metricsSig) || (view === "rollouts" && rowsSig !== state.rowsSig);
    state.metricsSig = metricsSig;
    state.rowsSig = rowsSig;
    if (changed) await render();
    document.getElementById("live").textContent = `live · updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    document.getElementById("live").textContent = `viewer unreachable (${err.message}); retrying`;
  }
}

// A token's details show in the trajectory's bar that stays in view: on hover, on click (touch) and on
// keyboard focus. Listeners on <main> (installed once) outlive the re-renders of its content.
function showTokenInfo(event) {
  const info = document.getElementById("token-info");
  const tok = event.target.closest && event.target.closest(".tok");
  if (info && tok && tok.title) info.textContent = tok.title;
}
for (const type of ["mouseover", "click", "focusin"]) document.getElementById("main").addEventListener(type, showTokenInfo);

window.addEventListener("hashchange", () => {
  render().catch((err) => { document.getElementById("main").replaceChildren(el("div", { class: "empty", text: `could not load: ${err.message}` })); });
});

(async function start() {
  await poll();
  await render();
  setInterval(poll, POLL_MS);
})();
