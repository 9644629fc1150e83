//! Every real chat template of the llama.cpp test assets renders a conversation with tools and
//! history, and the introspection the server relies on gives the right answers on real templates.
//!
//! Some templates legitimately refuse a shape: no system role, strict user/assistant alternation,
//! Mistral's 9-character tool-call ids, arguments that must be a JSON string, variables that only
//! that model's tokenizer passes. Each template tries the `fallback_shapes` of
//! `conversations.json` in order; [`EXPECTED_SHAPES`] records the first shape each such template
//! accepts (every other template accepts the first, `tools_history`), so a change in what a
//! template accepts fails the test. The table of accepted shapes is printed (`--nocapture`).

mod chat_template_support;

use anyhow::{Context, Result};
use chat_template_support::{template_files, Spec};
use wick_chat::chat_template::{normalize_messages, starts_in_thinking, ChatInput, ChatTemplate};

/// Templates that refuse `tools_history`, the shape they accept first, and why.
const EXPECTED_SHAPES: &[(&str, &str, &str)] = &[
    (
        "LFM2-8B-A1B",
        "tools_history_empty_content",
        "tojson of the tool-call message's content",
    ),
    (
        "LFM2.5-Instruct",
        "tools_history_empty_content",
        "tojson of the tool-call message's content",
    ),
    (
        "Qwen-QwQ-32B",
        "tools_history_empty_content",
        "reads the tool-call message's content",
    ),
    (
        "Qwen-Qwen3-0.6B",
        "tools_history_empty_content",
        "`'</think>' in message.content`",
    ),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
        "tools_history_empty_content",
        "reads content",
    ),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        "tools_history_empty_content",
        "reads content",
    ),
    (
        "ibm-granite-granite-3.3-2B-Instruct",
        "tools_history_empty_content",
        "reads content",
    ),
    (
        "microsoft-Phi-3.5-mini-instruct",
        "tools_history_empty_content",
        "reads content",
    ),
    (
        "unsloth-mistral-Devstral-Small-2507",
        "tools_history_empty_content",
        "reads content",
    ),
    (
        "Mistral-Small-3.2-24B-Instruct-2506",
        "tools_history_answered",
        "alternation, 9-char ids",
    ),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512",
        "tools_history_answered",
        "alternation",
    ),
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        "tools_history_answered",
        "alternation, 9-char ids",
    ),
    (
        "meetkai-functionary-medium-v3.2",
        "tools_history_string_args",
        "`'…' + arguments`",
    ),
    (
        "google-gemma-2-2b-it",
        "tools_history_alternating",
        "no system or tool role",
    ),
    (
        "fireworks-ai-llama-3-firefunction-v2",
        "tools_history_functions_kwarg",
        "reads `functions`, `datetime`",
    ),
];

fn template_name(path: &std::path::Path) -> String {
    path.file_stem()
        .unwrap_or_default()
        .to_string_lossy()
        .to_string()
}

/// The first fallback shape `template` renders, with its prompt, or every refusal.
fn first_accepted(
    spec: &Spec,
    template: &ChatTemplate,
    normalize: bool,
) -> Result<std::result::Result<(String, String), Vec<String>>> {
    let mut refusals = Vec::new();
    for shape in &spec.fallback_shapes {
        let conversation = spec.conversation(shape)?;
        let mut input = conversation.input.clone();
        if normalize {
            input.messages = normalize_messages(input.messages);
        }
        match template.render(&input) {
            Ok(prompt) => return Ok(Ok((shape.clone(), prompt))),
            Err(e) => refusals.push(format!("{shape}: {e}")),
        }
    }
    Ok(Err(refusals))
}

