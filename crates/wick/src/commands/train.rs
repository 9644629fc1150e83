//! `wick train MODEL --data DIR`: fine-tune a LoRA adapter (SFT, DPO or ORPO) on the CPU
//! and write it where `wick serve --adapter` and PEFT load it.
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use wick_engine::{LoadOptions, Model};
use wick_train::base::{BaseMode, BaseWeights};
use wick_train::data::{self, PromptStyle, Tokenizing};
use wick_train::lora::parse_targets;
use wick_train::loss::Method;
use wick_train::optim::Schedule;
use wick_train::trainer::{Event, TrainConfig, Trainer};

/// The training objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MethodArg {
    /// Supervised fine-tuning: cross-entropy on the responses.
    Sft,
    /// Direct preference optimization (sigmoid), the base as the reference.
    Dpo,
    /// Odds-ratio preference optimization.
    Orpo,
}

/// `wick train` flags (the reference's names and defaults).
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Base model: a catalog name, a local model, a GGUF file or a Hugging Face directory.
    pub model: Option<String>,
    /// Directory with train.jsonl (and optionally valid.jsonl).
    #[arg(long)]
    pub data: PathBuf,
    /// Tokenize a string `prompt` (prompt-completion and preference rows) as plain text
    /// with the response and an EOS after it, instead of as a user turn of the chat
    /// template: the adapter then learns raw completions, not chat replies.
    #[arg(long)]
    pub raw_prompt: bool,
    /// Objective.
    #[arg(long, value_enum, default_value = "orpo")]
    pub method: MethodArg,
    /// Output directory (default: $WICK_HOME/finetunes/<method>-<model>).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    pub iters: usize,
    /// Peak learning rate (default: sft 2e-4, dpo 5e-5, orpo 1e-5).
    #[arg(long)]
    pub lr: Option<f32>,
    /// LoRA rank (default: 8; orpo 16).
    #[arg(long)]
    pub rank: Option<usize>,
    /// LoRA scale α: the update is α·B·A (default: 1.0; orpo 2.0).
    #[arg(long)]
    pub scale: Option<f32>,
    /// Longest sequence in tokens (longer rows are cut).
    #[arg(long, default_value_t = 4096)]
    pub seq: usize,
    /// Examples per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Global gradient-norm clip (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f32,
    /// Seed of the initialization and the data order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Validation examples from valid.jsonl (at most).
    #[arg(long, default_value_t = 256)]
    pub val_size: usize,
    /// Steps between validations.
    #[arg(long, default_value_t = 50)]
    pub eval_every: usize,
    /// ORPO's λ.
    #[arg(long = "lambda", default_value_t = 0.1)]
    pub lambda: f32,
    /// DPO's β.
    #[arg(long, default_value_t = 0.1)]
    pub beta: f32,
    /// Write a mountable checkpoint every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub save_every: usize,
    /// Continue from a checkpoint (a checkpoint directory, or an output directory).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Load the model and data, print what would run, and stop.
    #[arg(long)]
    pub dry_run: bool,
    /// Adapt only the last N layers (-1: all).
    #[arg(long, default_value_t = -1, allow_hyphen_values = true)]
    pub num_layers: i64,
    /// Projections to adapt (comma-separated: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj;
    /// Qwen 3.5's DeltaNet layers also in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj; `all`).
    #[arg(
        long,
        default_value = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )]
    pub target_modules: String,
    /// rsLoRA: scale α/√r instead of α/r.
    #[arg(long)]
    pub rs_lora: bool,
    /// LoRA+: learning rate of B relative to A.
    #[arg(long, default_value_t = 1.0)]
    pub lora_plus_ratio: f32,
    /// LoRA dropout: the probability of zeroing each input value of the adapter branch
    /// while training (PEFT's lora_dropout).
    #[arg(long, default_value_t = 0.0)]
    pub lora_dropout: f32,
    /// Gradient checkpointing: keep only each layer's input and recompute the layer in
    /// the backward (less memory, about one more forward per step).
    #[arg(long)]
    pub grad_checkpoint: bool,
    /// QLoRA: keep a quantized (or f16/bf16) base's projections as stored and dequantize
    /// each for its products, instead of expanding the base to f32 once.
    #[arg(long)]
    pub keep_quantized: bool,
    /// Warm-up steps.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Learning-rate schedule: cosine, linear or constant.
    #[arg(long, default_value = "cosine")]
    pub schedule: String,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f32,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Also print one JSON event per line on stdout (stage, metric): what a training job of
    /// `wick serve` reads.
    #[arg(long, hide = true)]
    pub events: bool,
}

/// Set by SIGINT/SIGTERM: the loop stops between steps and saves the adapter so far.
static CANCEL: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    // A second Ctrl-C while the first one waits for the step to finish: stop now.
    if CANCEL.swap(true, Ordering::SeqCst) && signal == libc::SIGINT {
        unsafe { libc::_exit(130) };
    }
}

