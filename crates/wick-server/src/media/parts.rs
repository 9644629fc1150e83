//! Media parts of chat messages. Every protocol brings its media as OpenAI chat parts
//! (Anthropic `image` blocks and Responses `input_image` parts are converted on the way in):
//!
//! - `{"type": "image_url", "image_url": {"url": "data:image/png;base64,…" | "https://…"}}`
//! - `{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}`
//!
//! [`extract`] swaps each for the item chat templates render (`{"type": "image"}`,
//! `{"type": "audio"}`) and returns where its bytes come from.
use base64::Engine as _;
use serde_json::{json, Value};

use crate::error::ApiError;

/// Audio formats an `input_audio` part may declare (the bytes decide the decoder).
pub const AUDIO_PART_FORMATS: [&str; 4] = ["wav", "mp3", "flac", "ogg"];

/// Which tower an item is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    /// An image (vision tower).
    Image,
    /// An audio clip (audio tower).
    Audio,
}

/// Where an item's bytes are (decoded or fetched later, on a blocking worker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MediaSource {
    /// A `data:<mime>;base64,<data>` URL.
    DataUrl(String),
    /// A base64 field (`input_audio.data`).
    Base64(String),
    /// An `http(s)` URL to fetch.
    Url(String),
}

/// One media item of a request, in message order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaRef {
    /// Image or audio.
    pub kind: MediaKind,
    /// Its bytes or URL.
    pub source: MediaSource,
    /// The part's path in the request (`messages[0].content[1]`), for errors.
    pub at: String,
}

/// Key of a part converted from another protocol (Anthropic, Responses) that holds the
/// part's path in the request the client sent, so errors name what the client wrote
/// rather than the converted chat messages.
const ORIGIN: &str = "_wick_origin";

/// The path errors about `part` name: where the client wrote it when the part was
/// converted from another protocol, else `at` (its place in the chat messages).
fn origin_path(at: &str, part: &Value) -> String {
    part.get(ORIGIN)
        .and_then(Value::as_str)
        .map_or_else(|| at.to_string(), str::to_string)
}

/// Whether `part` is a media part (OpenAI chat shape).
pub fn is_media_part(part: &Value) -> bool {
    matches!(
        part.get("type").and_then(Value::as_str),
        Some("image_url" | "input_audio")
    )
}

/// Replaces every media part of `messages` by its template item and returns the items in
/// order; a malformed part is a 400 naming it.
pub fn extract(messages: &mut [Value]) -> Result<Vec<MediaRef>, ApiError> {
    let mut items = Vec::new();
    for (i, message) in messages.iter_mut().enumerate() {
        let Some(Value::Array(parts)) = message.get_mut("content") else {
            continue;
        };
        for (j, part) in parts.iter_mut().enumerate() {
            if !is_media_part(part) {
                continue;
            }
            let at = origin_path(&format!("messages[{i}].content[{j}]"), part);
            let item = parse_part(&at, part)?;
            *part = match item.kind {
                MediaKind::Image => json!({"type": "image"}),
                MediaKind::Audio => json!({"type": "audio"}),
            };
            items.push(item);
        }
    }
    Ok(items)
}

/// Checks a media part's shape without decoding it (validation's pass).
pub fn check_part(at: &str, part: &Value) -> Result<(), ApiError> {
    parse_source(&origin_path(at, part), part).map(|_| ())
}

fn parse_part(at: &str, part: &Value) -> Result<MediaRef, ApiError> {
    let (kind, source) = parse_source(at, part)?;
    let source = match source {
        RawSource::Url(url) => MediaSource::Url(url.to_string()),
        RawSource::DataUrl(url) => {
            // The payload is decoded later; its header is checked now.
            data_url_payload(at, url)?;
            MediaSource::DataUrl(url.to_string())
        }
        RawSource::Base64(data) => MediaSource::Base64(data.to_string()),
    };
    Ok(MediaRef {
        kind,
        source,
        at: at.to_string(),
    })
}

