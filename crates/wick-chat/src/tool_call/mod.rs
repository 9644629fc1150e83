//! Tool-call parsing: turning a model's reply into OpenAI tool calls, for every supported wire
//! format, whole ([`parse`]) or while it streams ([`ToolCallStream`]).
//!
//! The format is chosen from the model's chat template ([`ToolFormat::detect`]) or by name
//! ([`ToolFormat::from_name`], for `--tool-parser`). The offered tools ([`ToolSpec`], built from
//! the request's OpenAI `tools`) validate call names and give the parameter schemas that decide
//! how raw-text values are decoded (a `string` parameter keeps `"2025"` as text).
//!
//! Parsing is fail-soft: markup that cannot become a call (an unknown tool, a payload nothing can
//! repair) is returned as content, with the reason in [`ParseOutcome::failures`]. When strict
//! parsing fails, the repair layer ([`RepairKind`]) tries the reference's repairs in order and
//! records every one it needed on the call.
//!
//! [`parse`] is the streaming parser fed the whole text at once, so both agree by construction;
//! the tests check that every way of splitting a text into chunks gives the same result.
//!
//! Decisions that differ from the reference (mlx-bun), because arguments stream as generated:
//! - Fail-soft is per block: a refused block becomes content, the other calls stay calls
//!   (the reference drops every call of the reply).
//! - A call of an XML-style format or Gemma 4 is committed once its header names an offered
//!   tool; after that its body cannot fail. Deviations are repaired and recorded instead:
//!   missing closing tags or truncation (`unclosed_block`, or `unbalanced_braces` for Gemma 4,
//!   as in the reference), text between parameters (`stray_text`), a repeated parameter
//!   (`duplicate_key`, first value kept). An incomplete parameter at the end is dropped.
//! - The bare-JSON last resort (`bare_json`) looks only at the start of the reply (or right after
//!   a call) and at a ```` ```json ```` fence opening a line, so ordinary prose with braces
//!   streams without being held back to the end.
//! - Content is the text outside calls, exactly; only whitespace touching a call block is
//!   dropped with it.
//!
//! ```
//! use serde_json::json;
//! use wick_chat::tool_call::{parse, ToolFormat, ToolSpec};
//!
//! let tools = ToolSpec::list_from_openai(&[json!({"type": "function", "function": {
//!     "name": "get_weather",
//!     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})])?;
//! let reply = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
//! let outcome = parse(ToolFormat::HermesJson, reply, &tools);
//! assert_eq!(outcome.content, "Let me check.");
//! assert_eq!(outcome.calls[0].name, "get_weather");
//! assert_eq!(outcome.calls[0].arguments_json, r#"{"city":"Paris"}"#);
//! assert!(outcome.calls[0].repairs.is_empty());
//! # Ok::<(), wick_chat::tool_call::ToolCallError>(())
//! ```

mod error;
mod forced;
mod gemma4;
mod glm;
mod grammar;
mod hermes_json;
mod llama3_json;
mod minicpm;
mod mistral;
mod outcome;
mod qwen_xml;
mod repair;
pub mod report;
mod scan;
mod schema;
mod stream;
mod tagged;

pub use error::ToolCallError;
pub use forced::{envelope, forced_call_grammar, lazy_call_grammar, LazyCallGrammar};
pub use outcome::{CallIdSource, ParseFailure, ParseOutcome, ToolCall};
pub use repair::RepairKind;
pub use schema::ToolSpec;
pub use stream::{StreamEvent, ToolCallStream};

use grammar::{Block, JsonStart, Marker};

