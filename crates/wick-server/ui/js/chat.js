// The chat page: conversations (IndexedDB), a streamed reply with a stop button, reasoning
// and tool calls, sampling and tools popovers, system prompt, adapter picker, per-reply
// token counts and speed, regenerate and edit-and-resend.

import { h, replace, announce } from "./dom.js";
import { request, getJson } from "./api.js";
import { render } from "./markdown.js";
import { sseData, Reply } from "./stream.js";
import { number } from "./format.js";
import * as store from "./store.js";

const SETTINGS = "wick.chat.settings";

/** The sampling fields: name, label, what it does, input attributes. */
const SAMPLING = [
  ["temperature", "Temperature", "Randomness; 0 always picks the likeliest token.", { min: 0, max: 2, step: 0.05 }],
  ["top_p", "Top p", "Sample only from the smallest set of tokens whose probability adds up to this.", { min: 0, max: 1, step: 0.01 }],
  ["top_k", "Top k", "Sample only from the k likeliest tokens (0: off).", { min: 0, step: 1 }],
  ["max_tokens", "Max tokens", "Stop the reply after this many tokens.", { min: 1, step: 1 }],
  ["seed", "Seed", "The same seed and settings give the same reply.", { min: 0, step: 1 }],
];

function loadSettings() {
  try {
    return { tools: "", tool_choice: "auto", adapter: "", ...JSON.parse(localStorage.getItem(SETTINGS) ?? "{}") };
  } catch {
    return { tools: "", tool_choice: "auto", adapter: "" };
  }
}

/** The `tools` array the tools field holds, or throws with what is wrong. */
export function parseTools(text) {
  if (!text.trim()) return null;
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (e) {
    throw new Error(`Tools are not valid JSON: ${e.message}`);
  }
  if (!Array.isArray(tools)) throw new Error("Tools must be a JSON array of {type: \"function\", function: {...}}.");
  return tools;
}

/** Mounts the chat page in `root`; returns the function that unmounts it. */
export async function mount(root) {
  const page = new ChatPage(root);
  await page.start();
  return () => page.stop();
}

class ChatPage {
  constructor(root) {
    this.root = root;
    this.settings = loadSettings();
    this.conversation = null;
    this.controller = null;
    this.model = null;
    this.build();
  }

