// The chat page of `fsd-local serve`: plain JavaScript, no build step, nothing fetched from elsewhere.
// It talks to this server's OpenAI API (streaming) and reads fsd-local's extension fields: `fsd_delta` on each
// chunk (every new token's text and origin; divergence and log-probability gap of a token rescued by tau; how
// many tokens the round drafted) and `fsd` on the last chunk (the generation's statistics).
"use strict";

// the settings offered on the page, in this order, when the server accepts them (GET /v1/fsd/settings)
const CONTROLS = ["mode", "tau", "quality_budget", "drafter", "draft_policy", "temperature", "max_tokens"];
// the settings shown as sliders, with the range where the declarations leave one open (tau: js is at most ln 2);
// other numbers get a number box
const SLIDERS = { tau: [0, 1, 0.01], quality_budget: [0, 1, 0.01] };
const STEPS = { temperature: 0.1 };
// moving one of these sets the other aside: the quality budget moves the threshold itself (tau 0), tau means no budget
const EXCLUSIVE = { quality_budget: ["tau", 0], tau: ["quality_budget", null] };
const KEY_STORE = "fsd-local.api-key";

const $ = (id) => document.getElementById(id);
const state = { messages: [], settings: {}, changed: new Set(), start: {}, abort: null, busy: false };

// ------------------------------------------------------------------ talking to the server
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return `HTTP ${response.status}`;
}

async function* serverSentEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

async function loadSettings() {
  const response = await fetch("/v1/fsd/settings", { headers: headers() });
  if (!response.ok) {
    $("model").textContent = "";
    showError(response.status === 401
      ? "This server needs an API key: enter it under Settings."
      : "Could not read the server's settings: " + (await errorText(response)));
    if (response.status === 401) { $("controls-box").open = true; $("api-key").focus(); }
    return;
  }
  const info = await response.json();
  $("model").textContent = info.model + (info.has_draft ? "" : " (no draft model)");
  buildControls(info.settings);
  showError("");
}

// ------------------------------------------------------------------ controls, built from the declarations
function labelText(name) { return name === "tau" ? "tau" : name.replace(/_/g, " "); }

function formatValue(v) { return typeof v === "number" ? String(Math.round(v * 1000) / 1000) : String(v); }

function buildControls(declared) {
  const byName = Object.fromEntries(declared.map((d) => [d.name, d]));
  const box = $("controls");
  box.replaceChildren();
  state.settings = {};
  state.changed.clear();
  // the page starts with chat's sampling defaults where they differ from the API's (`start`): sent with every
  // request, shown on the controls the page has
  state.start = {};
  for (const d of declared) if (d.start !== undefined && d.start !== d.default) state.start[d.name] = d.start;
  for (const name of CONTROLS) {
    const found = byName[name];
    if (!found) continue;  // this server does not know the setting (yet)
    const d = { ...found, default: found.start !== undefined ? found.start : found.default };
    const id = "set-" + name;
    const field = document.createElement("div");
    field.className = "field";
    const label = document.createElement("label");
    label.htmlFor = id;
    label.title = d.help;
    label.append(labelText(name));
    let input;
    if (d.choices) {
      input = document.createElement("select");
      for (const c of d.choices) input.append(new Option(c, c, false, c === d.default));
    } else if (SLIDERS[name] || (d.min !== null && d.max !== null)) {
      const [lo, hi, step] = SLIDERS[name] || [d.min, d.max, d.type === "integer" ? 1 : 0.01];
      input = document.createElement("input");
      input.type = "range";
      input.min = d.min ?? lo;
      input.max = d.max ?? hi;
      input.step = step;
      input.value = d.default ?? lo;
      const out = document.createElement("output");
      out.htmlFor = id;
      out.id = id + "-value";
      out.textContent = d.default === null ? "off" : formatValue(Number(input.value));  // null: off until moved
      input.addEventListener("input", () => { out.textContent = formatValue(Number(input.value)); });
      label.append(out);
      field.classList.add("wide");
    } else {
      input = document.createElement("input");
      input.type = "number";
      input.step = STEPS[name] || (d.type === "integer" ? 1 : "any");
      if (d.min !== null) input.min = d.min;
      if (d.max !== null) input.max = d.max;
      input.value = d.default ?? "";
    }
    input.id = id;
    input.name = name;
    input.setAttribute("aria-label", labelText(name));
    input.addEventListener("input", () => moved(name));
    input.addEventListener("change", () => moved(name));
    state.settings[name] = { decl: d, input };
    field.append(label, input);
    box.append(field);
  }
}

