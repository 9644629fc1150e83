//! `wick tools parse`: run a model reply through the tool-call parser and show the calls,
//! the repairs applied, or why nothing parsed.
use std::io::{Read, Write};

use anyhow::Context;
use clap::{Args, Subcommand};
use wick_chat::tool_call::{self, report, ToolFormat, ToolSpec};

#[derive(Args)]
pub struct ToolsArgs {
    #[command(subcommand)]
    command: ToolsCommand,
}

#[derive(Subcommand)]
enum ToolsCommand {
    /// Parse a reply read from stdin.
    Parse(ParseArgs),
    /// List the wire formats `--format` and `--tool-parser` accept.
    Formats,
}

#[derive(Args)]
struct ParseArgs {
    /// Wire format (hermes, qwen-xml, glm, minicpm, gemma4, llama3, mistral); when absent,
    /// detected from --model's chat template, else from the reply's own markup.
    #[arg(long)]
    format: Option<String>,
    /// The offered tools: an OpenAI `tools` array or a request body holding one.
    #[arg(long)]
    tools: Option<std::path::PathBuf>,
    /// A model whose chat template picks the format.
    #[arg(long)]
    model: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: ToolsArgs) -> anyhow::Result<()> {
    match args.command {
        ToolsCommand::Formats => {
            let names: String = ToolFormat::all()
                .iter()
                .map(|f| format!("{}\n", f.name()))
                .collect();
            emit(&names)
        }
        ToolsCommand::Parse(a) => parse(a),
    }
}

fn detect_from_model(arg: &str) -> anyhow::Result<Option<ToolFormat>> {
    let path = crate::model_arg::resolve(Some(arg))?;
    let (template, arch) = if path.is_dir() {
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path.join("config.json"))?)?;
        let arch = cfg
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string();
        let tc = std::fs::read_to_string(path.join("chat_template.jinja"))
            .ok()
            .or_else(|| {
                let t: serde_json::Value = serde_json::from_str(
                    &std::fs::read_to_string(path.join("tokenizer_config.json")).ok()?,
                )
                .ok()?;
                t.get("chat_template")
                    .and_then(|v| v.as_str())
                    .map(str::to_string)
            });
        (tc.unwrap_or_default(), arch)
    } else {
        let f = wick_gguf::GgufFile::open(&path)?;
        let m = f.metadata();
        (
            m.opt_str("tokenizer.chat_template")?
                .unwrap_or("")
                .to_string(),
            m.get_str("general.architecture")?.to_string(),
        )
    };
    Ok(ToolFormat::detect(&template, &arch))
}

/// Writes `text` to stdout. A reader that went away (`wick tools parse | head`) ends the
/// output quietly, as in other command-line tools: that is not an error.
fn emit(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing to stdout"),
    }
}

fn parse(a: ParseArgs) -> anyhow::Result<()> {
    let tools: Vec<ToolSpec> = match &a.tools {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            ToolSpec::list_from_json_text(&text)?
        }
        None => Vec::new(),
    };
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .context("reading the reply from stdin")?;
    let format = match (&a.format, &a.model) {
        (Some(f), _) => ToolFormat::from_name(f)?,
        (None, Some(m)) => detect_from_model(m)?.unwrap_or(ToolFormat::HermesJson),
        (None, None) => {
            ToolFormat::detect_in_reply(&text, &tools).unwrap_or(ToolFormat::HermesJson)
        }
    };
    let outcome = tool_call::parse(format, &text, &tools);
    let shown = if a.json {
        let mut json = serde_json::to_string_pretty(&report::to_json(&outcome))?;
        json.push('\n');
        json
    } else {
        report::render(&outcome)
    };
    emit(&shown)
}
