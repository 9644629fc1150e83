//! The public behaviour of `ChatTemplate` around rendering: errors that name the line or carry
//! the template's message, the injectable clock, how variables reach the template, the llama.cpp
//! extensions (mutable namespace lists, `from_json`), and rendering from many threads.

use std::sync::Arc;

use serde_json::json;
use wick_chat::chat_template::{
    normalize_messages, strftime, ChatInput, ChatTemplate, CivilTime, FixedClock, TemplateError,
    TemplateTokens,
};

fn render(source: &str, input: &ChatInput) -> Result<String, TemplateError> {
    ChatTemplate::new(source, TemplateTokens::default())?.render(input)
}

fn user(text: &str) -> ChatInput {
    ChatInput {
        messages: vec![json!({"role": "user", "content": text})],
        ..ChatInput::default()
    }
}

#[test]
fn syntax_error_names_the_line() {
    let source = "{% for m in messages %}\n{{ m.content }}\n{% if %}\n{% endfor %}";
    match ChatTemplate::new(source, TemplateTokens::default()) {
        Err(TemplateError::Syntax { line, detail }) => {
            assert_eq!(line, Some(3));
            assert!(!detail.is_empty());
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    let unclosed =
        ChatTemplate::new("a\nb\n{% if true %}x", TemplateTokens::default()).unwrap_err();
    assert_eq!(unclosed.error_type(), "template_syntax");
    assert!(unclosed.to_string().contains("syntax error"), "{unclosed}");
}

#[test]
fn raise_exception_carries_the_templates_message() {
    let source = "{% for m in messages %}{% if m.role == 'user' %}\
                  {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
                  {% endif %}{% endfor %}";
    let err = render(source, &user("hi")).unwrap_err();
    assert_eq!(
        err,
        TemplateError::Raised {
            message: "Conversation roles must alternate user/assistant/user/assistant/...".into()
        }
    );
    assert_eq!(err.error_type(), "template_raised");
    // Raised from inside a macro and through a filter, the message is still found.
    let nested = "{% macro check(x) %}{{ raise_exception('bad: ' ~ x) | trim }}{% endmacro %}{{ check(messages[0].role) }}";
    assert_eq!(
        render(nested, &user("hi")).unwrap_err(),
        TemplateError::Raised {
            message: "bad: user".into()
        }
    );
}

#[test]
fn render_errors_name_the_line() {
    let source = "line one\n{{ messages[0].content.nope.deeper }}";
    match render(source, &user("hi")) {
        Err(TemplateError::Render { line, detail }) => {
            assert_eq!(line, Some(2));
            assert!(detail.contains("undefined"), "{detail}");
        }
        other => panic!("expected a render error, got {other:?}"),
    }
    let unknown = render("{{ 'x' | no_such_filter }}", &user("hi")).unwrap_err();
    assert!(unknown.to_string().contains("no_such_filter"), "{unknown}");
}

#[test]
fn strftime_now_reads_the_injected_clock() {
    let now = CivilTime::new(2024, 7, 26, 18, 5, 0).unwrap();
    let template = ChatTemplate::with_clock(
        "Today Date: {{ strftime_now('%d %b %Y') }} {{ strftime_now('%I:%M %p') }}",
        TemplateTokens::default(),
        Arc::new(FixedClock(now)),
    )
    .unwrap();
    assert_eq!(
        template.render(&ChatInput::default()).unwrap(),
        "Today Date: 26 Jul 2024 06:05 PM"
    );
    assert_eq!(strftime(&now, "%Y-%m-%d"), "2024-07-26");
    // The system clock gives a date in the expected shape.
    let today = render("{{ strftime_now('%Y-%m-%d') }}", &ChatInput::default()).unwrap();
    assert_eq!(today.len(), 10, "{today}");
}

#[test]
fn variables_reach_the_template_as_transformers_passes_them() {
    let special = TemplateTokens {
        bos_token: Some("<s>".into()),
        eos_token: Some("</s>".into()),
        ..TemplateTokens::default()
    };
    let source = "{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}|{{ tools is none }}|\
                  {{ documents is none }}|{{ add_generation_prompt }}|{{ enable_thinking }}|{{ reasoning_effort }}";
    let template = ChatTemplate::new(source, special).unwrap();
    let mut input = user("hi");
    input.kwargs =
        json!({"enable_thinking": false, "reasoning_effort": "low", "eos_token": "<|end|>"})
            .as_object()
            .cloned()
            .unwrap();
    input.add_generation_prompt = true;
    assert_eq!(
        template.render(&input).unwrap(),
        "<s>|<|end|>|False|True|True|True|False|low"
    );
    input.tools = Some(vec![json!({"type": "function", "function": {"name": "f"}})]);
    let tools = ChatTemplate::new(
        "{{ tools | map(attribute='function') | map(attribute='name') | join }}",
        TemplateTokens::default(),
    )
    .unwrap();
    assert_eq!(tools.render(&input).unwrap(), "f");
}

#[test]
fn key_order_of_messages_is_kept() {
    let input = ChatInput {
        messages: vec![json!({"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{\"zeta\": 1, \"alpha\": {\"y\": [1.0, 2.5e-8], \"x\": null}}"}}]})],
        ..ChatInput::default()
    };
    let input = ChatInput {
        messages: normalize_messages(input.messages),
        ..input
    };
    let source = "{{ messages[0].tool_calls[0].function.arguments | tojson }}";
    assert_eq!(
        render(source, &input).unwrap(),
        r#"{"zeta": 1, "alpha": {"y": [1.0, 2.5e-08], "x": null}}"#
    );
}

