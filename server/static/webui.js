// The jitkern chat page: streams from this server's /v1/chat/completions (SSE read through fetch + a
// ReadableStream), renders the answer's markdown with the small renderer below, and shows tokens/s.
//
// Safety: model text never reaches innerHTML. The markdown renderer builds DOM nodes and puts every piece
// of text in with createTextNode / textContent, which the browser treats as text (escaped by
// construction: a "<script>" in an answer is shown, never parsed). Links keep only http:, https: and
// mailto: targets (checked after the URL parser has normalised the string). The page's
// Content-Security-Policy (server/webui.py) allows no inline script in any case.
"use strict";

(function () {
  // ================================================================================ markdown renderer
  const SAFE_SCHEMES = new Set(["http:", "https:", "mailto:"]);

  function el(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  function text(s) {
    return document.createTextNode(s);
  }

  // The URL a link may point to, or null (javascript:, data:, vbscript:, ... are refused).
  function safeHref(raw) {
    let url;
    try {
      url = new URL(raw, document.baseURI);
    } catch (e) {
      return null;
    }
    return SAFE_SCHEMES.has(url.protocol) ? url.href : null;
  }

  function link(href, label) {
    const a = el("a");
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    if (typeof label === "string") a.textContent = label;
    return a;
  }

  // Inline spans, tried in this order at each position: code, bold, strike, italic, links, URLs.
  const INLINE_SOURCE = [
    "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)",                            // 1, 2: `code`
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",                                // 3: **bold**
    "(?<!\\w)__(?=\\S)([\\s\\S]*?\\S)__(?!\\w)",                         // 4: __bold__
    "~~(?=\\S)([\\s\\S]*?\\S)~~",                                        // 5: ~~strike~~
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*",                              // 6: *italic*
    "(?<!\\w)_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?!\\w)",                   // 7: _italic_
    "\\[([^\\]\\n]+)\\]\\(\\s*<?([^\\s<>]*?)>?(?:\\s+\"[^\"\\n]*\")?\\s*\\)",  // 8, 9: [text](url "title")
    "<((?:https?|mailto):[^\\s<>]+)>",                                   // 10: <https://autolink>
    "(https?://[^\\s<>\"'`]*[^\\s<>\"'`.,;:!?)\\]])",                    // 11: bare URL
  ].join("|");

  function renderInline(src, parent) {
    const re = new RegExp(INLINE_SOURCE, "g");   // one per call: the recursion must not share lastIndex
    let last = 0;
    let m;
    while ((m = re.exec(src)) !== null) {
      if (m.index > last) parent.appendChild(text(src.slice(last, m.index)));
      last = re.lastIndex;
      if (m[1] !== undefined) {
        let body = m[2];
        if (/^ .*[^ ].* $/.test(body)) body = body.slice(1, -1);
        const code = el("code");
        code.textContent = body;
        parent.appendChild(code);
      } else if (m[3] !== undefined || m[4] !== undefined) {
        const strong = el("strong");
        renderInline(m[3] !== undefined ? m[3] : m[4], strong);
        parent.appendChild(strong);
      } else if (m[5] !== undefined) {
        const del = el("del");
        renderInline(m[5], del);
        parent.appendChild(del);
      } else if (m[6] !== undefined || m[7] !== undefined) {
        const em = el("em");
        renderInline(m[6] !== undefined ? m[6] : m[7], em);
        parent.appendChild(em);
      } else if (m[8] !== undefined) {
        const href = safeHref(m[9]);
        if (href === null) {
          parent.appendChild(text(m[0]));            // an unsafe target stays visible as plain text
        } else {
          const a = link(href);
          renderInline(m[8], a);
          parent.appendChild(a);
        }
      } else {
        const url = m[10] !== undefined ? m[10] : m[11];
        const href = safeHref(url);
        parent.appendChild(href === null ? text(m[0]) : link(href, url));
      }
    }
    if (last < src.length) parent.appendChild(text(src.slice(last)));
  }

  function codeBlock(body, lang) {
    const pre = el("pre");
    const code = el("code");
    const cleanLang = (lang || "").replace(/[^\w+#.-]/g, "");
    if (cleanLang) code.className = "language-" + cleanLang;
    code.textContent = body;
    const copy = el("button", "copy");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => {
      if (navigator.clipboard) navigator.clipboard.writeText(body).then(() => { copy.textContent = "Copied"; },
                                                                         () => { copy.textContent = "Copy failed"; });
    });
    pre.appendChild(copy);
    pre.appendChild(code);
    return pre;
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const BLANK = /^\s*$/;

  function renderList(lines, i, parent) {
    const first = LIST_ITEM.exec(lines[i]);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const list = el(ordered ? "ol" : "ul");
    if (ordered) {
      const start = parseInt(first[2], 10);
      if (start !== 1) list.start = start;
    }
    parent.appendChild(list);
    let item = null;
    while (i < lines.length) {
      const line = lines[i];
      const m = LIST_ITEM.exec(line);
      if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
        item = el("li");
        renderInline(m[3], item);
        list.appendChild(item);
        i++;
      } else if (m && m[1].length > indent) {
        i = renderList(lines, i, item);               // a nested list (always consumes its first line)
      } else if (BLANK.test(line)) {
        let j = i + 1;
        while (j < lines.length && BLANK.test(lines[j])) j++;
        const next = j < lines.length ? LIST_ITEM.exec(lines[j]) : null;
        if (!next || next[1].length < indent) break;
        i = j;                                         // a loose list goes on after blank lines
      } else if (!m && /^\s+\S/.test(line)) {
        item.appendChild(el("br"));                    // an indented continuation line
        renderInline(line.trim(), item);
        i++;
      } else {
        break;
      }
    }
    return i;
  }

  // Renders markdown `src` into `root` (appends; the caller empties it). Unclosed code fences (an answer
  // still streaming) run to the end of the text.
  function renderMarkdown(src, root) {
    const lines = src.replace(/\r\n?/g, "\n").split("\n");
    let para = [];
    const flush = () => {
      if (!para.length) return;
      const p = el("p");
      para.forEach((line, k) => {
        if (k) p.appendChild(el("br"));
        renderInline(line, p);
      });
      root.appendChild(p);
      para = [];
    };
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        flush();
        const close = new RegExp("^ {0,3}\\" + m[1][0] + "{" + m[1].length + ",}\\s*$");
        const body = [];
        i++;
        while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
        if (i >= lines.length && body.length && body[body.length - 1] === "") body.pop();  // unclosed: streaming
        i++;
        root.appendChild(codeBlock(body.join("\n"), m[2]));
      } else if (BLANK.test(line)) {
        flush();
        i++;
      } else if ((m = HEADING.exec(line))) {
        flush();
        const h = el("h" + m[1].length);
        renderInline(m[2], h);
        root.appendChild(h);
        i++;
      } else if (RULE.test(line)) {
        flush();
        root.appendChild(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        flush();
        const inner = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          inner.push(m[1]);
          i++;
        }
        const quote = el("blockquote");
        renderMarkdown(inner.join("\n"), quote);
        root.appendChild(quote);
      } else if (LIST_ITEM.test(line)) {
        flush();
        i = renderList(lines, i, root);
      } else {
        para.push(line);
        i++;
      }
    }
    flush();
  }

  // For tests and the curious: jitkernMarkdown.render("**x**") returns a <div> with the rendered nodes.
  window.jitkernMarkdown = {
    render(src) {
      const div = el("div", "content");
      renderMarkdown(String(src), div);
      return div;
    },
    safeHref,
  };

  // ================================================================================ the chat
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "jitkern.apiKey";          // sessionStorage: forgotten when the tab closes
  const SETTINGS_STORE = "jitkern.settings";   // localStorage: sampling settings and the system prompt
  const SETTING_FIELDS = ["system-prompt", "temperature", "top-p", "max-tokens"];

  // conversation: bumped by "New chat", so an answer still finishing does not land in the new history.
  const state = { history: [], controller: null, model: null, apiKey: "", conversation: 0 };

  function storageGet(store, key) {
    try { return store.getItem(key); } catch (e) { return null; }
  }

  function storageSet(store, key, value) {
    try {
      if (value === null) store.removeItem(key); else store.setItem(key, value);
    } catch (e) { /* storage disabled: the setting lasts for this page only */ }
  }

  function showStatus(message) {
    const status = $("status");
    status.textContent = message;
    status.hidden = !message;
  }

  function authHeaders(json) {
    const headers = {};
    if (json) headers["Content-Type"] = "application/json";
    if (state.apiKey) headers.Authorization = "Bearer " + state.apiKey;
    return headers;
  }

  async function errorText(resp) {
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return "HTTP " + resp.status + " " + resp.statusText;
  }

  function askForKey(message) {
    const form = $("key-form");
    form.hidden = false;
    const err = $("key-error");
    err.textContent = message || "";
    err.hidden = !message;
    $("api-key").focus();
  }

  // Checks the server (and the key) through /v1/models, and learns the served model's name.
  async function connect() {
    let resp;
    try {
      resp = await fetch("v1/models", { headers: authHeaders(false) });
    } catch (e) {
      showStatus("Cannot reach the server: " + e.message);
      return;
    }
    if (resp.status === 401) {
      askForKey(state.apiKey ? "The server refused this key." : "");
      return;
    }
    if (!resp.ok) {
      showStatus(await errorText(resp));
      return;
    }
    const body = await resp.json();
    state.model = body.data && body.data.length ? body.data[0].id : null;
    $("model-name").textContent = state.model ? "model: " + state.model : "";
    $("key-form").hidden = true;
    document.body.dataset.connected = "true";
    showStatus("");
    $("prompt").focus();
  }

  function scrolledToBottom() {
    const box = $("messages");
    return box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  }

  function scrollToBottom() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function addUserBubble(content) {
    const msg = el("div", "msg user");
    const role = el("div", "role");
    role.textContent = "you";
    msg.appendChild(role);
    msg.appendChild(text(content));
    $("messages").appendChild(msg);
    scrollToBottom();
  }

  // The assistant's bubble: reasoning (if the server's reasoning parser sends any), the rendered answer,
  // then the stats line or an error. Rendering is batched to one pass per animation frame.
  function addAssistantBubble() {
    const msg = el("div", "msg assistant");
    msg.dataset.state = "streaming";
    const role = el("div", "role");
    role.textContent = "assistant";
    const reasoning = el("details", "reasoning");
    const summary = el("summary");
    summary.textContent = "reasoning";
    const reasoningText = el("div");
    reasoning.append(summary, reasoningText);
    reasoning.hidden = true;
    const content = el("div", "content");
    const stats = el("div", "stats");
    const error = el("div", "error");
    error.hidden = true;
    msg.append(role, reasoning, content, stats, error);
    $("messages").appendChild(msg);
    scrollToBottom();
    let answer = "";
    let thoughts = "";
    let frame = 0;
    const render = () => {
      frame = 0;
      const follow = scrolledToBottom();
      content.replaceChildren();
      renderMarkdown(answer, content);
      reasoningText.textContent = thoughts;
      reasoning.hidden = !thoughts;
      if (follow) scrollToBottom();
    };
    return {
      msg,
      update(newAnswer, newThoughts) {
        answer = newAnswer;
        thoughts = newThoughts;
        if (!frame) frame = requestAnimationFrame(render);
      },
      finish(stateName, statsText, errorMessage) {
        // A frame still pending would render the answer again after this one and replace the finished
        // bubble's nodes (a reader holding them, or a test, would see them go stale): cancel it.
        if (frame) cancelAnimationFrame(frame);
        render();
        msg.dataset.state = stateName;
        stats.textContent = statsText || "";
        if (errorMessage) {
          error.textContent = errorMessage;
          error.hidden = false;
        }
      },
    };
  }

  // The data of each server-sent event in a response body.
  async function* sseData(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = event.split("\n").filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
          if (data) yield data;
        }
      }
    } finally {
      reader.releaseLock();
    }
  }

  function readNumber(id, parse, name) {
    const input = $(id);
    if (input.value.trim() === "") {
      if (input.validity && input.validity.badInput) throw new Error(name + " is not a number");
      return undefined;
    }
    const value = parse(input.value);
    if (!Number.isFinite(value)) throw new Error(name + " is not a number");
    return value;
  }

  function requestBody() {
    const messages = [];
    const system = $("system-prompt").value;
    if (system.trim()) messages.push({ role: "system", content: system });
    messages.push(...state.history);
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (state.model) body.model = state.model;
    const temperature = readNumber("temperature", parseFloat, "temperature");
    const topP = readNumber("top-p", parseFloat, "top_p");
    const maxTokens = readNumber("max-tokens", (v) => parseInt(v, 10), "max tokens");
    if (temperature !== undefined) body.temperature = temperature;
    if (topP !== undefined) body.top_p = topP;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    return body;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.dataset.busy = busy ? "true" : "false";
  }

  function statsLine(s) {
    const parts = [];
    if (s.stopped) parts.push("stopped");
    const tokens = s.usage ? s.usage.completion_tokens : s.chunks;
    parts.push(tokens + (s.usage ? " tokens" : " tokens (counted)"));
    // Generation speed: the tokens after the first over the time since the first arrived.
    if (s.tFirst !== null && tokens > 1 && s.tEnd > s.tFirst) {
      parts.push(((tokens - 1) / ((s.tEnd - s.tFirst) / 1000)).toFixed(1) + " tokens/s");
    }
    if (s.tFirst !== null) parts.push("first token after " + ((s.tFirst - s.t0) / 1000).toFixed(2) + " s");
    if (s.usage) parts.push(s.usage.prompt_tokens + " prompt tokens");
    if (s.finish) parts.push("finish: " + s.finish);
    return parts.join(" · ");
  }

  async function send(prompt) {
    let body;
    try {
      state.history.push({ role: "user", content: prompt });
      body = requestBody();
    } catch (e) {
      state.history.pop();
      showStatus(e.message);
      return;
    }
    showStatus("");
    const conversation = state.conversation;
    addUserBubble(prompt);
    $("prompt").value = "";
    const view = addAssistantBubble();
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    const s = { t0: performance.now(), tFirst: null, tEnd: null, chunks: 0, usage: null, finish: null,
                stopped: false };
    let answer = "";
    let thoughts = "";
    let error = null;
    try {
      const resp = await fetch("v1/chat/completions", {
        method: "POST", headers: authHeaders(true), body: JSON.stringify(body), signal: controller.signal });
      if (!resp.ok) {
        const message = await errorText(resp);
        if (resp.status === 401) askForKey("The server refused the key: " + message);
        throw new Error(message);
      }
      for await (const data of sseData(resp.body)) {
        if (data === "[DONE]") break;
        let chunk;
        try { chunk = JSON.parse(data); } catch (e) { continue; }
        if (chunk.error) {
          error = chunk.error.message || "the server reported an error";
          continue;
        }
        if (chunk.usage) s.usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.content || delta.reasoning_content) {
          if (s.tFirst === null) s.tFirst = performance.now();
          s.chunks++;
          answer += delta.content || "";
          thoughts += delta.reasoning_content || "";
          view.update(answer, thoughts);
        }
        if (choice.finish_reason) s.finish = choice.finish_reason;
      }
    } catch (e) {
      if (e.name === "AbortError") s.stopped = true;
      else error = e.message || String(e);
    } finally {
      state.controller = null;
      setBusy(false);
    }
    s.tEnd = performance.now();
    view.update(answer, thoughts);
    if (conversation !== state.conversation) {
      // "New chat" while this answer streamed: its bubble is gone and it is no part of the new history.
    } else if (answer) {
      state.history.push({ role: "assistant", content: answer });  // a stopped answer is kept, as it reads
    } else if (error || s.stopped) {
      state.history.pop();                                      // nothing came back: the turn is dropped
    }
    view.finish(s.stopped ? "stopped" : error ? "error" : "done", error && !answer ? "" : statsLine(s), error);
    $("prompt").focus();
  }

  function loadSettings() {
    let saved = {};
    try { saved = JSON.parse(storageGet(localStorage, SETTINGS_STORE) || "{}") || {}; } catch (e) { saved = {}; }
    for (const id of SETTING_FIELDS) {
      if (typeof saved[id] === "string") $(id).value = saved[id];
      $(id).addEventListener("change", saveSettings);
    }
  }

  function saveSettings() {
    const values = {};
    for (const id of SETTING_FIELDS) values[id] = $(id).value;
    storageSet(localStorage, SETTINGS_STORE, JSON.stringify(values));
  }

  function init() {
    state.apiKey = storageGet(sessionStorage, KEY_STORE) || "";
    loadSettings();
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const prompt = $("prompt").value;
      if (!prompt.trim() || state.controller) return;
      send(prompt);
    });
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => {
      if (state.controller) state.controller.abort();
    });
    $("new-chat").addEventListener("click", () => {
      if (state.controller) state.controller.abort();
      state.conversation++;
      state.history = [];
      $("messages").replaceChildren();
      showStatus("");
      $("prompt").focus();
    });
    $("toggle-settings").addEventListener("click", () => {
      const panel = $("settings");
      panel.hidden = !panel.hidden;
      $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
    });
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      state.apiKey = $("api-key").value.trim();
      storageSet(sessionStorage, KEY_STORE, state.apiKey || null);
      $("api-key").value = "";
      connect();
    });
    $("forget-key").addEventListener("click", () => {
      state.apiKey = "";
      storageSet(sessionStorage, KEY_STORE, null);
      connect();
    });
    connect();
  }

  init();
})();
