//! `wick generate [MODEL] [PROMPT]`: one generation, streamed to the terminal or as JSON.
use std::io::{Read, Write};
use std::ops::ControlFlow;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use wick_engine::sampler::{fresh_seed, SamplingParams};
use wick_engine::{GenerationRequest, LoadOptions, Model};

#[derive(Args)]
pub struct GenerateArgs {
    /// Model: a .gguf path, a model directory, or a name in the store (default: the embedded default model).
    model: Option<String>,
    /// The prompt (read from stdin when absent or `-`). With a single argument that names
    /// no model, that argument is the prompt and the default model is used.
    prompt: Option<String>,
    /// The prompt, as a flag.
    #[arg(long = "prompt", short = 'p', conflicts_with = "prompt")]
    prompt_flag: Option<String>,
    /// Feed the prompt as-is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// A system message (chat mode).
    #[arg(long)]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, alias = "temp", default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens below min_p × the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Seed for sampling (random when absent).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Print one JSON object: ids, text, finish reason, speeds.
    #[arg(long)]
    json: bool,
    /// Context length limit (default: the model's).
    #[arg(long)]
    ctx_size: Option<usize>,
    /// Compute backend: cpu (wick's own kernels; `candle` is an old name for it), mlx (GPU
    /// when the MLX runtime has one; needs a build with `--features mlx`) or cuda (wick's own
    /// NVIDIA backend; needs a build with `--features cuda`).
    #[arg(long, env = "WICK_BACKEND", default_value = "cpu", value_parser = ["cpu", "candle", "mlx", "cuda"])]
    backend: String,
    /// How the CPU KV cache stores keys and values: f16 (halves the memory batched decode
    /// reads; llama.cpp's default) or f32. Default: f16 for GGUF files, f32 for Hugging
    /// Face directories.
    #[arg(long, env = "WICK_KV_TYPE", value_parser = ["f16", "f32"])]
    kv_type: Option<String>,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let (path, prompt_arg) = match (
        &args.model,
        args.prompt.clone().or(args.prompt_flag.clone()),
    ) {
        (Some(only), None) => match crate::model_arg::resolve_if_model(only)? {
            Some(path) => (path, None),
            None => (crate::model_arg::resolve(None)?, Some(only.clone())),
        },
        (model, prompt) => (crate::model_arg::resolve(model.as_deref())?, prompt),
    };
    let prompt = match prompt_arg.as_deref() {
        Some(p) if p != "-" => p.to_string(),
        _ => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the prompt from stdin")?;
            s
        }
    };
    let model = Model::load(
        &path,
        &LoadOptions {
            context_length: args.ctx_size,
            backend: args.backend.parse()?,
            kv_dtype: crate::model_arg::kv_dtype(args.kv_type.as_deref())?,
        },
    )?;
    let text = if args.raw {
        prompt.clone()
    } else {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": prompt}));
        model.render_chat(&messages, None, &Default::default())?
    };
    let ids = model.tokenize(&text)?;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed.unwrap_or_else(fresh_seed),
        ..SamplingParams::default()
    };
    let request = GenerationRequest::new(ids.clone())
        .max_tokens(args.max_tokens)
        .sampling(sampling)
        .stop(args.stop.clone());
    let mut stdout = std::io::stdout().lock();
    // A failed write (the reader of a pipe went away) stops the generation; `main` exits
    // quietly on a closed pipe.
    let mut write_error = None;
    let out = model.generate(&request, |t| {
        if !args.json {
            if let Err(e) = stdout
                .write_all(t.text.as_bytes())
                .and_then(|()| stdout.flush())
            {
                write_error = Some(e);
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })?;
    if let Some(e) = write_error {
        return Err(anyhow::Error::new(e).context("writing to stdout"));
    }
    let u = &out.usage;
    if args.json {
        let v = json!({
            "model": model.info().name,
            "backend": model.info().backend,
            "prompt_ids": ids,
            "ids": out.tokens,
            "text": out.text,
            "finish_reason": out.finish_reason.openai(),
            "stop": match &out.finish_reason { wick_engine::FinishReason::StopString(s) => Some(s.clone()), _ => None },
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "prompt_tps": u.prefill_tps(),
            "decode_tps": u.decode_tps(),
        });
        writeln!(stdout, "{v}")?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s, finish: {:?}]",
            u.prompt_tokens,
            u.prefill_tps(),
            u.completion_tokens,
            u.decode_tps(),
            out.finish_reason
        );
    }
    Ok(())
}
