//! [`ApiJson`]: the JSON body extractor whose failures answer in OpenAI's error shape, naming
//! the field at fault (`messages[0].content: invalid type …`). The body must arrive at a
//! minimum rate once a grace period has passed (408 otherwise), and a field no part of the
//! request type reads is logged once per name.
use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use axum::extract::{FromRequest, Request};
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;
use crate::state::AppState;

/// A request body type: built from the parsed JSON object, usually with [`typed`] once per
/// part (several parts read the same object, which keeps field paths exact where serde's
/// `flatten` would lose them).
pub trait RequestBody: Sized {
    /// Reads the body from `value`, a JSON object.
    fn from_json(value: &Value) -> Result<Self, ApiError>;

    /// Every top-level field some part of the type reads (see [`struct_fields`]); other
    /// fields are ignored with a warning. Empty: no warnings.
    fn known_fields() -> Vec<&'static str> {
        Vec::new()
    }
}

/// The field names a `#[derive(Deserialize)]` struct reads, as serde's derive lists them
/// (`skip`ped fields are not among them).
pub fn struct_fields<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut fields = None;
    let _ = T::deserialize(FieldNames(&mut fields));
    fields.unwrap_or(&[])
}

/// A deserializer that only records the field list a struct asks for.
struct FieldNames<'a>(&'a mut Option<&'static [&'static str]>);

impl<'de> serde::Deserializer<'de> for FieldNames<'_> {
    type Error = serde::de::value::Error;

    fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(serde::de::Error::custom("not a struct"))
    }

    fn deserialize_struct<V: serde::de::Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = Some(fields);
        Err(serde::de::Error::custom("field names recorded"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// Distinct unknown field names warned about at most (a client inventing names cannot grow
/// the set without bound).
const MAX_WARNED_FIELDS: usize = 256;

/// Logs the fields of `value` (a JSON object) that are not among the `known` ones, each
/// name the first time it is seen; returns the names logged by this call.
pub fn warn_unknown_fields(value: &Value, known: &[&str]) -> Vec<String> {
    let Some(object) = value.as_object() else {
        return Vec::new();
    };
    if known.is_empty() {
        return Vec::new();
    }
    let unknown: Vec<String> = object
        .keys()
        .filter(|k| !known.contains(&k.as_str()))
        .cloned()
        .collect();
    if unknown.is_empty() {
        return unknown;
    }
    static WARNED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let mut warned = WARNED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let mut logged = Vec::new();
    for name in unknown {
        if warned.len() < MAX_WARNED_FIELDS && warned.insert(name.clone()) {
            let shown: String = name.chars().take(64).collect();
            tracing::warn!(field = %shown, "request field not supported by wick: ignored (logged once per name)");
            logged.push(name);
        }
    }
    logged
}

/// A request body parsed as `T`; a bad body is an [`ApiError`], never axum's plain-text
/// rejection.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T: RequestBody> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let config = state.config();
        let rate = BodyRate {
            limit: config.max_body_bytes,
            grace: config.body_timeout,
            min_rate: config.min_body_rate,
        };
        let bytes = read_body(req.into_body(), rate).await?;
        parse_body(&bytes).map(ApiJson)
    }
}

/// How a request body must arrive.
#[derive(Debug, Clone, Copy)]
pub struct BodyRate {
    /// Bytes at most (413 beyond).
    pub limit: usize,
    /// Time before the minimum rate applies.
    pub grace: std::time::Duration,
    /// Bytes per second the body must average after `grace` (0: no minimum).
    pub min_rate: u64,
}

/// Reads a whole body: more than `rate.limit` bytes is [`ApiError::PayloadTooLarge`], a
/// body that has not arrived by `grace + received / min_rate` after the start is
/// [`ApiError::BodyTimeout`] (a client trickling bytes cannot hold a request open).
pub async fn read_body(mut body: axum::body::Body, rate: BodyRate) -> Result<Vec<u8>, ApiError> {
    let started = Instant::now();
    let mut bytes: Vec<u8> = Vec::new();
    loop {
        let allowed = if rate.min_rate == 0 {
            None
        } else {
            let earned = bytes.len() as f64 / rate.min_rate as f64;
            Some(rate.grace + std::time::Duration::from_secs_f64(earned))
        };
        let frame = match allowed {
            Some(allowed) => {
                let deadline = tokio::time::Instant::from_std(started + allowed);
                match tokio::time::timeout_at(deadline, body.frame()).await {
                    Ok(frame) => frame,
                    Err(_) => {
                        return Err(ApiError::BodyTimeout {
                            received: bytes.len(),
                            seconds: started.elapsed().as_secs_f64(),
                            min_rate: rate.min_rate,
                            grace_s: rate.grace.as_secs_f64(),
                        })
                    }
                }
            }
            None => body.frame().await,
        };
        let Some(frame) = frame else {
            return Ok(bytes);
        };
        let frame = frame.map_err(|e| ApiError::InvalidJson(format!("reading the body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if bytes.len() + data.len() > rate.limit {
                return Err(ApiError::PayloadTooLarge { limit: rate.limit });
            }
            bytes.extend_from_slice(&data);
        }
    }
}

/// Parses a body: it must be one JSON object (syntax errors are [`ApiError::InvalidJson`]),
/// then `T` reads it.
pub fn parse_body<T: RequestBody>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            ApiError::InvalidJson("the body is empty".into())
        } else {
            ApiError::InvalidJson(e.to_string())
        }
    })?;
    if !value.is_object() {
        return Err(ApiError::InvalidJson(
            "the body must be a JSON object".into(),
        ));
    }
    warn_unknown_fields(&value, &T::known_fields());
    T::from_json(&value)
}