enum RawSource<'a> {
    Url(&'a str),
    DataUrl(&'a str),
    Base64(&'a str),
}

fn parse_source<'a>(at: &str, part: &'a Value) -> Result<(MediaKind, RawSource<'a>), ApiError> {
    match part.get("type").and_then(Value::as_str) {
        Some("image_url") => {
            // `{"url": …}` as OpenAI documents it; a bare string as some clients send.
            let url = match part.get("image_url") {
                Some(Value::String(u)) => u.as_str(),
                Some(Value::Object(o)) => match o.get("url") {
                    Some(Value::String(u)) => u.as_str(),
                    _ => {
                        return Err(ApiError::field(
                            format!("{at}.image_url.url"),
                            "must be a string (a data: URL or an http(s) URL)",
                        ))
                    }
                },
                _ => {
                    return Err(ApiError::field(
                        format!("{at}.image_url"),
                        "must be an object with a 'url'",
                    ))
                }
            };
            Ok((
                MediaKind::Image,
                url_source(&format!("{at}.image_url.url"), url)?,
            ))
        }
        Some("input_audio") => {
            let Some(audio) = part.get("input_audio").and_then(Value::as_object) else {
                return Err(ApiError::field(
                    format!("{at}.input_audio"),
                    "must be an object with 'data' and 'format'",
                ));
            };
            match audio.get("format") {
                Some(Value::String(f)) if AUDIO_PART_FORMATS.contains(&f.as_str()) => {}
                Some(Value::Null) | None => {}
                Some(other) => {
                    return Err(ApiError::field(
                        format!("{at}.input_audio.format"),
                        format!(
                            "must be one of {}; got {other}",
                            AUDIO_PART_FORMATS.join(", ")
                        ),
                    ))
                }
            }
            match audio.get("data") {
                Some(Value::String(d)) => Ok((MediaKind::Audio, RawSource::Base64(d.as_str()))),
                _ => Err(ApiError::field(
                    format!("{at}.input_audio.data"),
                    "must be a base64 string",
                )),
            }
        }
        _ => Err(ApiError::field(format!("{at}.type"), "not a media part")),
    }
}

fn url_source<'a>(at: &str, url: &'a str) -> Result<RawSource<'a>, ApiError> {
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("data") => Ok(RawSource::DataUrl(url)),
        Some("http" | "https") => Ok(RawSource::Url(url)),
        _ => Err(ApiError::field(
            at,
            "must be a data: URL or an http(s) URL".to_string(),
        )),
    }
}

/// The bytes of a `data:[<mime>][;base64],<data>` URL; only base64 payloads are accepted.
pub fn decode_data_url(at: &str, url: &str) -> Result<Vec<u8>, ApiError> {
    decode_base64(at, data_url_payload(at, url)?)
}

/// The base64 payload of a data URL, after checking its header.
fn data_url_payload<'a>(at: &str, url: &'a str) -> Result<&'a str, ApiError> {
    let rest = url.get("data:".len()..).unwrap_or_default();
    let Some((meta, data)) = rest.split_once(',') else {
        return Err(ApiError::field(
            at,
            "a data: URL needs a ',' before its payload",
        ));
    };
    if !meta.to_ascii_lowercase().ends_with(";base64") {
        return Err(ApiError::field(
            at,
            "a data: URL must be base64 (data:<mime>;base64,<data>)",
        ));
    }
    Ok(data)
}

/// Standard base64 (padding optional, whitespace ignored).
pub fn decode_base64(at: &str, data: &str) -> Result<Vec<u8>, ApiError> {
    let compact: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    engine
        .decode(compact.as_bytes())
        .map_err(|e| ApiError::field(at, format!("is not valid base64: {e}")))
}

/// Builds a message's content from text and media parts in order: a plain string when
/// there is no media (text pieces joined by `separator`, as before media existed), else
/// a list of parts with adjacent text merged.
#[derive(Debug, Default)]
pub struct ContentBuilder {
    separator: &'static str,
    text: String,
    parts: Vec<Value>,
    has_media: bool,
}

impl ContentBuilder {
    /// An empty content; text pieces are joined by `separator`.
    pub fn new(separator: &'static str) -> Self {
        ContentBuilder {
            separator,
            ..ContentBuilder::default()
        }
    }

    /// Appends text.
    pub fn push_text(&mut self, text: &str) {
        if !self.text.is_empty() {
            self.text.push_str(self.separator);
        }
        self.text.push_str(text);
    }

    /// Appends a media part (OpenAI chat shape).
    pub fn push_media(&mut self, part: Value) {
        self.flush_text();
        self.parts.push(part);
        self.has_media = true;
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.parts.is_empty()
    }

    fn flush_text(&mut self) {
        if !self.text.is_empty() {
            let text = std::mem::take(&mut self.text);
            self.parts.push(json!({"type": "text", "text": text}));
        }
    }

    /// The content, leaving the builder empty.
    pub fn take(&mut self) -> Value {
        if !self.has_media {
            return Value::String(std::mem::take(&mut self.text));
        }
        self.flush_text();
        self.has_media = false;
        Value::Array(std::mem::take(&mut self.parts))
    }
}

