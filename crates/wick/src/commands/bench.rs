//! `wick bench [MODEL]`: prompt-processing and decode speed, median of several runs; with
//! `--concurrency N`, load on a running server instead (`load.rs`).
use std::ops::ControlFlow;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};
use wick_engine::{BackendKind, GenerationRequest, LoadOptions, Model, DEFAULT_PREFILL_CHUNK};

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
    /// Untimed runs before the timed ones (kernel compilation, caches).
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Print JSON (one line per case).
    #[arg(long)]
    json: bool,
    /// Load a running server (`--url`) with this many concurrent streaming chat
    /// requests instead of timing the model in-process.
    #[arg(long)]
    concurrency: Option<usize>,
    /// The server to load with --concurrency.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// With --concurrency: requests each client sends one after the other.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// With --concurrency: LoRA adapter ids (comma-separated, `none` for the base model)
    /// the clients take in turn, client `i` the `i % n`-th.
    #[arg(long, value_delimiter = ',')]
    adapters: Vec<String>,
    /// With --concurrency: sampling temperature of the requests.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Compute backend: cpu (wick's own kernels; `candle` is an old name for it) or mlx
    /// (needs a build with `--features mlx`).
    #[arg(long, env = "WICK_BACKEND", default_value = "cpu", value_parser = ["cpu", "candle", "mlx", "cuda"])]
    backend: String,
    /// How the CPU KV cache stores keys and values: f16 (halves the memory batched decode
    /// reads; llama.cpp's default) or f32. Default: f16 for GGUF files, f32 for Hugging
    /// Face directories.
    #[arg(long, env = "WICK_KV_TYPE", value_parser = ["f16", "f32"])]
    kv_type: Option<String>,
    /// Sequences decoded together. Above 1, and always on mlx, the greedy lockstep path
    /// is measured (argmax on the backend, next step queued before ids are read); with 1
    /// on cpu, the regular sampler path.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Measure this machine's memory read bandwidth and store it for `wick fit`'s decode
    /// speed prediction (instead of timing a model).
    #[arg(long)]
    calibrate: bool,
    /// Cases `PROMPT:GEN:BATCH` run on one loaded model (repeatable); replaces
    /// --prompt-tokens, --gen-tokens and --batch.
    #[arg(long = "case")]
    cases: Vec<String>,
    /// The long-prompt cases: prompts of 512, 4096, 8192 and 16384 tokens (those the
    /// model's context holds), each followed by --gen-tokens of decode, batch 1.
    #[arg(long, conflicts_with = "cases")]
    long_prompts: bool,
    /// Use prompt ids `100 + (7919·i + 13) mod 32000` instead of tokenized text (the
    /// same ids scripts/gpu/mlx_lm_bench.py feeds mlx-lm).
    #[arg(long)]
    synthetic_prompt: bool,
    /// Prompt rows per forward pass; 0 feeds the whole prompt in one pass. Default: what
    /// `wick serve` feeds a lone prompt with its default --step-tokens (512): the
    /// backend's longer chunks where it prefers them (2,048 on the CPU, 8,192 on CUDA),
    /// else 512.
    #[arg(long)]
    prefill_chunk: Option<usize>,
}

/// Prompt lengths of `--long-prompts`: a chat turn, then what coding agents send (Codex's
/// first request is 7–12k tokens, Claude Code's about 19k).
const LONG_PROMPTS: [usize; 4] = [512, 4096, 8192, 16384];

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

/// One measured configuration.
#[derive(Debug, Clone, Copy)]
struct Case {
    prompt: usize,
    gen: usize,
    batch: usize,
}

fn parse_case(s: &str) -> anyhow::Result<Case> {
    let parts: Vec<usize> = s
        .split(':')
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("--case {s}: expected PROMPT:GEN:BATCH"))?;
    match parts[..] {
        [prompt, gen, batch] if prompt > 0 && batch > 0 => Ok(Case { prompt, gen, batch }),
        _ => anyhow::bail!("--case {s}: expected PROMPT:GEN:BATCH with PROMPT, BATCH ≥ 1"),
    }
}