/// Reads `T` from a JSON object; a wrong type is [`ApiError::InvalidField`] naming the
/// field's path (`messages[0].content`).
pub fn typed<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        if path == "." || path.is_empty() {
            ApiError::InvalidJson(message)
        } else {
            ApiError::field(path, message)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Body {
        #[allow(dead_code)]
        temperature: Option<f32>,
        #[allow(dead_code)]
        items: Option<Vec<u32>>,
    }

    impl RequestBody for Body {
        fn from_json(value: &Value) -> Result<Self, ApiError> {
            typed(value)
        }
    }

    #[test]
    fn struct_fields_lists_what_serde_reads() {
        assert_eq!(struct_fields::<Body>(), &["temperature", "items"]);
        assert!(struct_fields::<u32>().is_empty());
    }

    #[test]
    fn unknown_fields_are_logged_once_per_name() {
        let body = serde_json::json!({"temperature": 1, "lora_test_a": "x", "items": []});
        let known = struct_fields::<Body>();
        assert_eq!(warn_unknown_fields(&body, known), vec!["lora_test_a"]);
        assert!(warn_unknown_fields(&body, known).is_empty(), "logged twice");
        let both = serde_json::json!({"lora_test_a": 1, "lora_test_b": 2});
        assert_eq!(warn_unknown_fields(&both, known), vec!["lora_test_b"]);
        assert!(warn_unknown_fields(&serde_json::json!({"temperature": 1}), known).is_empty());
    }

    fn rate(limit: usize, grace_ms: u64, min_rate: u64) -> BodyRate {
        BodyRate {
            limit,
            grace: std::time::Duration::from_millis(grace_ms),
            min_rate,
        }
    }

    /// A body that sends `chunks` with `gap` between them.
    fn trickle(chunks: usize, gap: std::time::Duration) -> axum::body::Body {
        let stream = futures_util::stream::unfold(0, move |i| async move {
            if i == chunks {
                return None;
            }
            tokio::time::sleep(gap).await;
            Some((
                Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"x")),
                i + 1,
            ))
        });
        axum::body::Body::from_stream(stream)
    }

    #[tokio::test]
    async fn a_trickled_body_times_out() {
        let gap = std::time::Duration::from_millis(40);
        let e = read_body(trickle(1000, gap), rate(1 << 20, 100, 1000))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "body_timeout", "{e}");
        assert_eq!(e.status(), axum::http::StatusCode::REQUEST_TIMEOUT);
        // The same body at a rate the server asks for arrives whole.
        let ok = read_body(trickle(5, gap), rate(1 << 20, 1000, 1))
            .await
            .unwrap();
        assert_eq!(ok, b"xxxxx");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_413() {
        let e = read_body(axum::body::Body::from(vec![b'a'; 11]), rate(10, 1000, 1))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "payload_too_large");
    }

    #[test]
    fn syntax_errors_are_invalid_json() {
        for body in ["{", "not json", "", "  ", "{} {}"] {
            let e = parse_body::<Body>(body.as_bytes()).unwrap_err();
            assert_eq!(e.code(), "invalid_json", "{body:?}: {e}");
        }
    }

    #[test]
    fn type_errors_name_the_field() {
        let e = parse_body::<Body>(br#"{"temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.param(), Some("temperature"));
        let e = parse_body::<Body>(br#"{"items": [1, -2]}"#).unwrap_err();
        assert_eq!(e.param(), Some("items[1]"));
        let e = parse_body::<Body>(b"[1, 2]").unwrap_err();
        assert_eq!(e.code(), "invalid_json");
    }
}
