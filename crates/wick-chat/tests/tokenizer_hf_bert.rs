//! A BERT-style `tokenizer.json` (BertNormalizer, BertPreTokenizer, WordPiece, `[CLS]`/`[SEP]`
//! template, fixed padding and truncation as sentence-transformers exports ship it) through
//! `Tokenizer::from_hf_dir`: texts are framed by the template and neither padded nor cut.
use serde_json::json;
use wick_chat::tokenizer::Tokenizer;

fn bert_dir() -> tempfile::TempDir {
    let vocab = [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "un", "##believ", "##able",
        ",", "!",
    ];
    let vocab: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), json!(i)))
        .collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0},
        "padding": {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": null,
                    "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
        "added_tokens": [special(0, "[PAD]"), special(1, "[UNK]"), special(2, "[CLS]"),
                         special(3, "[SEP]"), special(4, "[MASK]")],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}},
                     {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                               "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab}
    });
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        dir.path().join("tokenizer.json"),
        serde_json::to_vec(&tokenizer).expect("json"),
    )
    .expect("writes tokenizer.json");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        br#"{"do_lower_case": true, "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "tokenizer_class": "BertTokenizer"}"#,
    )
    .expect("writes tokenizer_config.json");
    dir
}

#[test]
fn bert_texts_are_framed_and_neither_padded_nor_truncated() {
    let dir = bert_dir();
    let tok = Tokenizer::from_hf_dir(dir.path()).expect("loads");
    // Lowercased, split on punctuation, WordPiece continuation pieces, [CLS] … [SEP].
    assert_eq!(
        tok.encode("Hello, WORLD! Unbelievable", true)
            .expect("encodes"),
        vec![2, 5, 10, 6, 11, 7, 8, 9, 3]
    );
    assert_eq!(
        tok.encode("hello world", false).expect("encodes"),
        vec![5, 6]
    );
    // Unknown words become [UNK]; the text is longer than the file's max_length of 4.
    assert_eq!(
        tok.encode("hello zebra world hello", true)
            .expect("encodes"),
        vec![2, 5, 1, 6, 5, 3]
    );
}
