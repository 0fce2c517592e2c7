// The server's API from the page: the API key (asked once, kept in local storage), JSON calls,
// and server-sent events read from a fetch() body (EventSource cannot send the key).
"use strict";

(function () {
  const KEY = "pagedllm.apiKey";

  function headers(extra) {
    const h = Object.assign({ "Content-Type": "application/json" }, extra || {});
    const key = localStorage.getItem(KEY);
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function askKey() {
    const key = window.prompt("API key for this server (sent as Authorization: Bearer):", localStorage.getItem(KEY) || "");
    if (key === null) return false;
    if (key) localStorage.setItem(KEY, key); else localStorage.removeItem(KEY);
    return true;
  }

  async function call(path, options) {
    options = options || {};
    const resp = await fetch(path, Object.assign({}, options, { headers: headers(options.headers) }));
    if (resp.status === 401 && !options.retried && askKey()) {
      return call(path, Object.assign({}, options, { retried: true }));
    }
    if (!resp.ok) {
      let message = resp.status + " " + resp.statusText;
      try { message = (await resp.json()).error.message || message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    return resp;
  }

  // Calls onEvent(eventName, dataText) for every event of the response's SSE body.
  async function readEvents(resp, onEvent) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(name, data.join("\n"));
      }
    }
  }

  document.getElementById("key-button").addEventListener("click", askKey);
  window.pagedllmApi = { call: call, readEvents: readEvents, askKey: askKey };
})();
