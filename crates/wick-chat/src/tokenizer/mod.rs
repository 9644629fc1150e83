//! Text ↔ token ids: a [`tokenizers`] tokenizer built from GGUF metadata (no sidecar file) or
//! from a Hugging Face `tokenizer.json`, with llama.cpp's encoding and decoding rules for GGUF
//! models.
//!
//! - [`Tokenizer::from_gguf`] reads `tokenizer.ggml.*`: byte-level BPE (`gpt2`, words cut by the
//!   regexes `tokenizer.ggml.pre` names), SentencePiece-style BPE (`llama`, merges derived from
//!   scores, `▁` for spaces, `<0xXX>` byte fallback), Gemma 4 BPE (`gemma4`) and WordPiece
//!   (`bert`). Control and user-defined tokens become added tokens, so `<|im_start|>` in text is
//!   one id when special tokens are parsed.
//! - [`Tokenizer::from_hf_dir`] loads `tokenizer.json` plus `tokenizer_config.json` (BOS/EOS
//!   strings, `add_bos_token`) and `config.json`/`generation_config.json` (`eos_token_id`).
//!
//! For GGUF models the ids are those llama.cpp produces (`llama_tokenize` with the same
//! `add_special`/`parse_special`; checked against its test vectors and against llama-cpp-python
//! on the real models). Decoding concatenates llama.cpp's token pieces (`llama_token_to_piece`),
//! with two deliberate differences from `llama_detokenize`: the space a SentencePiece encoder
//! prepends is removed from the start of the text even after a skipped BOS (Hugging Face's rule,
//! so that `decode(encode(s)) == s`), and no `clean_up_tokenization_spaces` pass rewrites
//! `" ."` into `"."` — the text is what the model produced, as a streaming server emits it.
//!
//! Known differences from llama.cpp's encoder, all on rare input: characters assigned in
//! Unicode 16 are letters/digits to Oniguruma but unknown to llama.cpp's older tables, and
//! DeepSeek LLM's punctuation regex treats U+3000 after a space as Hugging Face does, not as
//! llama.cpp's `std::regex` emulation does.
//!
//! ```no_run
//! use wick_chat::tokenizer::Tokenizer;
//!
//! let gguf = wick_gguf::GgufFile::open("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")?;
//! let tok = Tokenizer::from_gguf(&gguf)?;
//! let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false)?;
//! assert_eq!(ids[0], tok.token_id("<|im_start|>").unwrap());
//! assert_eq!(tok.decode(&ids, false)?, "<|im_start|>user\nhi<|im_end|>");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
mod bpe;
mod error;
mod gguf_tokenizer;
mod gguf_vocab;
mod hf;
mod piece_decoder;
mod pre_tokenizer;
mod special_tokens;
mod spm;
mod token_attrs;
mod user_text;
mod wordpiece;

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

pub use error::TokenizerError;
pub use user_text::{pick_marker, UserTextGuard};

use gguf_tokenizer::GgufCodec;
use hf::HfCodec;
use special_tokens::Protection;
use token_attrs::TokenAttrs;

/// A tokenizer: cheap to clone (shared inside), usable from many threads.
#[derive(Clone)]
pub struct Tokenizer {
    shared: Arc<Shared>,
}

/// Everything a tokenizer holds; built once, shared by all clones.
pub(crate) struct Shared {
    /// The `tokenizers` pipeline.
    hf: tokenizers::Tokenizer,
    /// Who encodes and decodes: wick's llama.cpp-compatible codec or the pipeline itself.
    backend: Backend,
    /// Raw vocabulary pieces by id ("" where an id has none).
    pieces: Vec<String>,
    attrs: Vec<TokenAttrs>,
    bos: Option<u32>,
    /// End-of-generation ids, EOS first.
    eos_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// BOS is put before the text by `encode(…, add_special = true)`.
    add_bos: bool,
    /// Ids put after the text by `encode(…, add_special = true)` (EOS, BERT's separator).
    suffix: Vec<u32>,
    /// Remove one leading space when decoding (SentencePiece `add_space_prefix`).
    strip_leading_space: bool,
}

