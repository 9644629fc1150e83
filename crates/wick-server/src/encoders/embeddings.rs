//! `POST /v1/embeddings` in OpenAI's shape: the request checked into [`EmbeddingsRequest`],
//! the vectors turned into the response body ([`response_body`]), as JSON floats or as
//! base64 of little-endian f32 (`encoding_format: "base64"`, what the openai SDKs ask for
//! by default).
use base64::Engine as _;
use serde_json::{json, Value};

use crate::error::ApiError;

/// Most inputs one request may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// One input: text, or token ids given directly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EmbeddingInput {
    /// Text, tokenized with the model's tokenizer and template.
    Text(String),
    /// Token ids, embedded as they are.
    Ids(Vec<u32>),
}

/// How vectors are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncodingFormat {
    /// JSON numbers.
    #[default]
    Float,
    /// base64 of the little-endian f32 bytes.
    Base64,
}

/// A checked embeddings request.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingsRequest {
    /// The inputs, in order.
    pub inputs: Vec<EmbeddingInput>,
    /// How to write the vectors.
    pub encoding_format: EncodingFormat,
    /// Requested vector length (checked against the model later).
    pub dimensions: Option<usize>,
    /// An instruction for the query format `Instruct: {instruction}\nQuery:{text}`.
    pub instruction: Option<String>,
    /// A prompt of the model's sentence-transformers config, by name.
    pub prompt_name: Option<String>,
}

fn ids(param: &str, items: &[Value]) -> Result<Vec<u32>, ApiError> {
    if items.is_empty() {
        return Err(ApiError::field(param, "a token list must not be empty"));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    ApiError::field(
                        format!("{param}[{i}]"),
                        format!("token ids must be non-negative integers, got {v}"),
                    )
                })
        })
        .collect()
}

fn text(param: &str, s: &str) -> Result<EmbeddingInput, ApiError> {
    if s.is_empty() {
        return Err(ApiError::field(param, "input strings must not be empty"));
    }
    Ok(EmbeddingInput::Text(s.to_string()))
}

fn optional_string(body: &Value, key: &str) -> Result<Option<String>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ApiError::field(
            key,
            format!("must be a string, got {other}"),
        )),
    }
}

impl EmbeddingsRequest {
    /// Checks a request body: `input` is a string, a list of strings, a list of token ids
    /// or a list of token-id lists; `encoding_format` is `float` or `base64`; `dimensions`
    /// a positive integer. `model` and `user` are ignored (the served model answers).
    pub fn parse(body: &Value) -> Result<Self, ApiError> {
        let obj = body
            .as_object()
            .ok_or_else(|| ApiError::InvalidJson("the body must be a JSON object".into()))?;
        let input = obj.get("input").ok_or_else(|| ApiError::Missing {
            param: "input".into(),
        })?;
        let inputs = match input {
            Value::String(s) => vec![text("input", s)?],
            Value::Array(items) if items.is_empty() => {
                return Err(ApiError::Missing {
                    param: "input".into(),
                })
            }
            Value::Array(items) if items.iter().all(Value::is_number) => {
                vec![EmbeddingInput::Ids(ids("input", items)?)]
            }
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    let param = format!("input[{i}]");
                    match item {
                        Value::String(s) => text(&param, s),
                        Value::Array(list) => Ok(EmbeddingInput::Ids(ids(&param, list)?)),
                        other => Err(ApiError::field(
                            param,
                            format!("must be a string or a list of token ids, got {other}"),
                        )),
                    }
                })
                .collect::<Result<_, _>>()?,
            other => {
                return Err(ApiError::field(
                    "input",
                    format!("must be a string, a list of strings, a list of token ids or a list of token-id lists, got {other}"),
                ))
            }
        };
        if inputs.len() > MAX_INPUTS {
            return Err(ApiError::field(
                "input",
                format!(
                    "at most {MAX_INPUTS} inputs per request, got {}",
                    inputs.len()
                ),
            ));
        }
        let encoding_format = match obj.get("encoding_format") {
            None | Some(Value::Null) => EncodingFormat::Float,
            Some(Value::String(s)) if s == "float" => EncodingFormat::Float,
            Some(Value::String(s)) if s == "base64" => EncodingFormat::Base64,
            Some(other) => {
                return Err(ApiError::field(
                    "encoding_format",
                    format!("must be 'float' or 'base64', got {other}"),
                ))
            }
        };
        let dimensions = match obj.get("dimensions") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .filter(|&d| d > 0)
                    .and_then(|d| usize::try_from(d).ok())
                    .ok_or_else(|| {
                        ApiError::field(
                            "dimensions",
                            format!("must be a positive integer, got {v}"),
                        )
                    })?,
            ),
        };
        let instruction = optional_string(body, "instruction")?;
        let prompt_name = optional_string(body, "prompt_name")?;
        let has_ids = inputs.iter().any(|i| matches!(i, EmbeddingInput::Ids(_)));
        if has_ids && (instruction.is_some() || prompt_name.is_some()) {
            return Err(ApiError::field(
                if instruction.is_some() {
                    "instruction"
                } else {
                    "prompt_name"
                },
                "applies to text input only, not to token ids",
            ));
        }
        Ok(EmbeddingsRequest {
            inputs,
            encoding_format,
            dimensions,
            instruction,
            prompt_name,
        })
    }
}