/// An Anthropic `image` block as an OpenAI `image_url` part: `source` is
/// `{"type": "base64", "media_type", "data"}` or `{"type": "url", "url"}`.
pub fn from_anthropic_image(at: &str, block: &Value) -> Result<Value, ApiError> {
    let source = block
        .get("source")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            ApiError::field(format!("{at}.source"), "must be an object with a 'type'")
        })?;
    let url = match source.get("type").and_then(Value::as_str) {
        Some("base64") => {
            let Some(data) = source.get("data").and_then(Value::as_str) else {
                return Err(ApiError::field(
                    format!("{at}.source.data"),
                    "must be a base64 string",
                ));
            };
            let media_type = anthropic_media_type(at, source.get("media_type"), data)?;
            format!("data:{media_type};base64,{data}")
        }
        Some("url") => match source.get("url").and_then(Value::as_str) {
            Some(u) => u.to_string(),
            None => {
                return Err(ApiError::field(
                    format!("{at}.source.url"),
                    "must be a string",
                ))
            }
        },
        other => {
            return Err(ApiError::field(
                format!("{at}.source.type"),
                format!("must be 'base64' or 'url', got {other:?}"),
            ))
        }
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}, ORIGIN: at}))
}

/// The image types Anthropic's `image` blocks take, and the format each names.
const ANTHROPIC_IMAGE_TYPES: [(&str, wick_media::ImageFormat); 4] = [
    ("image/jpeg", wick_media::ImageFormat::Jpeg),
    ("image/png", wick_media::ImageFormat::Png),
    ("image/gif", wick_media::ImageFormat::Gif),
    ("image/webp", wick_media::ImageFormat::WebP),
];

/// An Anthropic base64 image's `media_type`, checked as Anthropic does: one of the four
/// image types, and the type of the data (read from the signature in the payload's first
/// bytes; data with no known signature is left to the decoder's error).
fn anthropic_media_type<'a>(
    at: &str,
    media_type: Option<&'a Value>,
    data: &str,
) -> Result<&'a str, ApiError> {
    let field = format!("{at}.source.media_type");
    let allowed = || {
        ANTHROPIC_IMAGE_TYPES
            .iter()
            .map(|(t, _)| *t)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(media_type) = media_type.and_then(Value::as_str) else {
        return Err(ApiError::field(
            field,
            format!("is required: one of {}", allowed()),
        ));
    };
    let Some(&(_, declared)) = ANTHROPIC_IMAGE_TYPES
        .iter()
        .find(|(t, _)| t.eq_ignore_ascii_case(media_type))
    else {
        return Err(ApiError::field(
            field,
            format!("'{media_type}' is not supported: one of {}", allowed()),
        ));
    };
    // 16 base64 characters are 12 bytes: enough for every signature (WebP's is 12).
    let head: String = data
        .chars()
        .filter(|c| !c.is_ascii_whitespace())
        .take(16)
        .collect();
    let head = head.get(..head.len() / 4 * 4).unwrap_or_default();
    if let Ok(bytes) = decode_base64(at, head) {
        if let Ok(found) = wick_media::sniff_image(&bytes) {
            if found != declared {
                return Err(ApiError::field(
                    field,
                    format!(
                        "says {media_type} but the data is {}",
                        found
                            .extensions_str()
                            .first()
                            .map_or("another format", |e| *e)
                            .to_uppercase()
                    ),
                ));
            }
        }
    }
    Ok(media_type)
}