/// The tool-call wire formats. Each variant shows what the model writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    /// Hermes / Qwen2.5 / Qwen3: JSON in tags, one block per call.
    ///
    /// ```text
    /// <tool_call>
    /// {"name": "get_weather", "arguments": {"city": "Paris"}}
    /// </tool_call>
    /// ```
    /// `arguments` may also be a JSON string, and `{"function": {"name", "arguments"}}` is
    /// accepted. A bare envelope without tags (as Qwen2.5-Coder sometimes writes), optionally in
    /// a ```` ```json ```` fence, is the last resort (tagged `bare_json`).
    HermesJson,
    /// Qwen3-Coder / Qwen3.5 XML: values are raw text, one framing newline removed.
    ///
    /// ```text
    /// <tool_call>
    /// <function=get_weather>
    /// <parameter=city>
    /// Paris
    /// </parameter>
    /// </function>
    /// </tool_call>
    /// ```
    QwenXml,
    /// GLM-4.5 / 4.6 / 4.7: name then key/value tag pairs, values XML-decoded.
    ///
    /// ```text
    /// <tool_call>get_weather
    /// <arg_key>city</arg_key>
    /// <arg_value>Paris</arg_value>
    /// </tool_call>
    /// ```
    Glm,
    /// MiniCPM5: XML attributes, no wrapper; values plain text or CDATA.
    ///
    /// ```text
    /// <function name="get_weather"><param name="city">Paris</param></function>
    /// ```
    MiniCpm,
    /// Gemma 4: special tokens, bare keys, `<|"|>`-delimited strings; the reasoning channel
    /// `<|channel>thought\n…<channel|>` is split out as reasoning.
    ///
    /// ```text
    /// <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>
    /// ```
    Gemma4,
    /// Llama 3.1 / 3.2 / 3.3: the reply is a JSON object (optionally after `<|python_tag|>`),
    /// several separated by `;`.
    ///
    /// ```text
    /// {"name": "get_weather", "parameters": {"city": "Paris"}}
    /// ```
    Llama3Json,
    /// Mistral: after the `[TOOL_CALLS]` token, a JSON array (v3, Nemo) or `NAME[ARGS]{…}` per
    /// call (v11+: Small 3.2, Devstral, Ministral 3; `[CALL_ID]id` optional).
    ///
    /// ```text
    /// [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    /// [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
    /// ```
    Mistral,
}

/// Every format, in documentation order.
const ALL: [ToolFormat; 7] = [
    ToolFormat::HermesJson,
    ToolFormat::QwenXml,
    ToolFormat::Glm,
    ToolFormat::MiniCpm,
    ToolFormat::Gemma4,
    ToolFormat::Llama3Json,
    ToolFormat::Mistral,
];

const TAGGED: Marker = Marker {
    text: tagged::OPEN,
    block: Block::Tagged,
    line_start: false,
};
const FENCE_JSON: Marker = Marker {
    text: hermes_json::FENCE_JSON,
    block: Block::BareJson,
    line_start: true,
};

