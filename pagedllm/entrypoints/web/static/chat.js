// The chat playground: conversations in local storage, replies streamed from
// /v1/chat/completions, stop / regenerate, sampling settings and per-reply figures.
"use strict";

(function () {
  const api = window.pagedllmApi, md = window.pagedllmMarkdown;
  const STORE = "pagedllm.conversations", SETTINGS = "pagedllm.settings";
  const $ = (id) => document.getElementById(id);
  let model = null;
  let conversations = load(STORE, []);
  let current = null;
  let controller = null;

  function load(key, fallback) {
    try { return JSON.parse(localStorage.getItem(key)) || fallback; } catch (e) { return fallback; }
  }
  function save() { localStorage.setItem(STORE, JSON.stringify(conversations)); }

  // ---- settings ---------------------------------------------------------------------------
  const fields = { system: "system-prompt", temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", seed: "seed" };
  const saved = load(SETTINGS, {});
  for (const [k, id] of Object.entries(fields)) {
    if (saved[k] !== undefined) $(id).value = saved[k];
    $(id).addEventListener("change", () => {
      const s = {};
      for (const [k2, id2] of Object.entries(fields)) s[k2] = $(id2).value;
      localStorage.setItem(SETTINGS, JSON.stringify(s));
    });
  }

  function sampling() {
    const body = {};
    const num = (id) => $(id).value.trim() === "" ? null : Number($(id).value);
    if (num("temperature") !== null) body.temperature = num("temperature");
    if (num("top-p") !== null) body.top_p = num("top-p");
    if (num("max-tokens") !== null) body.max_tokens = num("max-tokens");
    if (num("seed") !== null) body.seed = num("seed");
    return body;
  }

  // ---- conversations ----------------------------------------------------------------------
  function newConversation() {
    current = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New conversation", messages: [] };
    conversations.unshift(current);
    save();
    renderList();
    renderMessages();
  }

  function renderList() {
    const ul = $("conversations");
    ul.replaceChildren();
    for (const c of conversations) {
      const li = document.createElement("li");
      li.textContent = c.title;
      if (c === current) li.className = "active";
      li.addEventListener("click", () => { if (!controller) { current = c; renderList(); renderMessages(); } });
      const del = document.createElement("button");
      del.className = "small del";
      del.textContent = "×";
      del.title = "Delete";
      del.addEventListener("click", (ev) => {
        ev.stopPropagation();
        if (controller) return;
        conversations = conversations.filter((x) => x !== c);
        save();
        if (c === current) { current = conversations[0] || null; if (!current) { newConversation(); return; } }
        renderList();
        renderMessages();
      });
      li.appendChild(del);
      ul.appendChild(li);
    }
  }

  function figures(stats) {
    const parts = [];
    if (stats.ttft !== undefined) parts.push("TTFT " + stats.ttft.toFixed(2) + " s");
    if (stats.tps !== undefined) parts.push(stats.tps.toFixed(1) + " tokens/s");
    if (stats.tokens !== undefined) parts.push(stats.tokens + " tokens");
    if (stats.cached !== undefined) parts.push(stats.cached + " cached prompt tokens");
    if (stats.finish) parts.push(stats.finish);
    return parts.join(" · ");
  }

  function messageNode(m) {
    const div = document.createElement("div");
    div.className = "msg " + m.role;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = m.role === "user" ? "You" : (m.model || "assistant");
    const body = document.createElement("div");
    body.className = "body";
    body.appendChild(md.render(m.content));
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = m.stats ? figures(m.stats) : "";
    div.append(who, body, stats);
    return div;
  }

  function renderMessages() {
    const box = $("messages");
    box.replaceChildren(...(current ? current.messages.map(messageNode) : []));
    box.scrollTop = box.scrollHeight;
  }

  // ---- a reply ----------------------------------------------------------------------------
  function busy(on) {
    $("send").disabled = on;
    $("regenerate").disabled = on;
    $("stop").disabled = !on;
  }

  function showError(text) {
    const e = $("chat-error");
    e.textContent = text || "";
    e.hidden = !text;
  }

  async function reply() {
    const conv = current;
    const history = conv.messages.map((m) => ({ role: m.role, content: m.content }));
    const system = $("system-prompt").value.trim();
    if (system) history.unshift({ role: "system", content: system });
    const m = { role: "assistant", content: "", model: model, stats: {} };
    conv.messages.push(m);
    const node = messageNode(m);
    $("messages").appendChild(node);
    const body = node.querySelector(".body"), stats = node.querySelector(".stats");
    controller = new AbortController();
    busy(true);
    showError("");
    const start = performance.now();
    let first = null, last = null;
    try {
      const resp = await api.call("/v1/chat/completions", {
        method: "POST", signal: controller.signal,
        body: JSON.stringify(Object.assign({ model: model, messages: history, stream: true,
                                             stream_options: { include_usage: true } }, sampling())),
      });
      await api.readEvents(resp, (name, data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          const text = (choice.delta && choice.delta.content) || "";
          if (text) {
            const now = performance.now();
            if (first === null) { first = now; m.stats.ttft = (now - start) / 1000; }
            last = now;
            m.content += text;
            node.dataset.chunks = (Number(node.dataset.chunks) || 0) + 1;
            body.replaceChildren(md.render(m.content));
            $("messages").scrollTop = $("messages").scrollHeight;
          }
          if (choice.finish_reason) m.stats.finish = choice.finish_reason;
        }
        if (chunk.usage) {
          m.stats.tokens = chunk.usage.completion_tokens;
          const details = chunk.usage.prompt_tokens_details;
          m.stats.cached = details && details.cached_tokens ? details.cached_tokens : 0;
        }
        stats.textContent = figures(m.stats);
      });
    } catch (e) {
      if (e.name === "AbortError") m.stats.finish = "stopped";
      else showError(e.message);
    } finally {
      if (first !== null && m.stats.tokens) {
        const secs = ((last || first) - first) / 1000;
        if (secs > 0 && m.stats.tokens > 1) m.stats.tps = (m.stats.tokens - 1) / secs;
      }
      stats.textContent = figures(m.stats);
      node.dataset.done = "1";
      controller = null;
      busy(false);
      save();
    }
  }

  function send(text) {
    if (controller || !text.trim()) return;
    if (!current) newConversation();
    current.messages.push({ role: "user", content: text });
    if (current.messages.length === 1) { current.title = text.slice(0, 40); renderList(); }
    $("messages").appendChild(messageNode(current.messages[current.messages.length - 1]));
    save();
    reply();
  }

  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("regenerate").addEventListener("click", () => {
    if (controller || !current || !current.messages.length) return;
    if (current.messages[current.messages.length - 1].role === "assistant") current.messages.pop();
    if (!current.messages.length) return;
    renderMessages();
    reply();
  });
  $("new-chat").addEventListener("click", () => { if (!controller) newConversation(); });

  // ---- start ------------------------------------------------------------------------------
  api.call("/v1/models").then((r) => r.json()).then((j) => {
    model = j.data[0].id;
    $("model-name").textContent = model;
  }).catch((e) => showError("cannot list the models: " + e.message));
  current = conversations[0] || null;
  if (!current) newConversation(); else { renderList(); renderMessages(); }

  window.pagedllmChat = { send: send, render: md.render };
})();
