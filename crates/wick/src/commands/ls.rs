//! `wick ls [QUERY]`: local models (wick's store and the Hugging Face cache) with size,
//! architecture, parameters, quantization, context and capabilities.
use std::io::Write;

use clap::Args;
use serde_json::json;
use wick_hub::fit::FitModel;
use wick_hub::{LocalModel, ModelKind, Store};

#[derive(Args)]
pub struct LsArgs {
    /// Only models whose name contains this (case-insensitive).
    query: Option<String>,
    /// Print JSON (one object per model).
    #[arg(long)]
    json: bool,
}

/// What a model can do beyond plain chat, from its chat template and configuration.
pub fn capabilities(m: &LocalModel) -> Vec<&'static str> {
    let mut caps = Vec::new();
    let (template, (vision, audio)) = match m.format {
        ModelKind::Gguf => {
            let t = wick_gguf::GgufFile::open(&m.path).ok().and_then(|f| {
                f.metadata()
                    .opt_str("tokenizer.chat_template")
                    .ok()
                    .flatten()
                    .map(str::to_string)
            });
            (t, (false, false))
        }
        ModelKind::HfDir => {
            let config: Option<serde_json::Value> =
                std::fs::read_to_string(m.path.join("config.json"))
                    .ok()
                    .and_then(|t| serde_json::from_str(&t).ok());
            let towers = config.as_ref().map_or((false, false), |c| {
                towers(c, &m.path.join("config.json").display().to_string())
            });
            let tokenizer_config: Option<serde_json::Value> =
                std::fs::read_to_string(m.path.join("tokenizer_config.json"))
                    .ok()
                    .and_then(|t| serde_json::from_str(&t).ok());
            let t = tokenizer_config
                .as_ref()
                .and_then(|c| c.get("chat_template"))
                .and_then(|t| t.as_str())
                .map(str::to_string)
                .or_else(|| std::fs::read_to_string(m.path.join("chat_template.jinja")).ok());
            (t, towers)
        }
    };
    if let Some(t) = &template {
        caps.push("chat");
        if t.contains("tools") {
            caps.push("tools");
        }
        if t.contains("<think>") || t.contains("enable_thinking") {
            caps.push("reasoning");
        }
    }
    if vision {
        caps.push("vision");
    }
    if audio {
        caps.push("audio");
    }
    caps
}

/// Whether the engine reads images and audio with this configuration's towers `(vision,
/// audio)`: a tower the configuration describes in a family the engine runs towers for
/// (`wick serve` still checks the weights are there when it loads the model).
fn towers(config: &serde_json::Value, source: &str) -> (bool, bool) {
    match wick_engine::config::ModelConfig::from_hf(config, source) {
        Ok(cfg) => (
            cfg.vision.is_some()
                || cfg.qwen_vision.is_some()
                || cfg.gemma4.as_ref().is_some_and(|g| g.vision.is_some()),
            cfg.audio.is_some(),
        ),
        Err(_) => (false, false),
    }
}

pub fn run(args: LsArgs) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let q = args.query.map(|q| q.to_lowercase());
    // Write errors end the listing (a closed pipe exits quietly in `main`); `println!`
    // would panic on them.
    let mut out = std::io::stdout().lock();
    if !args.json {
        writeln!(
            out,
            "{:<44} {:>9} {:<11} {:<8} {:>6} {:<7} {:>7} {:<18} PATH",
            "NAME", "SIZE", "FORMAT", "ARCH", "PARAMS", "QUANT", "CONTEXT", "CAPABILITIES"
        )?;
    }
    for m in store.list() {
        if q.as_ref()
            .is_some_and(|q| !m.name.to_lowercase().contains(q))
        {
            continue;
        }
        let fit = FitModel::read(&m.path, m.format).ok();
        let caps = capabilities(&m);
        if args.json {
            writeln!(
                out,
                "{}",
                json!({
                    "name": m.name,
                    "path": m.path,
                    "format": m.format.to_string(),
                    "origin": match m.origin { wick_hub::ModelOrigin::Store => "store", wick_hub::ModelOrigin::HfCache => "hf-cache" },
                    "size_bytes": m.size_bytes,
                    "arch": m.arch,
                    "params": fit.as_ref().map(|f| f.params),
                    "weights_bytes": fit.as_ref().map(|f| f.weights_bytes),
                    "quant": fit.as_ref().map(|f| f.quant.clone()),
                    "context_length": fit.as_ref().map(|f| f.context_length),
                    "capabilities": caps,
                })
            )?;
            continue;
        }
        writeln!(
            out,
            "{:<44} {:>7.1}MB {:<11} {:<8} {:>6} {:<7} {:>7} {:<18} {}",
            m.name,
            m.size_bytes as f64 / 1e6,
            m.format.to_string(),
            m.arch.clone().unwrap_or_default(),
            fit.as_ref()
                .map_or("-".into(), |f| super::fit::human_count(f.params)),
            fit.as_ref().map_or("-".into(), |f| f.quant.clone()),
            fit.as_ref()
                .map_or("-".into(), |f| f.context_length.to_string()),
            if caps.is_empty() {
                "-".to_string()
            } else {
                caps.join(",")
            },
            m.path.display()
        )?;
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::towers;

    fn golden(name: &str) -> (bool, bool) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../wick-engine/tests/goldens/hf")
            .join(name)
            .join("config.json");
        let config = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        towers(&config, &path.display().to_string())
    }

    #[test]
    fn towers_follow_the_families_the_engine_reads_media_for() {
        assert_eq!(golden("gemma3"), (false, false));
        assert_eq!(golden("gemma3_vision"), (true, false));
        assert_eq!(golden("gemma4_vision"), (true, false));
        assert_eq!(golden("gemma4_audio_vision"), (true, true));
        assert_eq!(golden("qwen35_vision"), (true, false));
        assert_eq!(golden("qwen25_vl"), (true, false));
        assert_eq!(golden("qwen35"), (false, false));
    }
}
