// neuron's page: a chat playground and the cluster at a glance. Plain DOM, no build step, no CDN.
// Text from the model or the server is only ever set as textContent: nothing it says is read as HTML.
"use strict";

const KEY = "neuron.key"; // the API key where the page had to ask for it, in this tab's session storage only
const STORE = "neuron.conversations"; // conversations live in this browser, never on the server
const POLL_MS = 1000;
const HISTORY_MS = 5 * 60 * 1000;

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "text") node.textContent = value;
    else if (name === "cls") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

// The API key: the browser asked for it when it loaded the page (HTTP Basic) and resends it with every call here.
// Only if a call is still refused (the key changed since, say) does the page ask for it and send it as a bearer token.

function headers(json) {
  const out = json ? { "content-type": "application/json" } : {};
  const key = sessionStorage.getItem(KEY);
  if (key) out.authorization = "Bearer " + key;
  return out;
}

function askForKey() {
  $("key-form").classList.remove("hidden");
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key-input").value.trim());
  $("key-input").value = "";
  $("key-form").classList.add("hidden");
  poll();
});

// Views.

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    for (const other of document.querySelectorAll(".tab")) other.classList.toggle("active", other === tab);
    for (const view of document.querySelectorAll(".view")) view.classList.toggle("hidden", view.id !== "view-" + tab.dataset.view);
  });
}

// Conversations, kept in localStorage.

let conversations = [];
try {
  conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
} catch {
  conversations = [];
}
let current = null;
let streaming = null; // the AbortController of the reply being streamed
let image = null; // a data: URL attached to the next message

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
  } catch {
    // Over the browser's quota (images are large): keep the words, drop the images.
    const words = conversations.map((c) => ({ ...c, messages: c.messages.map((m) => ({ ...m, content: textOf(m.content) })) }));
    localStorage.setItem(STORE, JSON.stringify(words));
  }
}

function newConversation() {
  if (current && current.messages.length === 0) return render(); // the empty one at hand will do
  current = { id: Date.now().toString(36), title: "New chat", messages: [] };
  conversations.unshift(current);
  save();
  render();
}

function renderList() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const conversation of conversations) {
    const remove = el("button", { type: "button", title: "Delete", text: "×" });
    remove.addEventListener("click", (event) => {
      event.stopPropagation();
      conversations = conversations.filter((c) => c !== conversation);
      if (current === conversation) current = conversations[0] || null;
      save();
      if (!current) newConversation();
      else render();
    });
    const item = el("li", { cls: conversation === current ? "current" : "" }, el("span", { text: conversation.title }), remove);
    item.addEventListener("click", () => {
      if (streaming) return;
      current = conversation;
      render();
    });
    list.append(item);
  }
}

function textOf(content) {
  if (typeof content === "string") return content;
  return content.filter((part) => part.type === "text").map((part) => part.text).join("");
}

