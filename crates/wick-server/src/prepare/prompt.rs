//! Building prompts off the async runtime: chat template rendering, tokenization and
//! detokenization run on `spawn_blocking` workers, so a huge prompt never stalls other
//! requests.
//!
//! A prompt far longer than the context is refused while it is tokenized: text of more
//! than [`WHOLE_BYTES_PER_TOKEN`] bytes per context token is first counted piece by piece
//! ([`check_length`]), and counting stops once it passes twice the context, so such a
//! request costs time and memory in proportion to the context, not to its body.
use serde_json::{Map, Value};
use wick_chat::chat_template::{
    normalize_messages, starts_in_thinking, starts_in_thinking_marked, ChatInput, ChatTemplate,
};
use wick_chat::markup::client_text_guard;
use wick_chat::tokenizer::{pick_marker, TokenizerError};

use wick_engine::generation::CachePoint;
use wick_engine::media::MediaSpan;

use crate::openai::chat::CacheBreakpoint;

use crate::error::ApiError;
use crate::media::splice::{self, MediaTokens};
use crate::media::LoadedMedia;
use crate::state::AppState;

/// A rendered and tokenized chat prompt.
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Whether the prompt ends inside an open `<think>` block.
    pub starts_in_thinking: bool,
    /// The media items, placed on their soft tokens.
    pub media: Vec<MediaSpan>,
    /// Where the prompt cache keeps the KV: the end of the last complete message (where
    /// the next turn of the conversation parts from this prompt) and each breakpoint.
    pub cache_points: Vec<CachePoint>,
}

/// Runs `work` on a blocking worker; a panic inside is an internal error, not a crash.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::Internal(format!("prompt worker failed: {e}")))?
}

