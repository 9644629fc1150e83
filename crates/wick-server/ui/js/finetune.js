// The fine-tune page: pick a base model and a dataset folder (inspected by the server, which says
// how its prompts will be rendered: a user turn of the chat template, or raw text when "Raw
// prompts" is ticked or the model has no template), set the method and its hyper-parameters, start a job (POST /api/finetune/submit) and watch it through
// its event stream (GET /api/jobs/{id}/stream: progress, train and validation loss drawn as a
// chart), then mount the adapter (POST /v1/adapters) and chat with it, or fuse it into a copy
// of the base model (POST /api/finetune/export). Recent jobs are listed from /api/jobs; any of
// them can be watched again.

import { h, replace, announce } from "./dom.js";
import { getJson, request } from "./api.js";
import { sseData } from "./stream.js";
import { number, percent } from "./format.js";

const CHAT_SETTINGS = "wick.chat.settings";
const SVG = "http://www.w3.org/2000/svg";

const METHODS = {
  sft: { lr: 2e-4, note: "Supervised fine-tuning: learn to give the dataset's answers (loss on the responses only)." },
  dpo: { lr: 5e-5, note: "Direct preference optimization: prefer each row's chosen reply over its rejected one; the base model is the reference." },
  orpo: { lr: 1e-5, note: "Odds-ratio preference optimization: learn the chosen replies and push away the rejected ones, no reference model." },
};

/** [name, label, meaning, input attributes, default]. */
const PARAMS = [
  ["iters", "Steps", "Optimizer steps to run.", { min: 1, step: 1 }, 100],
  ["learning_rate", "Learning rate", "Peak step size (AdamW, cosine schedule). Too high forgets, too low learns nothing.", { min: 0, step: "any" }, 2e-4],
  ["rank", "LoRA rank", "Size of the low-rank update: more capacity, more memory.", { min: 1, step: 1 }, 8],
  ["scale", "LoRA scale (α)", "The update is α·B·A/r: how strongly the adapter speaks.", { min: 0, step: "any" }, 1],
  ["max_seq_length", "Max sequence", "Tokens per example; longer rows are cut.", { min: 8, step: 1 }, 512],
  ["batch_size", "Batch size", "Examples per micro-batch.", { min: 1, step: 1 }, 1],
  ["steps_per_eval", "Validate every", "Steps between validation passes (needs valid.jsonl).", { min: 1, step: 1 }, 50],
  ["num_layers", "Layers", "Adapt only the last N layers (-1: all).", { min: -1, step: 1 }, -1],
];

function svg(tag, attrs = {}) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  return el;
}

/** A loss chart: train and validation curves over steps, redrawn as points arrive. */
class LossChart {
  constructor() {
    this.train = [];
    this.val = [];
    this.el = svg("svg", { id: "ft-chart", viewBox: "0 0 600 220", role: "img", "aria-label": "Training and validation loss by step" });
    this.el.classList.add("chart");
    this.draw();
  }

  add(kind, step, loss) {
    if (!Number.isFinite(loss)) return;
    (kind === "val" ? this.val : this.train).push([step, loss]);
    this.draw();
  }

  draw() {
    this.el.replaceChildren();
    const all = [...this.train, ...this.val];
    const [w, h0, pad] = [600, 220, 34];
    this.el.append(svg("line", { x1: pad, y1: h0 - pad, x2: w - 8, y2: h0 - pad, class: "axis" }));
    this.el.append(svg("line", { x1: pad, y1: 8, x2: pad, y2: h0 - pad, class: "axis" }));
    this.el.dataset.train = this.train.length;
    this.el.dataset.val = this.val.length;
    if (all.length === 0) return;
    const maxStep = Math.max(...all.map((p) => p[0]), 1);
    const maxLoss = Math.max(...all.map((p) => p[1]));
    const minLoss = Math.min(0, ...all.map((p) => p[1]));
    const x = (s) => pad + ((w - pad - 8) * s) / maxStep;
    const y = (l) => h0 - pad - ((h0 - pad - 8) * (l - minLoss)) / (maxLoss - minLoss || 1);
    for (const [points, cls] of [[this.train, "train"], [this.val, "val"]]) {
      if (!points.length) continue;
      this.el.append(svg("polyline", { points: points.map(([s, l]) => `${x(s).toFixed(1)},${y(l).toFixed(1)}`).join(" "), class: `curve ${cls}` }));
      if (cls === "val") for (const [s, l] of points) this.el.append(svg("circle", { cx: x(s), cy: y(l), r: 3, class: "curve val" }));
    }
    const label = (text, attrs) => { const t = svg("text", attrs); t.textContent = text; this.el.append(t); };
    label(number(maxLoss, 3), { x: 2, y: 14, class: "tick" });
    label(number(minLoss, 3), { x: 2, y: h0 - pad, class: "tick" });
    label(`step ${maxStep}`, { x: w - 70, y: h0 - 12, class: "tick" });
  }
}

