//! The backend × family table of README.md, written from what each family declares it needs
//! and what each backend declares it has (`wick_engine::backend::capability`), and held
//! against what actually loads on every backend this test binary was built with: the CPU
//! always, MLX with `--features mlx` (CI runs it on MLX's CPU device), CUDA with
//! `--features cuda` (on a GPU machine).
//!
//! `WICK_UPDATE_TABLE=1 cargo test -p wick-engine --test support_table` rewrites the table
//! in README.md after a declaration changed; without it the test fails when they differ.
use std::path::Path;

use wick_engine::backend::capability::{Capabilities, Support, CPU, CUDA, MLX};
use wick_engine::backend::BackendKind;
use wick_engine::config::ModelConfig;
use wick_engine::models::decoder::support;
use wick_engine::{EngineError, LoadOptions, Model};

mod common;
use common::golden::{golden_dir, read_json};

/// The tiny random checkpoint of each family (`tests/goldens/hf`, made by the scripts in
/// `scripts/goldens/`), with the name the table gives it.
const FAMILIES: &[(&str, &str)] = &[
    ("llama", "Llama, SmolLM"),
    ("qwen2", "Qwen 2 / 2.5"),
    ("qwen3", "Qwen 3"),
    ("mistral", "Mistral"),
    ("phi3", "Phi-3"),
    ("gemma2", "Gemma 2"),
    ("gemma3", "Gemma 3"),
    ("gemma3_vision", "Gemma 3 + vision"),
    ("olmo2", "OLMo 2"),
    ("granite", "Granite"),
    ("starcoder2", "StarCoder 2"),
    ("smollm3", "SmolLM 3"),
    ("glm4", "GLM-4"),
    ("minicpm", "MiniCPM"),
    ("gemma4", "Gemma 4"),
    ("gemma4_moe", "Gemma 4 MoE (26B-A4B)"),
    ("gemma4_vision", "Gemma 4 + vision"),
    ("gemma4_audio", "Gemma 4 + audio"),
    ("qwen35", "Qwen 3.5"),
    ("qwen35_vision", "Qwen 3.5 + vision"),
    ("qwen25_vl", "Qwen2.5-VL"),
];

const BACKENDS: [(&Capabilities, BackendKind); 3] = [
    (&CPU, BackendKind::Candle),
    (&CUDA, BackendKind::Cuda),
    (&MLX, BackendKind::Mlx),
];

const START: &str = "<!-- support table: written by crates/wick-engine/tests/support_table.rs -->";
const END: &str = "<!-- end of support table -->";

fn config(name: &str) -> ModelConfig {
    let json = read_json(&golden_dir(name).join("config.json"));
    ModelConfig::from_hf(&json, name).unwrap()
}

/// A cell: what runs, or why the model does not load.
fn cell(s: &Support) -> String {
    if let Err(e) = &s.text {
        return format!("— (needs {})", e.requirement);
    }
    let mut parts = vec!["text", "JSON"];
    let ok = |p: &Option<Result<(), _>>| matches!(p, Some(Ok(())));
    if ok(&s.vision) {
        parts.push("images");
    }
    if ok(&s.audio) {
        parts.push("audio");
    }
    if s.adapters.is_ok() {
        parts.push("adapters");
    }
    if s.speculation.is_ok() {
        parts.push("speculation");
    }
    parts.join(", ")
}

fn table() -> String {
    let mut t = String::from(
        "| family | `--backend cpu` | `--backend cuda` | `--backend mlx` |\n|---|---|---|---|\n",
    );
    for (dir, name) in FAMILIES {
        let cfg = config(dir);
        let cells: Vec<String> = BACKENDS
            .iter()
            .map(|(c, _)| cell(&support(c, &cfg)))
            .collect();
        t.push_str(&format!("| {name} | {} |\n", cells.join(" | ")));
    }
    t
}

#[test]
fn the_readme_table_is_written_from_the_declarations() {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let text = std::fs::read_to_string(&readme).unwrap();
    let (Some(a), Some(b)) = (text.find(START), text.find(END)) else {
        panic!("README.md has no support table between `{START}` and `{END}`");
    };
    let want = format!("{START}\n{}{END}", table());
    let have = &text[a..b + END.len()];
    if have == want {
        return;
    }
    if std::env::var_os("WICK_UPDATE_TABLE").is_some() {
        std::fs::write(&readme, text.replace(have, &want)).unwrap();
        return;
    }
    panic!(
        "README.md's support table differs from the declarations; rerun with WICK_UPDATE_TABLE=1.\nwant:\n{want}\nhave:\n{have}"
    );
}

/// Every family on every backend built in: it loads exactly where the table says, with
/// the towers the table says, and a refusal is the one `Unsupported` error.
#[test]
fn what_loads_is_what_the_table_says() {
    for (caps, kind) in BACKENDS.iter().filter(|(_, k)| k.available()) {
        for (dir, name) in FAMILIES {
            let declared = support(caps, &config(dir));
            let options = LoadOptions {
                backend: *kind,
                ..LoadOptions::default()
            };
            match (Model::load(&golden_dir(dir), &options), &declared.text) {
                (Ok(m), Ok(())) => {
                    let caps = &m.info().media;
                    assert_eq!(
                        caps.vision.is_some(),
                        matches!(declared.vision, Some(Ok(()))),
                        "{name} on {kind}: images"
                    );
                    assert_eq!(
                        caps.audio.is_some(),
                        matches!(declared.audio, Some(Ok(()))),
                        "{name} on {kind}: audio"
                    );
                    assert_eq!(m.support(), &declared, "{name} on {kind}");
                }
                (Err(EngineError::Unsupported(got)), Err(want)) => {
                    assert_eq!(&got, want, "{name} on {kind}")
                }
                (got, want) => panic!(
                    "{name} on {kind}: the table says {want:?}, loading gave {:?}",
                    got.err()
                ),
            }
        }
    }
}
