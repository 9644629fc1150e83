//! Streaming behaviour: prose streams live, markup never reaches content, calls go out as
//! start → argument deltas → end, arguments of XML-style and Gemma 4 calls stream one by one
//! while the call is generated, and huge arguments stream in small chunks in reasonable time.

mod support;

use serde_json::{json, Value};
use support::check::{as_streamed, random_chunks, rebuild, Rng};
use wick_chat::tool_call::{
    parse_with_ids, CallIdSource, StreamEvent, ToolCallStream, ToolFormat, ToolSpec,
};

fn tools() -> Vec<ToolSpec> {
    ToolSpec::list_from_openai(&[
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
        json!({"type": "function", "function": {"name": "write_file", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}),
    ])
    .expect("tools")
}

fn stream(format: ToolFormat) -> ToolCallStream {
    ToolCallStream::with_ids(format, &tools(), CallIdSource::counter())
}

#[test]
fn prose_streams_before_the_call_is_complete() {
    let mut s = stream(ToolFormat::HermesJson);
    assert_eq!(
        s.push("Let me check the weather. "),
        vec![StreamEvent::Content("Let me check the weather.".into())]
    );
    assert_eq!(s.push("<tool_call>\n{\"name\": \"get_weather\", "), vec![]);
    let events = s.push("\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
    assert_eq!(
        events,
        vec![
            StreamEvent::CallStart {
                index: 0,
                id: "call_00000000".into(),
                name: "get_weather".into()
            },
            StreamEvent::CallArguments {
                index: 0,
                delta: "{\"city\":\"Paris\"}".into()
            },
            StreamEvent::CallEnd {
                index: 0,
                repairs: vec![]
            },
        ]
    );
    assert_eq!(s.push("\n"), vec![]);
    assert_eq!(s.finish(), vec![]);
}

#[test]
fn xml_arguments_stream_one_parameter_at_a_time() {
    let mut s = stream(ToolFormat::QwenXml);
    let mut events = s.push("<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n<parameter=content>\nhel");
    assert_eq!(
        events,
        vec![
            StreamEvent::CallStart {
                index: 0,
                id: "call_00000000".into(),
                name: "write_file".into()
            },
            StreamEvent::CallArguments {
                index: 0,
                delta: "{\"path\":\"a.txt\"".into()
            },
        ]
    );
    events = s.push("lo\n</parameter>\n</function>\n</tool_call>");
    assert_eq!(
        events,
        vec![
            StreamEvent::CallArguments {
                index: 0,
                delta: ",\"content\":\"hello\"".into()
            },
            StreamEvent::CallArguments {
                index: 0,
                delta: "}".into()
            },
            StreamEvent::CallEnd {
                index: 0,
                repairs: vec![]
            },
        ]
    );
}

#[test]
fn gemma_arguments_stream_one_by_one_and_reasoning_is_separate() {
    let mut s = stream(ToolFormat::Gemma4);
    let events = s.push("<|channel>thought\nNeed weather.<channel|><|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,da");
    assert_eq!(
        events,
        vec![
            StreamEvent::Reasoning("Need weather.".into()),
            StreamEvent::CallStart {
                index: 0,
                id: "call_00000000".into(),
                name: "get_weather".into()
            },
            StreamEvent::CallArguments {
                index: 0,
                delta: "{\"city\":\"Paris\"".into()
            },
        ]
    );
    let events = s.push("ys:3}<tool_call|>");
    assert_eq!(
        events,
        vec![
            StreamEvent::CallArguments {
                index: 0,
                delta: ",\"days\":3".into()
            },
            StreamEvent::CallArguments {
                index: 0,
                delta: "}".into()
            },
            StreamEvent::CallEnd {
                index: 0,
                repairs: vec![]
            },
        ]
    );
}

#[test]
fn markup_never_reaches_content_while_streaming() {
    let text = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
    for format in [ToolFormat::HermesJson, ToolFormat::QwenXml, ToolFormat::Glm] {
        let mut s = stream(format);
        let mut content = String::new();
        for piece in text.as_bytes().chunks(1) {
            for event in s.push(std::str::from_utf8(piece).expect("ascii")) {
                if let StreamEvent::Content(text) = event {
                    content.push_str(&text);
                }
            }
        }
        for event in s.finish() {
            if let StreamEvent::Content(text) = event {
                content.push_str(&text);
            }
        }
        assert_eq!(content, "Sure.", "{format}");
    }
}

/// A call with one huge string argument, written the way each format writes it.
fn huge_call(format: ToolFormat, value: &str) -> String {
    let q = "<|\"|>";
    match format {
        ToolFormat::HermesJson => format!(
            "<tool_call>\n{}\n</tool_call>",
            json!({"name": "write_file", "arguments": {"path": "big.txt", "content": value}})
        ),
        ToolFormat::QwenXml => format!(
            "<tool_call>\n<function=write_file>\n<parameter=path>\nbig.txt\n</parameter>\n<parameter=content>\n{value}\n</parameter>\n</function>\n</tool_call>"
        ),
        ToolFormat::Glm => format!(
            "<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>big.txt</arg_value>\n<arg_key>content</arg_key>\n<arg_value>{value}</arg_value>\n</tool_call>"
        ),
        ToolFormat::MiniCpm => format!(
            "<function name=\"write_file\"><param name=\"path\">big.txt</param><param name=\"content\"><![CDATA[{value}]]></param></function>"
        ),
        ToolFormat::Gemma4 => {
            format!("<|tool_call>call:write_file{{content:{q}{value}{q},path:{q}big.txt{q}}}<tool_call|>")
        }
        ToolFormat::Llama3Json => {
            json!({"name": "write_file", "parameters": {"path": "big.txt", "content": value}})
                .to_string()
        }
        ToolFormat::Mistral => format!(
            "[TOOL_CALLS]write_file[ARGS]{}",
            json!({"path": "big.txt", "content": value})
        ),
    }
}

#[test]
fn huge_arguments_stream_in_small_chunks() {
    // ~300 KB with unicode, quotes, braces and newlines (no markup of any format).
    let line = "fn main() { println!(\"héllo, wörld — 東京 🌧\"); let x = [1, 2, 3]; }\n";
    let value: String = line.repeat(300_000 / line.len());
    let value = value.trim().to_string();
    for &format in ToolFormat::all() {
        let text = huge_call(format, &value);
        let expected = parse_with_ids(format, &text, &tools(), CallIdSource::counter());
        assert_eq!(expected.calls.len(), 1, "{format}: {:?}", expected.failures);
        assert_eq!(
            expected.calls[0].arguments["content"],
            Value::String(value.clone()),
            "{format}"
        );
        assert!(expected.calls[0].repairs.is_empty(), "{format}");
        let mut rng = Rng::new(7);
        let chunks = random_chunks(&text, &mut rng);
        let mut s = stream(format);
        let mut events = Vec::new();
        for chunk in &chunks {
            events.extend(s.push(chunk));
        }
        events.extend(s.finish());
        assert_eq!(
            rebuild(&events).expect("protocol"),
            as_streamed(&expected),
            "{format}"
        );
    }
}

#[test]
fn push_after_finish_is_ignored() {
    let mut s = stream(ToolFormat::HermesJson);
    assert_eq!(s.push("hi "), vec![StreamEvent::Content("hi".into())]);
    assert_eq!(s.finish(), vec![StreamEvent::Content(" ".into())]);
    assert_eq!(s.push("more"), vec![]);
    assert_eq!(s.finish(), vec![]);
    assert_eq!(s.into_outcome().content, "hi ");
}