export async function mount(root) {
  const page = new FinetunePage(root);
  await page.start();
  return () => page.stop();
}

class FinetunePage {
  constructor(root) {
    this.root = root;
    this.abort = null;
    this.job = null;
    this.lrTouched = false;
    this.build();
  }

  field(id, label, hint, input) {
    return h("div", { class: "field" }, h("label", { for: id }, label), input, hint ? h("p", { class: "hint", id: `${id}-hint` }, hint) : null);
  }

  build() {
    this.model = h("input", { id: "ft-model", type: "text", required: true, "aria-describedby": "ft-model-hint" });
    this.data = h("input", { id: "ft-data", type: "text", required: true, placeholder: "/path/to/dataset", "aria-describedby": "ft-data-hint" });
    this.inspectButton = h("button", { type: "button", id: "ft-inspect", onclick: () => this.inspect() }, "Inspect");
    this.inspectResult = h("p", { id: "ft-inspect-result", class: "hint", role: "status" });
    this.rendering = h("p", { id: "ft-rendering", class: "hint", role: "status" });
    this.rawPrompt = h("input", { id: "ft-raw-prompt", type: "checkbox", "aria-describedby": "ft-raw-prompt-hint",
      onchange: () => { if (this.data.value.trim()) this.inspect(); } });
    this.method = h("select", { id: "ft-method", onchange: () => this.methodChanged() },
      Object.keys(METHODS).map((m) => h("option", { value: m }, m.toUpperCase())));
    this.methodNote = h("p", { class: "hint", id: "ft-method-note" });
    this.inputs = {};
    const params = PARAMS.map(([name, label, hint, attrs, value]) => {
      const input = h("input", { id: `ft-${name}`, type: "number", value: String(value), ...attrs, "aria-describedby": `ft-${name}-hint` });
      if (name === "learning_rate") input.addEventListener("input", () => { this.lrTouched = true; });
      this.inputs[name] = input;
      return this.field(`ft-${name}`, label, hint, input);
    });
    this.pref = h("input", { id: "ft-pref", type: "number", value: "0.1", min: 0, step: "any", "aria-describedby": "ft-pref-hint" });
    this.prefField = this.field("ft-pref", "β / λ", "DPO's β (how far from the base) or ORPO's λ (weight of the odds-ratio term).", this.pref);
    this.output = h("input", { id: "ft-output", type: "text", placeholder: "(default: an adapters folder in wick's home)", "aria-describedby": "ft-output-hint" });
    this.startButton = h("button", { type: "submit", id: "ft-start", class: "primary" }, "Start training");
    this.formError = h("p", { class: "error", id: "ft-error", role: "alert" });
    const form = h("form", { id: "ft-form", onsubmit: (e) => { e.preventDefault(); this.submit(); } },
      h("fieldset", {}, h("legend", {}, "1. Base model"),
        this.field("ft-model", "Model", "A model name (see the status page's library), a folder or a GGUF file.", this.model)),
      h("fieldset", {}, h("legend", {}, "2. Dataset"),
        this.field("ft-data", "Folder", "A folder with train.jsonl (and optionally valid.jsonl): rows of messages, prompt + completion, text, or prompt + chosen + rejected.",
          h("span", { class: "row" }, this.data, this.inspectButton)),
        this.inspectResult,
        h("div", { class: "field" },
          h("span", { class: "field inline" }, this.rawPrompt, h("label", { for: "ft-raw-prompt" }, "Raw prompts")),
          h("p", { class: "hint", id: "ft-raw-prompt-hint" },
            "Off (as mlx-lm): a string prompt is a user turn of the model's chat template and the response the assistant's reply, so the adapter changes chat replies. On: prompts are plain text, for raw completions.")),
        this.rendering),
      h("fieldset", {}, h("legend", {}, "3. Method and hyper-parameters"),
        this.field("ft-method", "Method", null, this.method), this.methodNote,
        h("div", { class: "param-grid" }, params, this.prefField),
        this.field("ft-output", "Adapter folder", "Where the adapter is written.", this.output)),
      h("div", { class: "form-buttons" }, this.startButton), this.formError);

    this.progress = h("progress", { id: "ft-progress", max: 1, value: 0, "aria-label": "Training progress" });
    this.statusLine = h("p", { id: "ft-status", role: "status", class: "live" }, "No job yet.");
    this.numbers = h("dl", { class: "stats columns", id: "ft-numbers" });
    this.chart = new LossChart();
    this.cancelButton = h("button", { type: "button", id: "ft-cancel", disabled: true, onclick: () => this.cancel() }, "Cancel");
    this.mountButton = h("button", { type: "button", id: "ft-mount", class: "primary", disabled: true, onclick: () => this.mountAdapter() }, "Mount and chat");
    this.exportButton = h("button", { type: "button", id: "ft-export", disabled: true, onclick: () => this.exportModel() }, "Export (fuse into a model)");
    this.exportResult = h("p", { id: "ft-export-result", class: "hint", role: "status" });
    this.log = h("pre", { id: "ft-log", class: "job-log", tabindex: "0", "aria-label": "Trainer log" });
    this.jobsBody = h("tbody", { id: "ft-jobs" });
    replace(this.root, h("div", { class: "status-page finetune-page" },
      h("div", { class: "page-head" }, h("h1", {}, "Fine-tune"),
        h("p", { class: "live" }, "LoRA adapters trained on this machine, one job at a time, behind serving.")),
      h("section", { class: "card wide", "aria-labelledby": "ft-setup" }, h("h2", { id: "ft-setup" }, "New job"), form),
      h("section", { class: "card wide", "aria-labelledby": "ft-run" },
        h("div", { class: "card-head" }, h("h2", { id: "ft-run" }, "Training"), h("span", { class: "row" }, this.cancelButton, this.mountButton, this.exportButton)),
        this.statusLine, this.exportResult, this.progress, this.chart.el,
        h("p", { class: "legend" }, h("span", { class: "key train" }, "train loss"), " ", h("span", { class: "key val" }, "validation loss")),
        this.numbers, h("details", {}, h("summary", {}, "Log"), this.log)),
      h("section", { class: "card wide", "aria-labelledby": "ft-recent" }, h("h2", { id: "ft-recent" }, "Recent jobs"),
        h("div", { class: "table-wrap" }, h("table", {},
          h("thead", {}, h("tr", {}, ["Job", "Method", "Status", "Progress", "Adapter", ""].map((t) => h("th", {}, t)))),
          this.jobsBody)))));
    this.methodChanged();
  }