function moved(name) {
  state.changed.add(name);
  const [other, value] = EXCLUSIVE[name] || [];
  const control = other && state.settings[other];
  if (!control) return;
  if (value === null) {  // back to off: not sent
    state.changed.delete(other);
    const out = document.getElementById(control.input.id + "-value");
    if (out) out.textContent = "off";
  } else if (Number(control.input.value) !== value || !state.changed.has(other)) {
    control.input.value = value;
    const out = document.getElementById(control.input.id + "-value");
    if (out) out.textContent = formatValue(value);
    state.changed.add(other);
  }
}

function requestSettings() {
  // chat's starting values and what the user moved: everything else is the server's own default
  const out = { ...state.start };
  for (const name of state.changed) {
    const { decl, input } = state.settings[name];
    if (decl.type === "number") out[name] = Number(input.value);
    else if (decl.type === "integer") out[name] = parseInt(input.value, 10);
    else out[name] = input.value;
  }
  return out;
}

// ------------------------------------------------------------------ the conversation
function addMessage(role, text) {
  $("empty").hidden = true;
  const msg = document.createElement("div");
  msg.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "you" : "assistant";
  const body = document.createElement("div");
  body.className = "body";
  if (text) body.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  msg.append(who, body, meta);
  $("log").append(msg);
  scrollDown();
  return msg;
}

function scrollDown() { const log = $("log"); log.scrollTop = log.scrollHeight; }

// Released text is matched to the tokens that produced it, character by character: every token becomes one
// element (data-origin = target | sd | fuzzy | forced), even when its text arrives over two chunks.
class ReplyView {
  constructor(msg) {
    this.msg = msg;
    this.body = msg.querySelector(".body");
    this.chars = [];  // [character, token index, token] decoded by the server, not yet shown
    this.read = 0;
    this.tokens = 0;
    this.span = null;
    this.spanIndex = null;
    this.text = "";
  }

  addTokens(tokens) {
    for (const t of tokens) {
      const index = this.tokens++;
      for (const ch of t.text) this.chars.push([ch, index, t]);
    }
  }

  addText(text) {
    for (const ch of text) {
      const [, index, token] = this.read < this.chars.length ? this.chars[this.read++] : [ch, -1, null];
      if (this.span === null || index !== this.spanIndex) this.newSpan(index, token);
      this.span.textContent += ch;
    }
    this.text += text;
    scrollDown();
  }

  newSpan(index, token) {
    const span = document.createElement("span");
    span.className = "tok";
    span.dataset.origin = token ? token.origin : "target";  // "draft": the draft-only baseline's tokens
    if (token && token.origin === "fuzzy") {
      if (token.divergence !== null && token.divergence !== undefined) span.dataset.divergence = token.divergence;
      span.dataset.logprobGap = token.logprob_gap;
      span.tabIndex = 0;
      span.setAttribute("aria-label", token.text + ": " + tipText(span));
    }
    this.body.append(span);
    this.span = span;
    this.spanIndex = index;
  }
}

function tipText(span) {
  const parts = ["rescued by tau"];
  if (span.dataset.divergence !== undefined) parts.push("divergence " + Number(span.dataset.divergence).toFixed(4));
  if (span.dataset.logprobGap !== undefined) {
    parts.push("log-prob gap " + Number(span.dataset.logprobGap).toFixed(3) + " nats (the target's top token vs this one)");
  }
  return parts.join(" · ");
}

// ------------------------------------------------------------------ statistics
class LiveStats {
  constructor() {
    this.start = performance.now();
    this.first = null;
    this.tokens = 0;
    this.byOrigin = { target: 0, sd: 0, fuzzy: 0, forced: 0, draft: 0 };
    this.rounds = 0;
    this.drafted = [];
    this.accepted = [];
  }

