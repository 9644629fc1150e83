//! BERT-style WordPiece vocabularies (`tokenizer.ggml.model = bert`).
//!
//! GGUF stores them the SentencePiece way: a piece that starts a word carries a leading `▁`,
//! a continuation piece is bare. The `tokenizers` WordPiece model wants the opposite
//! convention (bare word starts, `##` continuations), so the vocabulary is rewritten for it;
//! ids stay the same.
use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
use tokenizers::models::bpe::Vocab;
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;

use super::gguf_vocab::GgufVocab;
use super::token_attrs::TokenAttrs;

/// Builds the WordPiece pipeline: BERT normalizer (lower-casing, accent stripping, CJK
/// spacing), BERT pre-tokenizer (whitespace and punctuation), greedy longest-match model.
pub(crate) fn build(vocab: &GgufVocab<'_>) -> Result<tokenizers::Tokenizer, String> {
    let mut map = Vocab::with_capacity(vocab.tokens.len());
    for (id, (token, attr)) in vocab.tokens.iter().zip(&vocab.attrs).enumerate() {
        let piece = if attr.contains(TokenAttrs::NORMAL) {
            match token.strip_prefix('\u{2581}') {
                Some(word_start) if !word_start.is_empty() => word_start.to_string(),
                _ => format!("##{token}"),
            }
        } else {
            token.clone()
        };
        map.entry(piece).or_insert(id as u32);
    }
    let unk = vocab
        .ids
        .unk
        .map(|id| vocab.tokens[id as usize].clone())
        .unwrap_or_else(|| "[UNK]".to_string());
    if !map.contains_key(&unk) {
        map.insert(unk.clone(), vocab.ids.unk.unwrap_or(0));
    }
    let model = WordPiece::builder()
        .vocab(map)
        .unk_token(unk)
        .continuing_subword_prefix("##".into())
        .max_input_chars_per_word(usize::MAX)
        .build()
        .map_err(|e| e.to_string())?;
    let mut hf = tokenizers::Tokenizer::new(model);
    hf.with_normalizer(Some(BertNormalizer::new(true, true, Some(true), true)))
        .map_err(|e| e.to_string())?;
    hf.with_pre_tokenizer(Some(BertPreTokenizer));
    hf.with_decoder(Some(WordPieceDecoder::new("##".into(), true)));
    Ok(hf)
}