  async start() {
    try {
      const stats = await getJson("/stats");
      this.model.value = stats?.server?.model_path ?? stats?.server?.model ?? "";
    } catch {
      // Leave the field for the user.
    }
    await this.refreshJobs();
    const running = this.jobs?.find((j) => j.status === "running" || j.status === "queued");
    if (running) this.watch(running);
  }

  stop() {
    if (this.abort) this.abort.abort();
  }

  methodChanged() {
    const m = this.method.value;
    this.methodNote.textContent = METHODS[m].note;
    if (!this.lrTouched) this.inputs.learning_rate.value = String(METHODS[m].lr);
    this.prefField.hidden = m === "sft";
  }

  async inspect() {
    this.inspectResult.className = "hint";
    this.inspectResult.textContent = "Inspecting…";
    try {
      const body = { path: this.data.value.trim(), model_dir: this.model.value.trim(), raw_prompt: this.rawPrompt.checked };
      const r = await (await request("/api/finetune/inspect-dataset", { method: "POST", body })).json();
      if (!r.ok) {
        this.inspectResult.className = "error";
        this.inspectResult.textContent = r.error;
        this.rendering.textContent = "";
        return r;
      }
      this.inspectResult.textContent = `${r.n_train} training rows, ${r.n_valid} validation rows, ${r.format} format.`;
      this.rendering.textContent = `Prompts: ${r.rendering}.`;
      this.rendering.dataset.rendering = r.prompt_rendering;
      if (r.format === "preference" && this.method.value === "sft") { this.method.value = "dpo"; this.methodChanged(); }
      if (r.format !== "preference" && this.method.value !== "sft") { this.method.value = "sft"; this.methodChanged(); }
      return r;
    } catch (e) {
      this.inspectResult.className = "error";
      this.inspectResult.textContent = e.message;
      return null;
    }
  }