/// Renders `messages` (with `tools` and template `kwargs`) through the chat template in force
/// and tokenizes the result. Everything the client sent is user text: the text of a control
/// token, a tool-call or reasoning marker or a token the template writes is tokenized as plain
/// text in it ([`wick_chat::markup`]); only the template's own markup becomes those tokens.
/// `media` are the messages' media items in order: each marker the template writes for one
/// is expanded into the item's tokens ([`splice`]) before tokenizing.
pub async fn chat_prompt(
    state: &AppState,
    mut messages: Vec<Value>,
    mut tools: Vec<Value>,
    mut kwargs: Map<String, Value>,
    media: Vec<LoadedMedia>,
    breakpoints: Vec<CacheBreakpoint>,
) -> Result<ChatPrompt, ApiError> {
    let state = state.clone();
    blocking(move || {
        let model = state.model();
        let tokenizer = model.tokenizer();
        let override_template = state.template_override();
        let template_source = match &override_template {
            Some(t) => Some(t.source()),
            None => model.chat_template().map(ChatTemplate::source),
        };
        let marker = pick_marker(
            messages.iter().chain(&tools).chain(kwargs.values()),
            template_source,
        )
        .ok_or_else(|| {
            ApiError::field(
                "messages",
                "the messages use every Unicode noncharacter; wick needs one free to mark them",
            )
        })?;
        let guard = client_text_guard(tokenizer, template_source);
        let mut marked = false;
        for value in messages.iter_mut().chain(tools.iter_mut()) {
            marked |= guard.mark_json(value, marker);
        }
        for value in kwargs.values_mut() {
            marked |= guard.mark_json(value, marker);
        }
        let tools = (!tools.is_empty()).then_some(tools);
        let template = match &override_template {
            Some(t) => Some(t.as_ref()),
            None => model.chat_template(),
        };
        let render = |messages: &[Value], generation_prompt: bool| match template {
            Some(t) => t
                .render(&ChatInput {
                    messages: normalize_messages(messages.to_vec()),
                    tools: tools.clone(),
                    add_generation_prompt: generation_prompt,
                    kwargs: kwargs.clone(),
                })
                .map_err(|e| ApiError::PromptBuild(e.to_string())),
            None => Err(ApiError::from(wick_engine::EngineError::NoChatTemplate(
                model.info().name.clone(),
            ))),
        };
        let text = render(&messages, true)?;
        let media_tokens = if media.is_empty() {
            None
        } else {
            let tokens = MediaTokens::new(&model.info().media, |id| {
                tokenizer.decode(&[id], false).ok()
            })?;
            Some(tokens)
        };
        let text = match &media_tokens {
            Some(tokens) => splice::expand(&text, marked.then_some(marker), &media, tokens)?,
            None => text,
        };
        let context = model.info().context_length;
        let (thinking, ids) = if marked {
            check_length(&text, context, "messages", |piece| {
                let (_, ids) = guard.encode_marked(piece, marker, false)?;
                Ok(ids.len())
            })?;
            let thinking = starts_in_thinking_marked(&text, marker);
            let (_, ids) = guard
                .encode_marked(&text, marker, true)
                .map_err(|e| ApiError::PromptBuild(e.to_string()))?;
            (thinking, drop_doubled_bos(ids, tokenizer.bos_id()))
        } else {
            check_length(&text, context, "messages", |piece| {
                Ok(tokenizer.encode(piece, false)?.len())
            })?;
            (starts_in_thinking(&text), model.tokenize(&text)?)
        };
        // Where the next turn parts from this prompt: the end of the last complete message
        // (and of each breakpoint's prefix), found by rendering those messages without the
        // generation prompt. Prompts with media are left out: their markers expand per item.
        let mut cache_points = Vec::new();
        if media.is_empty() {
            let mut wanted: Vec<(usize, Option<std::time::Duration>)> = breakpoints
                .iter()
                .map(|b| (b.messages, Some(b.ttl)))
                .collect();
            // Unpinned points only matter where a longer entry cannot serve a prefix: the
            // engine drops them elsewhere, so they are not rendered and tokenized for nothing.
            if !model.caches_can_be_cut_back() {
                wanted.push((messages.len(), None));
                // The next turn itself, as an agent sends it: this prompt's reply as a
                // history turn and a new message. Templates render a past reply differently
                // from the generation prompt (Qwen drops the empty think block), so this is
                // where the next turn truly parts; probing finds it for any template.
                wanted.push((PROBE_NEXT_TURN, None));
            }
            for (n, pin) in wanted {
                let part = if n == PROBE_NEXT_TURN {
                    let mut next = messages.clone();
                    next.push(serde_json::json!({"role": "assistant", "content": PROBE_TEXT}));
                    next.push(serde_json::json!({"role": "user", "content": PROBE_TEXT}));
                    render(&next, false)
                } else {
                    render(&messages[..n.min(messages.len())], false)
                };
                let Ok(part) = part else {
                    continue;
                };
                let part_ids = if marked {
                    guard
                        .encode_marked(&part, marker, true)
                        .ok()
                        .map(|(_, ids)| drop_doubled_bos(ids, tokenizer.bos_id()))
                } else {
                    model.tokenize(&part).ok()
                };
                let Some(part_ids) = part_ids else { continue };
                let at = common_prefix(&part_ids, &ids);
                if at > 0 && at <= ids.len() {
                    cache_points.push(CachePoint { at, pin });
                }
            }
        }
        let media = match &media_tokens {
            Some(tokens) => splice::spans(&ids, media, tokens)?,
            None => Vec::new(),
        };
        Ok(ChatPrompt {
            starts_in_thinking: thinking,
            ids,
            media,
            cache_points,
        })
    })
    .await
}

/// Marks the probe of the conversation's next turn among the wanted cache points.
const PROBE_NEXT_TURN: usize = usize::MAX;
/// The text of the probe's reply and message; only where it starts matters.
const PROBE_TEXT: &str = "\u{2063}probe";

/// Tokens `a` and `b` share at their start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A BOS the template wrote after the one the tokenizer added is not doubled (as
/// `Model::tokenize` does).
fn drop_doubled_bos(mut ids: Vec<u32>, bos: Option<u32>) -> Vec<u32> {
    if let (Some(bos), true) = (bos, ids.len() >= 2) {
        if ids[0] == bos && ids[1] == bos {
            ids.remove(0);
        }
    }
    ids
}

/// Tokenizes raw prompt text (special-token text parsed, BOS as the model wants it); text
/// far longer than the context is refused on the way ([`check_length`]).
pub async fn tokenize(state: &AppState, text: String) -> Result<Vec<u32>, ApiError> {
    let state = state.clone();
    blocking(move || {
        let model = state.model();
        let tokenizer = model.tokenizer();
        check_length(&text, model.info().context_length, "prompt", |piece| {
            Ok(tokenizer.encode(piece, false)?.len())
        })?;
        Ok(model.tokenize(&text)?)
    })
    .await
}

/// Text of at most this many bytes per context token is tokenized whole at once; longer
/// text is counted piece by piece first. Prompts average 3 to 5 bytes a token (English
/// prose, code; fewer for CJK), so a prompt that fits its context is almost never counted
/// twice.
pub const WHOLE_BYTES_PER_TOKEN: usize = 8;

