//! Why a piece of markup did not become a tool call, and why a tool list or parser name was refused.

/// An error of the tool-call layer.
///
/// Parsing never fails as a whole: each block that cannot become a call is released as content
/// and its error is kept in [`ParseFailure`](super::ParseFailure) (fail-soft). These errors are
/// also returned by the checked constructors ([`ToolFormat::from_name`](super::ToolFormat::from_name),
/// [`ToolSpec::from_openai`](super::ToolSpec::from_openai)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolCallError {
    /// The model called a tool that the request did not offer.
    #[error("unknown tool '{name}' (offered: {offered})")]
    UnknownTool {
        /// The name the model wrote.
        name: String,
        /// The offered names, comma separated.
        offered: String,
    },
    /// A call envelope had no usable name, not even inside its arguments.
    #[error("tool call has no name")]
    MissingName,
    /// A call name that no tool can have (empty, or with spaces or angle brackets).
    #[error("invalid tool name '{name}'")]
    InvalidName {
        /// The name as written.
        name: String,
    },
    /// The JSON payload could not be parsed, even after every repair.
    #[error("unrecoverable JSON in tool call: {reason}")]
    InvalidJson {
        /// serde_json's message for the last attempt.
        reason: String,
    },
    /// JSON that parsed but does not have the shape of a tool call.
    #[error("JSON is not a tool-call envelope: {reason}")]
    NotAnEnvelope {
        /// What is missing or wrong.
        reason: String,
    },
    /// The arguments of a call are JSON but not an object.
    #[error("arguments of '{name}' are {found}, not an object")]
    ArgumentsNotObject {
        /// The tool name.
        name: String,
        /// The JSON type found (`array`, `number`, …).
        found: &'static str,
    },
    /// The arguments of a call were a string that is not JSON, even after repairs.
    #[error("arguments string of '{name}' is not JSON: {reason}")]
    ArgumentsNotJson {
        /// The tool name.
        name: String,
        /// serde_json's message.
        reason: String,
    },
    /// The markup after an opening marker does not follow the format.
    #[error("unsupported {format} tool-call payload: {reason}")]
    UnsupportedPayload {
        /// The format's name.
        format: &'static str,
        /// What was expected.
        reason: String,
    },
    /// `--tool-parser` / `--format` named no known format.
    #[error("unknown tool parser '{name}' (known: {known})")]
    UnknownFormat {
        /// The name given.
        name: String,
        /// The canonical names, comma separated.
        known: String,
    },
    /// An entry of the request's `tools` list is not a usable function definition.
    #[error("tools[{index}]: {reason}")]
    InvalidToolSpec {
        /// Position in the `tools` array.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// Calls cannot be forced in this format: its arguments are not one JSON body.
    #[error("forcing a tool call (tool_choice 'required' or a named function) is not supported for the {format} tool-call format")]
    UnsupportedForcedFormat {
        /// The format's name.
        format: &'static str,
    },
}

impl ToolCallError {
    /// A stable machine name for the variant (for logs and JSON reports).
    pub fn kind(&self) -> &'static str {
        match self {
            ToolCallError::UnknownTool { .. } => "unknown_tool",
            ToolCallError::MissingName => "missing_name",
            ToolCallError::InvalidName { .. } => "invalid_name",
            ToolCallError::InvalidJson { .. } => "invalid_json",
            ToolCallError::NotAnEnvelope { .. } => "not_an_envelope",
            ToolCallError::ArgumentsNotObject { .. } => "arguments_not_object",
            ToolCallError::ArgumentsNotJson { .. } => "arguments_not_json",
            ToolCallError::UnsupportedPayload { .. } => "unsupported_payload",
            ToolCallError::UnknownFormat { .. } => "unknown_format",
            ToolCallError::InvalidToolSpec { .. } => "invalid_tool_spec",
            ToolCallError::UnsupportedForcedFormat { .. } => "unsupported_forced_format",
        }
    }
}