  body() {
    const b = { model_dir: this.model.value.trim(), data_dir: this.data.value.trim(), method: this.method.value };
    for (const [name, input] of Object.entries(this.inputs)) if (input.value !== "") b[name] = Number(input.value);
    if (this.method.value === "dpo") b.dpo_beta = Number(this.pref.value);
    if (this.method.value === "orpo") b.orpo_lambda = Number(this.pref.value);
    if (this.output.value.trim()) b.adapter_path = this.output.value.trim();
    if (this.rawPrompt.checked) b.raw_prompt = true;
    return b;
  }

  async submit() {
    this.formError.textContent = "";
    this.startButton.disabled = true;
    try {
      const r = await (await request("/api/finetune/submit", { method: "POST", body: this.body() })).json();
      announce(`Job ${r.job_id} queued`);
      await this.refreshJobs();
      this.watch({ id: r.job_id, output_path: r.adapter_path, config: this.body() });
    } catch (e) {
      this.formError.textContent = e.message;
    } finally {
      this.startButton.disabled = false;
    }
  }

  /** Follows a job's event stream from its start, redrawing the chart. */
  async watch(job) {
    if (this.abort) this.abort.abort();
    const abort = new AbortController();
    this.abort = abort;
    this.job = job;
    this.chart = Object.assign(this.chart, { train: [], val: [] });
    this.chart.draw();
    this.log.textContent = "";
    this.progress.value = 0;
    this.mountButton.disabled = true;
    this.exportButton.disabled = true;
    this.exportResult.textContent = "";
    this.cancelButton.disabled = false;
    this.statusLine.textContent = `${job.id}: waiting…`;
    this.root.querySelector(".finetune-page").dataset.job = job.id;
    let last = null;
    try {
      const response = await request(`/api/jobs/${job.id}/stream`, { signal: abort.signal });
      for await (const data of sseData(response)) {
        let event;
        try { event = JSON.parse(data); } catch { continue; }
        if (!event.type) continue;
        last = event;
        this.show(job, event);
      }
    } catch (e) {
      if (abort.signal.aborted) return;
      this.statusLine.textContent = `${job.id}: the stream failed: ${e.message}`;
    }
    if (abort.signal.aborted) return;
    this.cancelButton.disabled = true;
    this.root.querySelector(".finetune-page").dataset.state = last?.type ?? "unknown";
    await this.refreshJobs();
  }

  show(job, e) {
    const line = (text) => { this.log.textContent += `${text}\n`; };
    switch (e.type) {
      case "queued": this.statusLine.textContent = `${job.id}: queued`; break;
      case "started": this.statusLine.textContent = `${job.id}: starting the trainer`; break;
      case "stage":
        this.statusLine.textContent = `${job.id}: ${e.message ?? e.stage}`;
        if (e.output_dir) job.output_path = e.output_dir;
        break;
      case "log": line(e.line); break;
      case "metric": {
        this.chart.add(e.kind, e.step, e.loss);
        if (typeof e.progress === "number") this.progress.value = e.progress;
        if (e.kind === "train") {
          this.statusLine.textContent = `${job.id}: step ${e.step}, loss ${number(e.loss, 4)}`;
          this.setNumbers([["Step", number(e.step)], ["Train loss", number(e.loss, 4)], ["Learning rate", e.learning_rate?.toExponential(2) ?? "–"],
            ["Tokens/s", number(e.tokens_per_sec)], ["Progress", percent(e.progress)],
            ...(e.accuracy !== undefined ? [["Reward accuracy", percent(e.accuracy)], ["Margin", number(e.margin, 3)]] : [])]);
        } else {
          line(`step ${e.step} validation loss ${number(e.loss, 4)}`);
        }
        break;
      }
      case "done":
        this.progress.value = 1;
        job.output_path = e.output_dir ?? job.output_path;
        this.statusLine.textContent = `${job.id}: done — adapter in ${job.output_path}`;
        this.mountButton.disabled = false;
        this.exportButton.disabled = false;
        announce("Training finished");
        break;
      case "cancelled":
        this.statusLine.textContent = `${job.id}: cancelled — the adapter so far is in ${e.output_dir ?? job.output_path}`;
        this.mountButton.disabled = false;
        break;
      case "failed":
        this.statusLine.textContent = `${job.id}: failed — ${e.error}`;
        announce("Training failed");
        break;
      default: break;
    }
  }

