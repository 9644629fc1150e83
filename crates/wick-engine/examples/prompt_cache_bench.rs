//! Time to first token for a long shared prefix: cold, RAM hit, SSD hit after a restart,
//! and decode speed with the cache tiers on and off.
//!
//! ```text
//! cargo run --release -p wick-engine --example prompt_cache_bench -- \
//!     MODEL.gguf --tokens 4096 [--tokens 16384] [--ssd-dir DIR] [--decode 32]
//! ```
//!
//! For each prefix length N: a prompt of N tokens is the shared prefix; each measured
//! request is the prefix plus a short question of its own (an agent's next turn).
//! - cold: an engine without a prompt cache;
//! - RAM hit: an engine with RAM+SSD tiers, after one request on the prefix alone;
//! - SSD hit: that engine flushed and shut down, a new engine on the same directory
//!   (a restarted server; the page cache is warm, as after a quick restart).
//!
//! Decode speed is measured on the same requests (`--decode` tokens, EOS ignored).
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent, EngineHandle};
use wick_engine::{GenerationRequest, LoadOptions, Model};

struct Args {
    model: PathBuf,
    tokens: Vec<usize>,
    ssd_dir: Option<PathBuf>,
    decode: usize,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut args = Args {
        model: PathBuf::new(),
        tokens: Vec::new(),
        ssd_dir: None,
        decode: 32,
    };
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--tokens" => args.tokens.push(
                value("--tokens")?
                    .parse()
                    .map_err(|e| format!("--tokens: {e}"))?,
            ),
            "--ssd-dir" => args.ssd_dir = Some(PathBuf::from(value("--ssd-dir")?)),
            "--decode" => {
                args.decode = value("--decode")?
                    .parse()
                    .map_err(|e| format!("--decode: {e}"))?
            }
            _ if a.starts_with("--") => return Err(format!("unknown option {a}")),
            _ => args.model = PathBuf::from(a),
        }
    }
    if args.model.as_os_str().is_empty() {
        return Err(
            "usage: prompt_cache_bench MODEL --tokens N [--tokens N] [--ssd-dir DIR] [--decode N]"
                .into(),
        );
    }
    if args.tokens.is_empty() {
        args.tokens.push(4096);
    }
    Ok(args)
}

/// A prompt of exactly `n` tokens: log lines, tokenized line by line (tokenizing one
/// huge string costs more than the prefill being measured).
fn prefix(model: &Model, n: usize) -> Vec<u32> {
    let tok = model.tokenizer();
    let mut ids: Vec<u32> = tok.bos_id().filter(|_| tok.add_bos()).into_iter().collect();
    let mut i = 0;
    while ids.len() < n {
        let line = format!(
            "Log line {i}: service {} answered request {} in {} ms.\n",
            i % 17,
            i * 31 % 1000,
            (i * 7) % 250
        );
        ids.extend(tok.encode(&line, false).expect("tokenize"));
        i += 1;
    }
    ids.truncate(n);
    ids
}

fn question(model: &Model, base: &[u32], k: usize) -> GenerationRequest {
    let mut p = base.to_vec();
    p.extend(
        model
            .tokenize(&format!(
                "\nQuestion {k}: which service answered request {}?",
                k * 13
            ))
            .expect("tokenize"),
    );
    GenerationRequest::new(p)
}

struct Measured {
    ttft: Duration,
    cached: usize,
    decode_tps: f64,
}

fn measure(engine: &EngineHandle, req: GenerationRequest) -> Measured {
    let started = Instant::now();
    let mut h = engine.submit(req).expect("submit");
    let mut ttft = None;
    loop {
        match h.blocking_next() {
            Some(EngineEvent::Token(_)) => {
                ttft.get_or_insert_with(|| started.elapsed());
            }
            Some(EngineEvent::Done(d)) => {
                return Measured {
                    ttft: ttft.unwrap_or_else(|| started.elapsed()),
                    cached: d.usage.cached_tokens,
                    decode_tps: d.usage.decode_tps(),
                }
            }
            Some(EngineEvent::Failed(e)) => panic!("request failed: {e}"),
            None => panic!("engine stopped"),
        }
    }
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let model = Arc::new(Model::load(&args.model, &LoadOptions::default()).expect("load model"));
    let tmp;
    let ssd_root = match &args.ssd_dir {
        Some(d) => d.clone(),
        None => {
            tmp = std::env::temp_dir()
                .join(format!("wick-prompt-cache-bench-{}", std::process::id()));
            tmp
        }
    };
    println!(
        "model {} ({}), context {}, SSD dir {}",
        model.info().name,
        model.info().arch,
        model.info().context_length,
        ssd_root.display()
    );
    println!("| prefix tokens | cold TTFT | RAM hit TTFT | SSD hit TTFT (restart) | RAM / cold | SSD / cold | decode tok/s cold / RAM / SSD |");
    println!("|---|---|---|---|---|---|---|");
    for &n in &args.tokens {
        let base = prefix(&model, n);
        let with = |r: GenerationRequest| {
            let mut r = r.max_tokens(args.decode);
            r.ignore_eos = true;
            r
        };
        let cold_engine = Engine::start(
            model.clone(),
            EngineConfig {
                prompt_cache_bytes: 0,
                ..EngineConfig::default()
            },
        )
        .expect("engine");
        let cold = measure(&cold_engine, with(question(&model, &base, 1)));
        cold_engine.shutdown(Duration::from_secs(5));
        let _ = std::fs::remove_dir_all(&ssd_root);
        let cached_config = EngineConfig {
            ssd_cache_dir: Some(ssd_root.clone()),
            ..EngineConfig::default()
        };
        let (ram, flush_ms) = {
            let engine = Engine::start(model.clone(), cached_config.clone()).expect("engine");
            measure(&engine, GenerationRequest::new(base.clone()).max_tokens(1));
            let ram = measure(&engine, with(question(&model, &base, 2)));
            let t = Instant::now();
            let report = engine.flush_cache(Duration::from_secs(600));
            assert!(report.durable, "flush: {report:?}");
            let flush_ms = t.elapsed().as_millis();
            engine.shutdown(Duration::from_secs(5));
            (ram, flush_ms)
        };
        let (ssd, restore_ms) = {
            let engine = Engine::start(model.clone(), cached_config).expect("engine");
            let ssd = measure(&engine, with(question(&model, &base, 3)));
            let restore_ms = engine
                .stats()
                .prompt_cache
                .ssd
                .map_or(0, |s| s.restore_ms_last);
            (ssd, restore_ms)
        };
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "| {n} | {:.0} ms | {:.0} ms ({} cached) | {:.0} ms ({} cached, read {} ms) | {:.1}% | {:.1}% | {:.1} / {:.1} / {:.1} |",
            ms(cold.ttft),
            ms(ram.ttft),
            ram.cached,
            ms(ssd.ttft),
            ssd.cached,
            restore_ms,
            100.0 * ms(ram.ttft) / ms(cold.ttft),
            100.0 * ms(ssd.ttft) / ms(cold.ttft),
            cold.decode_tps,
            ram.decode_tps,
            ssd.decode_tps,
        );
        eprintln!("(flush of the {n}-token entries took {flush_ms} ms)");
    }
    if args.ssd_dir.is_none() {
        let _ = std::fs::remove_dir_all(&ssd_root);
    }
}