function messageNode(message) {
  const copy = el("button", { type: "button", cls: "copy", text: "Copy" });
  const node = el("div", { cls: "message " + message.role }, el("div", { cls: "role" }, el("span", { text: message.role }), copy));
  const reasoning = el("details", { cls: "reasoning hidden" }, el("summary", { text: "Reasoning" }), el("div"));
  const content = el("div", { cls: "content" });
  node.append(reasoning, content);
  if (Array.isArray(message.content)) {
    for (const part of message.content) if (part.type === "image_url") node.append(el("img", { src: part.image_url.url, alt: "attached image" }));
  }
  copy.addEventListener("click", async () => {
    const text = textOf(message.content);
    try {
      await navigator.clipboard.writeText(text);
    } catch {
      const area = el("textarea");
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    copy.textContent = "Copied";
    setTimeout(() => (copy.textContent = "Copy"), 1500);
  });
  const show = (m) => {
    content.textContent = textOf(m.content);
    if (m.reasoning) {
      reasoning.classList.remove("hidden");
      reasoning.lastChild.textContent = m.reasoning;
    }
    if (m.error) node.append(el("div", { cls: "error", text: m.error }));
  };
  show(message);
  return { node, show };
}

function render() {
  renderList();
  const box = $("messages");
  box.replaceChildren(...current.messages.map((m) => messageNode(m).node));
  box.scrollTop = box.scrollHeight;
}

// A reply, streamed as server-sent events from /v1/chat/completions.

async function send(text) {
  const content = image ? [{ type: "text", text }, { type: "image_url", image_url: { url: image } }] : text;
  current.messages.push({ role: "user", content });
  if (current.title === "New chat") current.title = text.slice(0, 40) || "Image";
  image = null;
  $("attached").textContent = "";
  $("attach").value = "";
  const reply = { role: "assistant", content: "", reasoning: "" };
  current.messages.push(reply);
  save();
  render();
  const view = messageNode(reply);
  $("messages").lastChild.replaceWith(view.node);

  const system = $("system").value.trim();
  const history = current.messages.slice(0, -1).map(({ role, content }) => ({ role, content }));
  const body = {
    model: modelId || "default",
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  streaming = new AbortController();
  $("stop").disabled = false;
  $("send").disabled = true;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(true),
      body: JSON.stringify(body),
      signal: streaming.signal,
    });
    if (response.status === 401) askForKey();
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || "HTTP " + response.status);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const lines = buffer.split("\n");
      buffer = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const event = JSON.parse(line.slice(6));
        if (event.error) throw new Error(event.error.message);
        const delta = (event.choices && event.choices[0] && event.choices[0].delta) || {};
        if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
        if (delta.content) reply.content += delta.content;
      }
      view.show(reply);
      $("messages").scrollTop = $("messages").scrollHeight;
      // A read of a chunk already received resolves at once, as a microtask: a page behind its stream would read
      // to the end without taking a click (Stop) or painting. One task per chunk lets them in.
      await new Promise((resolve) => setTimeout(resolve, 0));
    }
  } catch (error) {
    if (error.name === "AbortError") reply.stopped = true;
    else reply.error = String(error.message || error);
    view.show(reply);
  } finally {
    view.node.dataset.done = reply.stopped ? "stopped" : "done";
    streaming = null;
    $("stop").disabled = true;
    $("send").disabled = false;
    save();
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if ((!text && !image) || streaming) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

// Stopping closes the stream: the server cancels the request at its next step.
$("stop").addEventListener("click", () => streaming && streaming.abort());
$("new-chat").addEventListener("click", () => !streaming && newConversation());

$("attach").addEventListener("change", () => {
  const file = $("attach").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.addEventListener("load", () => {
    image = reader.result;
    $("attached").textContent = file.name;
  });
  reader.readAsDataURL(file);
});

// The cluster, from /v1/status.

let modelId = null;
// A router of several models (docs/several-models.md): the model the page shows and chats with, picked by the
// person; its status is the router's /v1/status?model=NAME.
let picked = null;

function renderPicker(models) {
  const picker = $("model-picker");
  picker.classList.remove("hidden");
  picker.replaceChildren(...models.map((m) => el("option", { value: m.id, text: `${m.id} (${m.status.value})` })));
  picker.value = picked;
}

$("model-picker").addEventListener("change", () => {
  picked = $("model-picker").value;
  poll();
});

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function facts(dl, pairs) {
  dl.replaceChildren();
  for (const [name, value] of pairs) dl.append(el("dt", { text: name }), el("dd", { text: String(value ?? "–") }));
}

function chart(svg, label, points, unit) {
  const NS = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const values = points.map((p) => p[1]);
  const top = Math.max(...values, 1e-9);
  const line = document.createElementNS(NS, "polyline");
  const coords = points.map(([x, v]) => `${(x * 298 + 1).toFixed(1)},${(78 - (v / top) * 74).toFixed(1)}`);
  line.setAttribute("points", coords.join(" "));
  svg.append(line);
  const busy = values.filter((v) => v > 0);
  const mean = busy.length ? busy.reduce((a, b) => a + b, 0) / busy.length : 0;
  label.textContent = `peak ${Math.max(...values, 0).toFixed(1)} ${unit}, mean ${mean.toFixed(1)} ${unit} while busy (last 5 min)`;
}

// The server's seconds of the last five minutes, each with its steps (a second without one is idle: zero).
function series(status) {
  const now = Math.floor(status.now);
  const span = HISTORY_MS / 1000;
  const bySecond = new Map(status.recent.map((b) => [b[0], b]));
  const step = [];
  const tps = [];
  for (let s = now - span + 1; s <= now; s++) {
    const b = bySecond.get(s);
    const x = (s - (now - span + 1)) / (span - 1);
    step.push([x, b && b[1] ? (b[2] / b[1]) * 1000 : 0]);
    tps.push([x, b ? b[3] : 0]);
  }
  return { step, tps };
}

function rankState(rank, events) {
  // The latest event naming this rank decides between lost and recovered, so that a poll that fell between the
  // loss and the recovery still shows both.
  const last = events.filter((e) => e.ranks.includes(rank.rank)).pop();
  if (rank.state === "lost" || (last && last.event !== "recovered")) return "lost";
  if (rank.state === "starting") return "starting";
  return last ? "recovered" : "ok";
}

function renderStatus(status) {
  if (status.models) renderPicker(status.models);
  modelId = status.model.id;
  $("model-name").textContent = status.model.id;
  const ready = $("readiness");
  ready.textContent = status.ready ? "ready" : status.reason;
  ready.className = "badge " + (status.ready ? "ready" : "unready");
  $("attach-label").classList.toggle("hidden", !status.model.vision);
  const arch = status.model.architecture || {};
  facts($("model-facts"), [
    ["id", status.model.id],
    ["architecture", arch.model_type],
    ["layers", arch.layers],
    ["hidden size", arch.hidden_size],
    ["attention heads", arch.attention_heads],
    ["KV heads", arch.kv_heads],
    ["context", status.model.context_length],
    ["ranks", status.world_size],
    ["spares", (status.spares || []).map((s) => `${s.host} (${s.state})`).join(", ") || "none"],
    ["pipeline stages", status.pipeline_stages],
    ["images", status.model.vision ? "yes" : "no"],
  ]);
  const kv = status.kv_cache || {};
  const prefix = status.prefix_cache || {};
  const memory = status.memory || {};
  facts($("load-facts"), [
    ["waiting", status.queue.waiting],
    ["running", status.queue.running],
    ["memory budget", memory.budget_bytes === undefined ? "–" : `${bytes(memory.budget_bytes)} for the caches (rank ${memory.rank}), ${Math.round((memory.usage || 0) * 100)}% held`],
    ["preempted", status.counters.preemptions ?? 0],
    ["KV cache", `${kv.sequences ?? 0}/${kv.max_sequences ?? "–"} sequences, ${kv.tokens ?? 0} tokens, ${bytes(kv.bytes ?? 0)}`],
    ["prefix cache", prefix.enabled ? `${prefix.entries} entries, ${bytes(prefix.bytes)} of ${bytes(prefix.budget_bytes)}` : "off"],
    ["prefix hits", `${status.counters.prefix_cache_hits} hit, ${status.counters.prefix_cache_misses} missed`],
    ["recoveries", status.recoveries],
  ]);
  const { step, tps } = series(status);
  chart($("chart-step"), $("chart-step-label"), step, "ms");
  chart($("chart-tps"), $("chart-tps-label"), tps, "tok/s");

  $("crowded").replaceChildren(...(status.crowded || []).map((machine) => el("p", { cls: "warning", text: machine.advice })));
  const ranks = $("ranks");
  ranks.replaceChildren();
  for (const rank of status.ranks) {
    const state = rankState(rank, status.events);
    const read = rank.memory_read_at
      ? `read ${Math.max(0, Math.round(status.now - rank.memory_read_at))} s ago`
      : "when it joined";
    const card = el(
      "div",
      { cls: "card rank", "data-rank": String(rank.rank), "data-state": state },
      el("h3", { text: `rank ${rank.rank} · ${rank.host}` }),
      el("div", { cls: "state", text: state }),
    );
    const dl = el("dl");
    facts(dl, [
      ["host name", rank.hostname],
      ["device", rank.device],
      ["weights", bytes(rank.weights_bytes)],
      [`memory used (${rank.memory_read_at ? read : "not read yet"})`, bytes(rank.used_bytes)],
      [`memory free (${read})`, bytes(rank.free_bytes)],
      ["layers", rank.layers ? `${rank.layers[0]}–${rank.layers[1] - 1}` : "–"],
      ["attention heads", rank.heads ?? "all"],
      ...(rank.memory
        ? [
            ["memory in all", bytes(rank.memory.total_bytes)],
            ["kept for a step", bytes(rank.memory.steps_bytes)],
            ["headroom", bytes(rank.memory.headroom_bytes)],
            ["caches' budget", `${bytes(rank.memory.caches_bytes)} of ${bytes(rank.memory.budget_bytes)}`],
          ]
        : []),
    ]);
    card.append(dl);
    if (rank.reason) card.append(el("div", { cls: "muted", text: rank.reason }));
    ranks.append(card);
  }
  const events = $("events");
  events.replaceChildren();
  for (const event of status.events) {
    const when = new Date(event.at * 1000).toLocaleTimeString();
    const who = event.ranks.length ? `rank ${event.ranks.join(", ")}` : "the group";
    // A loss, a move to a spare, a drain and a shrink (or its refusal) say why; a recovery says what it came after.
    const why = ["lost", "moved", "drained", "shrunk", "not shrunk"];
    const cause = why.includes(event.event) ? event.reason : "after " + event.reason;
    events.append(el("li", { cls: event.event.replace(" ", "-"), text: `${when} ${who} ${event.event}: ${cause}` }));
  }
  if (!status.events.length) events.append(el("li", { cls: "muted", text: "none" }));
}

async function poll() {
  try {
    const query = picked ? "?model=" + encodeURIComponent(picked) : "";
    const response = await fetch("/v1/status" + query, { headers: headers(false) });
    if (response.status === 401) return askForKey();
    if (!response.ok) return;
    const status = await response.json();
    if (!status.model && status.models) {
      // A router's overview: show a model of its, a loaded one where there is one.
      picked = (status.models.find((m) => m.status.value === "loaded") || status.models[0]).id;
      return poll();
    }
    renderStatus(status);
  } catch {
    $("readiness").textContent = "server unreachable";
    $("readiness").className = "badge unready";
  }
}

current = conversations[0] || null;
if (current) render();
else newConversation();
poll();
setInterval(poll, POLL_MS);
