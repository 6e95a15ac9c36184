// lightning view: polls the read-only JSON API and draws with plain DOM + SVG.
"use strict";
const KEY = new URLSearchParams(location.search).get("key");
const POLL_MS = 1500;
const state = { offset: 0, rows: [], next: null, filters: "", sessionsNext: null };

async function api(path) {
  const headers = KEY ? { Authorization: "Bearer " + KEY } : {};
  const r = await fetch(path, { headers });
  if (!r.ok) throw new Error(path + ": " + r.status + " " + (await r.text()));
  return r.json();
}
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k);
  return e;
}
const fmt = (x) => (x === null || x === undefined ? "–" : Math.abs(x) >= 100 || x === Math.round(x) ? String(+x.toFixed(1)) : String(+x.toPrecision(3)));

// ---------------------------------------------------------------- charts
// Each chart: title and the series it draws; keys as a list or a RegExp over the row keys.
const CHARTS = [
  { id: "reward", title: "reward", keys: ["reward_mean", "eval_reward"], ci: ["eval_reward", "eval_ci_low", "eval_ci_high"] },
  { id: "loss", title: "loss", keys: ["loss", "policy_loss"] },
  { id: "sft", title: "supervised (SFT) loss", keys: ["sft_loss", "sft_val_loss"] },
  { id: "sft-entropy", title: "SFT entropy", keys: ["sft_entropy", "sft_val_entropy"] },
  { id: "kl", title: "KL", keys: ["approx_kl", "gap_kl", "kl_penalty"] },
  { id: "entropy", title: "entropy", keys: /^entropy/ },
  { id: "staleness", title: "staleness", keys: /stale/ },
  { id: "idle", title: "idle fraction", keys: /idle_frac$/ },
];
const COLORS = ["#4c78a8", "#e45756", "#54a24b", "#b279a2", "#f58518", "#72b7b2"];
const SVGNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}
function keysOf(spec, rows) {
  if (Array.isArray(spec.keys)) return spec.keys.filter((k) => rows.some((r) => typeof r[k] === "number"));
  const seen = new Set();
  for (const r of rows) for (const k in r) if (spec.keys.test(k) && typeof r[k] === "number") seen.add(k);
  return [...seen].sort();
}
function drawCharts() {
  const host = document.getElementById("charts");
  const rows = state.rows;
  document.getElementById("no-metrics").hidden = rows.length > 0;
  for (const spec of CHARTS) {
    const keys = keysOf(spec, rows);
    let card = document.getElementById("chart-" + spec.id);
    if (!keys.length) { if (card) card.remove(); continue; }
    if (!card) {
      card = el("div", { class: "chart", id: "chart-" + spec.id }, el("h3", {}, spec.title), svg("svg", { viewBox: "0 0 340 170", preserveAspectRatio: "none" }), el("div", { class: "legend" }));
      host.append(card);
    }
    drawChart(card, spec, keys, rows);
  }
}
// Axis ticks at round values, steps of 1, 2 or 5 x 10^k: a reader takes a value
// off the axis without arithmetic. The smallest such step that gives at most
// `n` ticks in [lo, hi] (at least 1 for whole-number steps), so the axis keeps
// the data's range and the ticks fall inside it.
function niceTicks(lo, hi, n, minStep) {
  const mag = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)) - 1);
  let step = mag;
  for (let i = 0; ; i++) {
    step = [1, 2, 5][i % 3] * mag * Math.pow(10, Math.floor(i / 3));
    if (step >= (minStep || 0) && Math.floor(hi / step + 1e-9) - Math.ceil(lo / step - 1e-9) + 1 <= n) break;
  }
  // The step's decimals, so labels read 0.3, not 0.30000000000000004.
  const dec = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const values = [];
  for (let i = Math.ceil(lo / step - 1e-9); i <= Math.floor(hi / step + 1e-9); i++) values.push(+(i * step).toFixed(dec));
  return { values, label: (v) => v.toFixed(dec) };
}
function drawChart(card, spec, keys, rows) {
  const W = 340, H = 170, L = 42, R = 8, T = 8, B = 22;
  const plot = card.querySelector("svg");
  plot.replaceChildren();
  const step = (r, i) => (typeof r.step === "number" ? r.step : i);
  const series = keys.map((k) => rows.map((r, i) => [step(r, i), r[k]]).filter((p) => typeof p[1] === "number"));
  let ys = series.flat().map((p) => p[1]);
  const ci = spec.ci && rows.filter((r) => typeof r[spec.ci[1]] === "number" && typeof r[spec.ci[2]] === "number");
  if (ci) for (const r of ci) ys.push(r[spec.ci[1]], r[spec.ci[2]]);
  const xs = series.flat().map((p) => p[0]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const yt = niceTicks(y0, y1, 5);
  const xt = niceTicks(x0, x1, 6, xs.every((x) => Number.isInteger(x)) ? 1 : 0);
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  plot.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }), svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  for (const v of yt.values) {
    const ty = svg("text", { class: "tick", x: 2, y: Y(v) + 3 }); ty.textContent = yt.label(v); plot.append(ty);
  }
  for (const v of xt.values) {
    const tx = svg("text", { class: "tick", x: X(v) - 6, y: H - 6 }); tx.textContent = xt.label(v); plot.append(tx);
  }
  card.dataset.yticks = yt.values.map(yt.label).join(" ");
  card.dataset.xticks = xt.values.map(xt.label).join(" ");
  let n = 0;
  const legend = card.querySelector(".legend");
  legend.replaceChildren();
  series.forEach((pts, i) => {
    const color = COLORS[i % COLORS.length];
    n += pts.length;
    plot.append(svg("polyline", { points: pts.map((p) => X(p[0]) + "," + Y(p[1])).join(" "), fill: "none", stroke: color, "stroke-width": 1.8 }));
    if (pts.length < 40 || keys[i] === "eval_reward") for (const p of pts) plot.append(svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: color }));
    const last = pts.length ? pts[pts.length - 1][1] : null;
    legend.append(el("span", { style: "color:" + color }, keys[i] + " " + fmt(last)));
  });
  if (ci) {
    const color = COLORS[keys.indexOf(spec.ci[0]) % COLORS.length];
    for (const r of ci) {
      const x = X(step(r, rows.indexOf(r)));
      plot.append(svg("line", { class: "ci", x1: x, x2: x, y1: Y(r[spec.ci[1]]), y2: Y(r[spec.ci[2]]), stroke: color, "stroke-width": 1.5 }));
      plot.append(svg("line", { x1: x - 3, x2: x + 3, y1: Y(r[spec.ci[1]]), y2: Y(r[spec.ci[1]]), stroke: color }), svg("line", { x1: x - 3, x2: x + 3, y1: Y(r[spec.ci[2]]), y2: Y(r[spec.ci[2]]), stroke: color }));
    }
    if (ci.length) legend.append(el("span", { class: "muted" }, "| eval 95% interval"));
  }
  card.dataset.points = n;
}

