//! A tokenizer assembled from GGUF metadata: the `tokenizers` pipeline for the vocabulary's
//! family, and around it the llama.cpp-compatible encoder (special-token cutting, SentencePiece
//! space prefix) and piece decoder.
use std::time::Instant;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::{Prepend, Sequence as NormalizerSequence};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, Model, NormalizerWrapper, OffsetReferential, OffsetType,
    PreTokenizedString, PreTokenizer, Token,
};
use wick_gguf::GgufFile;

use super::bpe::{build_bpe, parse_merges, split_merges, vocab_map, BpeOptions};
use super::gguf_vocab::{GgufVocab, VocabModel};
use super::piece_decoder::{char_of_byte, PieceStyle, PieceTable};
use super::special_tokens::{Fragment, Protection, SpecialTokenSplitter};
use super::spm::merges_from_scores;
use super::token_attrs::TokenAttrs;
use super::wordpiece;
use super::{Shared, TokenizerError};

/// How the encoder treats spaces in text before the model sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spaces {
    /// Left as they are (byte-level BPE maps them to `Ġ` itself).
    Keep,
    /// Replaced by `▁` (Gemma 4).
    Escape,
    /// Replaced by `▁`, with one prepended to the start of the text and after every token cut
    /// out of it (SentencePiece `add_space_prefix`).
    EscapeWithPrefix,
}

/// The llama.cpp-compatible encoder and decoder of a GGUF vocabulary.
#[derive(Debug)]
pub(crate) struct GgufCodec {
    splitter: SpecialTokenSplitter,
    spaces: Spaces,
    /// Run the `tokenizers` normalizer on text (WordPiece lower-casing and accent stripping).
    normalize: bool,
    whole_newline_runs: bool,
    pieces: PieceTable,
}

impl GgufCodec {
    /// Appends the ids of `text` (no BOS/EOS) to `out`; a protected token (control, or named by
    /// `protection`) covering one of `marks` (sorted byte offsets of user text) stays text.
    pub fn encode(
        &self,
        hf: &tokenizers::Tokenizer,
        text: &str,
        parse_special: bool,
        (marks, protection): (&[usize], &Protection),
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let mut after_token = true;
        for fragment in self
            .splitter
            .split_marked(text, parse_special, marks, protection)
        {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_token = true;
                }
                Fragment::Text(text) => {
                    self.encode_text(hf, text, after_token, out)?;
                    after_token = false;
                }
            }
        }
        Ok(())
    }

    /// Runs one text fragment through the normalizer, pre-tokenizer and model.
    fn encode_text(
        &self,
        hf: &tokenizers::Tokenizer,
        text: &str,
        after_token: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let escaped;
        let text = match self.spaces {
            Spaces::Keep => text,
            Spaces::Escape => {
                escaped = text.replace(' ', "\u{2581}");
                &escaped
            }
            Spaces::EscapeWithPrefix => {
                let prefix = if after_token { "\u{2581}" } else { "" };
                escaped = format!("{prefix}{}", text.replace(' ', "\u{2581}"));
                &escaped
            }
        };
        let failed = |e: tokenizers::Error| TokenizerError::Encode {
            reason: e.to_string(),
        };
        let mut pts = PreTokenizedString::from(text);
        if self.normalize {
            if let Some(normalizer) = hf.get_normalizer() {
                pts.normalize(|n| tokenizers::Normalizer::normalize(normalizer, n))
                    .map_err(failed)?;
            }
        }
        if let Some(pre) = hf.get_pre_tokenizer() {
            pre.pre_tokenize(&mut pts).map_err(failed)?;
        }
        let model = hf.get_model();
        let whole_newline_runs = self.whole_newline_runs;
        pts.tokenize(|word| {
            let s = word.get();
            if whole_newline_runs && s.bytes().all(|b| b == b'\n') {
                if let Some(id) = model.token_to_id(s) {
                    return Ok(vec![Token::new(id, s.to_string(), (0, s.len()))]);
                }
            }
            model.tokenize(s)
        })
        .map_err(failed)?;
        for (_, _, tokens) in pts.get_splits(OffsetReferential::Original, OffsetType::None) {
            if let Some(tokens) = tokens {
                out.extend(tokens.iter().map(|t| t.id));
            }
        }
        Ok(())
    }

    /// The special-token splitter of the vocabulary.
    pub fn splitter(&self) -> &SpecialTokenSplitter {
        &self.splitter
    }

    /// The bytes token `id` renders to, special tokens included.
    pub fn piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.piece(id)
    }

    /// The bytes `ids` decode to.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let piece = self.pieces.piece(id).ok_or(TokenizerError::IdOutOfRange {
                id,
                vocab_size: self.pieces.len(),
            })?;
            if skip_special && self.pieces.is_special(id) {
                continue;
            }
            out.extend_from_slice(piece);
        }
        Ok(out)
    }
}

