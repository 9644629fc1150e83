//! LoRA adapter costs: the time to mount an adapter, and batched decode throughput of N
//! sequences on the base model vs the same N spread over several adapters (one forward
//! pass per step, rows grouped by adapter).
//!
//! ```text
//! cargo run --release -p wick-engine --example adapter_bench -- \
//!     MODEL.gguf [ADAPTER_DIR ...] [--random N] [--rank 16] [--streams 8] [--steps 48] [--rounds 3] \
//!     [--adapter-dtype auto,f32,f16]
//! ```
//!
//! `--random N` writes N random PEFT adapters (f32, every projection of every layer, rank
//! `--rank`, `lora_alpha = 2·rank`) shaped for MODEL into a temporary folder (or, kept, into
//! `--random-dir DIR`) and benches those too: speed does not depend on the values.
//!
//! Each round decodes `--steps` tokens for every stream (after a 16-token prompt) on the
//! base, then spread over the adapters once per `--adapter-dtype` (a comma-separated list;
//! default `auto`: each is mounted with the model's factor type set to it), and prints the
//! rates; the mount time is the median over mounting every adapter `--rounds` times.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use wick_engine::adapters::{Adapter, AdapterDtype, AdapterStack, Target};
use wick_engine::{LoadOptions, Model, RowOutput, StepPlan, StepRow, Want};

/// Writes a random PEFT adapter of `rank` for `model` (every projection of every layer,
/// f32) into `dir`.
fn write_random_peft(model: &Model, dir: &Path, rank: usize, seed: u64) -> std::io::Result<()> {
    let cfg = model.config();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        // xorshift64*: values in [-0.02, 0.02).
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let u = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
        (u - 0.5) * 0.04
    };
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    for layer in 0..cfg.num_layers {
        for t in Target::ALL {
            let (out, inp) = t.base_shape(cfg);
            let stem = format!("base_model.model.model.layers.{layer}.{}", t.hf_module());
            for (factor, shape) in [("A", [rank, inp]), ("B", [out, rank])] {
                let at = data.len();
                for _ in 0..shape[0] * shape[1] {
                    data.extend_from_slice(&next().to_le_bytes());
                }
                header.insert(
                    format!("{stem}.lora_{factor}.weight"),
                    serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, data.len()]}),
                );
            }
        }
    }
    let h = serde_json::Value::Object(header).to_string();
    std::fs::create_dir_all(dir)?;
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(dir.join("adapter_model.safetensors"), bytes)?;
    let config = serde_json::json!({
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": Target::ALL.map(|t| t.hf_module().rsplit('.').next().unwrap_or("")),
    });
    std::fs::write(dir.join("adapter_config.json"), config.to_string())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Decode tokens per second of `stacks.len()` sequences stepped together.