  build() {
    const field = (id, label, input, hint) => h("div", { class: "field" },
      h("label", { for: id }, label), input, hint && h("p", { class: "hint", id: `${id}-hint` }, hint));

    this.list = h("ul", { class: "conv-list" });
    this.sidebar = h("aside", { id: "conversations", class: "sidebar", "aria-label": "Conversations" },
      h("div", { class: "sidebar-head" },
        h("h2", {}, "Conversations"),
        h("button", { type: "button", id: "new-chat", onclick: () => this.newConversation() }, "New chat"),
        h("button", { type: "button", class: "sidebar-close icon", "aria-label": "Close conversations", onclick: () => this.toggleSidebar(false) }, "✕")),
      this.list);
    this.sidebar.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && this.sidebar.classList.contains("open")) this.toggleSidebar(false);
    });

    this.adapter = h("select", { id: "adapter", onchange: () => this.saveSetting("adapter", this.adapter.value) },
      h("option", { value: "" }, "Server default"), h("option", { value: "none" }, "Base model (none)"));
    this.modelName = h("span", { class: "model-name", id: "model-name" }, "…");

    const sampling = h("div", { id: "sampling-pop", class: "popover", popover: "auto", role: "dialog", "aria-labelledby": "sampling-title" },
      h("h2", { id: "sampling-title" }, "Sampling"),
      h("p", { class: "hint" }, "Empty fields use the server's defaults."),
      SAMPLING.map(([name, label, hint, attrs]) => {
        const input = h("input", {
          id: `s-${name}`, name, type: "number", inputmode: "decimal", ...attrs,
          value: this.settings[name] ?? "", "aria-describedby": `s-${name}-hint`,
          oninput: (e) => this.saveSetting(name, e.target.value),
        });
        return field(`s-${name}`, label, input, hint);
      }),
      h("button", { type: "button", popovertarget: "sampling-pop", popovertargetaction: "hide" }, "Done"));

    this.toolsInput = h("textarea", {
      id: "tools-json", rows: 8, spellcheck: "false", value: this.settings.tools,
      placeholder: '[{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}]',
      "aria-describedby": "tools-json-hint", oninput: (e) => this.saveSetting("tools", e.target.value),
    });
    this.toolChoice = h("select", { id: "tool-choice", onchange: (e) => this.saveSetting("tool_choice", e.target.value) },
      ["auto", "required", "none"].map((v) => h("option", { value: v }, v)));
    this.toolChoice.value = this.settings.tool_choice;
    const tools = h("div", { id: "tools-pop", class: "popover wide", popover: "auto", role: "dialog", "aria-labelledby": "tools-title" },
      h("h2", { id: "tools-title" }, "Tools"),
      field("tools-json", "Tool definitions (JSON)", this.toolsInput,
        "OpenAI function tools. The model's calls are shown in the reply; nothing is run."),
      field("tool-choice", "Tool choice", this.toolChoice, "required makes the model call one of the tools."),
      h("button", { type: "button", popovertarget: "tools-pop", popovertargetaction: "hide" }, "Done"));

    this.toggle = h("button", {
      type: "button", class: "sidebar-toggle", "aria-controls": "conversations", "aria-expanded": "false",
      onclick: () => this.toggleSidebar(),
    }, "Conversations");
    this.system = h("textarea", {
      id: "system-prompt", rows: 3, placeholder: "You are a helpful assistant.",
      onchange: () => this.saveSystem(),
    });
    this.messages = h("div", { class: "messages", id: "messages", role: "log", "aria-live": "off", "aria-label": "Messages", tabindex: "-1" });
    this.error = h("p", { class: "error", role: "alert", hidden: true });
    this.prompt = h("textarea", {
      id: "prompt", rows: 2, placeholder: "Message (Enter sends, Shift+Enter adds a line)", "aria-describedby": "prompt-hint",
      onkeydown: (e) => {
        if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
          e.preventDefault();
          this.form.requestSubmit();
        }
      },
    });
    this.send = h("button", { type: "submit", id: "send", class: "primary" }, "Send");
    this.stopButton = h("button", { type: "button", id: "stop", disabled: true, onclick: () => this.controller?.abort() }, "Stop");
    this.form = h("form", { class: "composer", onsubmit: (e) => { e.preventDefault(); this.submit(); } },
      h("label", { for: "prompt", class: "visually-hidden" }, "Message"),
      h("p", { id: "prompt-hint", class: "visually-hidden" }, "Enter sends; Shift+Enter adds a line."),
      this.prompt, h("div", { class: "composer-buttons" }, this.send, this.stopButton));

    const main = h("section", { class: "chat-main", "aria-label": "Chat" },
      h("div", { class: "toolbar" },
        this.toggle,
        h("span", { class: "model" }, "Model ", this.modelName),
        h("span", { class: "field inline" }, h("label", { for: "adapter" }, "Adapter"), this.adapter),
        h("button", { type: "button", id: "sampling-button", popovertarget: "sampling-pop" }, "Sampling"),
        h("button", { type: "button", id: "tools-button", popovertarget: "tools-pop" }, "Tools")),
      h("details", { class: "system" }, h("summary", {}, "System prompt"),
        h("label", { for: "system-prompt", class: "visually-hidden" }, "System prompt"), this.system),
      this.messages, this.error, this.form);

    replace(this.root, h("div", { class: "chat-page" }, this.sidebar, main, sampling, tools));
  }

  async start() {
    const [models, adapters] = await Promise.allSettled([getJson("/v1/models"), getJson("/v1/adapters")]);
    if (models.status === "fulfilled") {
      const served = models.value.data?.[0];
      this.model = served?.id ?? null;
      this.modelName.textContent = served ? served.id : "unknown";
      if (served?.context_window) this.modelName.title = `${number(served.context_window)} tokens of context`;
    } else this.showError(`Cannot list models: ${models.reason.message}`);
    if (adapters.status === "fulfilled") {
      for (const a of adapters.value.adapters ?? []) this.adapter.append(h("option", { value: a.id }, `${a.id} (rank ${a.rank})`));
    }
    this.adapter.value = this.settings.adapter;
    if (this.adapter.value !== this.settings.adapter) this.adapter.value = "";
    const conversations = await store.list();
    if (conversations.length) await this.open(conversations[0].id);
    else await this.newConversation();
    this.prompt.focus();
  }

  stop() {
    this.controller?.abort();
  }

  saveSetting(name, value) {
    this.settings[name] = value;
    localStorage.setItem(SETTINGS, JSON.stringify(this.settings));
  }

  showError(text) {
    this.error.textContent = text ?? "";
    this.error.hidden = !text;
  }

  /** Opens or closes the conversation list (a panel over the chat on narrow windows). */
  toggleSidebar(force) {
    const wasOpen = this.sidebar.classList.contains("open");
    const open = force ?? !wasOpen;
    this.sidebar.classList.toggle("open", open);
    this.toggle.setAttribute("aria-expanded", String(open));
    const narrow = getComputedStyle(this.toggle).display !== "none";
    if (narrow && open && !wasOpen) this.sidebar.querySelector("#new-chat").focus();
    if (narrow && !open && wasOpen && this.sidebar.contains(document.activeElement)) this.toggle.focus();
  }

  // Conversations.

  async refreshList() {
    const all = await store.list();
    replace(this.list, all.map((c) => this.listItem(c)));
  }

  listItem(c) {
    const current = c.id === this.conversation?.id;
    const title = h("button", {
      type: "button", class: "conv-open", "aria-current": current ? "true" : null,
      onclick: async () => { await this.open(c.id); this.toggleSidebar(false); this.prompt.focus(); },
    }, c.title || "Untitled");
    const item = h("li", { class: current ? "current" : null }, title,
      h("button", { type: "button", class: "icon", "aria-label": `Rename ${c.title}`, title: "Rename", onclick: () => this.rename(c, item) }, "✎"),
      h("button", { type: "button", class: "icon", "aria-label": `Delete ${c.title}`, title: "Delete", onclick: () => this.remove(c) }, "✕"));
    return item;
  }

  rename(c, item) {
    const input = h("input", { type: "text", value: c.title, "aria-label": "New name", class: "rename" });
    const finish = async (keep) => {
      if (keep && input.value.trim()) {
        const saved = (await store.get(c.id)) ?? c;
        saved.title = input.value.trim();
        await store.save(saved);
        if (this.conversation?.id === c.id) this.conversation.title = saved.title;
      }
      await this.refreshList();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") finish(true);
      if (e.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true), { once: true });
    replace(item, input);
    input.focus();
    input.select();
  }

  async remove(c) {
    if (!window.confirm(`Delete the conversation “${c.title}”?`)) return;
    if (this.conversation?.id === c.id) this.controller?.abort();
    await store.remove(c.id);
    if (this.conversation?.id === c.id) {
      const rest = await store.list();
      if (rest.length) await this.open(rest[0].id);
      else await this.newConversation();
    } else await this.refreshList();
    announce("Conversation deleted");
  }

  async newConversation() {
    this.controller?.abort();
    this.conversation = store.create();
    await store.save(this.conversation);
    this.system.value = "";
    this.renderMessages();
    await this.refreshList();
    this.prompt.focus();
  }

  async open(id) {
    if (this.controller) this.controller.abort();
    const c = await store.get(id);
    if (!c) return;
    this.conversation = c;
    this.system.value = c.system ?? "";
    this.renderMessages();
    await this.refreshList();
  }

  async saveSystem() {
    this.conversation.system = this.system.value;
    await store.save(this.conversation);
  }

  // Messages.

  renderMessages() {
    const list = this.conversation.messages;
    if (!list.length) {
      replace(this.messages, h("p", { class: "empty" }, "Send a message to start."));
      return;
    }
    replace(this.messages, list.map((m, i) => this.messageView(m, i)));
    this.messages.scrollTop = this.messages.scrollHeight;
  }

  messageView(m, index) {
    const last = index === this.conversation.messages.length - 1;
    const busy = Boolean(this.controller);
    const article = h("article", { class: `msg ${m.role}`, "aria-label": m.role === "user" ? "You" : "Assistant", dataset: { index } });
    const actions = h("div", { class: "actions" });
    if (m.role === "user") {
      actions.append(h("button", { type: "button", class: "edit", disabled: busy, onclick: () => this.edit(index, article) }, "Edit"));
    } else if (last) {
      actions.append(h("button", { type: "button", class: "regenerate", disabled: busy, onclick: () => this.regenerate() }, "Regenerate"));
    }
    article.append(h("div", { class: "msg-head" }, h("span", { class: "who" }, m.role === "user" ? "You" : "Assistant"), actions));
    this.fillBody(article, m);
    return article;
  }

  /** The body of a message: reasoning, content, tool calls, then the reply's numbers. */
  fillBody(article, m) {
    for (const old of article.querySelectorAll(":scope > :not(.msg-head)")) old.remove();
    if (m.role === "user") {
      article.append(h("div", { class: "content plain" }, m.content));
      return;
    }
    if (m.reasoning) {
      const open = article.dataset.reasoningOpen === "true";
      const details = h("details", { class: "reasoning", open: open || (m.streaming && !m.content) },
        h("summary", {}, m.streaming && !m.content ? "Reasoning…" : "Reasoning"),
        h("div", { class: "md" }, render(m.reasoning)));
      // What the reader chose stays while the reply streams (a click is also Enter or Space).
      details.firstElementChild.addEventListener("click", () => { article.dataset.reasoningOpen = String(!details.open); });
      article.append(details);
    }
    if (m.content || (!m.tool_calls?.length && !m.error && m.streaming)) {
      article.append(h("div", { class: "content md" }, m.content ? render(m.content) : h("span", { class: "typing" }, "…")));
    }
    if (m.tool_calls?.length) {
      article.append(h("div", { class: "tool-calls" }, m.tool_calls.map((c) => toolCallView(c))));
    }
    if (m.error) article.append(h("p", { class: "error" }, `Error: ${m.error}`));
    if (m.stopped) article.append(h("p", { class: "note" }, "Stopped."));
    if (m.stats) article.append(statsView(m.stats));
  }

  history() {
    const out = [];
    if (this.conversation.system?.trim()) out.push({ role: "system", content: this.conversation.system });
    for (const m of this.conversation.messages) {
      if (m.role === "user") out.push({ role: "user", content: m.content });
      else if (m.content || m.tool_calls?.length) {
        const message = { role: "assistant", content: m.content || null };
        if (m.tool_calls?.length) {
          message.tool_calls = m.tool_calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
        }
        out.push(message);
      }
    }
    return out;
  }

  requestBody() {
    const body = { messages: this.history(), stream: true, stream_options: { include_usage: true } };
    if (this.model) body.model = this.model;
    for (const [name] of SAMPLING) {
      const raw = this.settings[name];
      if (raw !== undefined && raw !== "" && !Number.isNaN(Number(raw))) body[name] = Number(raw);
    }
    if (this.settings.adapter) body.adapter = this.settings.adapter;
    const tools = parseTools(this.settings.tools ?? "");
    if (tools) {
      body.tools = tools;
      body.tool_choice = this.settings.tool_choice || "auto";
    }
    return body;
  }

  async submit() {
    const text = this.prompt.value;
    if (!text.trim() || this.controller) return;
    this.prompt.value = "";
    const c = this.conversation;
    c.messages.push({ role: "user", content: text });
    if (c.title === "New chat") c.title = text.trim().split("\n")[0].slice(0, 60);
    await store.save(c);
    await this.refreshList();
    await this.generate();
  }

  async regenerate() {
    const list = this.conversation.messages;
    if (this.controller || list.at(-1)?.role !== "assistant") return;
    list.pop();
    await this.generate();
  }

  edit(index, article) {
    const m = this.conversation.messages[index];
    const area = h("textarea", { value: m.content, rows: 3, "aria-label": "Edit message" });
    const cancel = () => this.renderMessages();
    const save = async () => {
      if (!area.value.trim()) return;
      const list = this.conversation.messages;
      list.splice(index, list.length - index, { role: "user", content: area.value });
      await store.save(this.conversation);
      await this.generate();
    };
    area.addEventListener("keydown", (e) => {
      if (e.key === "Escape") cancel();
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); save(); }
    });
    for (const old of article.querySelectorAll(":scope > :not(.msg-head)")) old.remove();
    article.append(h("div", { class: "editor" }, area, h("div", { class: "composer-buttons" },
      h("button", { type: "button", class: "primary", onclick: save }, "Save and send"),
      h("button", { type: "button", onclick: cancel }, "Cancel"))));
    area.focus();
  }

  setBusy(busy) {
    const hadFocus = document.activeElement;
    this.send.disabled = busy;
    this.stopButton.disabled = !busy;
    for (const b of this.messages.querySelectorAll("button.edit, button.regenerate")) b.disabled = busy;
    if (busy && hadFocus === this.send) this.stopButton.focus();
    if (!busy && (hadFocus === this.stopButton || hadFocus === document.body)) this.prompt.focus();
  }

  async generate() {
    this.showError("");
    let body;
    try {
      body = this.requestBody();
    } catch (e) {
      this.showError(e.message);
      return;
    }
    const c = this.conversation;
    const m = { role: "assistant", content: "", reasoning: "", tool_calls: [], streaming: true };
    c.messages.push(m);
    const controller = new AbortController();
    this.controller = controller;
    this.renderMessages();
    const article = this.messages.lastElementChild;
    this.setBusy(true);
    const reply = new Reply();
    const started = performance.now();
    let frame = null;
    const paint = () => {
      frame = null;
      Object.assign(m, { content: reply.content, reasoning: reply.reasoning, tool_calls: reply.toolCalls });
      const atBottom = this.messages.scrollHeight - this.messages.scrollTop - this.messages.clientHeight < 40;
      this.fillBody(article, m);
      if (atBottom) this.messages.scrollTop = this.messages.scrollHeight;
    };
    try {
      const response = await request("/v1/chat/completions", { method: "POST", body, signal: controller.signal });
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        if (!reply.add(JSON.parse(data))) break;
        frame ??= requestAnimationFrame(paint);
      }
      if (reply.error) m.error = reply.error;
    } catch (e) {
      if (e.name === "AbortError") m.stopped = true;
      else m.error = e.message;
    }
    if (frame) cancelAnimationFrame(frame);
    const ended = performance.now();
    Object.assign(m, { content: reply.content, reasoning: reply.reasoning, tool_calls: reply.toolCalls, streaming: false });
    m.stats = replyStats(reply, started, ended);
    if (!m.reasoning) delete m.reasoning;
    // Saved before it is shown, so what the page shows is what a reload finds.
    await store.save(c);
    this.controller = null;
    if (this.conversation === c) {
      this.setBusy(false);
      this.renderMessages();
    }
    announce(m.stopped ? "Reply stopped" : m.error ? `Error: ${m.error}` : "Reply finished");
  }
}

