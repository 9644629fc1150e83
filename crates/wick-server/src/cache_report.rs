//! The prompt cache as the server shows it: the `prompt_cache` and `ssd_cache` objects of
//! `GET /stats`, the `wick_prompt_cache_*` series of `GET /metrics`, and the body of
//! `POST /admin/cache/flush`. Kept apart from the other stats so each family reads on its own.
use serde_json::{json, Value};
use wick_engine::scheduler::{CacheStats, FlushReport, SsdStats};

use crate::metrics::{counter, gauge, header};

/// `/stats.prompt_cache`: the RAM tier's counters, with the SSD tier's under `ssd`
/// (`null` without one).
pub fn prompt_cache_json(s: &CacheStats) -> Value {
    json!({
        "enabled": s.enabled,
        "entries": s.entries,
        "bytes": s.bytes,
        "max_bytes": s.max_bytes,
        "hits": s.hits,
        "misses": s.misses,
        "ram_hits": s.ram_hits,
        "ssd_hits": s.ssd_hits,
        "hit_tokens": s.cached_tokens_total,
        "evictions": s.evictions,
        "superseded": s.superseded,
        "pinned_entries": s.pinned_entries,
        "pinned_bytes": s.pinned_bytes,
        "misses_by_reason": s
            .misses_by_reason
            .iter()
            .map(|&(reason, n)| (reason.to_string(), Value::from(n)))
            .collect::<serde_json::Map<String, Value>>(),
        "ssd": s.ssd.as_ref().map(ssd_cache_json),
    })
}

/// `/stats.ssd_cache`: the SSD tier and its writer (`null` without one).
pub fn ssd_cache_json(s: &SsdStats) -> Value {
    json!({
        "entries": s.entries,
        "bytes": s.bytes,
        "max_bytes": s.max_bytes,
        "restores": s.restores,
        "bytes_written": s.bytes_written,
        "restore_failures": s.restore_failures,
        "scanning": s.scanning,
        "restore_ms_last": s.restore_ms_last,
        "spills": s.spills,
        "pending_snapshots": s.pending_snapshots,
        "pending_spills": s.pending_spills,
        "pending_spill_bytes": s.pending_spill_bytes,
        "dropped_spills": s.dropped_spills,
        "failed_spills": s.failed_spills,
        "evictions": s.evictions,
        "superseded": s.superseded,
        "longest_durable_prefix_tokens": s.longest_durable_prefix_tokens,
        "checkpoints": s.checkpoints,
        "checkpoints_saved": s.checkpoints_saved,
        "checkpoints_resumed": s.checkpoints_resumed,
    })
}

/// The body of `POST /admin/cache/flush`: the flush's outcome, and what the SSD tier
/// holds afterwards (`entries`, `bytes`, `longest_durable_prefix_tokens`).
pub fn flush_json(report: &FlushReport, after: &CacheStats) -> Value {
    let ssd = after.ssd.clone().unwrap_or_default();
    json!({
        "enabled": report.enabled,
        "durable": report.durable,
        "timed_out": report.timed_out,
        "elapsed_ms": report.elapsed_ms,
        "flushed_snapshots": report.flushed_snapshots,
        "missing_snapshots": report.missing_snapshots,
        "pending_snapshots": report.pending_snapshots,
        "pending_spills": report.pending_spills,
        "pending_spill_bytes": report.pending_spill_bytes,
        "dropped_spills": report.dropped_spills,
        "failed_spills": report.failed_spills,
        "entries": ssd.entries,
        "bytes": ssd.bytes,
        "longest_durable_prefix_tokens": ssd.longest_durable_prefix_tokens,
    })
}