  add(delta) {
    const now = performance.now();
    if (this.first === null) { this.first = now; this.firstTokens = delta.tokens.length; }
    this.tokens += delta.tokens.length;
    let accepted = 0;
    for (const t of delta.tokens) {
      this.byOrigin[t.origin] = (this.byOrigin[t.origin] || 0) + 1;
      if (t.origin === "sd" || t.origin === "fuzzy") accepted++;
    }
    this.rounds++;
    for (let i = 0; i < delta.drafted; i++) {
      this.drafted[i] = (this.drafted[i] || 0) + 1;
      this.accepted[i] = (this.accepted[i] || 0) + (i < accepted ? 1 : 0);
    }
    const seconds = (now - this.first) / 1000;
    const rescued = this.byOrigin.sd + this.byOrigin.fuzzy;
    const drafted = this.drafted.reduce((a, b) => a + b, 0);
    showStats({
      tokens: this.tokens,
      tokens_per_second: seconds > 0.05 ? (this.tokens - this.firstTokens) / seconds : null,
      speedup_vs_plain_est: null,
      fuzzy_share: rescued ? this.byOrigin.fuzzy / rescued : 0,
      acceptance_rate: drafted ? rescued / drafted : null,
      mean_tokens_per_round: this.tokens / this.rounds,
      acceptance_by_position: this.drafted.map((d, i) => (d ? this.accepted[i] / d : 0)),
    }, "streaming…");
  }
}

function percent(x) { return x === null || x === undefined ? "–" : Math.round(x * 100) + "%"; }
function number(x, digits) { return x === null || x === undefined || !isFinite(x) ? "–" : x.toFixed(digits); }

function showStats(s, label) {
  $("stats-state").textContent = label;
  $("stat-tps").textContent = number(s.tokens_per_second, 1);
  $("stat-speedup").textContent = s.speedup_vs_plain_est ? s.speedup_vs_plain_est.toFixed(2) + "×" : "–";
  $("stat-fuzzy").textContent = percent(s.fuzzy_share);
  $("stat-accept").textContent = percent(s.acceptance_rate);
  $("stat-tokens").textContent = s.tokens ?? "–";
  $("stat-per-round").textContent = number(s.mean_tokens_per_round, 2);
  drawChart(s.acceptance_by_position || []);
}

function drawChart(rates) {
  const svg = $("chart");
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const W = 240, H = 80, left = 30, bottom = 14, top = 5;
  const el = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
    return e;
  };
  for (const y of [0, 0.5, 1]) {
    const py = top + (1 - y) * (H - top - bottom);
    el("line", { x1: left, x2: W, y1: py, y2: py, class: "axis" });
    el("text", { x: left - 4, y: py + 3, "text-anchor": "end" }, Math.round(y * 100) + "%");
  }
  if (!rates.length) {
    el("text", { x: (W + left) / 2, y: H / 2, "text-anchor": "middle" }, "no draft tokens yet");
    return;
  }
  const slot = (W - left) / rates.length;
  const width = Math.min(28, slot * 0.7);
  rates.forEach((r, i) => {
    const h = r * (H - top - bottom);
    const x = left + i * slot + (slot - width) / 2;
    const bar = el("rect", { x, y: H - bottom - h, width, height: Math.max(h, 0.5), class: "bar" });
    const title = document.createElementNS(ns, "title");
    title.textContent = `position ${i + 1}: ${Math.round(r * 100)}% accepted`;
    bar.append(title);
    el("text", { x: x + width / 2, y: H - 3, "text-anchor": "middle" }, String(i + 1));
  });
}

