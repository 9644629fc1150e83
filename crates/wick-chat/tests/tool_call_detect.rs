//! Format detection on real chat templates (llama.cpp's `models/templates`, fetched by
//! `wick pull test-assets`) and on the templates embedded in the real GGUF models.

use std::path::PathBuf;

use wick_chat::tool_call::ToolFormat;

fn wick_home() -> PathBuf {
    std::env::var_os("WICK_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/wick")))
        .expect("WICK_HOME or HOME must be set")
}

fn template(name: &str) -> String {
    let path = wick_home()
        .join("assets/llama.cpp/templates")
        .join(format!("{name}.jinja"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {} ({e}): run `wick pull test-assets`",
            path.display()
        )
    })
}

/// The families this crate parses, as llama.cpp names their templates.
#[test]
fn supported_families_are_detected_from_their_templates() {
    let expected = [
        ("Qwen-Qwen2.5-7B-Instruct", ToolFormat::HermesJson),
        ("Qwen-Qwen3-0.6B", ToolFormat::HermesJson),
        ("Qwen-QwQ-32B", ToolFormat::HermesJson),
        (
            "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
            ToolFormat::HermesJson,
        ),
        (
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
            ToolFormat::HermesJson,
        ),
        ("Qwen3-Coder", ToolFormat::QwenXml),
        ("Qwen3.5-4B", ToolFormat::QwenXml),
        ("GLM-4.6", ToolFormat::Glm),
        ("GLM-4.7-Flash", ToolFormat::Glm),
        ("openbmb-MiniCPM5-1B", ToolFormat::MiniCpm),
        ("google-gemma-4-31B-it", ToolFormat::Gemma4),
        ("google-gemma-4-31B-it-interleaved", ToolFormat::Gemma4),
        ("meta-llama-Llama-3.1-8B-Instruct", ToolFormat::Llama3Json),
        ("meta-llama-Llama-3.2-3B-Instruct", ToolFormat::Llama3Json),
        ("meta-llama-Llama-3.3-70B-Instruct", ToolFormat::Llama3Json),
        ("mistralai-Mistral-Nemo-Instruct-2407", ToolFormat::Mistral),
        ("Mistral-Small-3.2-24B-Instruct-2506", ToolFormat::Mistral),
        (
            "mistralai-Ministral-3-14B-Reasoning-2512",
            ToolFormat::Mistral,
        ),
        ("unsloth-mistral-Devstral-Small-2507", ToolFormat::Mistral),
    ];
    for (name, format) in expected {
        assert_eq!(
            ToolFormat::detect(&template(name), ""),
            Some(format),
            "{name}"
        );
    }
}

/// Templates of families without a parser here must not be mistaken for one.
#[test]
fn unsupported_families_are_not_misdetected() {
    for name in [
        "google-gemma-2-2b-it",
        "microsoft-Phi-3.5-mini-instruct",
        "deepseek-ai-DeepSeek-V3.1",
        "moonshotai-Kimi-K2",
        "openai-gpt-oss-120b",
        "CohereForAI-c4ai-command-r-plus-tool_use",
        "meetkai-functionary-medium-v3.1",
        "ByteDance-Seed-OSS",
        "HuggingFaceTB-SmolLM3-3B",
    ] {
        assert_eq!(ToolFormat::detect(&template(name), ""), None, "{name}");
    }
}

fn model_template(model: &str, file: &str) -> (String, String) {
    let path = wick_home().join("models").join(model).join(file);
    let gguf = wick_gguf::GgufFile::open(&path).unwrap_or_else(|e| {
        panic!(
            "cannot open {} ({e}): run `wick pull {model}`",
            path.display()
        )
    });
    let metadata = gguf.metadata();
    let template = metadata
        .opt_str("tokenizer.chat_template")
        .expect("readable template")
        .unwrap_or_default()
        .to_string();
    let arch = metadata
        .get_str("general.architecture")
        .expect("architecture")
        .to_string();
    (template, arch)
}

#[test]
fn real_gguf_models() {
    let (template, arch) = model_template(
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    );
    assert_eq!(
        ToolFormat::detect(&template, &arch),
        Some(ToolFormat::HermesJson)
    );
    let (template, arch) =
        model_template("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(ToolFormat::detect(&template, &arch), None, "{arch}");
    let (template, arch) = model_template("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf");
    assert_eq!(ToolFormat::detect(&template, &arch), None, "{arch}");
}
