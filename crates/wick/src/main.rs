//! The `wick` command: a thin clap layer over the wick crates.
mod commands;
mod heap;
mod huge_pages;
mod model_arg;

use clap::{Parser, Subcommand};

/// wick: run open-weights LLMs locally — generate, serve, benchmark.
#[derive(Parser)]
#[command(name = "wick", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (chat template applied unless --raw).
    #[command(alias = "gen")]
    Generate(commands::generate::GenerateArgs),
    /// Measure prompt-processing and decode speed.
    Bench(commands::bench::BenchArgs),
    /// Fetch a catalog model or the test assets into the store.
    Pull(commands::pull::PullArgs),
    /// Fetch a model repository from the Hugging Face Hub into the Hugging Face cache.
    Get(commands::get::GetArgs),
    /// List local models (wick store and Hugging Face cache).
    Ls(commands::ls::LsArgs),
    /// Remove a local model.
    Rm(commands::rm::RmArgs),
    /// List (or, with --yes, remove) cache files no model uses.
    Gc(commands::gc::GcArgs),
    /// Whether a model and context fit this machine, and the decode speed to expect.
    Fit(commands::fit::FitArgs),
    /// Tool-call utilities.
    Tools(commands::tools::ToolsArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(commands::serve::ServeArgs),
    /// Print embedding vectors of texts, one JSON line each.
    Embed(commands::embed::EmbedArgs),
    /// Fine-tune a LoRA adapter (SFT, DPO, ORPO) on the CPU.
    Train(commands::train::TrainArgs),
    /// A training folder's format, rows and how its prompts are rendered.
    InspectDataset(commands::inspect_dataset::InspectDatasetArgs),
    /// Fold a LoRA adapter into a copy of its base model.
    Fuse(commands::fuse::FuseArgs),
}

fn main() -> std::process::ExitCode {
    huge_pages::enable();
    heap::retain_freed_memory();
    let cli = Cli::parse();
    // A server logs its requests by default; the other commands only warnings.
    let default_log = match cli.command {
        Command::Serve(_) => "info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("WICK_LOG")
                .unwrap_or_else(|_| default_log.into()),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: logs redirected to a file stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Generate(a) => commands::generate::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Pull(a) => commands::pull::run(a),
        Command::Get(a) => commands::get::run(a),
        Command::Ls(a) => commands::ls::run(a),
        Command::Rm(a) => commands::rm::run(a),
        Command::Gc(a) => commands::gc::run(a),
        Command::Fit(a) => commands::fit::run(a),
        Command::Tools(a) => commands::tools::run(a),
        Command::Serve(a) => commands::serve::run(a),
        Command::Embed(a) => commands::embed::run(a),
        Command::Train(a) => commands::train::run(a),
        Command::InspectDataset(a) => commands::inspect_dataset::run(a),
        Command::Fuse(a) => commands::fuse::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader of our output went away (`wick ls | head -1`): nothing more to say, as
        // with other command-line tools.
        Err(e) if is_broken_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether `e` (or what caused it) is a write to a closed pipe.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
