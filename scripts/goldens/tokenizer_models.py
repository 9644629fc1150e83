#!/usr/bin/env python3
"""Reference token ids from llama.cpp (llama-cpp-python) for wick's tokenizer tests.

For each model GGUF under $WICK_HOME/models it records, on a varied set of strings:
  plain: llama_tokenize(add_special=False, parse_special=False)
  chat:  llama_tokenize(add_special=True,  parse_special=True)
  text:  the concatenated llama_token_to_piece(special=True) of the chat ids
and per vocabulary: BOS/EOS ids, add_bos, the end-of-generation ids, the ids llama.cpp treats as
special (control or unknown), and the pieces of a deterministic sample of ids (byte tokens
included) as hex.

Usage: target/goldens/venv/bin/python scripts/goldens/tokenizer_models.py   (the venv scripts/goldens/regen.sh makes)
Writes crates/wick-chat/tests/goldens/tokenizer_models.json.
"""
import ctypes
import json
import os
import random
from pathlib import Path

import llama_cpp

MODELS = [
    "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m/gemma-3-270m-q4_k_m.gguf",
]

TEXTS = [
    "Hello world",
    " Hello world",
    "Hello, world! How are you doing today?",
    "  leading and trailing spaces  ",
    "   ",
    "\n\n\n",
    "Trailing newline\n",
    "\ttabbed\tline\n\t\tsecond line\n",
    "multiple     spaces\n\n\nand newlines\r\nwindows line\r\n",
    "def foo(x):\n    return x * 2  # double it\n\n\nclass Bar:\n\tpass\n",
    'fn main() {\n        println!("{}", 42);\n    let v: Vec<u8> = vec![0x1F; 16];\n}\n',
    '<div class="x">&nbsp;<br/></div>\n<script>if (a && b || !c) {}</script>',
    "1234567890 3.14159 -42 1e10 0x1F 1,000,000 2024-01-31",
    "I'm you're they'll we've she'd it's DON'T WE'LL",
    "Ünïcödé çàfé naïve résumé Ærøskøbing straße",
    "日本語のテキストと中文混合，还有标点。",
    "Русский текст и Ελληνικά γράμματα",
    "مرحبا بالعالم שלום עולם",
    "Hangul 한국어 텍스트 and Thai ภาษาไทย",
    "Emoji: 🦙🚀😶‍🌫️👨‍👩‍👧‍👦 ✅ 🇫🇷",
    "😀😀😀😀😀",
    "∑_{i=1}^{n} i² = n(n+1)/2 → ∞ ≤ ≥ ≠",
    "Ｆｕｌｌｗｉｄｔｈ　ｓｐａｃｅ and\u00a0non-breaking\u2009thin",
    "combining: e\u0301 a\u0308 o\u0302",
    "control chars: \x01\x02\x7f end",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nhi<|im_end|>",
    "mixed<|im_end|>text<|endoftext|>more",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nhi<end_of_turn>",
    "<s>[INST] hi [/INST]</s>",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<think>\nreasoning here\n</think>\n\nThe answer is 42.",
    "<unused0> <pad> <mask> [multimodal] <start_of_image>",
    "a" * 300,
    "word " * 40,
    (
        "The quick brown fox jumps over the lazy dog. Meanwhile, in a galaxy far, far away, "
        "a small robot named R2 was fixing the hyperdrive (again!) while humming \"Für Elise\"."
    ),
]

ATTR_UNKNOWN = 1 << 0
ATTR_CONTROL = 1 << 3


def ranges(ids):
    """Sorted ids as [start, end] inclusive ranges."""
    out = []
    for i in sorted(ids):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def piece(vocab, token):
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 256, 0, True)
    assert 0 <= n <= 256, n
    return buf.raw[:n]


def render(out):
    """JSON with one line per case and per list, so diffs stay reviewable."""
    compact = lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    lines = ["{", f' "generator": {compact(out["generator"])},', f' "llama_cpp_python": {compact(out["llama_cpp_python"])},', ' "models": {']
    models = list(out["models"].items())
    for mi, (name, m) in enumerate(models):
        lines.append(f"  {compact(name)}: {{")
        for key in ("vocab_size", "bos", "eos", "add_bos", "eog", "special_ranges", "pieces"):
            lines.append(f"   {compact(key)}: {compact(m[key])},")
        lines.append('   "cases": [')
        for ci, case in enumerate(m["cases"]):
            lines.append("    " + compact(case) + ("," if ci + 1 < len(m["cases"]) else ""))
        lines.append("   ]")
        lines.append("  }" + ("," if mi + 1 < len(models) else ""))
    lines += [" }", "}", ""]
    return "\n".join(lines)


def main():
    home = Path(os.environ.get("WICK_HOME", Path.home() / ".cache" / "wick"))
    out = {"generator": "scripts/goldens/tokenizer_models.py", "llama_cpp_python": llama_cpp.__version__, "models": {}}
    for rel in MODELS:
        path = home / "models" / rel
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        vocab = llm._model.vocab
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        eog = [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)]
        special = [i for i in range(n) if llama_cpp.llama_vocab_get_attr(vocab, i) & (ATTR_UNKNOWN | ATTR_CONTROL)]
        rng = random.Random(1234)
        sample = sorted(set(rng.randrange(n) for _ in range(300)) | set(range(0, 300)) | set(range(n - 20, n)))
        cases = []
        for text in TEXTS:
            plain = llm.tokenize(text.encode(), add_bos=False, special=False)
            chat = llm.tokenize(text.encode(), add_bos=True, special=True)
            rendered = b"".join(piece(vocab, t) for t in chat)
            cases.append({"text": text, "plain": plain, "chat": chat, "rendered": rendered.decode("utf-8")})
        out["models"][rel] = {
            "vocab_size": n,
            "bos": llama_cpp.llama_vocab_bos(vocab),
            "eos": llama_cpp.llama_vocab_eos(vocab),
            "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
            "eog": eog,
            "special_ranges": ranges(special),
            "pieces": {str(i): piece(vocab, i).hex() for i in sample},
            "cases": cases,
        }
        print(f"{rel}: {len(cases)} cases, {len(eog)} eog ids, {len(special)} special ids")
    dest = Path(__file__).resolve().parents[2] / "crates/wick-chat/tests/goldens/tokenizer_models.json"
    dest.write_text(render(out), encoding="utf-8")
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
