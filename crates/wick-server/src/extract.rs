//! [`ApiJson`]: the JSON body extractor whose failures answer in OpenAI's error shape, naming
//! the field at fault (`messages[0].content: invalid type …`).
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
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
}

/// A request body parsed as `T`; a bad body is an [`ApiError`], never axum's plain-text
/// rejection.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T: RequestBody> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge {
                    limit: state.config().max_body_bytes,
                }
            } else {
                ApiError::InvalidJson(rejection.body_text())
            }
        })?;
        parse_body(&bytes).map(ApiJson)
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