/// The media type a `data:` URL declares (`data:<type>[;params];base64,…`), lower-cased;
/// empty when it declares none.
pub fn data_url_type(url: &str) -> String {
    let rest = url.get("data:".len()..).unwrap_or_default();
    let meta = rest.split_once(',').map_or(rest, |(m, _)| m);
    meta.split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// A Responses `input_image` part (`image_url` a string, or `{"url"}`) as an OpenAI chat
/// `image_url` part; `input_audio` parts already have the chat shape.
pub fn from_responses_part(at: &str, part: &Value) -> Result<Value, ApiError> {
    match part.get("type").and_then(Value::as_str) {
        Some("input_image") => {
            let url = match part.get("image_url") {
                Some(Value::String(u)) => u.clone(),
                Some(Value::Object(o)) => o
                    .get("url")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .unwrap_or_default(),
                _ => {
                    return Err(ApiError::field(
                        format!("{at}.image_url"),
                        "must be a data: URL or an http(s) URL (file_id is not supported)",
                    ))
                }
            };
            Ok(json!({"type": "image_url", "image_url": {"url": url}, ORIGIN: at}))
        }
        Some("input_audio") => Ok(json!({
            "type": "input_audio",
            "input_audio": part.get("input_audio").cloned().unwrap_or(Value::Null),
            ORIGIN: at,
        })),
        other => Err(ApiError::field(
            format!("{at}.type"),
            format!("unknown media part {other:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extract_swaps_parts_for_template_items() {
        let mut messages = vec![json!({"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAEC"}},
            {"type": "input_audio", "input_audio": {"data": "AwQ=", "format": "wav"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}},
        ]})];
        let items = extract(&mut messages).unwrap();
        assert_eq!(items.len(), 3);
        let bytes = |i: usize| match &items[i].source {
            MediaSource::DataUrl(url) => decode_data_url("x", url).unwrap(),
            MediaSource::Base64(data) => decode_base64("x", data).unwrap(),
            MediaSource::Url(_) => panic!("inline expected"),
        };
        assert_eq!(bytes(0), vec![0, 1, 2]);
        assert_eq!(items[1].kind, MediaKind::Audio);
        assert_eq!(bytes(1), vec![3, 4]);
        assert_eq!(
            items[2].source,
            MediaSource::Url("https://example.com/a.jpg".into())
        );
        assert_eq!(items[2].at, "messages[0].content[3]");
        assert_eq!(messages[0]["content"][1], json!({"type": "image"}));
        assert_eq!(messages[0]["content"][2], json!({"type": "audio"}));
    }

    #[test]
    fn bad_sources_are_400s_naming_the_part() {
        let cases = [
            (
                json!({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}),
                "data: URL or an http(s)",
            ),
            (
                json!({"type": "image_url", "image_url": {"url": "data:image/png,rawtext"}}),
                "must be base64",
            ),
            (
                json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}),
                "not valid base64",
            ),
            (
                json!({"type": "image_url", "image_url": 5}),
                "must be an object",
            ),
            (
                json!({"type": "input_audio", "input_audio": {"data": "AA==", "format": "aiff"}}),
                "must be one of",
            ),
            (
                json!({"type": "input_audio", "input_audio": {"format": "wav"}}),
                "base64 string",
            ),
        ];
        for (part, want) in cases {
            let mut messages = vec![json!({"role": "user", "content": [part]})];
            let err = extract(&mut messages)
                .and_then(|items| match &items[0].source {
                    MediaSource::DataUrl(url) => decode_data_url(&items[0].at, url).map(|_| ()),
                    MediaSource::Base64(data) => decode_base64(&items[0].at, data).map(|_| ()),
                    MediaSource::Url(_) => Ok(()),
                })
                .unwrap_err();
            assert!(err.to_string().contains(want), "{err}");
            assert!(err.to_string().contains("messages[0].content[0]"), "{err}");
        }
    }

    #[test]
    fn anthropic_and_responses_parts_become_chat_parts() {
        let block = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAEC"}});
        assert_eq!(
            from_anthropic_image("m", &block).unwrap(),
            json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAEC"}, ORIGIN: "m"})
        );
        let block = json!({"type": "image", "source": {"type": "url", "url": "https://x/y.png"}});
        assert_eq!(
            from_anthropic_image("m", &block).unwrap()["image_url"]["url"],
            "https://x/y.png"
        );
        let part = json!({"type": "input_image", "image_url": "data:image/png;base64,AA=="});
        assert_eq!(
            from_responses_part("i", &part).unwrap()["type"],
            "image_url"
        );
    }

    /// A converted part's errors name where the client wrote it, not the chat messages it
    /// became (which gain a system message, merge turns, renumber parts).
    #[test]
    fn converted_parts_errors_name_the_original_path() {
        let block =
            json!({"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}});
        let part = from_anthropic_image("messages[2].content[1]", &block).unwrap();
        let mut messages = vec![json!({"role": "user", "content": [part]})];
        let err = extract(&mut messages).unwrap_err().to_string();
        assert!(err.contains("messages[2].content[1]"), "{err}");
        assert!(!err.contains("messages[0].content[0]"), "{err}");

        let audio =
            json!({"type": "input_audio", "input_audio": {"format": "aiff", "data": "AA=="}});
        let part = from_responses_part("input[3].content[0]", &audio).unwrap();
        let err = check_part("messages[0].content[0]", &part)
            .unwrap_err()
            .to_string();
        assert!(err.contains("input[3].content[0]"), "{err}");
    }

    #[test]
    fn content_builder_keeps_text_only_content_a_string() {
        let mut b = ContentBuilder::new("\n");
        b.push_text("a");
        b.push_text("b");
        assert_eq!(b.take(), json!("a\nb"));
        b.push_text("look");
        b.push_media(json!({"type": "image_url"}));
        b.push_text("end");
        assert_eq!(
            b.take(),
            json!([{"type": "text", "text": "look"}, {"type": "image_url"}, {"type": "text", "text": "end"}])
        );
    }
}
