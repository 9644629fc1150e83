//! [`Metrics`]: the server's counters and latency histograms, rendered in the Prometheus text
//! format by `GET /metrics` together with the engine's live figures.
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use wick_engine::scheduler::{EngineStats, HistogramSnapshot};

/// Bucket bounds (seconds) of the time-to-first-token histogram.
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Bucket bounds (seconds) of the inter-token latency histogram.
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// A fixed-bucket histogram.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    state: Mutex<HistogramState>,
}

#[derive(Debug, Default, Clone)]
struct HistogramState {
    /// Observations per bucket (not cumulative); the last slot is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            state: Mutex::new(HistogramState {
                counts: vec![0; bounds.len() + 1],
                ..HistogramState::default()
            }),
        }
    }

    fn observe(&self, value: f64) {
        let slot = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        let mut s = lock(&self.state);
        s.counts[slot] += 1;
        s.sum += value;
        s.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let s = lock(&self.state).clone();
        header(out, name, help, "histogram");
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&s.counts) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        cumulative += s.counts.last().copied().unwrap_or(0);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum {}", s.sum);
        let _ = writeln!(out, "{name}_count {}", s.count);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One HTTP request's labels.
type RequestKey = (String, String, u16);

/// The server's own counters (the engine keeps its own; both are rendered together).
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<RequestKey, u64>>,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    repairs: Mutex<BTreeMap<&'static str, u64>>,
    ttft: Histogram,
    itl: Histogram,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    tool_calls: AtomicU64,
    in_flight: AtomicI64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            errors: Mutex::default(),
            repairs: Mutex::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            tool_calls: AtomicU64::new(0),
            in_flight: AtomicI64::new(0),
        }
    }
}

impl Metrics {
    /// Counts a finished HTTP exchange (the response head was sent).
    pub fn record_request(&self, route: &str, method: &str, status: u16) {
        *lock(&self.requests)
            .entry((route.to_string(), method.to_string(), status))
            .or_insert(0) += 1;
    }

