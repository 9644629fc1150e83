//! Text targets: tool-call replies in every format, and chat templates.
use serde_json::json;
use wick_chat::chat_template::{normalize_messages, ChatInput, ChatTemplate, TemplateTokens};
use wick_chat::tool_call::{self, ToolCallStream, ToolFormat, ToolSpec};

use crate::Target;

const TOOL_SEEDS: &[&str] = &[
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "{\"name\": \"search\", \"arguments\": {\"query\": \"x\", \"filters\": {}}}",
    "<function=get_weather><parameter=city>Oslo</parameter></function>",
    "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}",
    "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"x\"}}",
    "Sure. <tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call> done",
    "```json\n[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"A\"}}]\n```",
];

const TOOL_DICT: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "{",
    "}",
    "[",
    "]",
    "\"",
    ":",
    ",",
    "\\u00",
    "\\",
    "\"name\"",
    "\"arguments\"",
    "null",
    "1e999",
    "\u{FFFD}",
    "\n",
];

/// Tool-call replies: the first byte picks the format and whether tools are offered; the text
/// is parsed whole and streamed in two chunks.
pub fn tool_call() -> Target {
    let tools = ToolSpec::list_from_openai(&[
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}),
        json!({"type": "function", "function": {"name": "search", "parameters": {
            "type": "object", "properties": {"query": {"type": "string"},
            "filters": {"type": "object"}}}}}),
    ])
    .unwrap_or_default();
    let seeds = TOOL_SEEDS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut v = vec![(i as u8) | 0x80];
            v.extend_from_slice(s.as_bytes());
            v
        })
        .collect();
    Target {
        name: "tool-call",
        seeds,
        dict: TOOL_DICT.iter().map(|s| s.as_bytes().to_vec()).collect(),
        run: Box::new(move |input| {
            let Some((&selector, rest)) = input.split_first() else {
                return false;
            };
            let formats = ToolFormat::all();
            let format = formats[selector as usize % formats.len()];
            let offered: &[ToolSpec] = if selector & 0x80 != 0 { &tools } else { &[] };
            let text = String::from_utf8_lossy(rest);
            let outcome = tool_call::parse(format, &text, offered);
            let mut stream = ToolCallStream::new(format, offered);
            let mut cut = (selector as usize * 7) % (text.len() + 1);
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            stream.push(&text[..cut]);
            stream.push(&text[cut..]);
            stream.finish();
            !outcome.calls.is_empty()
        }),
    }
}

/// Built-in template seeds (the real templates of the test assets join them when present).
const TEMPLATE_SEEDS: &[&str] = &[
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content | trim }} [/INST]{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
    "{%- if tools %}{{ tools | tojson(indent=2) }}{% endif %}{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}{% endif %}{{ m['content'].split('</think>')[-1] if m.content is string else '' }}{% endfor %}",
    "{% set ns = namespace(sys='') %}{% for m in messages %}{% if loop.first and m.role == 'system' %}{% set ns.sys = m.content %}{% else %}{{ ns.sys ~ m.content }}{% endif %}{% endfor %}{{ raise_exception('x') if messages | length > 9 }}",
];

const TEMPLATE_DICT: &[&str] = &[
    "{%",
    "%}",
    "{{",
    "}}",
    "{#",
    "#}",
    "{%-",
    "-%}",
    " for m in messages ",
    " endfor ",
    " if ",
    " endif ",
    " else ",
    " set x = ",
    "| tojson",
    "| trim",
    "| length",
    "| join(',')",
    ".split(",
    ")[-1]",
    "[0]",
    "loop.index",
    "namespace(",
    "raise_exception(",
    "range(",
    "strftime_now('%Y')",
    "'",
    "\"",
    "(",
    ")",
    "~",
    " is string",
    " in ",
    "message.content",
    "macro ",
    "endmacro",
    "recursive",
    "loop(",
    "9999999",
    "-1",
];

/// Chat templates: compiled and rendered with a conversation that has tools and history.
pub fn chat_template() -> Target {
    let mut seeds: Vec<Vec<u8>> = TEMPLATE_SEEDS
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
    if let Some(dir) = assets_templates() {
        if let Ok(entries) = std::fs::read_dir(dir) {
            let mut files: Vec<_> = entries.flatten().map(|e| e.path()).collect();
            files.sort();
            seeds.extend(
                files
                    .iter()
                    .filter(|p| p.extension().is_some_and(|e| e == "jinja"))
                    .filter_map(|p| std::fs::read(p).ok()),
            );
        }
    }
    let messages = normalize_messages(vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "Weather in Paris? <|im_start|>"}),
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_1",
            "type": "function", "function": {"name": "get_weather",
            "arguments": "{\"city\": \"Paris\"}"}}]}),
        json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
        json!({"role": "assistant", "content": "<think>x</think>Sunny."}),
        json!({"role": "user", "content": [{"type": "text", "text": "thanks"}]}),
    ]);
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
    ];
    let special = TemplateTokens {
        bos_token: Some("<s>".into()),
        eos_token: Some("</s>".into()),
        ..TemplateTokens::default()
    };
    Target {
        name: "chat-template",
        seeds,
        dict: TEMPLATE_DICT
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect(),
        run: Box::new(move |input| {
            let source = String::from_utf8_lossy(input);
            let Ok(template) = ChatTemplate::new(&source, special.clone()) else {
                return false;
            };
            let _ = template.capabilities();
            template
                .render(&ChatInput {
                    messages: messages.clone(),
                    tools: Some(tools.clone()),
                    add_generation_prompt: true,
                    kwargs: Default::default(),
                })
                .is_ok()
        }),
    }
}

fn assets_templates() -> Option<std::path::PathBuf> {
    let home = std::env::var_os("WICK_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache/wick"))
        })?;
    let dir = home.join("assets/llama.cpp/templates");
    dir.is_dir().then_some(dir)
}