/// Builds everything a `Tokenizer` holds from a GGUF file's tokenizer metadata.
pub(crate) fn build(gguf: &GgufFile) -> Result<Shared, TokenizerError> {
    let started = Instant::now();
    let mut vocab = GgufVocab::read(gguf)?;
    let path = vocab.path().to_path_buf();
    let build_err = |part: &'static str, reason: String| TokenizerError::Build {
        path: path.clone(),
        part,
        reason,
    };
    let unk_token = vocab.ids.unk.map(|id| vocab.tokens[id as usize].clone());

    let word_split = vocab.word_split;
    let (mut hf, spaces, normalize, style) = match vocab.model {
        VocabModel::Gpt2 | VocabModel::Gemma4 => {
            let split = word_split.ok_or_else(|| build_err("pre-tokenizer", "missing".into()))?;
            let byte_level = split.byte_level();
            let unspellable: Vec<char> = if byte_level {
                (0..=255u8)
                    .map(char_of_byte)
                    .filter(|c| !vocab.index.contains_key(c.encode_utf8(&mut [0; 4]) as &str))
                    .collect()
            } else {
                Vec::new()
            };
            let options = BpeOptions {
                ignore_merges: split.ignores_merges(),
                byte_fallback: !byte_level,
                unk_token: if byte_level { None } else { unk_token },
            };
            // Well-formed files (all known ones) build on the fast path; a merge naming pieces
            // outside the vocabulary makes the builder fail, and the checked path drops it.
            let (merges, dropped) = split_merges(&vocab.merges);
            let model = match build_bpe(std::mem::take(&mut vocab.index), merges, &options) {
                Ok(model) => model,
                Err(_) => {
                    let map = vocab_map(&vocab.tokens);
                    let (merges, dropped) = parse_merges(&vocab.merges, &map);
                    tracing::warn!(
                        path = %path.display(),
                        dropped,
                        "merges whose parts or result are not in the vocabulary were dropped"
                    );
                    build_bpe(map, merges, &options).map_err(|e| build_err("BPE model", e))?
                }
            };
            if dropped > 0 {
                tracing::warn!(path = %path.display(), dropped, "malformed or repeated merges were dropped");
            }
            let mut hf = tokenizers::Tokenizer::new(model);
            hf.with_pre_tokenizer(Some(
                split
                    .build(&unspellable)
                    .map_err(|e| build_err("pre-tokenizer", e))?,
            ));
            if byte_level {
                hf.with_decoder(Some(ByteLevelDecoder::new(false, false, false)));
                (hf, Spaces::Keep, false, PieceStyle::ByteLevel)
            } else {
                let escape = Replace::new(" ", "\u{2581}")
                    .map_err(|e| build_err("normalizer", e.to_string()))?;
                hf.with_normalizer(Some(escape))
                    .map_err(|e| build_err("normalizer", e.to_string()))?;
                hf.with_decoder(Some(
                    spaced_decoder(false).map_err(|e| build_err("decoder", e))?,
                ));
                (hf, Spaces::Escape, false, PieceStyle::Spaced)
            }
        }
        VocabModel::Llama => {
            let merges = merges_from_scores(&vocab.tokens, &vocab.scores, &vocab.index);
            let options = BpeOptions {
                ignore_merges: false,
                byte_fallback: true,
                unk_token,
            };
            let map = std::mem::take(&mut vocab.index);
            let model = build_bpe(map, merges, &options).map_err(|e| build_err("BPE model", e))?;
            let mut hf = tokenizers::Tokenizer::new(model);
            let mut steps: Vec<NormalizerWrapper> = Vec::new();
            if vocab.add_space_prefix {
                steps.push(Prepend::new("\u{2581}".into()).into());
            }
            steps.push(
                Replace::new(" ", "\u{2581}")
                    .map_err(|e| build_err("normalizer", e.to_string()))?
                    .into(),
            );
            hf.with_normalizer(Some(NormalizerSequence::new(steps)))
                .map_err(|e| build_err("normalizer", e.to_string()))?;
            hf.with_decoder(Some(
                spaced_decoder(vocab.add_space_prefix).map_err(|e| build_err("decoder", e))?,
            ));
            let spaces = if vocab.add_space_prefix {
                Spaces::EscapeWithPrefix
            } else {
                Spaces::Escape
            };
            (hf, spaces, false, PieceStyle::Spaced)
        }
        VocabModel::Bert => {
            let hf = wordpiece::build(&vocab).map_err(|e| build_err("WordPiece model", e))?;
            (hf, Spaces::Keep, true, PieceStyle::Spaced)
        }
    };

    add_tokens_and_template(&mut hf, &vocab).map_err(|e| build_err("added tokens", e))?;

    let codec = GgufCodec {
        splitter: SpecialTokenSplitter::new(&vocab.tokens, &vocab.attrs),
        spaces,
        normalize,
        whole_newline_runs: word_split.is_some_and(|w| w.whole_newline_runs()),
        pieces: PieceTable::new(&vocab.tokens, &vocab.attrs, style),
    };
    tracing::debug!(
        path = %path.display(),
        tokens = vocab.tokens.len(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "built tokenizer from GGUF metadata"
    );
    let bos_token = vocab.ids.bos.map(|id| vocab.tokens[id as usize].clone());
    let eos_token = vocab.ids.eos.map(|id| vocab.tokens[id as usize].clone());
    let mut suffix = Vec::new();
    if vocab.add_eos {
        suffix.extend(vocab.ids.eos);
    }
    if vocab.add_sep {
        suffix.extend(vocab.ids.sep);
    }
    Ok(Shared {
        hf,
        backend: super::Backend::Gguf(codec),
        pieces: vocab.tokens,
        attrs: vocab.attrs,
        bos: vocab.ids.bos,
        eos_ids: vocab.end_of_generation,
        bos_token,
        eos_token,
        add_bos: vocab.add_bos,
        suffix,
        strip_leading_space: vocab.add_space_prefix,
    })
}

