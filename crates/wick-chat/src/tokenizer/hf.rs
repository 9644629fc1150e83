//! Tokenizers of Hugging Face model directories: `tokenizer.json` run as it is, with BOS/EOS
//! settings from `tokenizer_config.json`, `config.json` and `generation_config.json`.
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;
use tokenizers::{
    Model, Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer,
};

use super::piece_decoder::{byte_token_value, PieceStyle, PieceTable};
use super::special_tokens::{Fragment, Protection, SpecialTokenSplitter};
use super::token_attrs::TokenAttrs;
use super::{Backend, Shared, TokenizerError};

/// How a Hugging Face tokenizer encodes.
pub(crate) struct HfCodec {
    /// A copy that leaves special-token strings as text, made on first use.
    literal: OnceLock<Box<tokenizers::Tokenizer>>,
    /// Finds added tokens in prompts that carry marked user text, made on first use.
    splitter: OnceLock<SpecialTokenSplitter>,
    /// What the post-processor puts before and after a text, probed on first use.
    frame: OnceLock<(Vec<u32>, Vec<u32>)>,
    /// `tokenizer_config.json` sets neither `add_bos_token` nor `add_eos_token`: BOS/EOS are
    /// whatever the pipeline's post-processor adds.
    framed_by_post_processor: bool,
}

impl HfCodec {
    fn literal<'a>(&'a self, s: &Shared) -> &'a tokenizers::Tokenizer {
        self.literal.get_or_init(|| {
            let mut copy = s.hf.clone();
            copy.set_encode_special_tokens(true);
            Box::new(copy)
        })
    }

    /// The added-token splitter over the vocabulary.
    pub fn splitter<'a>(&'a self, s: &Shared) -> &'a SpecialTokenSplitter {
        self.splitter
            .get_or_init(|| SpecialTokenSplitter::new(&s.pieces, &s.attrs))
    }

    /// Ids of `text` in which a protected token (control, or named by `protection`) covering
    /// one of `marks` (sorted byte offsets of user text) stays text: the text is cut at the
    /// other added tokens, and each piece between them goes through the normalizer,
    /// pre-tokenizer and model alone, so no added token forms inside it.
    pub fn encode_marked(
        &self,
        s: &Shared,
        text: &str,
        (marks, protection): (&[usize], &Protection),
        add_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut body = Vec::with_capacity(text.len() / 3 + 2);
        for fragment in self.splitter(s).split_marked(text, true, marks, protection) {
            match fragment {
                Fragment::Token(id) => body.push(id),
                Fragment::Text(piece) => encode_plain(&s.hf, piece, &mut body)?,
            }
        }
        if !add_special {
            return Ok(body);
        }
        let (before, after) = if self.framed_by_post_processor {
            self.frame.get_or_init(|| post_processor_frame(&s.hf))
        } else {
            &(
                if s.add_bos {
                    s.bos.into_iter().collect()
                } else {
                    Vec::new()
                },
                s.suffix.clone(),
            )
        };
        let mut ids = Vec::with_capacity(before.len() + body.len() + after.len());
        ids.extend_from_slice(before);
        ids.extend_from_slice(&body);
        ids.extend_from_slice(after);
        Ok(ids)
    }

    /// Ids of `text`, framed with BOS/EOS when `add_special`.
    pub fn encode(
        &self,
        s: &Shared,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let hf = if parse_special {
            &s.hf
        } else {
            self.literal(s)
        };
        let failed = |e: tokenizers::Error| TokenizerError::Encode {
            reason: e.to_string(),
        };
        if self.framed_by_post_processor {
            return Ok(hf
                .encode(text, add_special)
                .map_err(failed)?
                .get_ids()
                .to_vec());
        }
        let body = hf.encode(text, false).map_err(failed)?;
        let mut ids = Vec::with_capacity(body.len() + 2);
        if add_special && s.add_bos {
            ids.extend(s.bos);
        }
        ids.extend_from_slice(body.get_ids());
        if add_special {
            ids.extend_from_slice(&s.suffix);
        }
        Ok(ids)
    }
}