/** Token counts and speed of a finished (or stopped) reply. */
function replyStats(reply, started, ended) {
  const stats = { finish: reply.finish, seconds: (ended - started) / 1000 };
  if (reply.firstTokenAt !== null) stats.first_token_s = (reply.firstTokenAt - started) / 1000;
  if (reply.usage) {
    stats.prompt_tokens = reply.usage.prompt_tokens;
    stats.cached_tokens = reply.usage.prompt_tokens_details?.cached_tokens ?? 0;
    stats.completion_tokens = reply.usage.completion_tokens;
    // Decode speed: the tokens after the first over the time after the first.
    const decoding = (ended - (reply.firstTokenAt ?? started)) / 1000;
    if (stats.completion_tokens > 1 && decoding > 0) stats.tokens_per_second = (stats.completion_tokens - 1) / decoding;
  }
  return stats;
}

function statsView(s) {
  const parts = [];
  if (s.prompt_tokens !== undefined) parts.push(`${number(s.prompt_tokens)} prompt tokens${s.cached_tokens ? ` (${number(s.cached_tokens)} cached)` : ""}`);
  if (s.completion_tokens !== undefined) parts.push(`${number(s.completion_tokens)} tokens`);
  if (s.tokens_per_second !== undefined) parts.push(`${number(s.tokens_per_second)} tok/s`);
  if (s.first_token_s !== undefined) parts.push(`first token ${number(s.first_token_s, 2)} s`);
  if (s.finish) parts.push(`finish: ${s.finish}`);
  return h("p", {
    class: "msg-stats",
    dataset: { completionTokens: s.completion_tokens ?? "", promptTokens: s.prompt_tokens ?? "", finish: s.finish ?? "" },
  }, parts.join(" · "));
}

function toolCallView(call) {
  let args = call.arguments;
  try {
    args = JSON.stringify(JSON.parse(call.arguments), null, 2);
  } catch {
    // Still streaming, or not JSON: show it as it came.
  }
  return h("div", { class: "tool-call", dataset: { name: call.name } },
    h("div", { class: "tool-head" },
      h("span", { class: "tool-label" }, "Tool call"), h("code", { class: "tool-name" }, call.name || "…"),
      call.id && h("span", { class: "tool-id" }, call.id),
      call.repairs?.length ? h("span", { class: "badge", title: "wick repaired the model's call text" }, `repaired: ${call.repairs.join(", ")}`) : null),
    h("pre", { class: "tool-args", tabindex: "0", "aria-label": `Arguments of ${call.name}` }, h("code", {}, args)));
}