/// Appends the `wick_prompt_cache_*` series. SSD series are always present (zero without
/// a tier, with `wick_prompt_cache_ssd_enabled 0`) so dashboards need no special case.
pub fn render_metrics(out: &mut String, s: &CacheStats) {
    gauge(
        out,
        "wick_prompt_cache_enabled",
        "1 when the RAM prompt cache is on.",
        f64::from(u8::from(s.enabled)),
    );
    header(
        out,
        "wick_prompt_cache_hits_total",
        "Prompt-cache lookups that reused a prefix, by the tier that served it.",
        "counter",
    );
    for (tier, n) in [("ram", s.ram_hits), ("ssd", s.ssd_hits)] {
        out.push_str(&format!(
            "wick_prompt_cache_hits_total{{tier=\"{tier}\"}} {n}\n"
        ));
    }
    counter(
        out,
        "wick_prompt_cache_misses_total",
        "Prompt-cache lookups that reused nothing.",
        s.misses,
    );
    header(
        out,
        "wick_prompt_cache_miss_reasons_total",
        "Prompt-cache misses by why nothing was reused: no entry shared a prefix, one did but could not be cut back to it (recurrent state, wrapped sliding window), only another namespace's did, or it was evicted.",
        "counter",
    );
    for (reason, n) in &s.misses_by_reason {
        out.push_str(&format!(
            "wick_prompt_cache_miss_reasons_total{{reason=\"{reason}\"}} {n}\n"
        ));
    }
    gauge(
        out,
        "wick_prompt_cache_pinned_entries",
        "RAM prompt-cache entries pinned by cache_control breakpoints.",
        s.pinned_entries as f64,
    );
    gauge(
        out,
        "wick_prompt_cache_pinned_bytes",
        "Bytes of the pinned RAM prompt-cache entries.",
        s.pinned_bytes as f64,
    );
    counter(
        out,
        "wick_prompt_cache_hit_tokens_total",
        "Prompt tokens reused from the prompt cache.",
        s.cached_tokens_total,
    );
    gauge(
        out,
        "wick_prompt_cache_ram_entries",
        "Entries in the RAM prompt cache.",
        s.entries as f64,
    );
    gauge(
        out,
        "wick_prompt_cache_ram_bytes",
        "Bytes held by the RAM prompt cache.",
        s.bytes as f64,
    );
    gauge(
        out,
        "wick_prompt_cache_ram_max_bytes",
        "Byte cap of the RAM prompt cache.",
        s.max_bytes as f64,
    );
    let ssd = s.ssd.clone().unwrap_or_default();
    header(
        out,
        "wick_prompt_cache_evictions_total",
        "Prompt-cache entries evicted for space, by tier.",
        "counter",
    );
    for (tier, n) in [("ram", s.evictions), ("ssd", ssd.evictions)] {
        out.push_str(&format!(
            "wick_prompt_cache_evictions_total{{tier=\"{tier}\"}} {n}\n"
        ));
    }
    header(
        out,
        "wick_prompt_cache_superseded_total",
        "Prompt-cache entries dropped because a longer entry covers them, by tier.",
        "counter",
    );
    for (tier, n) in [("ram", s.superseded), ("ssd", ssd.superseded)] {
        out.push_str(&format!(
            "wick_prompt_cache_superseded_total{{tier=\"{tier}\"}} {n}\n"
        ));
    }
    render_ssd_metrics(out, s.ssd.is_some(), &ssd);
}

