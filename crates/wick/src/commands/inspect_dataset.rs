//! `wick inspect-dataset DIR [--model MODEL] [--raw-prompt]`: a training folder's format,
//! rows, and how its prompts become tokens (the chat template or raw text); with a model,
//! the first example as the trainer will see it.
use std::fmt::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use wick_engine::{LoadOptions, Model};
use wick_train::data::{self, Example, Format, PromptStyle, TemplateKnown, Tokenizing};

/// `wick inspect-dataset` flags.
#[derive(Args, Debug)]
pub struct InspectDatasetArgs {
    /// Directory with train.jsonl (and optionally valid.jsonl).
    pub data: PathBuf,
    /// The base model to render with (its chat template decides how prompts look); without
    /// one only the rows are read.
    #[arg(long)]
    pub model: Option<String>,
    /// As `wick train --raw-prompt`: string prompts as plain text.
    #[arg(long)]
    pub raw_prompt: bool,
    /// Longest sequence in tokens, as `wick train --seq`.
    #[arg(long, default_value_t = 4096)]
    pub seq: usize,
}

/// The tokens of `example` as text: `[prompt]` then the response(s) the loss reads.
pub fn show(model: &Model, example: &Example) -> Result<String> {
    let decode = |ids: &[u32]| -> Result<String> { Ok(model.tokenizer().decode(ids, false)?) };
    let mut out = String::new();
    match example {
        Example::Sft(s) => {
            let cut = s.prompt_len.min(s.tokens.len());
            writeln!(
                out,
                "  [{}]{}",
                decode(&s.tokens[..cut])?,
                decode(&s.tokens[cut..])?
            )?;
        }
        Example::Pair { chosen, rejected } => {
            for (name, s) in [("chosen", chosen), ("rejected", rejected)] {
                let cut = s.prompt_len.min(s.tokens.len());
                writeln!(
                    out,
                    "  {name}: [{}]{}",
                    decode(&s.tokens[..cut])?,
                    decode(&s.tokens[cut..])?
                )?;
            }
        }
    }
    Ok(out)
}

/// Runs `wick inspect-dataset`.
pub fn run(args: InspectDatasetArgs) -> Result<()> {
    let summary = data::inspect(&args.data)?;
    let style = PromptStyle::from_raw_flag(args.raw_prompt);
    println!(
        "format: {} ({} train rows, {} valid rows, {} with a string prompt)",
        summary.format.name(),
        summary.n_train,
        summary.n_valid,
        summary.string_prompts
    );
    let Some(arg) = args.model.as_deref() else {
        let rendering = summary.rendering(style, TemplateKnown::Unknown);
        println!("prompts: {}", rendering.describe());
        return Ok(());
    };
    let resolved = crate::model_arg::resolve_named(Some(arg))?;
    let model = Model::load(&resolved.path, &LoadOptions::default())
        .with_context(|| format!("loading {}", resolved.path.display()))?;
    let dataset = data::load(
        &args.data,
        summary.format == Format::Preference,
        &Tokenizing {
            model: &model,
            max_seq: args.seq,
            prompt_style: style,
        },
    )?;
    println!(
        "prompts ({}): {}",
        resolved.name,
        dataset.rendering.describe()
    );
    if let Some(first) = dataset.train.first() {
        println!("first example, [prompt] then the response the loss reads:");
        print!("{}", show(&model, first)?);
    }
    Ok(())
}