// Calls per second and errors, from the store (one aggregate per poll): x is
// seconds before the latest call, so a finished store shows its last activity.
const RATE = { id: "rate", title: "calls/s and errors (x: seconds before the latest call)", keys: ["calls_per_s", "upstream_errors_per_s", "aborted_per_s"] };
async function loadRate() {
  const r = await api("api/rate");
  let card = document.getElementById("chart-rate");
  if (!r.buckets.length) { if (card) card.remove(); return; }
  if (!card) {
    card = el("div", { class: "chart", id: "chart-rate" }, el("h3", {}, RATE.title), svg("svg", { viewBox: "0 0 340 170", preserveAspectRatio: "none" }), el("div", { class: "legend" }));
    document.getElementById("charts").prepend(card);
  }
  const rows = r.buckets.map((b) => ({ step: b.start - r.end, calls_per_s: b.calls / r.bucket_s, upstream_errors_per_s: b.upstream_errors / r.bucket_s, aborted_per_s: b.aborted / r.bucket_s }));
  drawChart(card, RATE, RATE.keys, rows);
  card.dataset.calls = r.buckets.reduce((n, b) => n + b.calls, 0);
  card.dataset.errors = r.buckets.reduce((n, b) => n + b.upstream_errors + b.aborted, 0);
}