/// Appends the ids of `text` run through the pipeline's normalizer, pre-tokenizer and model
/// only — what `encode` gives for text holding no added token, and for text that does, the
/// added tokens' texts spelled in ordinary pieces.
fn encode_plain(
    hf: &tokenizers::Tokenizer,
    text: &str,
    out: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    let failed = |e: tokenizers::Error| TokenizerError::Encode {
        reason: e.to_string(),
    };
    let mut pts = PreTokenizedString::from(text);
    if let Some(normalizer) = hf.get_normalizer() {
        pts.normalize(|n| normalizer.normalize(n)).map_err(failed)?;
    }
    if let Some(pre) = hf.get_pre_tokenizer() {
        pre.pre_tokenize(&mut pts).map_err(failed)?;
    }
    let model = hf.get_model();
    pts.tokenize(|word| model.tokenize(word.get()))
        .map_err(failed)?;
    for (_, _, tokens) in pts.get_splits(OffsetReferential::Original, OffsetType::None) {
        out.extend(tokens.iter().flatten().map(|t| t.id));
    }
    Ok(())
}

/// The ids the post-processor puts before and after a text, found by encoding one letter with
/// and without special tokens.
fn post_processor_frame(hf: &tokenizers::Tokenizer) -> (Vec<u32>, Vec<u32>) {
    let ids = |add: bool| {
        hf.encode("a", add)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    };
    let (with, without) = (ids(true), ids(false));
    match with
        .windows(without.len().max(1))
        .position(|w| !without.is_empty() && w == without.as_slice())
    {
        Some(at) => (with[..at].to_vec(), with[at + without.len()..].to_vec()),
        None => (Vec::new(), Vec::new()),
    }
}

/// Every token's bytes (see [`super::Tokenizer::vocabulary_bytes`]): the pipeline's decoder says
/// how pieces spell bytes — GPT-2's byte alphabet (`ByteLevel`) or UTF-8 with `▁` for a space
/// (`Metaspace`, or `Replace` + `ByteFallback`, where `<0xXX>` pieces are single bytes).
pub(crate) fn vocabulary_bytes(
    hf: &tokenizers::Tokenizer,
    pieces: &[String],
    attrs: &[TokenAttrs],
) -> Vec<Vec<u8>> {
    let decoder = hf
        .get_decoder()
        .and_then(|d| serde_json::to_value(d).ok())
        .unwrap_or(Value::Null);
    let kinds: Vec<&str> = match decoder.get("decoders").and_then(Value::as_array) {
        Some(list) => list
            .iter()
            .filter_map(|d| d.get("type").and_then(Value::as_str))
            .collect(),
        None => decoder
            .get("type")
            .and_then(Value::as_str)
            .into_iter()
            .collect(),
    };
    let byte_level = kinds.contains(&"ByteLevel")
        || (kinds.is_empty() && pieces.iter().any(|p| p.starts_with('\u{120}')));
    let style = if byte_level {
        PieceStyle::ByteLevel
    } else {
        PieceStyle::Spaced
    };
    let byte_fallback = kinds.contains(&"ByteFallback");
    let attrs: Vec<TokenAttrs> = pieces
        .iter()
        .zip(attrs)
        .map(|(piece, &attr)| {
            if byte_fallback && attr == TokenAttrs::NORMAL && byte_token_value(piece).is_some() {
                TokenAttrs::BYTE
            } else {
                attr
            }
        })
        .collect();
    let table = PieceTable::new(pieces, &attrs, style);
    (0..pieces.len() as u32)
        .map(|id| table.piece(id).map(<[u8]>::to_vec).unwrap_or_default())
        .collect()
}

/// Reads a JSON file; `None` when it does not exist.
fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TokenizerError::HfConfig {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })
}

