//! The minijinja environment set up the way transformers sets up jinja2 for chat templates.
//!
//! transformers renders with `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
//! extensions=[AssistantTracker, loopcontrols])`, its own `tojson`, and the globals
//! `raise_exception`, `strftime_now`, `dict` and `namespace`. Here the same, plus what minijinja
//! needs to behave like Python: Python's `str()` for printed values, Python's type tests and
//! string/dict methods, markupsafe escaping. Two additions serve templates written for llama.cpp:
//! the `from_json` filter and lists in a namespace that `append`/`pop` change.

use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior};

use super::clock::Clock;
use super::error::{RaisedByTemplate, TemplateError};
use super::mutable_list::make_mutable;
use super::python_str::python_str;
use super::strftime::strftime;
use super::{filters, json, python_methods, python_types};

/// The name the chat template is registered under in its environment.
pub(crate) const TEMPLATE_NAME: &str = "chat_template";

/// Builds an environment holding the (already prepared) template `source`.
pub(crate) fn build(
    source: String,
    clock: Arc<dyn Clock>,
) -> Result<Environment<'static>, TemplateError> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()
        .map_err(|err| TemplateError::from_compile(&err))?;
    env.set_syntax(syntax);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_formatter(|out, _state, value| {
        match value.as_str() {
            Some(text) => out.write_str(text),
            None => out.write_str(&python_str(value)),
        }
        .map_err(Error::from)
    });
    env.set_unknown_method_callback(python_methods::call_method);

    env.add_filter("tojson", json::tojson_filter);
    env.add_filter("from_json", json::from_json_filter);
    env.add_filter("string", filters::string);
    env.add_filter("join", filters::join);
    env.add_filter("trim", filters::trim);
    env.add_filter("indent", filters::indent);
    env.add_filter("int", filters::int);
    env.add_filter("float", filters::float);
    env.add_filter("wordcount", filters::wordcount);
    env.add_filter("center", filters::center);
    env.add_filter("escape", filters::escape);
    env.add_filter("e", filters::escape);

    env.add_test("string", python_types::is_string);
    env.add_test("mapping", python_types::is_mapping);
    env.add_test("iterable", python_types::is_iterable);
    env.add_test("sequence", python_types::is_sequence);
    env.add_test("number", python_types::is_number);
    env.add_test("integer", python_types::is_integer);
    env.add_test("float", python_types::is_float);
    env.add_test("boolean", python_types::is_boolean);

    env.add_function("raise_exception", raise_exception);
    env.add_function("namespace", namespace);
    env.add_function("strftime_now", move |format: &str| {
        strftime(&clock.now(), format)
    });

    env.add_template_owned(TEMPLATE_NAME, source)
        .map_err(|err| TemplateError::from_compile(&err))?;
    Ok(env)
}

/// `raise_exception(message)`: stops rendering with the template's message.
fn raise_exception(message: Option<Value>) -> Result<Value, Error> {
    let message = message.map(|m| python_str(&m)).unwrap_or_default();
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedByTemplate(message)))
}

/// `namespace(dict?, **kwargs)`: minijinja's namespace, with its lists made mutable.
fn namespace(args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let mut pairs: Vec<(Value, Value)> = Vec::new();
    for arg in args.into_values() {
        if arg.is_kwargs() || arg.kind() == ValueKind::Map {
            if let Some(iter) = arg.as_object().and_then(|obj| obj.try_iter_pairs()) {
                pairs.extend(iter);
            }
        } else {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "namespace: expected a dict or keyword arguments, got {}",
                    arg.kind()
                ),
            ));
        }
    }
    let initial: Kwargs = pairs
        .into_iter()
        .filter_map(|(key, value)| key.as_str().map(|k| (k.to_string(), make_mutable(value))))
        .collect();
    minijinja::functions::namespace(Some(Value::from(initial).into()))
}
