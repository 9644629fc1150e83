//! `wick embed MODEL TEXT...`: the embedding vector of each text as one JSON line; and the
//! embedding side of `wick serve` (encoders, or any model with `--embedding`).
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use serde_json::json;
use wick_engine::embedding::Embedder;
use wick_engine::LoadOptions;
use wick_server::routes::embeddings::{run_embeddings, EmbedState};
use wick_server::ServerConfig;

#[derive(Args)]
pub struct EmbedArgs {
    /// Model: a catalog name (`minilm`), a store or Hugging Face cache name, or a path.
    model: String,
    /// Texts to embed (all run as one batch); read from stdin, one per line, when none is given.
    texts: Vec<String>,
    /// Put Qwen3-Embedding's query format before each text: `Instruct: {instruction}\nQuery:`.
    #[arg(long)]
    instruction: Option<String>,
    /// Put the model's named sentence-transformers prompt (e.g. `query`) before each text.
    #[arg(long, conflicts_with = "instruction")]
    prompt_name: Option<String>,
    /// Cut vectors to this length and renormalise (models that declare Matryoshka dimensions).
    #[arg(long)]
    dimensions: Option<usize>,
    /// Compute backend for decoder embedders: cpu or mlx.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "candle", "mlx", "cuda"])]
    backend: String,
}

fn load(path: &Path, opts: &LoadOptions) -> anyhow::Result<Embedder> {
    Embedder::load(path, opts)
        .with_context(|| format!("loading {} as an embedding model", path.display()))
}

pub fn run(args: EmbedArgs) -> anyhow::Result<()> {
    let path = crate::model_arg::resolve(Some(&args.model))?;
    let opts = LoadOptions {
        backend: args.backend.parse()?,
        ..LoadOptions::default()
    };
    let embedder = load(&path, &opts)?;
    let texts = if args.texts.is_empty() {
        std::io::stdin()
            .lines()
            .collect::<Result<Vec<_>, _>>()
            .context("reading texts from stdin")?
    } else {
        args.texts
    };
    anyhow::ensure!(!texts.is_empty(), "no texts to embed");
    let prompt = embedder.prompt(args.prompt_name.as_deref(), args.instruction.as_deref())?;
    let ids = texts
        .iter()
        .map(|t| embedder.encode_text(t, prompt.as_deref()))
        .collect::<Result<Vec<_>, _>>()?;
    let vectors = embedder.embed(&ids, args.dimensions)?;
    let mut out = std::io::stdout().lock();
    for ((text, ids), v) in texts.iter().zip(&ids).zip(&vectors) {
        let line = json!({"text": text, "tokens": ids.len(), "embedding": v});
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// `wick serve` for an embedding model: loads it and serves `/v1/embeddings`.
pub fn serve(
    path: &Path,
    opts: &LoadOptions,
    config: ServerConfig,
    listener: std::net::TcpListener,
    started: Instant,
) -> anyhow::Result<()> {
    let embedder = Arc::new(load(path, opts)?);
    let info = embedder.info().clone();
    let state = EmbedState::new(embedder, config);
    let model_id = state.config().model_id.clone();
    run_embeddings(listener, state, |addr| {
        let ready_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(
            model = %model_id,
            %addr,
            dimensions = info.dimensions,
            max_tokens = info.max_tokens,
            pooling = info.pooling.name(),
            ready_ms,
            "ready (embeddings)"
        );
        eprintln!(
            "wick: serving {model_id} ({}-dim embeddings) at http://{addr}/v1 (ready in {ready_ms:.0} ms)",
            info.dimensions
        );
    })?;
    eprintln!("wick: stopped");
    Ok(())
}