/// Who turns text into ids and back.
pub(crate) enum Backend {
    /// GGUF vocabularies: llama.cpp's special-token cutting and piece rendering around the
    /// `tokenizers` pre-tokenizer and model.
    Gguf(GgufCodec),
    /// Hugging Face tokenizers: the `tokenizers` pipeline as it is.
    Hf(HfCodec),
}

impl Tokenizer {
    /// Builds the tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file.
    pub fn from_gguf(gguf: &wick_gguf::GgufFile) -> Result<Self, TokenizerError> {
        Ok(Self::from_shared(gguf_tokenizer::build(gguf)?))
    }

    /// Loads a Hugging Face model directory's `tokenizer.json`, with BOS/EOS settings from
    /// `tokenizer_config.json`, `config.json` and `generation_config.json` when present.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        Ok(Self::from_shared(hf::load(dir.as_ref())?))
    }

    fn from_shared(shared: Shared) -> Self {
        Tokenizer {
            shared: Arc::new(shared),
        }
    }

    /// Token ids of `text`. Special-token strings in the text (`<|im_start|>`) become their
    /// ids; `add_special` adds BOS/EOS as the model's flags say.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, add_special, true)
    }

    /// Like [`encode`](Self::encode), but control-token strings in `text` stay text (llama.cpp's
    /// `parse_special = false`), for text that must not inject special tokens. User-defined
    /// tokens are still matched, as llama.cpp does.
    pub fn encode_literal(
        &self,
        text: &str,
        add_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, add_special, false)
    }

    fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let s = &*self.shared;
        match &s.backend {
            Backend::Gguf(codec) => {
                let mut ids = Vec::with_capacity(text.len() / 3 + 2);
                if add_special && s.add_bos {
                    ids.extend(s.bos);
                }
                codec.encode(
                    &s.hf,
                    text,
                    parse_special,
                    (&[], &Protection::default()),
                    &mut ids,
                )?;
                if add_special {
                    ids.extend_from_slice(&s.suffix);
                }
                Ok(ids)
            }
            Backend::Hf(codec) => codec.encode(s, text, add_special, parse_special),
        }
    }

    /// The text of `ids`. With `skip_special`, control and unknown tokens (BOS, `<|im_end|>` …)
    /// are left out; user-defined tokens are always kept. Bytes that do not form valid UTF-8
    /// become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let s = &*self.shared;
        match &s.backend {
            Backend::Gguf(codec) => {
                let bytes = codec.decode(ids, skip_special)?;
                let mut text = match String::from_utf8(bytes) {
                    Ok(text) => text,
                    Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
                };
                if s.strip_leading_space && text.starts_with(' ') {
                    text.remove(0);
                }
                Ok(text)
            }
            Backend::Hf(_) => {
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= s.pieces.len()) {
                    return Err(TokenizerError::IdOutOfRange {
                        id,
                        vocab_size: s.pieces.len(),
                    });
                }
                s.hf.decode(ids, skip_special)
                    .map_err(|e| TokenizerError::Decode {
                        reason: e.to_string(),
                    })
            }
        }
    }

    /// The raw vocabulary piece of `id` (`"▁Hello"`, `"Ġhello"`, `"<|im_end|>"`).
    pub fn token_piece(&self, id: u32) -> Option<&str> {
        self.shared
            .pieces
            .get(id as usize)
            .map(String::as_str)
            .filter(|p| !p.is_empty())
    }

    /// The bytes token `id` decodes to on its own, special tokens rendered (a byte-fallback
    /// token gives its single byte) — the `bytes` of OpenAI-style logprobs.
    pub fn token_bytes(&self, id: u32) -> Option<Cow<'_, [u8]>> {
        let s = &*self.shared;
        match &s.backend {
            Backend::Gguf(codec) => codec.piece(id).map(Cow::Borrowed),
            Backend::Hf(_) => {
                if id as usize >= s.pieces.len() {
                    return None;
                }
                let text = s.hf.decode(&[id], false).ok()?;
                Some(Cow::Owned(text.into_bytes()))
            }
        }
    }

    /// The id of a raw vocabulary piece.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        let s = &*self.shared;
        match s.hf.token_to_id(piece) {
            Some(id) if s.pieces.get(id as usize).is_some_and(|p| p == piece) => Some(id),
            // WordPiece vocabularies are respelled for the model; look the GGUF piece up.
            _ => s.pieces.iter().position(|p| p == piece).map(|i| i as u32),
        }
    }

    /// Number of ids (the largest id plus one).
    pub fn vocab_size(&self) -> usize {
        self.shared.pieces.len()
    }

    /// The BOS id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.shared.bos
    }

    /// Ids that end generation: EOS first, then the end-of-turn/end-of-message ids the metadata
    /// names and the tokens llama.cpp ends generation on by their text (`<|im_end|>`,
    /// `<end_of_turn>`, `<|endoftext|>`, fill-in-the-middle pad/repo/file-separator …). For
    /// Hugging Face directories: `eos_token` plus `eos_token_id` of `config.json` and
    /// `generation_config.json`.
    pub fn eos_ids(&self) -> &[u32] {
        &self.shared.eos_ids
    }

    /// The BOS token's text (`"<s>"`, `"<|begin_of_text|>"`), for chat templates.
    pub fn bos_token(&self) -> Option<&str> {
        self.shared.bos_token.as_deref()
    }

    /// The EOS token's text, for chat templates.
    pub fn eos_token(&self) -> Option<&str> {
        self.shared.eos_token.as_deref()
    }

    /// Whether `id` is a control or unknown token (skipped by `decode(…, true)`).
    pub fn is_special(&self, id: u32) -> bool {
        self.shared
            .attrs
            .get(id as usize)
            .is_some_and(|a| a.is_special())
    }

    /// Whether `encode(…, add_special = true)` puts BOS in front of the text.
    pub fn add_bos(&self) -> bool {
        self.shared.add_bos
    }

    /// Every token's bytes, by id, as a grammar engine must see them: exactly the bytes the
    /// token adds to the text (a byte-level piece that is half a UTF-8 character gives that
    /// half, unlike [`token_bytes`](Self::token_bytes) of a Hugging Face tokenizer, which
    /// decodes through UTF-8), control and user-defined tokens as their text, unused tokens
    /// empty. Whether a token is special is [`is_special`](Self::is_special).
    pub fn vocabulary_bytes(&self) -> Vec<Vec<u8>> {
        let s = &*self.shared;
        match &s.backend {
            Backend::Gguf(codec) => (0..s.pieces.len() as u32)
                .map(|id| codec.piece(id).map(<[u8]>::to_vec).unwrap_or_default())
                .collect(),
            Backend::Hf(_) => hf::vocabulary_bytes(&s.hf, &s.pieces, &s.attrs),
        }
    }

    /// The underlying `tokenizers` tokenizer. For GGUF models it carries the same vocabulary,
    /// added tokens and pre-tokenizer, but Hugging Face's rules for special tokens, which differ
    /// from llama.cpp's in corner cases; prefer [`encode`](Self::encode) and
    /// [`decode`](Self::decode).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.shared.hf
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &*self.shared;
        f.debug_struct("Tokenizer")
            .field(
                "backend",
                &match s.backend {
                    Backend::Gguf(_) => "gguf",
                    Backend::Hf(_) => "hf",
                },
            )
            .field("vocab_size", &s.pieces.len())
            .field("bos", &s.bos)
            .field("eos_ids", &s.eos_ids)
            .field("add_bos", &s.add_bos)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_is_send_sync_and_cheap_to_clone() {
        fn assert_send_sync<T: Send + Sync + Clone>() {}
        assert_send_sync::<Tokenizer>();
    }
}
