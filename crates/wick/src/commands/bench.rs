//! `wick bench [MODEL]`: prompt-processing and decode speed, median of several runs.
use std::ops::ControlFlow;
use std::time::Instant;

use clap::Args;
use serde_json::json;
use wick_engine::{BackendKind, GenerationRequest, LoadOptions, Model};

#[derive(Args)]
pub struct BenchArgs {
    /// Model (default: the embedded default model).
    model: Option<String>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens to generate.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Runs (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Compute backend: candle (CPU) or mlx (needs a build with `--features mlx`).
    #[arg(long, env = "WICK_BACKEND", default_value = "candle", value_parser = ["candle", "mlx"])]
    backend: String,
    /// Sequences decoded together. Above 1, and always on mlx, the greedy lockstep path
    /// is measured (argmax on the backend, next step queued before ids are read); with 1
    /// on candle, the regular sampler path.
    #[arg(long, default_value_t = 1)]
    batch: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Peak resident memory of this process (Linux `VmHWM`), in bytes.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()
        .map(|kb| kb * 1024)
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let path = crate::model_arg::resolve(args.model.as_deref())?;
    let t = Instant::now();
    let backend: BackendKind = args.backend.parse()?;
    let model = Model::load(
        &path,
        &LoadOptions {
            backend,
            ..LoadOptions::default()
        },
    )?;
    let load_s = t.elapsed().as_secs_f64();
    // A deterministic prompt of ordinary text, cut to the requested length.
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(args.prompt_tokens / 8 + 8);
    let mut ids = model.tokenize(&text)?;
    ids.truncate(args.prompt_tokens.max(1));
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let lockstep = args.batch > 1 || backend != BackendKind::Candle;
    let batch = args.batch.max(1);
    for run in 0..args.runs.max(1) {
        if lockstep {
            let prompts = vec![ids.clone(); batch];
            let out = model.generate_greedy(
                &prompts,
                args.gen_tokens.max(2),
                args.prompt_tokens.max(1),
            )?;
            pp.push(out.prefill_tps());
            tg.push(out.decode_tps());
            if !args.json {
                eprintln!(
                    "run {}: prompt {:.1} tok/s, decode {:.1} tok/s (batch {batch})",
                    run + 1,
                    out.prefill_tps(),
                    out.decode_tps()
                );
            }
            continue;
        }
        let mut request = GenerationRequest::new(ids.clone()).max_tokens(args.gen_tokens);
        request.ignore_eos = true;
        request.prefill_chunk = args.prompt_tokens.max(1);
        let out = model.generate(&request, |_| ControlFlow::Continue(()))?;
        pp.push(out.usage.prefill_tps());
        tg.push(out.usage.decode_tps());
        if !args.json {
            eprintln!(
                "run {}: prompt {:.1} tok/s, decode {:.1} tok/s",
                run + 1,
                out.usage.prefill_tps(),
                out.usage.decode_tps()
            );
        }
    }
    let (pp, tg) = (median(pp), median(tg));
    let peak = peak_rss().unwrap_or(0);
    if args.json {
        println!(
            "{}",
            json!({"model": model.info().name, "backend": model.info().backend, "threads": rayon_threads(), "prompt_tokens": ids.len(), "gen_tokens": args.gen_tokens,
                   "batch": batch, "mode": if lockstep { "greedy-lockstep" } else { "sampler" },
                   "runs": args.runs, "prompt_tps": pp, "decode_tps": tg, "peak_rss_bytes": peak, "load_seconds": load_s})
        );
    } else {
        println!(
            "{} [{} batch {}]: prompt {} tokens {:.1} tok/s | decode {} tokens {:.1} tok/s | peak RSS {:.0} MiB | load {:.2}s (median of {})",
            model.info().name,
            model.info().backend,
            batch,
            ids.len(),
            pp,
            args.gen_tokens,
            tg,
            peak as f64 / (1 << 20) as f64,
            load_s,
            args.runs
        );
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