#[test]
fn namespace_lists_can_be_appended_and_popped() {
    // The pattern Kimi-K2's template uses to pair tool results with tool-call ids.
    let source = "{%- set q = namespace(ids=[]) -%}\
                  {%- for m in messages -%}\
                    {%- if m.tool_calls -%}{%- for c in m.tool_calls -%}{%- set _ = q.ids.append(c.id) -%}{%- endfor -%}\
                    {%- elif m.role == 'tool' -%}[{{ q.ids.pop(0) }}:{{ m.content }}]\
                    {%- endif -%}\
                  {%- endfor -%}{{ q.ids | length }}";
    let input = ChatInput {
        messages: vec![
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": "a"}, {"id": "b"}]}),
            json!({"role": "tool", "content": "1"}),
            json!({"role": "tool", "content": "2"}),
        ],
        ..ChatInput::default()
    };
    assert_eq!(render(source, &input).unwrap(), "[a:1][b:2]0");
    let empty = render(
        "{% set q = namespace(ids=[]) %}{{ q.ids.pop() }}",
        &ChatInput::default(),
    )
    .unwrap_err();
    assert!(empty.to_string().contains("pop from empty list"), "{empty}");
    // Lists outside a namespace stay immutable, as in jinja2.
    assert!(render("{% set l = [] %}{{ l.append(1) }}", &ChatInput::default()).is_err());
}

#[test]
fn from_json_reads_arguments_text() {
    let source = "{% for k, v in ('{\"city\": \"Paris\", \"days\": 3}' | from_json).items() %}{{ k }}={{ v }};{% endfor %}";
    assert_eq!(
        render(source, &ChatInput::default()).unwrap(),
        "city=Paris;days=3;"
    );
    assert!(render("{{ '{oops' | from_json }}", &ChatInput::default()).is_err());
}

#[test]
fn generation_tags_render_their_body() {
    let source = "{% for m in messages %}{%- generation -%}\n  {{ m.content }}\n{%- endgeneration %}{% endfor %}";
    let template = ChatTemplate::new(source, TemplateTokens::default()).unwrap();
    assert!(template.capabilities().marks_generation);
    assert_eq!(template.render(&user("hi")).unwrap(), "hi");
}

#[test]
fn one_template_renders_from_many_threads() {
    let template = Arc::new(
        ChatTemplate::new(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}:{{ messages[-1].content }}",
            TemplateTokens::default(),
        )
        .unwrap(),
    );
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let template = Arc::clone(&template);
            std::thread::spawn(move || {
                let mut input = user("x");
                for j in 0..i {
                    input
                        .messages
                        .push(json!({"role": "user", "content": format!("m{j}")}));
                }
                (i, template.render(&input).unwrap())
            })
        })
        .collect();
    for handle in handles {
        let (i, rendered) = handle.join().unwrap();
        let last = if i == 0 {
            "x".to_string()
        } else {
            format!("m{}", i - 1)
        };
        assert_eq!(rendered, format!("{}:{last}", i + 1));
    }
}

#[test]
fn system_role_probe_sees_dropped_and_rejected_system_messages() {
    let rejects = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}";
    let drops = "{% for m in messages if m.role != 'system' %}{{ m.content }}{% endfor %}";
    let keeps = "{% for m in messages %}{{ m.content }}{% endfor %}";
    let caps = |s: &str| {
        ChatTemplate::new(s, TemplateTokens::default())
            .unwrap()
            .capabilities()
    };
    assert!(!caps(rejects).supports_system_role);
    assert!(!caps(drops).supports_system_role);
    assert!(caps(keeps).supports_system_role);
    assert!(!caps(keeps).uses_tools);
    assert!(caps("{% if tools %}{{ tools | tojson }}{% endif %}").uses_tools);
}