    /// A generation was submitted.
    pub fn generation_started(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A generation ended (finished, failed or dropped).
    pub fn generation_ended(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// Counts an error response by its code.
    pub fn record_error(&self, code: &'static str) {
        *lock(&self.errors).entry(code).or_insert(0) += 1;
    }

    /// Counts a tool-call repair by kind.
    pub fn record_repair(&self, kind: &'static str) {
        *lock(&self.repairs).entry(kind).or_insert(0) += 1;
    }

    /// Counts a parsed tool call.
    pub fn record_tool_call(&self) {
        self.tool_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Time from the request's arrival to its first generated token.
    pub fn observe_ttft(&self, d: Duration) {
        self.ttft.observe(d.as_secs_f64());
    }

    /// Time between two generated tokens of one request.
    pub fn observe_inter_token(&self, d: Duration) {
        self.itl.observe(d.as_secs_f64());
    }

    /// Counts a finished generation's tokens.
    pub fn record_tokens(&self, prompt: usize, cached: usize, completion: usize) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
    }

    /// Generations being served (streams included).
    pub fn generations_in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Tool-call repairs so far, by kind.
    pub fn repairs(&self) -> BTreeMap<&'static str, u64> {
        lock(&self.repairs).clone()
    }

    /// The Prometheus text exposition of these metrics and `engine`'s figures.
    pub fn render(&self, engine: &EngineStats, max_batch: usize, max_queue: usize) -> String {
        let mut out = String::with_capacity(4096);
        header(
            &mut out,
            "wick_http_requests_total",
            "HTTP requests answered, by route, method and status.",
            "counter",
        );
        for ((route, method, status), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "wick_http_requests_total{{route=\"{}\",method=\"{}\",status=\"{status}\"}} {n}",
                escape(route),
                escape(method)
            );
        }
        header(
            &mut out,
            "wick_http_errors_total",
            "Error responses, by error code.",
            "counter",
        );
        for (code, n) in lock(&self.errors).iter() {
            let _ = writeln!(out, "wick_http_errors_total{{code=\"{code}\"}} {n}");
        }
        gauge(
            &mut out,
            "wick_generations_in_flight",
            "Generation requests being served (submitted, not yet finished or dropped).",
            self.generations_in_flight() as f64,
        );
        self.ttft.render(
            &mut out,
            "wick_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
        );
        self.itl.render(
            &mut out,
            "wick_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
        );
        counter(
            &mut out,
            "wick_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "wick_prompt_cached_tokens_total",
            "Prompt tokens served from a cache.",
            self.cached_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "wick_generation_tokens_total",
            "Tokens generated for finished requests.",
            self.completion_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "wick_tool_calls_total",
            "Tool calls parsed from model output.",
            self.tool_calls.load(Ordering::Relaxed),
        );
        header(
            &mut out,
            "wick_tool_call_repairs_total",
            "Repairs applied to parse tool calls, by kind.",
            "counter",
        );
        for (kind, n) in lock(&self.repairs).iter() {
            let _ = writeln!(out, "wick_tool_call_repairs_total{{kind=\"{kind}\"}} {n}");
        }
        gauge(
            &mut out,
            "wick_queue_depth",
            "Requests waiting for a place in the batch.",
            engine.queued as f64,
        );
        gauge(
            &mut out,
            "wick_queue_limit",
            "Waiting requests beyond which new ones get 429.",
            max_queue as f64,
        );
        gauge(
            &mut out,
            "wick_running_sequences",
            "Sequences in the running batch.",
            engine.running as f64,
        );
        gauge(
            &mut out,
            "wick_batch_size",
            "Sequences in the last forward pass.",
            engine.last_batch_size as f64,
        );
        gauge(
            &mut out,
            "wick_batch_size_limit",
            "Sequences decoded together at most.",
            max_batch as f64,
        );
        gauge(
            &mut out,
            "wick_decode_tokens_per_second",
            "Recent aggregate decode rate.",
            engine.decode_tokens_per_second,
        );
        gauge(
            &mut out,
            "wick_kv_cache_bytes",
            "Bytes of KV cache held by running sequences.",
            engine.kv_bytes as f64,
        );
        counter(
            &mut out,
            "wick_engine_steps_total",
            "Forward passes run.",
            engine.steps,
        );
        counter(
            &mut out,
            "wick_engine_prompt_tokens_total",
            "Prompt tokens computed by the engine.",
            engine.prompt_tokens_total,
        );
        counter(
            &mut out,
            "wick_engine_generated_tokens_total",
            "Tokens sampled by the engine.",
            engine.generated_tokens_total,
        );
        header(
            &mut out,
            "wick_engine_requests_total",
            "Engine requests by outcome.",
            "counter",
        );
        for (outcome, n) in [
            ("completed", engine.completed),
            ("cancelled", engine.cancelled),
            ("failed", engine.failed),
        ] {
            let _ = writeln!(
                out,
                "wick_engine_requests_total{{outcome=\"{outcome}\"}} {n}"
            );
        }
        crate::cache_report::render_metrics(&mut out, &engine.prompt_cache);
        render_batching(&mut out, engine);
        out
    }
}

/// Continuous batching: KV blocks, preemptions, batch size and tokens per step.
fn render_batching(out: &mut String, engine: &EngineStats) {
    let pool = &engine.kv_pool;
    header(
        out,
        "wick_kv_blocks",
        "KV cache blocks by state (one layer's block of block_tokens tokens).",
        "gauge",
    );
    let _ = writeln!(out, "wick_kv_blocks{{state=\"used\"}} {}", pool.used_blocks);
    if let (Some(free), Some(total)) = (pool.free_blocks, pool.total_blocks) {
        let _ = writeln!(out, "wick_kv_blocks{{state=\"free\"}} {free}");
        let _ = writeln!(out, "wick_kv_blocks{{state=\"total\"}} {total}");
    }
    gauge(
        out,
        "wick_kv_block_tokens",
        "Tokens per KV block.",
        pool.block_tokens as f64,
    );
    gauge(
        out,
        "wick_waiting_sequences",
        "Requests and preempted sequences waiting to run.",
        engine.queued as f64,
    );
    counter(
        out,
        "wick_preemptions_total",
        "Running sequences preempted (blocks freed, recomputed later) for lack of KV blocks.",
        engine.preemptions,
    );
    count_histogram(
        out,
        "wick_step_batch_size",
        "Sequences per forward pass.",
        &engine.batch_size,
    );
    count_histogram(
        out,
        "wick_step_tokens",
        "Tokens per forward pass.",
        &engine.step_tokens,
    );
    let spec = &engine.speculation;
    counter(
        out,
        "wick_spec_steps_total",
        "Forward passes that verified speculative drafts (--spec).",
        spec.steps,
    );
    counter(
        out,
        "wick_spec_draft_tokens_total",
        "Tokens drafted (by prompt lookup or the draft model) and verified.",
        spec.drafted,
    );
    counter(
        out,
        "wick_spec_accepted_tokens_total",
        "Drafted tokens the model agreed with (emitted without a forward pass of their own).",
        spec.accepted,
    );
    counter(
        out,
        "wick_spec_draft_model_tokens_total",
        "Tokens the draft model computed (--draft-model): histories it caught up on and its drafts.",
        spec.draft_model_tokens,
    );
    counter(
        out,
        "wick_spec_draft_model_cached_tokens_total",
        "Tokens the draft model restored from the prompt cache instead of computing: prompts at admission, histories of preempted sequences that resume.",
        spec.draft_model_cached_tokens,
    );
}