/// base64 of the little-endian bytes of `v`.
pub fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// OpenAI's response body for `vectors` (in input order).
pub fn response_body(
    model: &str,
    vectors: &[Vec<f32>],
    format: EncodingFormat,
    prompt_tokens: usize,
) -> Value {
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = match format {
                EncodingFormat::Float => json!(v),
                EncodingFormat::Base64 => json!(base64_f32(v)),
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<EmbeddingsRequest, ApiError> {
        EmbeddingsRequest::parse(&v)
    }

    #[test]
    fn every_input_shape() {
        let r = parse(json!({"input": "hi"})).unwrap();
        assert_eq!(r.inputs, vec![EmbeddingInput::Text("hi".into())]);
        assert_eq!(r.encoding_format, EncodingFormat::Float);
        let r = parse(json!({"input": ["a", "b"], "encoding_format": "base64"})).unwrap();
        assert_eq!(r.inputs.len(), 2);
        assert_eq!(r.encoding_format, EncodingFormat::Base64);
        let r = parse(json!({"input": [1, 2, 3]})).unwrap();
        assert_eq!(r.inputs, vec![EmbeddingInput::Ids(vec![1, 2, 3])]);
        let r = parse(json!({"input": [[1, 2], [3]], "dimensions": 8})).unwrap();
        assert_eq!(
            r.inputs,
            vec![
                EmbeddingInput::Ids(vec![1, 2]),
                EmbeddingInput::Ids(vec![3])
            ]
        );
        assert_eq!(r.dimensions, Some(8));
    }

    #[test]
    fn bad_requests_name_the_field() {
        let param = |v: Value| parse(v).unwrap_err().param().map(str::to_string);
        assert_eq!(param(json!({})), Some("input".into()));
        assert_eq!(param(json!({"input": []})), Some("input".into()));
        assert_eq!(param(json!({"input": 3})), Some("input".into()));
        assert_eq!(param(json!({"input": ""})), Some("input".into()));
        assert_eq!(param(json!({"input": ["a", 3]})), Some("input[1]".into()));
        assert_eq!(
            param(json!({"input": [[1, -2]]})),
            Some("input[0][1]".into())
        );
        assert_eq!(param(json!({"input": [[]]})), Some("input[0]".into()));
        assert_eq!(param(json!({"input": [1.5]})), Some("input[0]".into()));
        assert_eq!(
            param(json!({"input": "a", "encoding_format": "int8"})),
            Some("encoding_format".into())
        );
        assert_eq!(
            param(json!({"input": "a", "dimensions": 0})),
            Some("dimensions".into())
        );
        assert_eq!(
            param(json!({"input": "a", "dimensions": "8"})),
            Some("dimensions".into())
        );
        assert_eq!(
            param(json!({"input": [1, 2], "instruction": "x"})),
            Some("instruction".into())
        );
        let many: Vec<String> = (0..=MAX_INPUTS).map(|i| i.to_string()).collect();
        assert_eq!(param(json!({ "input": many })), Some("input".into()));
        for e in [
            parse(json!({"input": 3})).unwrap_err(),
            parse(json!([1])).unwrap_err(),
        ] {
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn bodies_in_both_formats() {
        let v = vec![vec![1.0f32, -0.5], vec![0.25, 2.0]];
        let body = response_body("m", &v, EncodingFormat::Float, 7);
        assert_eq!(body["object"], "list");
        assert_eq!(body["data"][1]["index"], 1);
        assert_eq!(body["data"][0]["embedding"], json!([1.0, -0.5]));
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": 7, "total_tokens": 7})
        );
        let body = response_body("m", &v, EncodingFormat::Base64, 7);
        let b64 = body["data"][0]["embedding"].as_str().unwrap();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        let back: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(back, v[0]);
    }
}
