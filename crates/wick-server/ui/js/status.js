// The status page: what the server runs and how it is doing, from /stats and /metrics
// (polled every 1.5 s while the page is shown), the downloads in progress (/downloads,
// every 2 s), and the library and fit report (/library, /fit, on demand).

import { h, replace } from "./dom.js";
import { getJson, getText } from "./api.js";
import { bytes, number, percent, duration } from "./format.js";

const STATS_EVERY_MS = 1500;
const DOWNLOADS_EVERY_MS = 2000;

/** `get(o, "a.b")` is `o.a.b`, or undefined. */
function get(object, path) {
  return path.split(".").reduce((o, key) => (o === null || o === undefined ? undefined : o[key]), object);
}

const text = (v) => (v === null || v === undefined || v === "" ? "–" : String(v));
const tps = (v) => (v === null || v === undefined ? "–" : `${number(v)} tok/s`);
const kvUsed = (s) => {
  const k = get(s, "batching.kv_blocks");
  return k && k.used !== undefined && k.block_bytes !== undefined ? k.used * k.block_bytes : null;
};
const hitRate = (c) => (c && c.hits + c.misses > 0 ? c.hits / (c.hits + c.misses) : null);

/**
 * The cards: a title and rows of [label, /stats path or function of /stats, format].
 * A row with a path shows `data-stat` (the path) and `data-value` (the raw number), so
 * what is shown can be checked against /stats.
 */
const CARDS = [
  ["Model", [
    ["Model", "server.model", text],
    ["Architecture", "server.arch", text],
    ["Backend", "server.backend", text],
    ["KV type", "server.kv_type", text],
    ["Context length", "server.context_length", number],
    ["Tool-call format", "server.tool_format", text],
    ["Version", "server.version", text],
    ["Uptime", "server.uptime_s", duration],
  ]],
  ["Memory", [
    ["Weights", "memory.weights_bytes", bytes],
    ["KV pool used", ["memory.kv_pool_used_bytes", kvUsed], bytes],
    ["KV pool budget", "batch.kv_budget_bytes", bytes],
    ["KV in caches", "memory.kv_bytes", bytes],
    ["Prompt cache", "prompt_cache.bytes", bytes],
    ["Prompt cache limit", "prompt_cache.max_bytes", bytes],
    ["Resident (RSS)", "memory.rss_bytes", bytes],
    ["Max safe context", "admission.max_safe_context", number],
  ]],
  ["Speed", [
    ["Decode", "tokens_per_second.decode", tps],
    ["Batch size, last", "batching.batch_size.last", number],
    ["Batch size, average", "batching.batch_size.avg", number],
    ["Tokens per step, last", "batching.tokens_per_step.last", number],
    ["Tokens per step, average", "batching.tokens_per_step.avg", number],
    ["Steps", "batching.steps", number],
  ]],
  ["Queue and batch", [
    ["Waiting", "queue.waiting", number],
    ["Queue limit", "queue.limit", number],
    ["Running", "batch.active_rows", number],
    ["Batch limit", "batch.configured", number],
    ["Step token budget", "batch.step_token_budget", number],
    ["Preempted, waiting", "batching.preempted_waiting", number],
    ["Preemptions", "batching.preemptions", number],
    ["KV blocks used / total", ["batching.kv_blocks.used_of_total", (s) => {
      const k = get(s, "batching.kv_blocks");
      return k ? `${number(k.used)} / ${number(k.total)}` : null;
    }], text],
  ]],
  ["Prompt cache", [
    ["Hit rate", ["prompt_cache.hit_rate", (s) => hitRate(s.prompt_cache)], percent],
    ["Hits", "prompt_cache.hits", number],
    ["Misses", "prompt_cache.misses", number],
    ["Tokens served from cache", "prompt_cache.hit_tokens", number],
    ["Entries", "prompt_cache.entries", number],
    ["Evictions", "prompt_cache.evictions", number],
  ]],
  ["SSD tier", [
    ["Entries", "ssd_cache.entries", number],
    ["Size", "ssd_cache.bytes", bytes],
    ["Limit", "ssd_cache.max_bytes", bytes],
    ["Restores", "ssd_cache.restores", number],
    ["Last restore", ["ssd_cache.restore_ms_last", (s) => get(s, "ssd_cache.restore_ms_last")], (v) => (v === null || v === undefined ? "–" : `${number(v)} ms`)],
    ["Spills", "ssd_cache.spills", number],
    ["Pending spills", "ssd_cache.pending_spills", number],
    ["Dropped / failed spills", ["ssd_cache.dropped_failed", (s) => (s.ssd_cache ? `${s.ssd_cache.dropped_spills} / ${s.ssd_cache.failed_spills}` : null)], text],
  ]],
  ["Requests", [
    ["In flight", "requests.in_flight", number],
    ["Completed", "requests.completed", number],
    ["Cancelled", "requests.cancelled", number],
    ["Failed", "requests.failed", number],
    ["Tool-call repairs", ["requests.tool_call_repairs", (s) => {
      const r = get(s, "requests.tool_call_repairs");
      return r && typeof r === "object" ? Object.values(r).reduce((a, b) => a + Number(b || 0), 0) : r;
    }], number],
  ]],
];

