//! What `wick tools parse` prints: a [`ParseOutcome`] as readable text or as JSON.

use serde_json::{json, Value};

use super::ParseOutcome;

/// The outcome as text for a terminal: the calls with their arguments and repairs, the content
/// and reasoning, and why markup was refused; or why nothing parsed.
pub fn render(outcome: &ParseOutcome) -> String {
    let mut out = String::new();
    out.push_str(&format!("format: {}\n", outcome.format));
    match outcome.calls.len() {
        0 => out.push_str("no tool calls"),
        1 => out.push_str("1 tool call"),
        n => out.push_str(&format!("{n} tool calls")),
    }
    if outcome.calls.is_empty() {
        if outcome.failures.is_empty() {
            out.push_str(&format!(": no {} tool-call markup found\n", outcome.format));
        } else {
            out.push_str(": the markup did not parse (kept as content)\n");
        }
    } else {
        out.push('\n');
    }
    for (index, call) in outcome.calls.iter().enumerate() {
        out.push_str(&format!("  [{index}] {} ({})\n", call.name, call.id));
        out.push_str(&format!("      arguments: {}\n", call.arguments_json));
        if call.repairs.is_empty() {
            out.push_str("      repairs: none (strict parse)\n");
        } else {
            let kinds: Vec<&str> = call.repairs.iter().map(|kind| kind.as_str()).collect();
            out.push_str(&format!("      repairs: {}\n", kinds.join(", ")));
        }
    }
    if !outcome.failures.is_empty() {
        out.push_str("refused markup:\n");
        for failure in &outcome.failures {
            out.push_str(&format!(
                "  at byte {}: {} [{}]\n",
                failure.offset,
                failure.error,
                failure.error.kind()
            ));
        }
    }
    if !outcome.reasoning.is_empty() {
        out.push_str(&format!("reasoning: {:?}\n", outcome.reasoning));
    }
    out.push_str(&format!("content: {:?}\n", outcome.content));
    out
}

/// The outcome as JSON (`wick tools parse --json`):
/// `{format, calls: [{id, name, arguments, arguments_json, repairs}], content, reasoning,
/// failures: [{offset, kind, message}]}`.
pub fn to_json(outcome: &ParseOutcome) -> Value {
    json!({
        "format": outcome.format.name(),
        "calls": outcome.calls.iter().map(|call| json!({
            "id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "arguments_json": call.arguments_json,
            "repairs": call.repairs,
        })).collect::<Vec<_>>(),
        "content": outcome.content,
        "reasoning": outcome.reasoning,
        "failures": outcome.failures.iter().map(|failure| json!({
            "offset": failure.offset,
            "kind": failure.error.kind(),
            "message": failure.error.to_string(),
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_call::{parse_with_ids, CallIdSource, ToolFormat, ToolSpec};

    #[test]
    fn renders_calls_and_repairs() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1,}}</tool_call>";
        let outcome = parse_with_ids(ToolFormat::HermesJson, text, &[], CallIdSource::counter());
        assert_eq!(
            render(&outcome),
            "format: hermes-json\n1 tool call\n  [0] f (call_00000000)\n      arguments: {\"a\":1}\n      repairs: trailing_commas\ncontent: \"\"\n"
        );
        let json = to_json(&outcome);
        assert_eq!(json["calls"][0]["repairs"][0], "trailing_commas");
        assert_eq!(json["calls"][0]["arguments"]["a"], 1);
    }

    #[test]
    fn says_why_nothing_parsed() {
        let tools = [ToolSpec::from_openai(0, &serde_json::json!({"name": "g"})).unwrap()];
        let text = "<tool_call>{\"name\": 3}</tool_call>";
        let outcome = parse_with_ids(
            ToolFormat::HermesJson,
            text,
            &tools,
            CallIdSource::counter(),
        );
        let shown = render(&outcome);
        assert!(
            shown.contains("no tool calls: the markup did not parse"),
            "{shown}"
        );
        assert!(
            shown.contains("at byte 0: ") && shown.contains("[invalid_name]"),
            "{shown}"
        );
        let plain = parse_with_ids(ToolFormat::Gemma4, "hi", &[], CallIdSource::counter());
        assert!(render(&plain).contains("no tool calls: no gemma4 tool-call markup found"));
        assert_eq!(to_json(&outcome)["failures"][0]["kind"], "invalid_name");
        // A call to a tool that was not offered is a call, marked.
        let unknown = "<tool_call>{\"name\": \"f\"}</tool_call>";
        let outcome = parse_with_ids(
            ToolFormat::HermesJson,
            unknown,
            &tools,
            CallIdSource::counter(),
        );
        assert!(
            render(&outcome).contains("repairs: unknown_tool"),
            "{}",
            render(&outcome)
        );
    }
}