// ---------------------------------------------------------------- rollout list
function filterQuery() {
  const q = new URLSearchParams();
  for (const [id, k] of [["f-status", "status"], ["f-mode", "mode"], ["f-group", "group"]]) {
    const v = document.getElementById(id).value.trim();
    if (v) q.set(k, v);
  }
  return q;
}
function rolloutRow(r) {
  return el("tr", { class: "rollout", "data-id": r.rollout_id, onclick: () => (location.hash = "#/rollout/" + encodeURIComponent(r.rollout_id)) },
    el("td", {}, r.rollout_id), el("td", {}, r.group || ""), el("td", {}, r.mode || ""),
    el("td", { class: "status-" + r.status }, r.status || ""), el("td", {}, fmt(r.reward)));
}
async function loadRollouts(append) {
  const q = filterQuery();
  q.set("limit", "50");
  if (append && state.next) q.set("after", state.next);
  const page = await api("api/rollouts?" + q);
  const body = document.querySelector("#rollouts tbody");
  if (!append) body.replaceChildren();
  for (const r of page.rollouts) body.append(rolloutRow(r));
  state.next = page.next;
  document.getElementById("more").hidden = !page.next;
}
async function loadSummary() {
  const s = await api("api/summary");
  document.getElementById("source").textContent = s.db + (s.metrics ? " · " + s.metrics : "") + (s.decoded ? "" : " · no tokenizer: token ids shown");
  const statuses = [...new Set(Object.values(s.by_mode).flatMap((m) => Object.keys(m)))].sort();
  const head = el("tr", {}, el("th", {}, "mode"), ...statuses.map((st) => el("th", {}, st === "running" || st === "queued" ? st + " (in flight)" : st)));
  const rows = Object.entries(s.by_mode).map(([mode, per]) => el("tr", {}, el("td", {}, mode), ...statuses.map((st) => el("td", { class: "status-" + st }, String(per[st] || 0)))));
  const t = el("table", { id: "counts-table" }, el("thead", {}, head), el("tbody", {}, ...rows));
  document.getElementById("counts").replaceChildren(s.store ? t : el("p", { class: "muted" }, "No store yet at " + s.db));
}