/// An engine histogram of counts in the Prometheus format.
fn count_histogram(out: &mut String, name: &str, help: &str, h: &HistogramSnapshot) {
    header(out, name, help, "histogram");
    let mut cumulative = 0;
    for (bound, n) in h.bounds.iter().zip(&h.counts) {
        cumulative += n;
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum {}", h.sum);
    let _ = writeln!(out, "{name}_count {}", h.count);
}

pub(crate) fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

pub(crate) fn counter(out: &mut String, name: &str, help: &str, value: u64) {
    header(out, name, help, "counter");
    let _ = writeln!(out, "{name} {value}");
}

pub(crate) fn gauge(out: &mut String, name: &str, help: &str, value: f64) {
    header(out, name, help, "gauge");
    let _ = writeln!(out, "{name} {value}");
}

/// Escapes a label value (`\`, `"` and newlines).
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.observe_ttft(Duration::from_millis(3));
        m.observe_ttft(Duration::from_millis(30));
        m.observe_ttft(Duration::from_secs(100));
        let text = m.render(&EngineStats::default(), 8, 64);
        assert!(text.contains("wick_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("wick_time_to_first_token_seconds_bucket{le=\"0.05\"} 2\n"));
        assert!(text.contains("wick_time_to_first_token_seconds_bucket{le=\"30\"} 2\n"));
        assert!(text.contains("wick_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("wick_time_to_first_token_seconds_count 3\n"));
    }

    #[test]
    fn batching_figures_are_rendered() {
        let mut e = EngineStats::default();
        e.kv_pool.used_blocks = 30;
        e.kv_pool.total_blocks = Some(100);
        e.kv_pool.free_blocks = Some(70);
        e.preemptions = 3;
        e.batch_size = HistogramSnapshot {
            bounds: vec![1, 4],
            counts: vec![2, 5, 1],
            sum: 25,
            count: 8,
        };
        let text = Metrics::default().render(&e, 8, 64);
        for line in [
            "wick_kv_blocks{state=\"used\"} 30\n",
            "wick_kv_blocks{state=\"free\"} 70\n",
            "wick_kv_blocks{state=\"total\"} 100\n",
            "wick_preemptions_total 3\n",
            "wick_step_batch_size_bucket{le=\"4\"} 7\n",
            "wick_step_batch_size_bucket{le=\"+Inf\"} 8\n",
            "wick_step_batch_size_sum 25\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }

    #[test]
    fn labels_are_escaped_and_every_sample_has_a_type() {
        let m = Metrics::default();
        m.record_request("/v1/\"x\"", "GET", 404);
        m.record_error("route_not_found");
        m.record_repair("bare_json");
        let text = m.render(&EngineStats::default(), 8, 64);
        assert!(text.contains(
            "wick_http_requests_total{route=\"/v1/\\\"x\\\"\",method=\"GET\",status=\"404\"} 1"
        ));
        assert!(text.contains("wick_tool_call_repairs_total{kind=\"bare_json\"} 1"));
        let typed: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            let base = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count");
            assert!(
                typed.contains(&name) || typed.contains(&base),
                "{line} has no TYPE"
            );
        }
    }
}
