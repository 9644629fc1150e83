//! Offered tools ([`ToolSpec`]) and schema-aware decoding of argument values written as raw text.

use serde_json::Value;

use super::repair::{repair_json, RepairKind};
use super::ToolCallError;

/// One tool the request offers: its name and the JSON schema of its parameters.
///
/// Built from an OpenAI `tools` entry, either `{"type":"function","function":{name, description,
/// parameters}}` or the bare `{name, description, parameters}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// The function name calls must use.
    pub name: String,
    /// The `description`, if any.
    pub description: Option<String>,
    /// The `parameters` JSON schema (`Value::Null` when absent).
    pub parameters: Value,
}

impl ToolSpec {
    /// Builds a spec from one OpenAI `tools` entry; `index` is its position, used in errors.
    pub fn from_openai(index: usize, tool: &Value) -> Result<ToolSpec, ToolCallError> {
        let invalid = |reason: &str| ToolCallError::InvalidToolSpec {
            index,
            reason: reason.to_string(),
        };
        let object = tool.as_object().ok_or_else(|| invalid("not an object"))?;
        let function = match object.get("function") {
            Some(Value::Object(function)) => function,
            Some(_) => return Err(invalid("`function` is not an object")),
            None => object,
        };
        let name = match function.get("name") {
            Some(Value::String(name)) if !name.trim().is_empty() => name.trim().to_string(),
            Some(Value::String(_)) => return Err(invalid("`name` is empty")),
            Some(_) => return Err(invalid("`name` is not a string")),
            None => return Err(invalid("no `name`")),
        };
        let description = function
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_string);
        let parameters = function.get("parameters").cloned().unwrap_or(Value::Null);
        Ok(ToolSpec {
            name,
            description,
            parameters,
        })
    }

    /// Builds the specs of a whole OpenAI `tools` array.
    pub fn list_from_openai(tools: &[Value]) -> Result<Vec<ToolSpec>, ToolCallError> {
        tools
            .iter()
            .enumerate()
            .map(|(index, tool)| ToolSpec::from_openai(index, tool))
            .collect()
    }

    /// Reads a tools file (`wick tools parse --tools tools.json`): a JSON array of OpenAI tools,
    /// or an object with a `tools` array (a saved chat-completions request body).
    pub fn list_from_json_text(text: &str) -> Result<Vec<ToolSpec>, ToolCallError> {
        let invalid = |reason: String| ToolCallError::InvalidToolSpec { index: 0, reason };
        let value: Value = serde_json::from_str(text)
            .map_err(|e| invalid(format!("tools file is not JSON: {e}")))?;
        match &value {
            Value::Array(tools) => ToolSpec::list_from_openai(tools),
            Value::Object(object) => match object.get("tools") {
                Some(Value::Array(tools)) => ToolSpec::list_from_openai(tools),
                _ => Err(invalid(
                    "expected an array of tools or an object with `tools`".into(),
                )),
            },
            _ => Err(invalid(
                "expected an array of tools or an object with `tools`".into(),
            )),
        }
    }

    /// The schema of parameter `key`, if the spec declares it.
    pub fn property(&self, key: &str) -> Option<&Value> {
        self.parameters.get("properties")?.get(key)
    }
}

/// The offered tools as the parsers see them: lookup and name validation.
///
/// An empty list accepts every name (no validation, no schema): that is what `wick tools parse`
/// without `--tools` does.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ToolBox<'a> {
    specs: &'a [ToolSpec],
    /// Accept names that were not offered (the stream marks such calls `unknown_tool`).
    accept_unknown: bool,
}

impl<'a> ToolBox<'a> {
    pub(crate) fn new(specs: &'a [ToolSpec]) -> Self {
        ToolBox {
            specs,
            accept_unknown: false,
        }
    }

    /// A tool box that lets call markup name tools that were not offered.
    pub(crate) fn accepting_unknown(specs: &'a [ToolSpec]) -> Self {
        ToolBox {
            specs,
            accept_unknown: true,
        }
    }

    /// The same tools, refusing names that were not offered.
    pub(crate) fn strict(self) -> Self {
        ToolBox {
            accept_unknown: false,
            ..self
        }
    }

    /// Whether `name` was offered (every name is when no tools were given).
    pub(crate) fn offers(&self, name: &str) -> bool {
        self.specs.is_empty() || self.find(name).is_some()
    }