/// `▁` back to space, `<0xXX>` to bytes, pieces joined, and the prefix space removed if the
/// encoder adds one.
fn spaced_decoder(strip_prefix: bool) -> Result<DecoderWrapper, String> {
    let mut steps: Vec<DecoderWrapper> = vec![
        tokenizers::decoders::DecoderWrapper::Replace(
            Replace::new("\u{2581}", " ").map_err(|e| e.to_string())?,
        ),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if strip_prefix {
        steps.push(Strip::new(' ', 1, 0).into());
    }
    Ok(DecoderSequence::new(steps).into())
}

/// Registers control/unknown tokens as special and user-defined tokens as added tokens of the
/// `tokenizers` pipeline (for users of `Tokenizer::inner`), and the BOS/EOS template.
fn add_tokens_and_template(
    hf: &mut tokenizers::Tokenizer,
    vocab: &GgufVocab<'_>,
) -> Result<(), String> {
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (token, attr) in vocab.tokens.iter().zip(&vocab.attrs) {
        if attr.is_special() {
            special.push(AddedToken::from(token.clone(), true).normalized(false));
        } else if attr.contains(TokenAttrs::USER_DEFINED) {
            user.push(AddedToken::from(token.clone(), false).normalized(false));
        }
    }
    hf.add_special_tokens(special).map_err(|e| e.to_string())?;
    hf.add_tokens(user).map_err(|e| e.to_string())?;

    let bos = vocab
        .ids
        .bos
        .filter(|_| vocab.add_bos)
        .map(|id| (vocab.tokens[id as usize].clone(), id));
    let eos = vocab
        .ids
        .eos
        .filter(|_| vocab.add_eos)
        .map(|id| (vocab.tokens[id as usize].clone(), id));
    if bos.is_none() && eos.is_none() {
        return Ok(());
    }
    let mut single: Vec<String> = Vec::new();
    let mut pair: Vec<String> = Vec::new();
    let mut specials = Vec::new();
    if let Some((text, id)) = &bos {
        single.push(text.clone());
        pair.push(text.clone());
        specials.push((text.clone(), *id));
    }
    single.push("$A".into());
    pair.push("$A".into());
    if let Some((text, id)) = &eos {
        single.push(text.clone());
        specials.push((text.clone(), *id));
    }
    pair.push("$B:1".into());
    let template = TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| b.try_pair(pair))
        .map(|b| b.special_tokens(specials).build());
    match template {
        Ok(Ok(processor)) => {
            hf.with_post_processor(Some(processor));
        }
        // A BOS/EOS text the template syntax cannot hold only affects `inner()` users; wick's
        // own encode adds BOS/EOS itself.
        _ => tracing::debug!("BOS/EOS template not set on the inner tokenizer"),
    }
    Ok(())
}
