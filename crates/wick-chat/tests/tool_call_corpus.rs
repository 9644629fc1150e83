//! The tool-call corpus (`tests/corpus/tool_calls/*.json`, one file per family): every entry
//! parses to its expected calls, repairs, content and failures; the streaming parser agrees with
//! `parse` for every split into two pieces and for random chunkings; and every truncation of
//! every entry parses without panic, with streaming still agreeing.

mod support;

use serde_json::Value;
use support::check::{boundaries, check_text};
use wick_chat::tool_call::{ToolFormat, ToolSpec};

struct Corpus {
    format: ToolFormat,
    tools: Vec<ToolSpec>,
    cases: Vec<Value>,
}

fn load(file: &str) -> Corpus {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus/tool_calls")
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    let format =
        ToolFormat::from_name(json["format"].as_str().expect("format")).expect("known format");
    let tools =
        ToolSpec::list_from_openai(json["tools"].as_array().expect("tools")).expect("valid tools");
    let cases = json["cases"].as_array().expect("cases").clone();
    Corpus {
        format,
        tools,
        cases,
    }
}

fn str_list(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|item| item.as_str().expect("string").to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn run(file: &str) {
    let corpus = load(file);
    let mut problems = Vec::new();
    for (number, case) in corpus.cases.iter().enumerate() {
        let name = case["name"].as_str().expect("name");
        let text = case["text"].as_str().expect("text");
        let outcome = match check_text(corpus.format, text, &corpus.tools, true, 8, number as u64) {
            Ok(outcome) => outcome,
            Err(problem) => {
                problems.push(format!("{file} / {name}: {problem}"));
                continue;
            }
        };
        let got_calls: Vec<Value> = outcome
            .calls
            .iter()
            .map(|call| {
                serde_json::json!({
                    "name": call.name,
                    "arguments": call.arguments,
                    "repairs": call.repairs.iter().map(|r| r.as_str()).collect::<Vec<_>>(),
                })
            })
            .collect();
        if Value::Array(got_calls.clone()) != case["calls"] {
            problems.push(format!(
                "{file} / {name}: calls\n  got:      {}\n  expected: {}",
                Value::Array(got_calls),
                case["calls"]
            ));
        }
        if outcome.content != case["content"].as_str().expect("content") {
            problems.push(format!(
                "{file} / {name}: content {:?}, expected {:?}",
                outcome.content, case["content"]
            ));
        }
        let reasoning = case["reasoning"].as_str().unwrap_or("");
        if outcome.reasoning != reasoning {
            problems.push(format!(
                "{file} / {name}: reasoning {:?}, expected {reasoning:?}",
                outcome.reasoning
            ));
        }
        let failures: Vec<String> = outcome
            .failures
            .iter()
            .map(|f| f.error.kind().to_string())
            .collect();
        if failures != str_list(&case["failures"]) {
            problems.push(format!(
                "{file} / {name}: failures {failures:?} ({:?}), expected {:?}",
                outcome.failures, case["failures"]
            ));
        }
        // Truncated at every character boundary: no panic, streaming agrees.
        for at in boundaries(text) {
            if let Err(problem) = check_text(
                corpus.format,
                &text[..at],
                &corpus.tools,
                false,
                1,
                at as u64,
            ) {
                problems.push(format!("{file} / {name} truncated at {at}: {problem}"));
                break;
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn hermes_json_corpus() {
    run("hermes_json.json");
}

#[test]
fn qwen_xml_corpus() {
    run("qwen_xml.json");
}

#[test]
fn glm_corpus() {
    run("glm.json");
}

#[test]
fn minicpm_corpus() {
    run("minicpm.json");
}

#[test]
fn gemma4_corpus() {
    run("gemma4.json");
}

#[test]
fn llama3_json_corpus() {
    run("llama3_json.json");
}

#[test]
fn mistral_corpus() {
    run("mistral.json");
}

/// Real replies of Qwen2.5-Coder-0.5B (recorded by `scripts/goldens/tool_call_qwen_coder.py`):
/// it writes bare or fenced JSON envelopes without `<tool_call>` tags, and invents tool names.
#[test]
fn real_qwen_coder_replies() {
    run("real_qwen2.5_coder.json");
}

#[test]
fn every_family_has_a_corpus() {
    for format in ToolFormat::all() {
        let file = format!("{}.json", format.name().replace('-', "_"));
        assert_eq!(load(&file).format, *format, "{file}");
    }
}