    /// The spec named `name`, if offered.
    pub(crate) fn find(&self, name: &str) -> Option<&'a ToolSpec> {
        self.specs.iter().find(|spec| spec.name == name)
    }

    /// Checks that `name` may be called.
    pub(crate) fn check(&self, name: &str) -> Result<(), ToolCallError> {
        if self.accept_unknown || self.offers(name) {
            return Ok(());
        }
        Err(ToolCallError::UnknownTool {
            name: name.to_string(),
            offered: self
                .specs
                .iter()
                .map(|spec| spec.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }
}

/// The JSON types a parameter schema allows: `type` (a string or a union array), the types of
/// `anyOf`/`oneOf` branches, and `string` for an untyped `enum` of strings. Empty when unknown.
fn schema_types(schema: &Value) -> Vec<String> {
    let mut types = Vec::new();
    match schema.get("type") {
        Some(Value::String(kind)) => types.push(kind.clone()),
        Some(Value::Array(kinds)) => {
            types.extend(kinds.iter().filter_map(Value::as_str).map(str::to_string))
        }
        _ => {}
    }
    for union in ["anyOf", "oneOf"] {
        if let Some(Value::Array(branches)) = schema.get(union) {
            for branch in branches {
                types.extend(schema_types(branch));
            }
        }
    }
    if types.is_empty() {
        if let Some(Value::Array(values)) = schema.get("enum") {
            if !values.is_empty() && values.iter().all(Value::is_string) {
                types.push("string".to_string());
            }
        }
    }
    types
}

/// Decodes a parameter value that the model wrote as raw text (XML-style formats); returns the
/// value and the repairs it needed.
///
/// - An empty value is the empty string.
/// - When the schema allows only `string`/`null`, the text is kept as a string, so `2025` for a
///   string parameter stays `"2025"`.
/// - Otherwise the text is JSON-decoded when it parses (`42`, `true`, `{"a":1}`); a value that
///   starts like an object or array goes through the JSON repairs (templates that render Python
///   values write `{'a': True}`); the Python spellings `True`/`False`/`None` become
///   `true`/`false`/`null`; anything else stays a string.
pub(crate) fn decode_argument(
    tool: Option<&ToolSpec>,
    key: &str,
    raw: &str,
) -> (Value, Vec<RepairKind>) {
    if raw.is_empty() {
        return (Value::String(String::new()), Vec::new());
    }
    let types = tool
        .and_then(|spec| spec.property(key))
        .map(schema_types)
        .unwrap_or_default();
    if !types.is_empty() && types.iter().all(|t| t == "string" || t == "null") {
        return (Value::String(raw.to_string()), Vec::new());
    }
    let trimmed = raw.trim();
    if let Ok(value) = serde_json::from_str::<Value>(trimmed) {
        return (value, Vec::new());
    }
    if trimmed.starts_with(['{', '[']) {
        if let Ok(repaired) = repair_json(trimmed) {
            if repaired.value.is_object() || repaired.value.is_array() {
                return (repaired.value, repaired.repairs);
            }
        }
    }
    let value = match trimmed {
        "True" => Value::Bool(true),
        "False" => Value::Bool(false),
        "None" => Value::Null,
        _ => return (Value::String(raw.to_string()), Vec::new()),
    };
    (value, vec![RepairKind::PythonLiterals])
}

/// Name of a JSON value's type, for error messages.
pub(crate) fn json_type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec() -> ToolSpec {
        ToolSpec::from_openai(
            0,
            &json!({"type": "function", "function": {"name": "f", "parameters": {
                "type": "object",
                "properties": {
                    "year": {"type": "string"},
                    "count": {"type": "integer"},
                    "maybe": {"type": ["string", "null"]},
                    "either": {"type": ["string", "number"]},
                    "pick": {"enum": ["a", "b"]},
                    "union": {"anyOf": [{"type": "string"}, {"type": "boolean"}]},
                    "flag": {"type": "boolean"}
                }
            }}}),
        )
        .expect("valid spec")
    }

    fn decode(spec: Option<&ToolSpec>, key: &str, raw: &str) -> Value {
        decode_argument(spec, key, raw).0
    }

    #[test]
    fn string_schema_keeps_digits_as_text() {
        let spec = spec();
        assert_eq!(decode(Some(&spec), "year", "2025"), json!("2025"));
        assert_eq!(decode(Some(&spec), "maybe", "null"), json!("null"));
        assert_eq!(decode(Some(&spec), "pick", "1"), json!("1"));
    }

    #[test]
    fn other_schemas_decode_json_with_fallback() {
        let spec = spec();
        assert_eq!(decode(Some(&spec), "count", "2025"), json!(2025));
        assert_eq!(decode(Some(&spec), "count", " 7\n"), json!(7));
        assert_eq!(decode(Some(&spec), "count", "seven"), json!("seven"));
        assert_eq!(decode(Some(&spec), "either", "3.5"), json!(3.5));
        assert_eq!(decode(Some(&spec), "union", "true"), json!(true));
        assert_eq!(decode(Some(&spec), "flag", "True"), json!(true));
        assert_eq!(decode(Some(&spec), "unknown", "[1,2]"), json!([1, 2]));
        assert_eq!(decode(None, "x", "{\"a\": 1}"), json!({"a": 1}));
        assert_eq!(decode(Some(&spec), "count", ""), json!(""));
        assert_eq!(
            decode_argument(Some(&spec), "unknown", "{'a': True}"),
            (
                json!({"a": true}),
                vec![RepairKind::PythonLiterals, RepairKind::SingleQuotes]
            )
        );
        assert_eq!(
            decode(Some(&spec), "year", "{'a': True}"),
            json!("{'a': True}")
        );
    }

    #[test]
    fn specs_from_openai_shapes() {
        let bare = ToolSpec::from_openai(0, &json!({"name": " g ", "parameters": {}})).unwrap();
        assert_eq!(bare.name, "g");
        let err = ToolSpec::list_from_openai(&[json!({"type": "function"}), json!(3)]).unwrap_err();
        assert_eq!(err.kind(), "invalid_tool_spec");
        assert!(err.to_string().starts_with("tools[0]"), "{err}");
    }

    #[test]
    fn tools_files() {
        let array = r#"[{"type": "function", "function": {"name": "a"}}]"#;
        assert_eq!(ToolSpec::list_from_json_text(array).unwrap()[0].name, "a");
        let request = r#"{"model": "m", "tools": [{"name": "b"}]}"#;
        assert_eq!(ToolSpec::list_from_json_text(request).unwrap()[0].name, "b");
        assert!(ToolSpec::list_from_json_text("{}").is_err());
        assert!(ToolSpec::list_from_json_text("nope").is_err());
    }

    #[test]
    fn empty_toolbox_accepts_everything() {
        assert!(ToolBox::new(&[]).check("anything").is_ok());
        let specs = [spec()];
        let tools = ToolBox::new(&specs);
        assert!(tools.check("f").is_ok());
        let err = tools.check("g").unwrap_err();
        assert_eq!(err.to_string(), "unknown tool 'g' (offered: f)");
    }
}