fn decode_rate(model: &Model, stacks: &[AdapterStack], steps: usize) -> f64 {
    let mut caches: Vec<_> = stacks.iter().map(|_| model.new_cache()).collect();
    let prompts: Vec<Vec<u32>> = (0..stacks.len())
        .map(|i| (0..16).map(|j| 100 + (i * 31 + j * 7) as u32).collect())
        .collect();
    // Each sequence's greedy token after feeding it `tokens[i]`, under its adapter stack.
    let mut step = |tokens: &[&[u32]]| -> Vec<u32> {
        let rows = caches
            .iter_mut()
            .zip(tokens)
            .zip(stacks)
            .map(|((c, t), s)| StepRow {
                tokens: t,
                cache: c,
                want: Want::Token,
                adapters: Some(s),
            })
            .collect();
        model
            .execute(StepPlan::new(rows))
            .expect("step")
            .into_iter()
            .map(|o| match o {
                RowOutput::Token(t) => t,
                _ => 0,
            })
            .collect()
    };
    let prompts: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut next = step(&prompts);
    let started = Instant::now();
    for _ in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let toks: Vec<&[u32]> = toks.iter().map(|t| t.as_slice()).collect();
        next = step(&toks);
    }
    (steps * stacks.len()) as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let mut model_path = None;
    let mut dirs = Vec::new();
    let (mut streams, mut steps, mut rounds) = (8usize, 48usize, 3usize);
    let (mut random, mut rank) = (0usize, 16usize);
    let mut random_dir: Option<PathBuf> = None;
    let mut dtypes = vec![AdapterDtype::Auto];
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        if a == "--random-dir" {
            random_dir = it.next().map(PathBuf::from);
            continue;
        }
        if a == "--adapter-dtype" {
            let list = it.next().unwrap_or_default();
            dtypes = list
                .split(',')
                .map(|d| d.parse().expect("auto, f32 or f16"))
                .collect();
            continue;
        }
        let mut num = || -> usize {
            it.next()
                .and_then(|v| v.parse().ok())
                .expect("a number after the flag")
        };
        match a.as_str() {
            "--streams" => streams = num(),
            "--steps" => steps = num(),
            "--rounds" => rounds = num(),
            "--random" => random = num(),
            "--rank" => rank = num(),
            _ if model_path.is_none() => model_path = Some(PathBuf::from(a)),
            _ => dirs.push(PathBuf::from(a)),
        }
    }
    let (Some(model_path), false) = (model_path, dirs.is_empty() && random == 0) else {
        eprintln!(
            "usage: adapter_bench MODEL [ADAPTER_DIR...] [--random N] [--rank R] [--streams N] [--steps N] [--rounds N]"
        );
        std::process::exit(2);
    };
    let mut model = Model::load(&model_path, &LoadOptions::default()).expect("model");
    let scratch = tempfile::tempdir().expect("temporary folder");
    for i in 0..random {
        let dir = random_dir
            .as_deref()
            .unwrap_or(scratch.path())
            .join(format!("random{}", i + 1));
        write_random_peft(&model, &dir, rank, i as u64 + 1).expect("write a random adapter");
        dirs.push(dir);
    }
    // One set of mounted adapters per factor type.
    let mut sets: Vec<(String, Vec<Arc<Adapter>>)> = Vec::new();
    for &dtype in &dtypes {
        model.set_adapter_dtype(dtype);
        let mut mounts = Vec::new();
        let mut adapters = Vec::new();
        for r in 0..rounds.max(1) {
            for (i, d) in dirs.iter().enumerate() {
                let t = Instant::now();
                let a = model.load_adapter(&format!("a{i}"), d).expect("adapter");
                mounts.push(t.elapsed().as_secs_f64() * 1e3);
                if r == 0 {
                    println!(
                        "adapter {}: rank {}, {} layers, {:.1} MB of {}",
                        d.display(),
                        a.info().rank,
                        a.info().mounted_layers,
                        a.info().size_bytes as f64 / 1e6,
                        a.info().factor_dtype.name()
                    );
                    adapters.push(Arc::new(a));
                }
            }
        }
        let name = format!("{dtype:?}").to_lowercase();
        println!(
            "mount ({name}): median {:.1} ms over {} mounts",
            median(mounts.clone()),
            mounts.len()
        );
        sets.push((name, adapters));
    }
    // The part of a mount spent reading and checking the files (the rest is the upload).
    let (mut reads, mut digests) = (Vec::new(), Vec::new());
    for d in &dirs {
        let t = Instant::now();
        let host = wick_engine::adapters::load_host(d, model.config(), None).expect("adapter");
        reads.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        std::hint::black_box(host.digest());
        digests.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "  of which reading and checking: median {:.1} ms, digest: median {:.1} ms",
        median(reads),
        median(digests)
    );
    let base: Vec<AdapterStack> = (0..streams).map(|_| AdapterStack::none()).collect();
    let spreads: Vec<Vec<AdapterStack>> = sets
        .iter()
        .map(|(_, adapters)| {
            (0..streams)
                .map(|i| {
                    AdapterStack::new(vec![adapters[i % adapters.len()].clone()]).expect("stack")
                })
                .collect()
        })
        .collect();
    decode_rate(&model, &base, 4);
    let mut b = Vec::new();
    let mut s: Vec<Vec<f64>> = vec![Vec::new(); sets.len()];
    for _ in 0..rounds.max(1) {
        b.push(decode_rate(&model, &base, steps));
        let mut line = format!("round: base {:.1} tok/s", b[b.len() - 1]);
        for (k, spread) in spreads.iter().enumerate() {
            let rate = decode_rate(&model, spread, steps);
            s[k].push(rate);
            line += &format!(
                ", {} adapters ({}) {rate:.1} tok/s ({:.2})",
                dirs.len(),
                sets[k].0,
                rate / b[b.len() - 1]
            );
        }
        println!("{line}");
    }
    let b = median(b);
    for (k, rates) in s.into_iter().enumerate() {
        let s = median(rates);
        println!(
            "{streams} streams: base {b:.1} tok/s, over {} adapters ({}) {s:.1} tok/s, ratio {:.2}",
            dirs.len(),
            sets[k].0,
            s / b
        );
    }
}