/// A token named in `tokenizer_config.json`: a string or `{"content": "…"}`.
fn token_text(config: Option<&Value>, key: &str) -> Option<String> {
    match config?.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Token ids under `key` in `config.json`-style files: a number or a list of numbers.
fn config_ids(config: Option<&Value>, key: &str) -> Vec<u32> {
    match config.and_then(|c| c.get(key)) {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

/// Loads a Hugging Face tokenizer directory.
pub(crate) fn load(dir: &Path) -> Result<Shared, TokenizerError> {
    let tokenizer_path: PathBuf = dir.join("tokenizer.json");
    // `tokenizers` panics on some malformed files (a bad literal inside a pre-tokenizer is
    // reported through `unwrap`): a hostile file must be an error, not a crash.
    let parsed = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_file(&tokenizer_path))
        .map_err(|_| TokenizerError::HfConfig {
            path: tokenizer_path.clone(),
            reason: "not a usable tokenizer.json: the tokenizers library could not parse it".into(),
        })?;
    let mut hf = parsed.map_err(|e| {
        if !tokenizer_path.exists() {
            TokenizerError::Io {
                path: tokenizer_path.clone(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            }
        } else {
            TokenizerError::HfConfig {
                path: tokenizer_path.clone(),
                reason: format!("not a usable tokenizer.json: {e}"),
            }
        }
    })?;
    // A file's padding and truncation settings (BERT exports pad every text to a fixed
    // length) describe batch training, not one prompt: wick encodes each text as it is and
    // checks lengths itself.
    hf.with_padding(None);
    hf.with_truncation(None)
        .map_err(|e| TokenizerError::HfConfig {
            path: tokenizer_path.clone(),
            reason: format!("cannot turn truncation off: {e}"),
        })?;
    let tok_config = read_json(&dir.join("tokenizer_config.json"))?;
    let model_config = read_json(&dir.join("config.json"))?;
    let gen_config = read_json(&dir.join("generation_config.json"))?;

    let vocab = hf.get_vocab(true);
    let size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    // Ids index tables below: they must be (nearly) dense, not one absurd id in a small list.
    let limit = vocab.len().saturating_mul(2).max(1024);
    if size > limit {
        return Err(TokenizerError::HfConfig {
            path: tokenizer_path,
            reason: format!(
                "token ids reach {} but the vocabulary has {} tokens",
                size - 1,
                vocab.len()
            ),
        });
    }
    let mut pieces = Vec::new();
    pieces
        .try_reserve_exact(size)
        .map_err(|e| TokenizerError::HfConfig {
            path: tokenizer_path.clone(),
            reason: format!("cannot hold {size} token ids: {e}"),
        })?;
    pieces.resize(size, String::new());
    for (piece, id) in vocab {
        pieces[id as usize] = piece;
    }
    let mut attrs = vec![TokenAttrs::NORMAL; size];
    for (id, added) in hf.get_added_tokens_decoder() {
        if let Some(a) = attrs.get_mut(id as usize) {
            *a = if added.special {
                TokenAttrs::CONTROL
            } else {
                TokenAttrs::USER_DEFINED
            };
        }
    }

    let tc = tok_config.as_ref();
    let bos_text = token_text(tc, "bos_token");
    let eos_text = token_text(tc, "eos_token");
    let mut bos = bos_text.as_deref().and_then(|t| hf.token_to_id(t));
    if bos.is_none() {
        bos = config_ids(model_config.as_ref(), "bos_token_id")
            .into_iter()
            .chain(config_ids(gen_config.as_ref(), "bos_token_id"))
            .find(|&id| (id as usize) < size);
    }
    let mut eos_ids: Vec<u32> = eos_text
        .as_deref()
        .and_then(|t| hf.token_to_id(t))
        .into_iter()
        .chain(config_ids(model_config.as_ref(), "eos_token_id"))
        .chain(config_ids(gen_config.as_ref(), "eos_token_id"))
        .filter(|&id| (id as usize) < size)
        .collect();
    let mut seen = std::collections::HashSet::new();
    eos_ids.retain(|id| seen.insert(*id));

    let explicit_bos = tc
        .and_then(|c| c.get("add_bos_token"))
        .and_then(Value::as_bool);
    let explicit_eos = tc
        .and_then(|c| c.get("add_eos_token"))
        .and_then(Value::as_bool);
    let framed_by_post_processor = explicit_bos.is_none() && explicit_eos.is_none();

    // What the post-processor puts around text: probe with a one-letter input.
    let probe = |add: bool| {
        hf.encode("a", add)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    };
    let (with, without) = (probe(true), probe(false));
    let post_bos = with.len() > without.len() && with.first() != without.first();
    if post_bos && bos.is_none() {
        bos = with.first().copied();
    }
    let add_bos = explicit_bos.unwrap_or(post_bos) && bos.is_some();
    let add_eos = explicit_eos.unwrap_or(false);
    let suffix: Vec<u32> = if add_eos {
        eos_ids.first().copied().into_iter().collect()
    } else {
        Vec::new()
    };

    let piece_of = |id: Option<u32>| id.and_then(|id| pieces.get(id as usize)).cloned();
    let bos_token = bos_text.or_else(|| piece_of(bos));
    let eos_token = eos_text.or_else(|| piece_of(eos_ids.first().copied()));
    Ok(Shared {
        hf,
        backend: Backend::Hf(HfCodec {
            literal: OnceLock::new(),
            splitter: OnceLock::new(),
            frame: OnceLock::new(),
            framed_by_post_processor,
        }),
        pieces,
        attrs,
        bos,
        eos_ids,
        bos_token,
        eos_token,
        add_bos,
        suffix,
        strip_leading_space: false,
    })
}