// ---------------------------------------------------------------- tokens
function lpColor(lp) {
  if (lp === null || lp === undefined) return "#e5e7eb";
  const p = Math.exp(Math.min(0, lp));
  return "hsl(" + Math.round(120 * p) + ",75%,82%)";
}
// Token spans: generated tokens (weights > 0, or all of a completion) coloured by logprob.
function tokenSpans(pieces, opts) {
  const box = el("div", { class: "tokens" });
  const splits = new Map((opts.splits || []).map((d) => [d.position, d]));
  pieces.forEach((piece, i) => {
    const d = splits.get(i);
    if (d) box.append(el("span", { class: "split-label", title: "call " + d.call_index + " left call " + d.left_call_index + "'s path at token " + i }, "✂ " + d.kind));
    const gen = opts.gen ? opts.gen[i] : true;
    const lp = opts.logprobs ? opts.logprobs[i] : null;
    const title = ["id " + opts.ids[i], gen && lp !== null && lp !== undefined ? "logprob " + lp.toFixed(3) : null, opts.versions && opts.versions[i] >= 0 ? "weights v" + opts.versions[i] : null, opts.calls && opts.calls[i] >= 0 ? "call " + opts.calls[i] : null].filter(Boolean).join(" · ");
    let cls = "tok " + (gen ? "gen" : "ctx") + (d ? " split" : "");
    if (opts.diff !== undefined && opts.diff !== null) cls += i === opts.diff ? " diff" : i > opts.diff ? " after-diff" : "";
    box.append(el("span", { class: cls, "data-i": i, "data-id": opts.ids[i], title, style: gen ? "background:" + lpColor(lp) : null }, piece));
  });
  return box;
}
function sampleView(s, divs, diff) {
  return tokenSpans(s.pieces, { ids: s.tokens, gen: s.weights.map((w) => w > 0), logprobs: s.logprobs, versions: s.weight_version, calls: s.call_index, splits: divs.filter((d) => d.position < s.tokens.length), diff });
}
function rolloutHeader(d) {
  const r = d.rollout;
  const versions = [...new Set(d.calls.map((c) => c.weight_version))];
  return el("div", {},
    el("h2", {}, "rollout " + r.rollout_id),
    el("p", {}, el("span", { class: "pill" }, "reward " + fmt(r.reward)), el("span", { class: "pill status-" + r.status }, r.status), el("span", { class: "pill" }, "mode " + (r.mode || "–")),
      r.group ? el("a", { class: "pill", href: "#/group/" + encodeURIComponent(r.group) }, "group " + r.group) : null,
      el("span", { class: "pill" }, (d.calls_total ?? d.calls.length) + " calls"), el("span", { class: "pill" }, "weights v" + versions.join(", v")),
      el("span", { class: "pill" }, (d.samples_total ?? d.samples.length) + " samples"), d.ids_hidden ? el("span", { class: "pill" }, "redacted: ids hidden") : null, el("span", { class: "pill" }, d.divergences.length + " splits")),
    r.task !== undefined ? el("details", {}, el("summary", {}, "task"), el("pre", {}, JSON.stringify(r.task, null, 2))) : null);
}
// "N of TOTAL" and a button that fetches the next page of a detail's calls or
// samples and appends it: `load(offset)` draws that page and returns how many it
// added and where the page after it starts (null: no more).
function pager(id, what, shown, total, next, load) {
  const count = el("span", { class: "muted" });
  const button = el("button", { id }, "more " + what);
  const box = el("p", { class: "pager", id: id + "-pager" }, count, " ", button);
  const set = (nxt) => {
    count.textContent = shown + " of " + total + " " + what;
    box.dataset.shown = shown;
    button.hidden = nxt === null || nxt === undefined;
    next = nxt;
  };
  button.addEventListener("click", async () => {
    button.disabled = true;
    try {
      const got = await load(next);
      shown += got.added;
      set(got.next);
    } catch (e) {
      count.textContent = String(e);
    }
    button.disabled = false;
  });
  set(next);
  return box;
}
function callView(c, i) {
  return el("div", { class: "call" },
    el("h4", {}, "call " + i + " · seq " + c.seq + " · " + c.kind + " · weights v" + c.weight_version + " · " + c.status + (c.finish_reason ? " · " + c.finish_reason : "") + (c.flags.length ? " · " + c.flags.join(",") : "") + " · " + fmt(c.latency_ms) + " ms"),
    el("details", {}, el("summary", {}, "prompt · " + c.prompt.length + " tokens"), tokenSpans(c.prompt, { ids: c.prompt_ids, gen: c.prompt.map(() => false) })),
    tokenSpans(c.completion, { ids: c.completion_ids, logprobs: c.logprobs }));
}
async function showRollout(id) {
  const path = "api/rollouts/" + encodeURIComponent(id);
  const d = await api(path);
  const box = document.getElementById("detail");
  const samples = el("div", { id: "samples" }, el("h3", {}, "merged samples (what trains: grey context, generated tokens coloured by logprob, ✂ split points with their drift cause)"));
  const sampleList = el("div", { class: "page-items" });
  const addSamples = (page, from) => page.forEach((s, i) => sampleList.append(el("h4", {}, "sample " + (from + i) + " · " + s.tokens.length + " tokens"), sampleView(s, d.divergences)));
  addSamples(d.samples, 0);
  samples.append(sampleList);
  // The next samples without calls (an offset past the last call), and the next calls without samples.
  if (d.samples_total > d.samples.length) samples.append(pager("more-samples", "samples", d.samples.length, d.samples_total, d.next_samples_offset, async (off) => {
    const p = await api(path + "?offset=" + d.calls_total + "&samples_offset=" + off);
    addSamples(p.samples, off);
    return { added: p.samples.length, next: p.next_samples_offset };
  }));
  if (d.divergences.length) samples.append(el("ul", {}, ...d.divergences.map((v) => el("li", {}, "call " + v.call_index + " left call " + v.left_call_index + "'s path at token " + v.position + ": " + v.kind))));
  const calls = el("div", { id: "calls" }, el("h3", {}, "calls (exact ids, decoded" + (d.decoded ? "" : ": no tokenizer, ids shown") + ")"));
  const callList = el("div", { class: "page-items" }, ...d.calls.map((c, i) => callView(c, i)));
  calls.append(callList);
  if (d.calls_total > d.calls.length) calls.append(pager("more-calls", "calls", d.calls.length, d.calls_total, d.next_offset, async (off) => {
    const p = await api(path + "?offset=" + off + "&samples_offset=" + d.samples_total);
    p.calls.forEach((c, i) => callList.append(callView(c, off + i)));
    return { added: p.calls.length, next: p.next_offset };
  }));
  const events = d.events.length ? el("details", {}, el("summary", {}, d.events.length + " events"), el("pre", {}, JSON.stringify(d.events, null, 1))) : null;
  box.replaceChildren(rolloutHeader(d), samples, calls, events);
}
// A group shows GROUP_PAGE rollouts side by side, each with its first page of
// samples; "more" controls add the next rollouts and each column's next samples.
const GROUP_PAGE = 8;
function groupCol(d, k) {
  const path = "api/rollouts/" + encodeURIComponent(d.rollout.rollout_id);
  const list = el("div", { class: "page-items" });
  const add = (page) => page.forEach((s) => list.append(sampleView(s, d.divergences)));
  add(d.samples);
  const more = d.samples_total > d.samples.length ? pager("more-samples-" + k, "samples", d.samples.length, d.samples_total, d.next_samples_offset, async (off) => {
    // An offset past the last call: the next samples without calls.
    const p = await api(path + "?offset=" + d.calls_total + "&samples_offset=" + off);
    add(p.samples);
    return { added: p.samples.length, next: p.next_samples_offset };
  }) : null;
  return el("div", { class: "col", "data-rollout": d.rollout.rollout_id },
    el("h3", {}, el("a", { href: "#/rollout/" + encodeURIComponent(d.rollout.rollout_id) }, d.rollout.rollout_id), " · reward " + fmt(d.rollout.reward)),
    list, more);
}
async function showGroup(g) {
  const grp = await api("api/groups/" + encodeURIComponent(g));
  const total = grp.rollouts.length;
  const cols = el("div", { class: "side", id: "group-cols" });
  const addCols = async (from) => {
    const page = grp.rollouts.slice(from, from + GROUP_PAGE);
    const details = await Promise.all(page.map((r) => api("api/rollouts/" + encodeURIComponent(r.rollout_id))));
    details.forEach((d, i) => cols.append(groupCol(d, from + i)));
    const next = from + details.length;
    return { added: details.length, next: next < total ? next : null };
  };
  const first = await addCols(0);
  document.getElementById("detail").replaceChildren(el("h2", {}, "group " + g + " · " + total + " rollouts, highest reward first"), cols,
    first.next !== null ? pager("more-rollouts", "rollouts", first.added, total, first.next, addCols) : null);
}
async function showCompare(a, b) {
  const c = await api("api/compare?a=" + encodeURIComponent(a) + "&b=" + encodeURIComponent(b));
  const col = (d) => el("div", { class: "col" }, el("h3", {}, el("a", { href: "#/rollout/" + encodeURIComponent(d.rollout.rollout_id) }, d.rollout.rollout_id), " · reward " + fmt(d.rollout.reward)),
    d.samples.length ? sampleView(d.samples[0], d.divergences, c.first_diff) : el("p", { class: "muted" }, "no trainable calls"));
  document.getElementById("detail").replaceChildren(
    el("h2", {}, "compare"), el("p", { id: "first-diff" }, c.first_diff === null ? "identical first samples" : "first diverging token: position " + c.first_diff + " (outlined red)"),
    el("div", { class: "side" }, col(c.a), col(c.b)));
}