fn render_ssd_metrics(out: &mut String, enabled: bool, s: &SsdStats) {
    gauge(
        out,
        "wick_prompt_cache_ssd_enabled",
        "1 when the SSD cold tier is on.",
        f64::from(u8::from(enabled)),
    );
    let gauges: [(&str, &str, f64); 8] = [
        (
            "wick_prompt_cache_ssd_entries",
            "Entries on the SSD tier (generation checkpoints included).",
            s.entries as f64,
        ),
        (
            "wick_prompt_cache_ssd_bytes",
            "Bytes on the SSD tier.",
            s.bytes as f64,
        ),
        (
            "wick_prompt_cache_ssd_max_bytes",
            "Byte cap of the SSD tier (0 = unlimited).",
            s.max_bytes as f64,
        ),
        (
            "wick_prompt_cache_ssd_pending_snapshots",
            "RAM entries not yet durable on the SSD.",
            s.pending_snapshots as f64,
        ),
        (
            "wick_prompt_cache_ssd_pending_writes",
            "SSD writes queued or in progress.",
            s.pending_spills as f64,
        ),
        (
            "wick_prompt_cache_ssd_pending_write_bytes",
            "Bytes of queued SSD writes.",
            s.pending_spill_bytes as f64,
        ),
        (
            "wick_prompt_cache_ssd_longest_durable_prefix_tokens",
            "The longest prefix on the SSD, in tokens.",
            s.longest_durable_prefix_tokens as f64,
        ),
        (
            "wick_prompt_cache_checkpoints",
            "Generation checkpoints on the SSD.",
            s.checkpoints as f64,
        ),
    ];
    for (name, help, value) in gauges {
        gauge(out, name, help, value);
    }
    let counters: [(&str, &str, u64); 8] = [
        (
            "wick_prompt_cache_ssd_restores_total",
            "SSD entries restored into a request.",
            s.restores,
        ),
        (
            "wick_prompt_cache_ssd_restore_failures_total",
            "SSD restores that failed (file removed, request computed the prefix).",
            s.restore_failures,
        ),
        (
            "wick_prompt_cache_ssd_writes_total",
            "Entries written to the SSD (spills, write-behind and flush snapshots).",
            s.spills,
        ),
        (
            "wick_prompt_cache_ssd_bytes_written_total",
            "Bytes written to the SSD tier's files (entries, shared chunks, checkpoints).",
            s.bytes_written,
        ),
        (
            "wick_prompt_cache_ssd_write_failures_total",
            "SSD writes that failed (full disk, I/O errors).",
            s.failed_spills,
        ),
        (
            "wick_prompt_cache_ssd_dropped_writes_total",
            "SSD writes dropped because the write queue was full.",
            s.dropped_spills,
        ),
        (
            "wick_prompt_cache_checkpoints_saved_total",
            "Generation checkpoints written.",
            s.checkpoints_saved,
        ),
        (
            "wick_prompt_cache_checkpoints_resumed_total",
            "Generations resumed from a checkpoint.",
            s.checkpoints_resumed,
        ),
    ];
    for (name, help, value) in counters {
        counter(out, name, help, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CacheStats {
        CacheStats {
            enabled: true,
            entries: 2,
            bytes: 1000,
            max_bytes: 4000,
            hits: 5,
            misses: 3,
            ram_hits: 4,
            ssd_hits: 1,
            cached_tokens_total: 777,
            pinned_entries: 1,
            misses_by_reason: vec![("no_entry", 2), ("untrimmable", 1)],
            ssd: Some(SsdStats {
                entries: 7,
                bytes: 9000,
                spills: 11,
                failed_spills: 2,
                checkpoints: 1,
                checkpoints_saved: 6,
                ..SsdStats::default()
            }),
            ..CacheStats::default()
        }
    }

    #[test]
    fn stats_objects_carry_the_counters() {
        let v = prompt_cache_json(&sample());
        assert_eq!(v["hits"], 5);
        assert_eq!(v["misses"], 3);
        assert_eq!(v["hit_tokens"], 777);
        assert_eq!(v["ssd"]["entries"], 7);
        assert_eq!(v["ssd"]["failed_spills"], 2);
        assert_eq!(v["ssd"]["checkpoints_saved"], 6);
        let off = prompt_cache_json(&CacheStats::default());
        assert!(off["ssd"].is_null());
    }

    #[test]
    fn metrics_have_values_and_types() {
        let mut out = String::new();
        render_metrics(&mut out, &sample());
        for line in [
            "wick_prompt_cache_hits_total{tier=\"ram\"} 4\n",
            "wick_prompt_cache_hits_total{tier=\"ssd\"} 1\n",
            "wick_prompt_cache_misses_total 3\n",
            "wick_prompt_cache_miss_reasons_total{reason=\"untrimmable\"} 1\n",
            "wick_prompt_cache_pinned_entries 1\n",
            "wick_prompt_cache_hit_tokens_total 777\n",
            "wick_prompt_cache_ram_bytes 1000\n",
            "wick_prompt_cache_ssd_enabled 1\n",
            "wick_prompt_cache_ssd_entries 7\n",
            "wick_prompt_cache_ssd_writes_total 11\n",
            "wick_prompt_cache_ssd_write_failures_total 2\n",
            "wick_prompt_cache_checkpoints 1\n",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
        for line in out.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            assert!(
                out.contains(&format!("# TYPE {name} ")),
                "{name} has no TYPE"
            );
        }
    }

    #[test]
    fn flush_body_reports_what_is_left() {
        let report = FlushReport {
            enabled: true,
            durable: false,
            pending_spills: 2,
            failed_spills: 1,
            ..FlushReport::default()
        };
        let v = flush_json(&report, &sample());
        assert_eq!(v["durable"], false);
        assert_eq!(v["pending_spills"], 2);
        assert_eq!(v["failed_spills"], 1);
        assert_eq!(v["entries"], 7);
    }
}