#[test]
fn every_real_template_renders_tools_and_history() -> Result<()> {
    let spec = Spec::load()?;
    let files = template_files()?;
    assert!(
        files.len() >= 70,
        "expected the 70 llama.cpp templates, found {}",
        files.len()
    );
    let mut table = Vec::new();
    let mut failures = Vec::new();
    for file in &files {
        let name = template_name(file);
        let template = spec.compile(file)?;
        match first_accepted(&spec, &template, false)? {
            Ok((shape, prompt)) => {
                table.push(format!("{name:<45} {shape}"));
                let expected = EXPECTED_SHAPES
                    .iter()
                    .find(|(n, _, _)| *n == name)
                    .map_or("tools_history", |(_, shape, _)| shape);
                if shape != expected {
                    failures.push(format!("{name}: accepted {shape}, expected {expected}"));
                }
                if !prompt.contains("And in Tokyo?") {
                    failures.push(format!(
                        "{name}: the final user turn is missing from the prompt"
                    ));
                }
                if template.capabilities().uses_tools && !prompt.contains("get_weather") {
                    failures.push(format!(
                        "{name}: reads `tools` but neither tool nor call is in the prompt"
                    ));
                }
            }
            Err(refusals) => failures.push(format!(
                "{name} renders no shape:\n  {}",
                refusals.join("\n  ")
            )),
        }
    }
    println!("accepted shapes:\n{}", table.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Through the server's path (messages normalized first: `content: ""` on tool-call messages,
/// arguments parsed into objects), templates that needed an explicit empty content accept the
/// first shape. Only meetkai's functionary v3.2, which concatenates the arguments as a string,
/// cannot render a tool call once its arguments are parsed, as the spec asks.
#[test]
fn normalized_messages_render_with_every_template() -> Result<()> {
    let spec = Spec::load()?;
    let mut failures = Vec::new();
    for file in template_files()? {
        let name = template_name(&file);
        let template = spec.compile(&file)?;
        let accepted = first_accepted(&spec, &template, true)?;
        let expected = match EXPECTED_SHAPES.iter().find(|(n, _, _)| *n == name) {
            Some((_, "tools_history_empty_content", _)) | None => Some("tools_history"),
            Some((_, "tools_history_string_args", _)) => None,
            Some((_, shape, _)) => Some(*shape),
        };
        match (accepted, expected) {
            (Ok((shape, _)), Some(expected)) if shape == expected => {}
            (Err(_), None) => {}
            (outcome, expected) => failures.push(format!(
                "{name}: expected {expected:?}, got {:?}",
                outcome.map(|(shape, _)| shape)
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

fn compile_named(spec: &Spec, name: &str) -> Result<ChatTemplate> {
    let path = chat_template_support::templates_dir()?.join(format!("{name}.jinja"));
    spec.compile(&path).with_context(|| name.to_string())
}

#[test]
fn capabilities_of_real_templates() -> Result<()> {
    let spec = Spec::load()?;
    // (template, uses_tools, uses_think_tags, supports_system_role, marks_generation)
    let cases = [
        ("Qwen-Qwen2.5-7B-Instruct", true, false, true, false),
        ("Qwen-Qwen3-0.6B", true, true, true, false),
        ("meta-llama-Llama-3.1-8B-Instruct", true, false, true, false),
        ("google-gemma-2-2b-it", false, false, false, false),
        (
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            false,
            true,
            true,
            false,
        ),
        (
            "fireworks-ai-llama-3-firefunction-v2",
            false,
            false,
            true,
            false,
        ),
        // This (Unsloth-edited) SmolLM3 template renders no tools.
        ("HuggingFaceTB-SmolLM3-3B", false, true, true, false),
        ("LFM2.5-8B-A1B", true, true, true, true),
        ("poolside-Laguna-XS.2", true, true, true, true),
    ];
    let reads = |name: &str, variable: &str| -> Result<bool> {
        Ok(compile_named(&spec, name)?.reads_variable(variable))
    };
    assert!(reads("Qwen-Qwen3-0.6B", "enable_thinking")?);
    assert!(reads("openai-gpt-oss-120b", "reasoning_effort")?);
    assert!(reads("fireworks-ai-llama-3-firefunction-v2", "functions")?);
    assert!(!reads("Qwen-Qwen2.5-7B-Instruct", "enable_thinking")?);
    for (name, tools, think, system, generation) in cases {
        let caps = compile_named(&spec, name)?.capabilities();
        assert_eq!(caps.uses_tools, tools, "{name}: uses_tools");
        assert_eq!(caps.uses_think_tags, think, "{name}: uses_think_tags");
        assert_eq!(
            caps.supports_system_role, system,
            "{name}: supports_system_role"
        );
        assert_eq!(
            caps.marks_generation, generation,
            "{name}: marks_generation"
        );
    }
    Ok(())
}

#[test]
fn starts_in_thinking_follows_enable_thinking() -> Result<()> {
    let spec = Spec::load()?;
    let question = |kwargs: serde_json::Value| ChatInput {
        messages: vec![serde_json::json!({"role": "user", "content": "What is 2+2?"})],
        add_generation_prompt: true,
        kwargs: kwargs.as_object().cloned().unwrap_or_default(),
        ..ChatInput::default()
    };
    // Qwen3 opens no <think> itself when thinking is on (the model writes it) and writes an empty
    // closed block when it is off.
    let qwen3 = compile_named(&spec, "Qwen-Qwen3-0.6B")?;
    let off = qwen3.render(&question(serde_json::json!({"enable_thinking": false})))?;
    assert!(off.ends_with("<think>\n\n</think>\n\n"), "{off:?}");
    assert!(!starts_in_thinking(&off));
    let on = qwen3.render(&question(serde_json::json!({"enable_thinking": true})))?;
    assert!(!starts_in_thinking(&on), "{on:?}");
    // DeepSeek-R1 distills open <think> in the generation prompt.
    let r1 = compile_named(&spec, "deepseek-ai-DeepSeek-R1-Distill-Llama-8B")?;
    let prompt = r1.render(&question(serde_json::json!({})))?;
    assert!(starts_in_thinking(&prompt), "{prompt:?}");
    // SmolLM3 reads its reasoning switch from the system prompt flags and kwargs.
    let smol = compile_named(&spec, "HuggingFaceTB-SmolLM3-3B")?;
    let thinking = smol.render(&question(serde_json::json!({"enable_thinking": true})))?;
    let plain = smol.render(&question(serde_json::json!({"enable_thinking": false})))?;
    assert_ne!(thinking, plain, "enable_thinking reaches the template");
    Ok(())
}
