//! [`ReplicaLoad`]: what a router in front of several wick replicas reads of one of them —
//! the load behind `GET /get_load` (vllm-router's and sglang-router's `power_of_two`) and the
//! gauges under vLLM's names that the llm-d inference scheduler scores
//! (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, …), rendered into `/metrics`
//! beside wick's own.
use std::fmt::Write;

use serde::Serialize;
use wick_engine::scheduler::EngineStats;

use crate::metrics::header;

/// One replica's load, from the engine's live figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReplicaLoad {
    /// Waiting plus running sequences: the number routers compare.
    pub load: usize,
    /// Requests waiting for a place in the batch (preempted ones included).
    pub num_waiting_reqs: usize,
    /// Sequences in the running batch.
    pub num_running_reqs: usize,
    /// Fraction (0–1) of the KV block pool held by running sequences; 0 without a bound
    /// pool.
    pub kv_cache_usage: f64,
}

impl From<&EngineStats> for ReplicaLoad {
    fn from(s: &EngineStats) -> Self {
        let pool = &s.kv_pool;
        let kv_cache_usage = match pool.total_blocks {
            Some(total) if total > 0 => (pool.used_blocks as f64 / total as f64).min(1.0),
            _ => 0.0,
        };
        ReplicaLoad {
            load: s.queued + s.running,
            num_waiting_reqs: s.queued,
            num_running_reqs: s.running,
            kv_cache_usage,
        }
    }
}

/// The gauges under vLLM's names, labelled with the served model id as vLLM labels them.
/// `gpu_cache_usage_perc` is the name older vLLM (and the llm-d scheduler's defaults for
/// it) use, `kv_cache_usage_perc` the newer one; both are fractions, as in vLLM.
pub fn render_vllm_gauges(out: &mut String, model_id: &str, load: &ReplicaLoad) {
    let label = model_id
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    let gauges = [
        (
            "vllm:num_requests_running",
            "Requests in the running batch (wick_running_sequences).",
            load.num_running_reqs as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled (wick_waiting_sequences).",
            load.num_waiting_reqs as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "Fraction of the KV block pool in use (1 = full).",
            load.kv_cache_usage,
        ),
        (
            "vllm:gpu_cache_usage_perc",
            "Fraction of the KV block pool in use (1 = full; vLLM's older name).",
            load.kv_cache_usage,
        ),
    ];
    for (name, help, value) in gauges {
        header(out, name, help, "gauge");
        let _ = writeln!(out, "{name}{{model_name=\"{label}\"}} {value}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_and_gauges_follow_the_engine() {
        let mut s = EngineStats {
            queued: 3,
            running: 5,
            ..EngineStats::default()
        };
        s.kv_pool.total_blocks = Some(200);
        s.kv_pool.used_blocks = 50;
        let load = ReplicaLoad::from(&s);
        assert_eq!(
            (load.load, load.num_waiting_reqs, load.num_running_reqs),
            (8, 3, 5)
        );
        assert_eq!(load.kv_cache_usage, 0.25);
        let mut out = String::new();
        render_vllm_gauges(&mut out, "smol\"lm", &load);
        assert!(out.contains("# TYPE vllm:num_requests_waiting gauge\n"));
        assert!(out.contains("vllm:num_requests_waiting{model_name=\"smol\\\"lm\"} 3\n"));
        assert!(out.contains("vllm:num_requests_running{model_name=\"smol\\\"lm\"} 5\n"));
        assert!(out.contains("vllm:gpu_cache_usage_perc{model_name=\"smol\\\"lm\"} 0.25\n"));
        assert!(out.contains("vllm:kv_cache_usage_perc{model_name=\"smol\\\"lm\"} 0.25\n"));
        // No bounded pool: usage reads 0, not a division by zero.
        let unbounded = ReplicaLoad::from(&EngineStats::default());
        assert_eq!(unbounded.kv_cache_usage, 0.0);
    }
}