impl ToolFormat {
    /// Every format.
    pub fn all() -> &'static [ToolFormat] {
        &ALL
    }

    /// The canonical name (accepted by [`ToolFormat::from_name`]).
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::HermesJson => "hermes-json",
            ToolFormat::QwenXml => "qwen-xml",
            ToolFormat::Glm => "glm",
            ToolFormat::MiniCpm => "minicpm",
            ToolFormat::Gemma4 => "gemma4",
            ToolFormat::Llama3Json => "llama3-json",
            ToolFormat::Mistral => "mistral",
        }
    }

    /// The format named `name` (for `--tool-parser` / `--format`): a canonical name or a common
    /// alias (`hermes`, `qwen2.5`, `qwen3`, `qwen3-coder`, `qwen3.5`, `glm4.6`, `minicpm5`,
    /// `gemma-4`, `llama3`, `llama3.1`, `mistral-nemo`, …), case-insensitive, `_` = `-`.
    pub fn from_name(name: &str) -> Result<ToolFormat, ToolCallError> {
        let key = name.trim().to_ascii_lowercase().replace('_', "-");
        let format = match key.as_str() {
            "hermes-json" | "hermes" | "json" | "openai-json" | "qwen" | "qwen2" | "qwen2.5"
            | "qwen2.5-coder" | "qwen3" | "qwq" => ToolFormat::HermesJson,
            "qwen-xml" | "xml" | "qwen3-coder" | "qwen3coder" | "qwen3.5" | "qwen35"
            | "xml-equals" => ToolFormat::QwenXml,
            "glm" | "glm4" | "glm45" | "glm4.5" | "glm4.6" | "glm4.7" | "glm-4.5" | "glm-4.6"
            | "glm-4.7" => ToolFormat::Glm,
            "minicpm" | "minicpm5" | "xml-attr" => ToolFormat::MiniCpm,
            "gemma4" | "gemma-4" | "gemma" => ToolFormat::Gemma4,
            "llama3-json" | "llama3" | "llama" | "llama3.1" | "llama3.2" | "llama3.3"
            | "llama-3" => ToolFormat::Llama3Json,
            "mistral" | "mistral-nemo" | "devstral" | "ministral" => ToolFormat::Mistral,
            _ => {
                return Err(ToolCallError::UnknownFormat {
                    name: name.to_string(),
                    known: ALL.map(ToolFormat::name).join(", "),
                })
            }
        };
        Ok(format)
    }

    /// The format a model writes, from its chat template source and GGUF architecture
    /// (`general.architecture`); `None` when neither names a supported format.
    ///
    /// The template is searched for each format's distinctive markup, most specific first
    /// (Qwen-XML and GLM templates also contain `<tool_call>`, Hermes templates built on Llama
    /// contain `"parameters"`); the architecture decides only when the template says nothing.
    pub fn detect(template_source: &str, arch: &str) -> Option<ToolFormat> {
        let t = template_source;
        let arch = arch.to_ascii_lowercase();
        if arch.starts_with("gemma4") || t.contains(gemma4::CALL_OPEN) {
            return Some(ToolFormat::Gemma4);
        }
        if t.contains("<arg_key>") {
            return Some(ToolFormat::Glm);
        }
        if t.contains(tagged::OPEN) && t.contains(qwen_xml::FUNCTION_OPEN) {
            return Some(ToolFormat::QwenXml);
        }
        if t.contains(minicpm::FUNCTION_OPEN) || t.contains("<param name=") {
            return Some(ToolFormat::MiniCpm);
        }
        if t.contains(mistral::TOOL_CALLS) {
            return Some(ToolFormat::Mistral);
        }
        if t.contains(tagged::OPEN) {
            return Some(ToolFormat::HermesJson);
        }
        if (t.contains(llama3_json::PYTHON_TAG) || t.contains("ipython"))
            && t.contains("\"parameters\"")
        {
            return Some(ToolFormat::Llama3Json);
        }
        match arch.as_str() {
            "qwen2" | "qwen2moe" | "qwen3" | "qwen3moe" => Some(ToolFormat::HermesJson),
            "qwen35" | "qwen35moe" => Some(ToolFormat::QwenXml),
            "glm4moe" => Some(ToolFormat::Glm),
            _ => None,
        }
    }

    /// The format a reply is written in, judged from the reply alone (when the model is not
    /// known, as in `wick tools parse` without `--format` or `--model`); `None` when the text
    /// holds no markup of any format.
    ///
    /// Every format whose distinctive markup appears in the text is a candidate — Gemma 4's
    /// `<|tool_call>`, GLM's `<arg_key>` and Qwen-XML's `<function=` inside `<tool_call>`,
    /// MiniCPM's `<function name=`, Mistral's `[TOOL_CALLS]`, Hermes' `<tool_call>`, Llama 3's
    /// `<|python_tag|>`, and bare JSON for the two JSON formats — and each candidate parses the
    /// text with `tools`. The one giving the most calls wins, then the one refusing the fewest
    /// blocks, then the one needing the fewest repairs; a tie goes to the more specific
    /// markup, in the order above. When no candidate yields a call the most specific one is
    /// returned, so its reasons for refusing the markup can be shown.
    pub fn detect_in_reply(text: &str, tools: &[ToolSpec]) -> Option<ToolFormat> {
        let has = |markup: &str| text.contains(markup);
        let tagged = has(tagged::OPEN);
        let json = text.contains('{');
        let candidates = [
            (
                ToolFormat::Gemma4,
                has(gemma4::CALL_OPEN) || has(gemma4::CHANNEL_OPEN),
            ),
            (ToolFormat::Glm, tagged && has("<arg_key>")),
            (ToolFormat::QwenXml, tagged && has(qwen_xml::FUNCTION_OPEN)),
            (ToolFormat::MiniCpm, has(minicpm::FUNCTION_OPEN)),
            (ToolFormat::Mistral, has(mistral::TOOL_CALLS)),
            (ToolFormat::HermesJson, tagged || json),
            (ToolFormat::Llama3Json, has(llama3_json::PYTHON_TAG) || json),
            // A GLM call without arguments is only a name inside the tags.
            (ToolFormat::Glm, tagged),
        ];
        let mut best: Option<(ToolFormat, (usize, usize, usize))> = None;
        for (format, present) in candidates {
            if !present {
                continue;
            }
            let outcome = parse_with_ids(format, text, tools, CallIdSource::counter());
            let repairs: usize = outcome.calls.iter().map(|c| c.repairs.len()).sum();
            // Larger is better: more calls, fewer refusals, fewer repairs.
            let score = (
                outcome.calls.len(),
                usize::MAX - outcome.failures.len(),
                usize::MAX - repairs,
            );
            if best.is_none_or(|(_, b)| score > b) {
                best = Some((format, score));
            }
        }
        best.map(|(format, _)| format)
    }

    /// The markers that open markup in this format's prose.
    pub(crate) fn markers(self) -> &'static [Marker] {
        const HERMES: &[Marker] = &[TAGGED, FENCE_JSON];
        const MINICPM: &[Marker] = &[
            TAGGED,
            Marker {
                text: minicpm::FUNCTION_OPEN,
                block: Block::XmlAttr,
                line_start: false,
            },
            FENCE_JSON,
        ];
        const GEMMA4: &[Marker] = &[
            Marker {
                text: gemma4::CALL_OPEN,
                block: Block::Gemma4Call,
                line_start: false,
            },
            Marker {
                text: gemma4::CHANNEL_OPEN,
                block: Block::Gemma4Channel,
                line_start: false,
            },
        ];
        const LLAMA3: &[Marker] = &[
            Marker {
                text: llama3_json::PYTHON_TAG,
                block: Block::Llama3,
                line_start: false,
            },
            FENCE_JSON,
        ];
        const MISTRAL: &[Marker] = &[Marker {
            text: mistral::TOOL_CALLS,
            block: Block::Mistral,
            line_start: false,
        }];
        match self {
            ToolFormat::HermesJson | ToolFormat::QwenXml | ToolFormat::Glm => HERMES,
            ToolFormat::MiniCpm => MINICPM,
            ToolFormat::Gemma4 => GEMMA4,
            ToolFormat::Llama3Json => LLAMA3,
            ToolFormat::Mistral => MISTRAL,
        }
    }

    /// Every literal this format's parser acts on: what opens, closes and delimits a call or a
    /// reasoning channel (not the bare-JSON last resort, which is ordinary text). Where one is
    /// a token of the vocabulary, client text must not be able to produce it
    /// ([`crate::markup`]).
    pub fn markup(self) -> &'static [&'static str] {
        match self {
            ToolFormat::HermesJson => &[tagged::OPEN, tagged::CLOSE],
            ToolFormat::QwenXml => &[
                tagged::OPEN,
                tagged::CLOSE,
                qwen_xml::FUNCTION_OPEN,
                qwen_xml::FUNCTION_CLOSE,
                qwen_xml::PARAMETER_OPEN,
                qwen_xml::PARAMETER_CLOSE,
            ],
            ToolFormat::Glm => &[
                tagged::OPEN,
                tagged::CLOSE,
                glm::KEY_OPEN,
                glm::KEY_CLOSE,
                glm::VALUE_OPEN,
                glm::VALUE_CLOSE,
            ],
            ToolFormat::MiniCpm => &[
                tagged::OPEN,
                tagged::CLOSE,
                minicpm::FUNCTION_OPEN,
                minicpm::FUNCTION_CLOSE,
                minicpm::PARAM_OPEN,
                minicpm::PARAM_CLOSE,
                minicpm::CDATA_OPEN,
                minicpm::CDATA_CLOSE,
            ],
            ToolFormat::Gemma4 => &[
                gemma4::CALL_OPEN,
                gemma4::CALL_CLOSE,
                gemma4::QUOTE,
                gemma4::CHANNEL_OPEN,
                gemma4::CHANNEL_CLOSE,
            ],
            ToolFormat::Llama3Json => &[llama3_json::PYTHON_TAG],
            ToolFormat::Mistral => &[mistral::TOOL_CALLS, mistral::CALL_ID, mistral::ARGS],
        }
    }

    /// Which bare JSON this format accepts at the start of a reply or right after a call.
    pub(crate) fn json_start(self) -> JsonStart {
        match self {
            ToolFormat::HermesJson
            | ToolFormat::QwenXml
            | ToolFormat::Glm
            | ToolFormat::MiniCpm => JsonStart::LastResort,
            ToolFormat::Llama3Json => JsonStart::Llama3,
            ToolFormat::Gemma4 | ToolFormat::Mistral => JsonStart::Off,
        }
    }
}