/// Bytes of text counted at a time; a piece ends at a line end where the text has one.
const PIECE_BYTES: usize = 64 << 10;

/// A prompt is refused once its pieces count more than this many times the context. Cutting
/// text at line ends changes its token count by a token or two per cut, so a prompt counted
/// at twice the context is past it.
const REFUSE_AT_CONTEXTS: usize = 2;

/// Refuses `text` as longer than a context of `context` tokens (`param` names the prompt
/// field) when it is more than [`WHOLE_BYTES_PER_TOKEN`] bytes per context token and its
/// pieces of [`PIECE_BYTES`], counted by `count`, pass [`REFUSE_AT_CONTEXTS`] contexts:
/// counting stops there, so the rest of the text is never tokenized.
pub fn check_length(
    text: &str,
    context: usize,
    param: &'static str,
    count: impl Fn(&str) -> Result<usize, TokenizerError>,
) -> Result<(), ApiError> {
    if text.len() <= context.saturating_mul(WHOLE_BYTES_PER_TOKEN) {
        return Ok(());
    }
    let refuse_past = context.saturating_mul(REFUSE_AT_CONTEXTS);
    let mut counted = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let (piece, tail) = rest.split_at(piece_end(rest, PIECE_BYTES));
        counted += count(piece).map_err(|e| ApiError::PromptBuild(e.to_string()))?;
        if counted > refuse_past {
            return Err(ApiError::PromptTooLong {
                param,
                counted,
                limit: context,
            });
        }
        rest = tail;
    }
    Ok(())
}

/// Where the first piece of `text` ends: after its last line end within `max` bytes, else
/// after its last space or tab, else at the last character boundary.
fn piece_end(text: &str, max: usize) -> usize {
    if text.len() <= max {
        return text.len();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let window = &text[..end];
    window
        .rfind('\n')
        .or_else(|| window.rfind([' ', '\t']))
        .map(|at| at + 1)
        .unwrap_or(end)
}

/// Decodes token ids to text (special tokens kept), for echoing a token-array prompt.
pub async fn detokenize(state: &AppState, ids: Vec<u32>) -> Result<String, ApiError> {
    let state = state.clone();
    blocking(move || {
        state
            .model()
            .tokenizer()
            .decode(&ids, false)
            .map_err(|e| ApiError::field("prompt", e.to_string()))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Issue 45: a 30 MB prompt for an 8k context was tokenized whole (6M tokens, 3.4 GB).
    #[test]
    fn a_prompt_far_past_the_context_is_refused_after_a_few_pieces() {
        let text = "word ".repeat(6_000_000);
        let pieces = Cell::new(0);
        let e = check_length(&text, 8192, "prompt", |piece| {
            pieces.set(pieces.get() + 1);
            Ok(piece.len() / 5)
        })
        .unwrap_err();
        assert_eq!(e.code(), "context_length_exceeded");
        assert_eq!(e.param(), Some("prompt"));
        // 2 × 8192 tokens of 5 bytes are 82 KB of the 30 MB: two pieces.
        assert_eq!(pieces.get(), 2, "{e}");
    }

    #[test]
    fn a_prompt_that_fits_is_counted_whole_or_not_at_all() {
        let calls = Cell::new(0);
        let count = |piece: &str| {
            calls.set(calls.get() + 1);
            Ok(piece.len() / 5)
        };
        // Short text: not counted.
        assert_eq!(
            check_length(&"word ".repeat(1000), 8192, "prompt", count),
            Ok(())
        );
        assert_eq!(calls.get(), 0);
        // Long text of few tokens (long runs of one character): counted, and it fits.
        let sparse = |piece: &str| {
            calls.set(calls.get() + 1);
            Ok(piece.len() / 100)
        };
        assert_eq!(
            check_length(&"x".repeat(200_000), 8192, "prompt", sparse),
            Ok(())
        );
        assert_eq!(calls.get(), 4);
    }

    #[test]
    fn pieces_end_at_line_ends_then_spaces_then_characters() {
        assert_eq!(piece_end("ab\ncd\nef", 7), 6);
        assert_eq!(piece_end("ab cd ef", 7), 6);
        assert_eq!(piece_end("abcdefgh", 7), 7);
        // A character is never split: "é" is two bytes.
        assert_eq!(piece_end("aaaaaaéé", 7), 6);
        assert_eq!(piece_end("short", 7), 5);
    }
}