/** `wick_http_requests_total{...} N` lines of /metrics as rows, most requests first. */
export function requestRows(metrics) {
  const rows = [];
  for (const line of metrics.split("\n")) {
    const m = /^wick_http_requests_total\{([^}]*)\}\s+([0-9.eE+]+)$/.exec(line.trim());
    if (!m) continue;
    const labels = Object.fromEntries([...m[1].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)].map((l) => [l[1], l[2]]));
    rows.push({ ...labels, count: Number(m[2]) });
  }
  return rows.sort((a, b) => b.count - a.count);
}

/** Mounts the status page in `root`; returns the function that unmounts it. */
export async function mount(root) {
  const page = new StatusPage(root);
  page.start();
  return () => page.stop();
}

class StatusPage {
  constructor(root) {
    this.root = root;
    this.timers = [];
    this.values = new Map();
    this.build();
  }

  build() {
    this.updated = h("span", { id: "status-updated" }, "Loading…");
    this.error = h("p", { class: "error", role: "alert", hidden: true });
    this.ssdOff = h("p", { class: "hint", hidden: true }, "No SSD tier (start with --ssd-cache DIR).");
    const cards = CARDS.map(([title, rows]) => {
      const list = h("dl", { class: "stats" });
      for (const [label, source, format] of rows) {
        const [path, compute] = Array.isArray(source) ? source : [source, (s) => get(s, source)];
        const dd = h("dd", { dataset: { stat: path } }, "–");
        this.values.set(path, { dd, compute, format });
        list.append(h("div", { class: "stat" }, h("dt", {}, label), dd));
      }
      const id = `card-${title.toLowerCase().replace(/\W+/g, "-")}`;
      return h("section", { class: "card", "aria-labelledby": id }, h("h2", { id }, title),
        title === "SSD tier" ? this.ssdOff : null, list);
    });
    this.requests = h("tbody");
    this.downloads = h("div", { id: "downloads" }, h("p", { class: "hint" }, "Loading…"));
    this.library = h("div", { id: "library" }, h("p", { class: "hint" }, "Loading…"));
    this.fit = h("div", { id: "fit" }, h("p", { class: "hint" }, "Loading…"));
    replace(this.root, h("div", { class: "status-page" },
      h("div", { class: "page-head" }, h("h1", {}, "Status"),
        h("p", { class: "live", "aria-live": "off" }, h("span", { class: "dot", "aria-hidden": "true" }), " Live · updated ", this.updated)),
      this.error,
      h("div", { class: "cards" }, cards),
      h("section", { class: "card wide", "aria-labelledby": "requests-title" },
        h("h2", { id: "requests-title" }, "Requests by route"),
        h("p", { class: "hint" }, "Counted since start (from /metrics)."),
        h("div", { class: "table-wrap" }, h("table", { id: "requests" },
          h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Route"), h("th", { scope: "col" }, "Method"),
            h("th", { scope: "col" }, "Status"), h("th", { scope: "col", class: "num" }, "Requests"))),
          this.requests))),
      h("section", { class: "card wide", "aria-labelledby": "downloads-title" },
        h("h2", { id: "downloads-title" }, "Downloads"), this.downloads),
      h("section", { class: "card wide", "aria-labelledby": "library-title" },
        h("div", { class: "card-head" }, h("h2", { id: "library-title" }, "Library"),
          h("button", { type: "button", id: "refresh-library", onclick: () => this.loadLibrary() }, "Refresh")),
        this.library),
      h("section", { class: "card wide", "aria-labelledby": "fit-title" },
        h("h2", { id: "fit-title" }, "Will it fit?"), this.fit)));
  }

  start() {
    const every = (ms, work) => {
      work();
      this.timers.push(setInterval(() => { if (!document.hidden) work(); }, ms));
    };
    every(STATS_EVERY_MS, () => this.poll());
    every(DOWNLOADS_EVERY_MS, () => this.pollDownloads());
    this.loadLibrary();
  }

  stop() {
    this.timers.forEach(clearInterval);
    this.timers = [];
    this.stopped = true;
  }

  showError(message) {
    this.error.textContent = message ?? "";
    this.error.hidden = !message;
  }

  async poll() {
    if (this.polling) return;
    this.polling = true;
    try {
      const [stats, metrics] = await Promise.all([getJson("/stats"), getText("/metrics")]);
      if (this.stopped) return;
      this.showStats(stats);
      this.showRequests(requestRows(metrics));
      this.updated.textContent = new Date().toLocaleTimeString();
      this.showError("");
    } catch (e) {
      if (!this.stopped) this.showError(`Cannot read /stats: ${e.message}`);
    } finally {
      this.polling = false;
    }
  }

  showStats(stats) {
    for (const [, { dd, compute, format }] of this.values) {
      const value = compute(stats);
      dd.dataset.value = value === null || value === undefined ? "" : typeof value === "object" ? JSON.stringify(value) : String(value);
      dd.textContent = format(value);
    }
    this.ssdOff.hidden = Boolean(stats.ssd_cache);
  }

  showRequests(rows) {
    replace(this.requests, rows.map((r) => h("tr", {},
      h("td", {}, h("code", {}, r.route ?? "")), h("td", {}, r.method ?? ""), h("td", {}, r.status ?? ""),
      h("td", { class: "num" }, number(r.count)))));
  }

  async pollDownloads() {
    try {
      const { downloads = [] } = await getJson("/downloads");
      if (this.stopped) return;
      if (!downloads.length) {
        replace(this.downloads, h("p", { class: "hint" }, "No downloads since the server started (wick get, or the hub endpoints)."));
        return;
      }
      replace(this.downloads, h("ul", { class: "downloads" }, downloads.map((d) => {
        const label = `${d.repo_id}: ${d.state}`;
        return h("li", {},
          h("div", {}, h("strong", {}, d.repo_id), " ", h("span", { class: `badge ${d.state}` }, d.state),
            d.current_file ? h("span", { class: "hint" }, ` ${d.current_file}`) : null),
          h("progress", { max: d.total_bytes || 1, value: d.received_bytes || 0, "aria-label": label }),
          h("span", { class: "hint" }, `${bytes(d.received_bytes)} of ${bytes(d.total_bytes)} · files ${number(d.files_done)}/${number(d.files_total)}`,
            d.state === "active" && d.bytes_per_sec ? ` · ${bytes(d.bytes_per_sec)}/s` : "", d.error ? ` · ${d.error}` : ""));
      })));
    } catch (e) {
      if (!this.stopped) replace(this.downloads, h("p", { class: "error" }, `Cannot read /downloads: ${e.message}`));
    }
  }

  async loadLibrary() {
    const [library, fit] = await Promise.allSettled([getJson("/library"), getJson("/fit")]);
    if (this.stopped) return;
    if (library.status === "fulfilled") this.showLibrary(library.value.models ?? []);
    else replace(this.library, h("p", { class: "error" }, `Cannot read /library: ${library.reason.message}`));
    if (fit.status === "fulfilled") this.showFit(fit.value);
    else replace(this.fit, h("p", { class: "error" }, `Cannot read /fit: ${fit.reason.message}`));
  }

  showLibrary(models) {
    if (!models.length) {
      replace(this.library, h("p", { class: "hint" }, "No models on disk (wick pull, wick get)."));
      return;
    }
    const th = (t, cls) => h("th", { scope: "col", class: cls }, t);
    replace(this.library, h("div", { class: "table-wrap" }, h("table", { id: "library-table" },
      h("thead", {}, h("tr", {}, th("Model"), th("Type"), th("Size", "num"), th("Bits", "num"), th("Status"),
        th("Max context", "num"), th("Decode", "num"))),
      h("tbody", {}, models.map((m) => h("tr", { class: m.serving ? "serving" : null },
        h("td", {}, m.repo_id), h("td", {}, text(m.model_type)), h("td", { class: "num" }, bytes(m.size_bytes)),
        h("td", { class: "num" }, text(m.quant_bits)),
        h("td", {}, m.serving ? "serving" : m.supported ? (m.support_tier ?? "supported") : "unsupported",
          m.assessment && !m.assessment.fits ? " · does not fit" : ""),
        h("td", { class: "num" }, number(m.assessment?.max_safe_context)),
        h("td", { class: "num" }, tps(m.assessment?.predicted_decode_tps))))))));
  }

  showFit(fit) {
    const r = fit.report ?? {};
    const row = (label, value) => h("div", { class: "stat" }, h("dt", {}, label), h("dd", {}, value));
    const machine = fit.machine ?? {};
    const parts = [
      h("p", { class: `verdict ${r.fits ? "ok" : "bad"}` },
        r.fits ? "Fits" : "Does not fit", ` at ${number(fit.context_tokens)} tokens of context`),
      h("dl", { class: "stats columns" },
        row("Machine", text(machine.chip)), row("RAM", bytes(machine.ram_bytes)),
        row("Bandwidth", machine.bandwidth_gbs ? `${number(machine.bandwidth_gbs)} GB/s` : "–"),
        row("Weights", bytes(r.weights_bytes)), row("KV cache", bytes(r.kv_bytes)),
        row("Transient", bytes(r.transient_bytes)), row("Total", bytes(r.total_bytes)),
        row("Usable", bytes(r.usable_bytes)), row("Max safe context", number(r.max_safe_context)),
        row("Predicted decode", tps(r.predicted_decode_tps)),
        row("Measured decode", tps(fit.measured_decode_tps))),
    ];
    if (fit.sku_matrix?.length) {
      parts.push(h("h3", {}, `Other machines at ${number(fit.sku_matrix_ctx)} tokens`),
        h("div", { class: "table-wrap" }, h("table", {},
          h("thead", {}, h("tr", {}, ["Machine", "RAM", "Fits", "Max context", "Decode"].map((t, i) => h("th", { scope: "col", class: i ? "num" : null }, t)))),
          h("tbody", {}, fit.sku_matrix.map((s) => h("tr", {},
            h("td", {}, s.sku), h("td", { class: "num" }, `${number(s.ram_gb)} GB`), h("td", { class: "num" }, s.fits ? "yes" : "no"),
            h("td", { class: "num" }, number(s.max_context)), h("td", { class: "num" }, tps(s.decode_tps))))))));
    }
    replace(this.fit, parts);
  }
}