/// The synthetic prompt of `n` ids (see `--synthetic-prompt`).
fn synthetic_ids(n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| 100 + ((7919 * i + 13) % 32000) as u32)
        .collect()
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.calibrate {
        return calibrate(args.json);
    }
    if let Some(concurrency) = args.concurrency {
        return super::load::run(super::load::LoadSpec {
            url: args.url,
            concurrency,
            rounds: args.rounds,
            prompt_tokens: args.prompt_tokens,
            gen_tokens: args.gen_tokens,
            temperature: args.temperature,
            json: args.json,
            adapters: args.adapters.clone(),
        });
    }
    let path = crate::model_arg::resolve(args.model.as_deref())?;
    let backend: BackendKind = args.backend.parse()?;
    let t = Instant::now();
    let model = Model::load(
        &path,
        &LoadOptions {
            backend,
            kv_dtype: crate::model_arg::kv_dtype(args.kv_type.as_deref())?,
            ..LoadOptions::default()
        },
    )?;
    let load_s = t.elapsed().as_secs_f64();
    let cases = if args.long_prompts {
        let context = model.info().context_length;
        LONG_PROMPTS
            .iter()
            .filter(|&&prompt| {
                let fits = prompt + args.gen_tokens <= context;
                if !fits {
                    eprintln!("skipping the {prompt}-token prompt: the context is {context}");
                }
                fits
            })
            .map(|&prompt| Case {
                prompt,
                gen: args.gen_tokens,
                batch: 1,
            })
            .collect()
    } else if args.cases.is_empty() {
        vec![Case {
            prompt: args.prompt_tokens.max(1),
            gen: args.gen_tokens,
            batch: args.batch.max(1),
        }]
    } else {
        args.cases
            .iter()
            .map(|c| parse_case(c))
            .collect::<anyhow::Result<_>>()?
    };
    for case in cases {
        let ids = if args.synthetic_prompt {
            synthetic_ids(case.prompt)
        } else {
            // A deterministic prompt of ordinary text, cut to the requested length.
            let text = "The quick brown fox jumps over the lazy dog. ".repeat(case.prompt / 8 + 8);
            let mut ids = model.tokenize(&text)?;
            ids.truncate(case.prompt);
            ids
        };
        let lockstep = case.batch > 1 || backend != BackendKind::Candle;
        let chunk = match args.prefill_chunk {
            Some(0) => case.prompt.max(1),
            Some(n) => n,
            None => model.lone_prompt_tokens(DEFAULT_PREFILL_CHUNK),
        };
        let mut pp = Vec::new();
        let mut tg = Vec::new();
        // Per decode step, lockstep runs only: host time building it, time waiting for ids.
        let mut build_ms = Vec::new();
        let mut wait_ms = Vec::new();
        for run in 0..args.warmup + args.runs.max(1) {
            let (prompt_tps, decode_tps) = if lockstep {
                let prompts = vec![ids.clone(); case.batch];
                let out = model.generate_greedy(&prompts, case.gen.max(2), chunk)?;
                if run >= args.warmup {
                    let steps = out
                        .tokens
                        .first()
                        .map_or(1, |t| t.len().saturating_sub(1).max(1));
                    build_ms.push(out.decode_build_time.as_secs_f64() * 1e3 / steps as f64);
                    wait_ms.push(out.decode_wait_time.as_secs_f64() * 1e3 / steps as f64);
                }
                (out.prefill_tps(), out.decode_tps())
            } else {
                let mut request = GenerationRequest::new(ids.clone()).max_tokens(case.gen);
                request.ignore_eos = true;
                request.prefill_chunk = chunk;
                let out = model.generate(&request, |_| ControlFlow::Continue(()))?;
                (out.usage.prefill_tps(), out.usage.decode_tps())
            };
            let warm = run < args.warmup;
            if !args.json {
                eprintln!(
                    "{} {}: prompt {prompt_tps:.1} tok/s, decode {decode_tps:.1} tok/s (batch {})",
                    if warm { "warmup" } else { "run" },
                    run + 1,
                    case.batch
                );
            }
            if !warm {
                pp.push(prompt_tps);
                tg.push(decode_tps);
            }
        }
        let (pp, tg) = (median(pp), median(tg));
        let (build_ms, wait_ms) = if build_ms.is_empty() {
            (Value::Null, Value::Null)
        } else {
            (json!(median(build_ms)), json!(median(wait_ms)))
        };
        let peak = peak_rss().unwrap_or(0);
        if args.json {
            println!(
                "{}",
                json!({"model": model.info().name, "backend": model.info().backend, "kv_type": model.info().kv_type, "threads": rayon_threads(),
                       "prompt_tokens": ids.len(), "gen_tokens": case.gen, "batch": case.batch,
                       "mode": if lockstep { "greedy-lockstep" } else { "sampler" },
                       "prefill_chunk": chunk, "runs": args.runs, "warmup": args.warmup, "prompt_tps": pp, "decode_tps": tg,
                       "weight_bytes": model.info().weight_bytes,
                       "peak_rss_bytes": peak, "load_seconds": load_s,
                       "decode_build_ms_per_step": build_ms, "decode_wait_ms_per_step": wait_ms})
            );
        } else {
            println!(
                "{} [{} batch {}]: prompt {} tokens {:.1} tok/s | decode {} tokens {:.1} tok/s | peak RSS {:.0} MiB | load {:.2}s (median of {})",
                model.info().name,
                model.info().backend,
                case.batch,
                ids.len(),
                pp,
                case.gen,
                tg,
                peak as f64 / (1 << 20) as f64,
                load_s,
                args.runs
            );
        }
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// `wick bench --calibrate`: host memory bandwidth, stored in the store for `wick fit`.
fn calibrate(as_json: bool) -> anyhow::Result<()> {
    let store = wick_hub::Store::from_env()?;
    let gbs = wick_hub::fit::measure_host_bandwidth();
    anyhow::ensure!(
        gbs.is_finite() && gbs > 0.0,
        "the bandwidth measurement failed"
    );
    let measured_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let c = wick_hub::fit::Calibration {
        chip: "cpu".into(),
        bandwidth_gbs: gbs,
        measured_at,
    };
    wick_hub::fit::write_calibration(store.root(), &c).with_context(|| {
        format!(
            "writing {}",
            wick_hub::fit::calibration_path(store.root()).display()
        )
    })?;
    if as_json {
        println!("{}", serde_json::to_string(&c)?);
    } else {
        println!(
            "memory read bandwidth: {gbs:.1} GB/s (stored in {})",
            wick_hub::fit::calibration_path(store.root()).display()
        );
    }
    Ok(())
}