// ---------------------------------------------------------------- online sessions
function sessionQuery() {
  const q = new URLSearchParams();
  for (const [id, k] of [["s-key", "key"], ["s-tag", "tag"], ["s-feedback", "feedback"], ["s-trained", "trained"]]) {
    const v = document.getElementById(id).value.trim();
    if (v) q.set(k, v);
  }
  return q;
}
const when = (t) => (t === null || t === undefined ? "–" : new Date(t * 1000).toLocaleString());
function sessionRow(s) {
  return el("tr", { class: "session", "data-id": s.rollout_id, onclick: () => (location.hash = "#/session/" + encodeURIComponent(s.rollout_id)) },
    el("td", {}, s.rollout_id + (s.session_key ? " · " + s.session_key : "")), el("td", {}, s.app_key || s.key_id), el("td", {}, s.tags.join(", ")),
    el("td", {}, String(s.n_calls)), el("td", {}, String(s.feedback)), el("td", { title: s.reward_error || "" }, fmt(s.reward)),
    el("td", {}, s.trained ? when(s.trained) : "no"), el("td", {}, when(s.updated) + (s.closed ? "" : " (open)")));
}
async function loadSessions(append) {
  const q = sessionQuery();
  q.set("limit", "50");
  if (append && state.sessionsNext) q.set("after", state.sessionsNext);
  const page = await api("api/sessions?" + q);
  const body = document.querySelector("#session-list tbody");
  if (!append) body.replaceChildren();
  for (const s of page.sessions) body.append(sessionRow(s));
  state.sessionsNext = page.next;
  document.getElementById("more-sessions").hidden = !page.next;
}
function contentText(c) {
  if (typeof c === "string") return c;
  if (Array.isArray(c)) return c.map((b) => (b && typeof b.text === "string" ? b.text : JSON.stringify(b))).join("");
  return c === null || c === undefined ? "" : JSON.stringify(c);
}
function message(m) {
  const role = m && m.role ? m.role : m && m.type ? m.type : "item";
  return el("div", { class: "msg " + role }, el("span", { class: "role" }, role), contentText(m && m.role ? m.content : m));
}
function turnView(c, i) {
  return el("div", { class: "turn", "data-protocol": c.protocol || "" },
    el("h4", {}, el("span", { class: "pill proto" }, c.protocol || "unknown protocol"), "call " + i + " · " + (c.response_id || "no response id") + " · " + c.status + " · weights v" + c.weight_version),
    ...c.sent.map(message),
    el("div", { class: "msg assistant" }, el("span", { class: "role" }, "assistant"), tokenSpans(c.completion, { ids: c.completion_ids, logprobs: c.logprobs })));
}
async function showSession(id) {
  const d = await api("api/sessions/" + encodeURIComponent(id));
  const r = d.rollout;
  const task = r.task || {};
  const protos = [...new Set(d.calls.map((c) => c.protocol).filter(Boolean))];
  const head = el("div", {},
    el("h2", {}, "session " + r.rollout_id),
    el("p", {}, el("span", { class: "pill" }, "key " + (task.app_key || "–")), ...(task.tags || []).map((t) => el("span", { class: "pill" }, "tag " + t)),
      task.session_key ? el("span", { class: "pill" }, "session id " + task.session_key) : null,
      el("span", { class: "pill", title: d.reward_error || "" }, "reward " + fmt(d.reward)), el("span", { class: "pill" }, d.feedback.length + " feedback"),
      el("span", { class: "pill" }, (d.calls_total ?? d.calls.length) + " calls"), el("span", { class: "pill" }, "protocols " + (protos.join(", ") || "–")),
      d.ids_hidden ? el("span", { class: "pill" }, "redacted: ids hidden") : null,
      el("a", { class: "pill", href: "#/rollout/" + encodeURIComponent(r.rollout_id) }, "tokens and samples")));
  const conv = el("div", { id: "conversation" }, el("h3", {}, "conversation (each call: what the harness sent that turn, then the answer decoded from its exact ids)"));
  const turns = el("div", { class: "page-items" }, ...d.calls.map((c, i) => turnView(c, i)));
  conv.append(turns);
  if (d.calls_total > d.calls.length) conv.append(pager("more-turns", "calls", d.calls.length, d.calls_total, d.next_offset, async (off) => {
    const p = await api("api/sessions/" + encodeURIComponent(id) + "?offset=" + off);
    p.calls.forEach((c, i) => turns.append(turnView(c, off + i)));
    return { added: p.calls.length, next: p.next_offset };
  }));
  const fb = el("div", { id: "feedback" }, el("h3", {}, "feedback signals"),
    d.feedback.length ? el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "name"), el("th", {}, "value"), el("th", {}, "target"), el("th", {}, "at"), el("th", {}, "after training"))),
      el("tbody", {}, ...d.feedback.map((f) => el("tr", {}, el("td", {}, f.name), el("td", {}, fmt(f.value)), el("td", {}, f.response_id || "session"), el("td", {}, when(f.ts)), el("td", {}, f.after_training ? "yes" : "no")))))
      : el("p", { class: "muted" }, "none"));
  document.getElementById("detail").replaceChildren(head, conv, fb);
}