  setNumbers(rows) {
    replace(this.numbers, rows.map(([k, v]) => h("div", { class: "stat" }, h("dt", {}, k), h("dd", {}, v))));
  }

  async cancel() {
    if (!this.job) return;
    this.cancelButton.disabled = true;
    try {
      await request(`/api/jobs/${this.job.id}/cancel`, { method: "POST", body: {} });
      this.statusLine.textContent = `${this.job.id}: stopping…`;
    } catch (e) {
      this.statusLine.textContent = `${this.job.id}: ${e.message}`;
    }
  }

  /** Mounts the job's adapter under a free id and opens the chat with it selected. */
  async mountAdapter() {
    const path = this.job?.output_path;
    if (!path) return;
    this.mountButton.disabled = true;
    try {
      const mounted = (await getJson("/v1/adapters")).adapters ?? [];
      const existing = mounted.find((a) => a.path === path);
      let id = existing?.id;
      if (!id) {
        const base = path.split("/").filter(Boolean).pop().replace(/[^A-Za-z0-9._-]/g, "-") || "adapter";
        id = base;
        for (let i = 2; mounted.some((a) => a.id === id); i += 1) id = `${base}-${i}`;
        await request("/v1/adapters", { method: "POST", body: { id, path } });
      }
      let settings = {};
      try { settings = JSON.parse(localStorage.getItem(CHAT_SETTINGS) ?? "{}"); } catch { settings = {}; }
      localStorage.setItem(CHAT_SETTINGS, JSON.stringify({ ...settings, adapter: id }));
      announce(`Adapter ${id} mounted`);
      location.hash = "#/chat";
    } catch (e) {
      this.statusLine.textContent = `cannot mount ${path}: ${e.message}`;
      this.mountButton.disabled = false;
    }
  }

  /** Fuses the finished job's adapter into a copy of its base model, listed as a local model. */
  async exportModel() {
    const path = this.job?.output_path;
    if (!path) return;
    this.exportButton.disabled = true;
    this.exportResult.className = "hint";
    this.exportResult.textContent = "Fusing the adapter into a copy of the base model…";
    try {
      const body = { adapter_path: path };
      if (this.job.config?.model_dir) body.base_model = this.job.config.model_dir;
      const r = await (await request("/api/finetune/export", { method: "POST", body })).json();
      this.exportResult.textContent = `Exported as ${r.manifest?.model} in ${r.export_path} (${r.manifest?.dtype}); serve it with: wick serve ${r.manifest?.model}`;
      announce("Model exported");
    } catch (e) {
      this.exportResult.className = "error";
      this.exportResult.textContent = `export failed: ${e.message}`;
      this.exportButton.disabled = false;
    }
  }

  async refreshJobs() {
    try {
      this.jobs = (await getJson("/api/jobs")).jobs ?? [];
    } catch (e) {
      replace(this.jobsBody, h("tr", {}, h("td", { colspan: 6, class: "error" }, e.message)));
      return;
    }
    replace(this.jobsBody, this.jobs.slice(0, 20).map((j) => h("tr", { dataset: { job: j.id } },
      h("td", {}, j.id), h("td", {}, j.config?.method ?? j.kind), h("td", { class: `job-${j.status}` }, j.status),
      h("td", { class: "num" }, percent(j.progress)), h("td", {}, j.output_path ?? "–"),
      h("td", {}, h("button", { type: "button", onclick: () => this.watch(j), "aria-label": `Watch ${j.id}` }, "Watch")))));
    if (!this.jobs.length) replace(this.jobsBody, h("tr", {}, h("td", { colspan: 6, class: "hint" }, "No jobs yet.")));
  }
}
