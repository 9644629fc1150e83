//! One fuzz input, shared by the cargo-fuzz target (`fuzz/fuzz_targets/tool_call.rs`) and the
//! plain-test mutation harness (`tests/tool_call_fuzz.rs`): the first byte picks the format and
//! whether a tool list is given, the rest is the reply text.

use super::check::check_text;
use wick_chat::tool_call::{ToolFormat, ToolSpec};

/// Tools offered in fuzzing when the selector's high bit is set.
pub fn fuzz_tools() -> Vec<ToolSpec> {
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
            "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}}
    ]);
    ToolSpec::list_from_openai(tools.as_array().map(Vec::as_slice).unwrap_or(&[]))
        .unwrap_or_default()
}

/// Runs every check on one input; panics (a fuzz finding) when one fails.
pub fn fuzz_one(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let formats = ToolFormat::all();
    let format = formats[selector as usize % formats.len()];
    let tools = if selector & 0x80 != 0 {
        fuzz_tools()
    } else {
        Vec::new()
    };
    let text = String::from_utf8_lossy(rest);
    if let Err(problem) = check_text(format, &text, &tools, false, 2, data.len() as u64) {
        panic!("{format} {text:?}: {problem}");
    }
}