// ---------------------------------------------------------------- routing and polling
async function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  const detail = document.getElementById("detail");
  const online = parts[0] === "sessions" || parts[0] === "session";
  document.getElementById("run").hidden = online;
  document.getElementById("sessions").hidden = !online;
  document.getElementById("nav-run").className = online ? "" : "here";
  document.getElementById("nav-sessions").className = online ? "here" : "";
  detail.hidden = !parts[0] || parts[0] === "sessions";
  try {
    if (online) await loadSessions(false);
    if (parts[0] === "session") await showSession(parts.slice(1).join("/"));
    else if (parts[0] === "rollout") await showRollout(parts.slice(1).join("/"));
    else if (parts[0] === "group") await showGroup(parts.slice(1).join("/"));
    else if (parts[0] === "compare") await showCompare(parts[1], parts[2]);
    // The detail is the page's first section (index.html): a link to a rollout,
    // group, session or comparison opens on it, the lists below.
    if (parts[0] && parts[0] !== "sessions") window.scrollTo(0, 0);
  } catch (e) {
    detail.replaceChildren(el("p", { class: "status-failed" }, String(e)));
  }
}
async function poll() {
  try {
    const m = await api("api/metrics?offset=" + state.offset);
    if (m.offset < state.offset) state.rows = [];
    state.offset = m.offset;
    if (m.rows.length || !state.drawn) { state.rows.push(...m.rows); drawCharts(); state.drawn = true; }
    await loadSummary();
    await loadRate();
    if (!document.getElementById("sessions").hidden && document.querySelectorAll("#session-list tbody tr").length <= 50) await loadSessions(false);
    if (!state.next || document.querySelectorAll("#rollouts tbody tr").length <= 50) await loadRollouts(false);
    const live = document.getElementById("live");
    live.textContent = "live · " + state.rows.length + " steps · updated " + new Date().toLocaleTimeString();
    live.dataset.steps = state.rows.length;
  } catch (e) {
    document.getElementById("live").textContent = "offline: " + e.message;
  }
  setTimeout(poll, POLL_MS);
}
document.getElementById("more").addEventListener("click", () => loadRollouts(true));
document.getElementById("more-sessions").addEventListener("click", () => loadSessions(true));
for (const id of ["s-key", "s-tag", "s-feedback", "s-trained"]) document.getElementById(id).addEventListener("change", () => loadSessions(false));
for (const id of ["f-status", "f-mode", "f-group"]) document.getElementById(id).addEventListener("change", () => loadRollouts(false));
document.getElementById("cmp-go").addEventListener("click", () => {
  location.hash = "#/compare/" + encodeURIComponent(document.getElementById("cmp-a").value.trim()) + "/" + encodeURIComponent(document.getElementById("cmp-b").value.trim());
});
window.addEventListener("hashchange", route);
poll();
route();