/// Makes SIGINT and SIGTERM stop training gracefully (the adapter so far is written).
fn stop_on_signals() {
    let handler = on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only touches an atomic (and `_exit`), both async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// One JSON event on stdout for `--events` (a job runner reads them line by line).
fn emit(enabled: bool, event: serde_json::Value) {
    if enabled {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{event}");
        let _ = out.flush();
    }
}

fn config(args: &TrainArgs) -> Result<TrainConfig> {
    let method = match args.method {
        MethodArg::Sft => Method::Sft,
        MethodArg::Dpo => Method::Dpo { beta: args.beta },
        MethodArg::Orpo => Method::Orpo {
            lambda: args.lambda,
        },
    };
    let orpo = args.method == MethodArg::Orpo;
    let mut c = TrainConfig::defaults(method);
    c.iters = args.iters;
    if let Some(lr) = args.lr {
        c.lr = lr;
    }
    c.lora.rank = args.rank.unwrap_or(if orpo { 16 } else { 8 });
    c.lora.scale = args.scale.unwrap_or(if orpo { 2.0 } else { 1.0 });
    c.lora.rs_lora = args.rs_lora;
    c.lora.dropout = args.lora_dropout;
    c.grad_checkpoint = args.grad_checkpoint;
    c.lora.targets = parse_targets(&args.target_modules)?;
    c.lora.num_layers = match args.num_layers {
        n if n < 0 => None,
        n => Some(n as usize),
    };
    c.max_seq = args.seq;
    c.batch = args.batch;
    c.grad_accum = args.grad_accum;
    c.grad_clip = args.grad_clip;
    c.seed = args.seed;
    c.val_size = args.val_size;
    c.eval_every = args.eval_every;
    c.save_every = args.save_every;
    c.warmup = args.warmup;
    c.schedule = Schedule::parse(&args.schedule)?;
    c.adam.weight_decay = args.weight_decay;
    c.adam.lora_plus_ratio = args.lora_plus_ratio;
    c.validate()?;
    Ok(c)
}

/// Runs `wick train`.
pub fn run(args: TrainArgs) -> Result<()> {
    let cfg = config(&args)?;
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
            .context("setting the thread count")?;
    }
    let resolved = crate::model_arg::resolve_named(args.model.as_deref())?;
    let out = match &args.adapter {
        Some(p) => p.clone(),
        None => wick_hub::Store::from_env()?
            .root()
            .join("finetunes")
            .join(format!(
                "{}-{}",
                cfg.method.name(),
                resolved.name.replace('/', "--")
            )),
    };
    let events = args.events;
    emit(
        events,
        json!({"type": "stage", "stage": "load", "progress": 0.0,
               "message": format!("loading {}", resolved.name)}),
    );
    let started = Instant::now();
    let model = Model::load(&resolved.path, &LoadOptions::default())
        .with_context(|| format!("loading {}", resolved.path.display()))?;
    let dataset = data::load(
        &args.data,
        cfg.method.is_preference(),
        &Tokenizing {
            model: &model,
            max_seq: cfg.max_seq,
            prompt_style: PromptStyle::from_raw_flag(args.raw_prompt),
        },
    )?;
    if args.dry_run {
        if let Some(first) = dataset.train.first() {
            eprintln!("first example, [prompt] then the response the loss reads:");
            eprint!("{}", crate::commands::inspect_dataset::show(&model, first)?);
        }
    }
    // The engine's model only tokenizes: it goes before the trainer's copy of the weights
    // comes, so the two are never in memory together.
    drop(model);
    let mode = if args.keep_quantized {
        BaseMode::KeepStored
    } else {
        BaseMode::F32
    };
    let base = BaseWeights::load_as(&resolved.path, mode)?;
    let tokens: usize = dataset.train.iter().map(|e| e.tokens()).sum();
    let mut trainer = Trainer::new(&base, cfg)?;
    let cfg = trainer.config.clone();
    eprintln!(
        "base {} ({} layers, {} stored as {}, {}; {:.0} MB) loaded in {:.1}s",
        resolved.name,
        base.cfg.num_layers,
        base.cfg.arch.name(),
        base.stored_as,
        if base.keeps_stored() {
            "kept as stored and dequantized per product (QLoRA), trained in f32"
        } else {
            "trained in f32"
        },
        base.bytes() as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    eprintln!(
        "data {}: {} train / {} valid {} rows ({tokens} tokens{}); {} LoRA values (rank {}, scale {}{}{}); {} {} steps, lr {}, batch {}×{}{}",
        args.data.display(),
        dataset.train.len(),
        dataset.valid.len(),
        dataset.format.name(),
        if dataset.dropped > 0 {
            format!(", {} rows dropped: no response left within --seq", dataset.dropped)
        } else {
            String::new()
        },
        trainer.params.len(),
        cfg.lora.rank,
        cfg.lora.scale,
        if cfg.lora.rs_lora { ", rsLoRA" } else { "" },
        if cfg.lora.dropout > 0.0 {
            format!(", dropout {}", cfg.lora.dropout)
        } else {
            String::new()
        },
        cfg.method.name(),
        cfg.iters,
        cfg.lr,
        cfg.batch,
        cfg.grad_accum,
        if cfg.grad_checkpoint {
            ", gradient checkpointing"
        } else {
            ""
        },
    );
    // A job reads stderr lines as its log, so this one reaches the fine-tune page too.
    eprintln!("prompts: {}", dataset.rendering.describe());
    if let Some(dir) = &args.resume {
        let from = trainer.resume(dir)?;
        eprintln!("resuming from {} at step {}", from.display(), trainer.step);
        if trainer.step >= cfg.iters {
            bail!(
                "the checkpoint is at step {} already; pass a larger --iters",
                trainer.step
            );
        }
    }
    if args.dry_run {
        eprintln!("dry run: output would go to {}", out.display());
        return Ok(());
    }
    emit(
        events,
        json!({"type": "stage", "stage": "train", "progress": trainer.step as f64 / cfg.iters as f64,
               "message": format!("{} {} steps on {} examples", cfg.method.name(), cfg.iters, dataset.train.len()),
               "iters": cfg.iters, "output_dir": out.display().to_string()}),
    );
    stop_on_signals();
    let bar = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new(cfg.iters as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_position(trainer.step as u64);
        Some(bar)
    } else {
        None
    };
    let report_every = 10;
    let base_name = resolved.name.clone();
    let iters = cfg.iters as f64;
    let ran = trainer.run(&dataset, &out, &base_name, &CANCEL, |event| match event {
        Event::Step {
            stats,
            tokens_per_s,
        } => {
            let mut metric = json!({"type": "metric", "kind": "train", "step": stats.step,
                "loss": stats.loss, "grad_norm": stats.grad_norm, "learning_rate": stats.lr,
                "tokens_per_sec": tokens_per_s, "progress": stats.step as f64 / iters});
            if let (Some(a), Some(m)) = (stats.accuracy, stats.margin) {
                metric["accuracy"] = json!(a);
                metric["margin"] = json!(m);
            }
            emit(events, metric);
            let extra = match (stats.accuracy, stats.margin) {
                (Some(a), Some(m)) => format!(" acc {a:.2} margin {m:.3}"),
                _ => String::new(),
            };
            let msg = format!(
                "loss {:.4}{extra} lr {:.2e} {:.0} tok/s",
                stats.loss, stats.lr, tokens_per_s
            );
            match &bar {
                Some(b) => {
                    b.set_position(stats.step as u64);
                    b.set_message(msg);
                }
                None if stats.step.is_multiple_of(report_every)
                    || stats.step == 1
                    || stats.step == cfg.iters =>
                {
                    eprintln!("step {}/{} {msg}", stats.step, cfg.iters)
                }
                None => {}
            }
        }
        Event::Eval(e) => {
            let mut metric = json!({"type": "metric", "kind": "val", "step": e.step,
                "loss": e.loss, "progress": e.step as f64 / iters});
            if let (Some(a), Some(m)) = (e.accuracy, e.margin) {
                metric["accuracy"] = json!(a);
                metric["margin"] = json!(m);
            }
            emit(events, metric);
            let extra = match (e.accuracy, e.margin) {
                (Some(a), Some(m)) => format!(" acc {a:.2} margin {m:.3}"),
                _ => String::new(),
            };
            let line = format!("step {} val loss {:.4}{extra}", e.step, e.loss);
            match &bar {
                Some(b) => b.println(line),
                None => eprintln!("{line}"),
            }
        }
        Event::Saved(dir) => {
            let line = format!("checkpoint {}", dir.display());
            emit(events, json!({"type": "log", "line": line}));
            match &bar {
                Some(b) => b.println(line),
                None => eprintln!("{line}"),
            }
        }
    });
    if let Some(b) = bar {
        b.finish();
    }
    if let Err(wick_train::TrainError::Cancelled) = &ran {
        bail!(
            "stopped at step {} of {}; the adapter so far is in {}",
            trainer.step,
            cfg.iters,
            out.display()
        );
    }
    ran?;
    eprintln!(
        "adapter written to {} in {:.1}s (metrics: {})",
        out.display(),
        started.elapsed().as_secs_f64(),
        out.join("metrics.jsonl").display()
    );
    let model_arg = args.model.as_deref().unwrap_or("default");
    println!(
        "serve it: wick serve {model_arg} --adapter {}",
        out.display()
    );
    Ok(())
}