// ------------------------------------------------------------------ one reply
async function reply() {
  const msg = addMessage("assistant");
  const view = new ReplyView(msg);
  const live = new LiveStats();
  const controller = new AbortController();
  state.abort = controller;
  setBusy(true);
  showError("");
  $("stats-state").textContent = "waiting…";
  let final = null;
  let failed = null;
  try {
    const body = { messages: state.messages, stream: true, ...requestSettings() };
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of serverSentEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.fsd_delta) { view.addTokens(chunk.fsd_delta.tokens); live.add(chunk.fsd_delta); }
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && choice.delta.content) view.addText(choice.delta.content);
      if (chunk.fsd) final = chunk;
    }
  } catch (e) {
    if (e.name !== "AbortError") failed = e.message;
  } finally {
    state.abort = null;
    setBusy(false);
  }
  const meta = msg.querySelector(".meta");
  if (final) {
    const s = final.fsd;
    showStats(s, "finished: " + final.choices[0].finish_reason);
    const set = s.settings || {};
    meta.textContent = `${s.tokens} tokens · ${number(s.tokens_per_second, 1)} tokens/s · mode ${set.mode} · tau ${set.tau}`;
  } else if (failed) {
    msg.classList.add("failed");
    meta.textContent = "failed";
    showError(failed);
    $("stats-state").textContent = "failed";
  } else {
    meta.textContent = "stopped";
    $("stats-state").textContent = "stopped";
  }
  if (view.text || final) state.messages.push({ role: "assistant", content: view.text });
  else msg.remove();  // nothing came back: leave the conversation as it was
  $("regenerate").disabled = !state.messages.some((m) => m.role === "user");
}

function setBusy(busy) {
  state.busy = busy;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

// ------------------------------------------------------------------ wiring
function send() {
  const text = $("input").value.trim();
  if (!text || state.busy) return;
  $("input").value = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  reply();
}

function regenerate() {
  if (state.busy) return;
  if (state.messages.length && state.messages[state.messages.length - 1].role === "assistant") {
    state.messages.pop();
    const replies = $("log").querySelectorAll(".msg.assistant");
    if (replies.length) replies[replies.length - 1].remove();
  }
  if (state.messages.length) reply();
}

function newConversation() {
  if (state.abort) state.abort.abort();
  state.messages = [];
  for (const m of $("log").querySelectorAll(".msg")) m.remove();
  $("empty").hidden = false;
  $("regenerate").disabled = true;
  showError("");
  $("input").focus();
}

function showTip(event) {
  const tip = $("tip");
  const span = event.target.closest ? event.target.closest('.tok[data-origin="fuzzy"]') : null;
  if (!span || !$("log").contains(span)) { tip.hidden = true; return; }
  tip.textContent = tipText(span);
  tip.hidden = false;
  const r = span.getBoundingClientRect();
  const x = Math.min(r.left, window.innerWidth - tip.offsetWidth - 8);
  const y = r.top - tip.offsetHeight - 6 < 0 ? r.bottom + 6 : r.top - tip.offsetHeight - 6;
  tip.style.left = Math.max(8, x) + "px";
  tip.style.top = y + "px";
}

// the server's slots (requests generated at once) and its queue, from /health every 2 s
async function showServer() {
  try {
    const response = await fetch("/health");
    const h = await response.json();
    $("server-state").textContent = h.status;
    $("queue-waiting").textContent = h.queue ? String(h.queue.waiting) : "–";
    const list = $("slots");
    list.replaceChildren(...(h.slots || []).map((slot) => {
      const item = document.createElement("li");
      item.dataset.state = slot.state;
      const r = slot.request;
      item.textContent = r ? `slot ${slot.id}: ${r.mode}, ${r.tokens}/${r.max_tokens} tokens, ${r.seconds.toFixed(1)} s`
        : `slot ${slot.id}: idle`;
      return item;
    }));
  } catch (e) {
    $("server-state").textContent = "unreachable";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, $("api-key").value.trim());
    loadSettings();
  });
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (state.abort) state.abort.abort(); });
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newConversation);
  $("log").addEventListener("mouseover", showTip);
  $("log").addEventListener("focusin", showTip);
  $("log").addEventListener("mouseleave", () => { $("tip").hidden = true; });
  if (window.matchMedia("(max-width: 760px)").matches) $("controls-box").open = false;
  drawChart([]);
  loadSettings();
  showServer();
  setInterval(showServer, 2000);
});
