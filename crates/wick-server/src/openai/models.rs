//! `GET /v1/models` wire types: OpenAI's list shape with the fields Anthropic's SDK reads
//! (`type`, `display_name`, `created_at`, `has_more`, `first_id`, `last_id`) beside it, so
//! both SDKs' `models.list()` work.
use serde::Serialize;

/// `{"object": "list", "data": [...]}`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served model.
    pub data: Vec<ModelCard>,
    /// Anthropic: always false (one page).
    pub has_more: bool,
    /// Anthropic: the first id.
    pub first_id: Option<String>,
    /// Anthropic: the last id.
    pub last_id: Option<String>,
}

/// One model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// The id requests may name.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Anthropic's `model`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Anthropic: the id again.
    pub display_name: String,
    /// Unix seconds the server started.
    pub created: u64,
    /// Anthropic: the same instant in RFC 3339.
    pub created_at: String,
    /// `wick`.
    pub owned_by: &'static str,
    /// Context limit in tokens.
    pub context_window: usize,
    /// Architecture.
    pub arch: String,
    /// Whether the chat template writes `<think>` reasoning.
    pub reasoning: bool,
    /// Whether the chat template renders tools.
    pub tools: bool,
    /// Reads images (the model's vision tower loaded).
    pub vision: bool,
    /// Reads audio (the model's audio tower loaded).
    pub audio: bool,
    /// For a mounted LoRA adapter (vLLM's listing): the served model it adapts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// For a mounted LoRA adapter: where it was loaded from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
}

/// `unix` seconds as an RFC 3339 UTC timestamp (`2026-01-02T03:04:05Z`).
pub fn rfc3339(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Civil date from days since 1970-01-01 (proleptic Gregorian, 400-year eras).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_166_659), "2026-12-01T23:10:59Z");
    }
}
