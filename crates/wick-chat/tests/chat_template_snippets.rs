//! One small template per jinja2 feature that chat templates use (whitespace control, loop
//! controls, namespaces, slicing, type tests, Python methods, every filter they call,
//! `raise_exception`, `strftime_now`, `tojson`, `{% generation %}` …), each rendered by wick and
//! compared with Python jinja2's outcome in `snippets.expected.json`: the same text, the same
//! `raise_exception` message, or a failure where Python failed.

mod chat_template_support;

use std::sync::Arc;

use anyhow::{Context, Result};
use chat_template_support::{first_difference, goldens_dir, Spec};
use serde_json::Value;
use wick_chat::chat_template::{ChatInput, ChatTemplate, FixedClock, TemplateError};

#[test]
fn snippets_match_python_jinja2() -> Result<()> {
    let spec = Spec::load()?;
    let read = |name: &str| -> Result<Value> {
        let path = goldens_dir().join(name);
        Ok(serde_json::from_str(
            &std::fs::read_to_string(&path).with_context(|| path.display().to_string())?,
        )?)
    };
    let snippets = read("snippets.json")?;
    let expected = read("snippets.expected.json")?;
    let input = ChatInput {
        kwargs: snippets["context"].as_object().context("context")?.clone(),
        ..ChatInput::default()
    };
    let mut failures = Vec::new();
    let mut checked = 0;
    for (name, source) in snippets["snippets"].as_object().context("snippets")? {
        let source = source.as_str().context("snippet source")?;
        let want = &expected[name];
        let ours =
            ChatTemplate::with_clock(source, spec.special.clone(), Arc::new(FixedClock(spec.now)))
                .and_then(|template| template.render(&input));
        let problem = if let Some(text) = want["ok"].as_str() {
            match ours {
                Ok(actual) if actual == text => None,
                Ok(actual) => Some(first_difference(text, &actual)),
                Err(e) => Some(format!("Python rendered {text:?}, wick failed: {e}")),
            }
        } else if let Some(message) = want["raise_exception"].as_str() {
            match ours {
                Err(TemplateError::Raised { message: ours }) if ours == message => None,
                other => Some(format!(
                    "Python: raise_exception({message:?}); wick: {other:?}"
                )),
            }
        } else if want["error"].is_string() {
            match ours {
                Err(_) => None,
                Ok(actual) => Some(format!(
                    "Python failed ({}), wick rendered {actual:?}",
                    want["message"]
                )),
            }
        } else {
            Some("no expected outcome: rerun scripts/goldens/chat_templates.py".to_string())
        };
        checked += 1;
        if let Some(problem) = problem {
            failures.push(format!("{name}: {problem}"));
        }
    }
    assert!(checked >= 50, "only {checked} snippets");
    assert!(
        failures.is_empty(),
        "{} of {checked} snippets differ from jinja2:\n{}",
        failures.len(),
        failures.join("\n")
    );
    Ok(())
}