impl std::fmt::Display for ToolFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ToolFormat {
    type Err = ToolCallError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        ToolFormat::from_name(name)
    }
}

/// Parses a whole reply with random call ids. Never fails: see [`ParseOutcome`].
pub fn parse(format: ToolFormat, text: &str, tools: &[ToolSpec]) -> ParseOutcome {
    parse_with_ids(format, text, tools, CallIdSource::random())
}

/// Parses a whole reply, taking call ids from `ids`.
pub fn parse_with_ids(
    format: ToolFormat,
    text: &str,
    tools: &[ToolSpec],
    ids: CallIdSource,
) -> ParseOutcome {
    let mut stream = ToolCallStream::with_ids(format, tools, ids);
    stream.push(text);
    stream.into_outcome()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for &format in ToolFormat::all() {
            assert_eq!(ToolFormat::from_name(format.name()).unwrap(), format);
            assert_eq!(format.to_string().parse::<ToolFormat>().unwrap(), format);
        }
        assert_eq!(
            ToolFormat::from_name("Qwen3_Coder").unwrap(),
            ToolFormat::QwenXml
        );
        let err = ToolFormat::from_name("nope").unwrap_err();
        assert!(err.to_string().contains("hermes-json, qwen-xml"), "{err}");
    }

    /// Each format's documented call, pasted with no format named, is detected as that
    /// format and parses to the call.
    #[test]
    fn a_reply_names_its_format() {
        let tools = ToolSpec::list_from_openai(&[serde_json::json!({"type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}}}})])
        .unwrap();
        let replies = [
            (
                ToolFormat::HermesJson,
                "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            ),
            (
                ToolFormat::QwenXml,
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
            ),
            (
                ToolFormat::Glm,
                "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
            ),
            (
                ToolFormat::MiniCpm,
                "<function name=\"get_weather\"><param name=\"city\">Paris</param></function>",
            ),
            (
                ToolFormat::Gemma4,
                "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>",
            ),
            (
                ToolFormat::Llama3Json,
                "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
            ),
            (
                ToolFormat::Mistral,
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
            ),
            (
                ToolFormat::Mistral,
                "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}",
            ),
        ];
        for (want, reply) in replies {
            for tools in [&tools[..], &[]] {
                let got = ToolFormat::detect_in_reply(reply, tools);
                assert_eq!(got, Some(want), "{reply}");
                let outcome = parse(want, reply, tools);
                assert_eq!(outcome.calls.len(), 1, "{reply}");
                assert_eq!(outcome.calls[0].name, "get_weather");
                assert_eq!(outcome.calls[0].arguments_json, r#"{"city":"Paris"}"#);
            }
        }
    }

    /// The format that yields calls wins over more specific markup that does not parse
    /// (prose mentioning Mistral's token before a Hermes call). Prose has no format; markup
    /// nothing parses keeps its own format.
    #[test]
    fn detection_prefers_the_format_that_parses() {
        let reply = "Mistral models write [TOOL_CALLS] first.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        assert!(parse(ToolFormat::Mistral, reply, &[]).calls.is_empty());
        assert_eq!(
            ToolFormat::detect_in_reply(reply, &[]),
            Some(ToolFormat::HermesJson)
        );
        assert_eq!(ToolFormat::detect_in_reply("Just prose.", &[]), None);
        assert_eq!(
            ToolFormat::detect_in_reply("<|tool_call>call:<tool_call|>", &[]),
            Some(ToolFormat::Gemma4)
        );
    }

    #[test]
    fn detection_falls_back_on_the_architecture() {
        assert_eq!(
            ToolFormat::detect("", "qwen2"),
            Some(ToolFormat::HermesJson)
        );
        assert_eq!(ToolFormat::detect("", "gemma4"), Some(ToolFormat::Gemma4));
        assert_eq!(ToolFormat::detect("", "llama"), None);
        assert_eq!(
            ToolFormat::detect("{{ '<tool_call>' }}", "llama"),
            Some(ToolFormat::HermesJson)
        );
    }
}
