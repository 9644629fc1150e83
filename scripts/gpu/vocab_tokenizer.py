#!/usr/bin/env python3
"""Writes Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json) from one of
llama.cpp's vocab-only GGUFs (`models/ggml-vocab-*.gguf` in its source), so that the
random-weight models of make_models.py carry a real tokenizer of their family and
llama.cpp's `convert_hf_to_gguf.py` accepts them: it identifies a byte-level BPE
tokenizer by the hash of its tokens for a fixed text (so the pre-tokenizer and merges must
be the original ones), and reads Gemma 4's tokenizer as a byte-fallback BPE of exactly the
model's 262,144 ids.

    vocab_tokenizer.py VOCAB_GGUF OUT_DIR

Needs llama.cpp's `gguf` Python package (gguf-py in its source: put it on PYTHONPATH).
Supported vocabularies: qwen2 (Qwen 2/2.5/3, used for the Qwen 3.5 shapes), llama-bpe
(Llama 3), gemma-4.
"""
import json
import os
import re
import sys

try:
    import gguf
except ImportError:
    sys.exit("vocab_tokenizer.py: the `gguf` package is missing "
             "(PYTHONPATH=<llama.cpp>/gguf-py)")

# The pre-tokenizer regexes of the original tokenizer.json files, by llama.cpp's name.
BYTE_LEVEL_SPLIT = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def added(tid, text, special):
    return {"id": tid, "content": text, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": not special, "special": special}


def merge_pair(m):
    # As llama.cpp reads them: split at the first space after the first character.
    i = m.find(" ", 1)
    if i < 0:
        raise ValueError(f"merge without a space: {m!r}")
    return [m[:i], m[i + 1:]]


def byte_level(reader, pre, tokens, types, merges):
    """GPT-2-style byte-level BPE (Qwen 2, Llama 3)."""
    vocab, added_tokens = {}, []
    for tid, (text, t) in enumerate(zip(tokens, types)):
        # The converter pads a vocabulary to the model's size with [PADn] entries; the
        # converter adds them again, a tokenizer does not hold them.
        if t in (USER_DEFINED, UNUSED) and re.fullmatch(r"\[PAD\d+\]", text):
            continue
        if t in (CONTROL, USER_DEFINED):
            added_tokens.append(added(tid, text, t == CONTROL))
        else:
            vocab[text] = tid
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    add_bos = pre == "llama-bpe"  # Llama 3 prepends <|begin_of_text|>, Qwen nothing
    post = None
    if add_bos:
        b = tokens[bos]
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": b, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": b, "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": b, "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {b: {"id": b, "ids": [bos], "tokens": [b]}}}
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"} if pre == "qwen2" else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": BYTE_LEVEL_SPLIT[pre]},
             "behavior": "Isolated", "invert": False},
            level]},
        "post_processor": post,
        "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre == "llama-bpe",
                  "vocab": vocab, "merges": [merge_pair(m) for m in merges]},
    }, add_bos


def sentencepiece_bpe(reader, tokens, types, merges):
    """Gemma 4: BPE over text whose spaces became U+2581, bytes outside the vocabulary as
    <0xNN> tokens."""
    vocab = {text: tid for tid, text in enumerate(tokens)}
    added_tokens = [added(tid, text, t == CONTROL) for tid, (text, t)
                    in enumerate(zip(tokens, types)) if t in (CONTROL, USER_DEFINED)]
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    post = {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos],
                                             "tokens": [tokens[bos]]}}}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[^\\n]+|[\\n]+"},
                          "behavior": "Isolated", "invert": False},
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None,
                  "unk_token": tokens[unk] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [merge_pair(m) for m in merges]},
    }, True


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(src)
    model = field(reader, "tokenizer.ggml.model")
    pre = field(reader, "tokenizer.ggml.pre")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = field(reader, "tokenizer.ggml.merges")
    if not tokens or not types or len(tokens) != len(types) or not merges:
        sys.exit(f"{src}: no BPE vocabulary (tokens, token types and merges)")
    if model == "gpt2" and pre in BYTE_LEVEL_SPLIT:
        tok, add_bos = byte_level(reader, pre, tokens, types, merges)
    elif model == "gemma4":
        tok, add_bos = sentencepiece_bpe(reader, tokens, types, merges)
    else:
        sys.exit(f"{src}: tokenizer {model!r} / pre-tokenizer {pre!r} is not supported "
                 f"(qwen2, llama-bpe, gemma4)")

    def name(key):
        i = field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "add_bos_token": add_bos, "add_eos_token": False,
              "bos_token": name("bos"), "eos_token": name("eos"), "pad_token": name("padding"),
              "unk_token": name("unknown")}
    template = field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2,
                  ensure_ascii=False)
    print(f"{out}: {model}/{pre or '-'} tokenizer, {len(tokens)} ids, {len(merges)} merges")


if __name__ == "__main__":
    main()
