#!/usr/bin/env python3
"""Embedding goldens: sentence-transformers' vectors for wick's embedding models.

Two models:
- all-MiniLM-L6-v2 (BERT, mean pooling + Normalize), as `wick pull minilm` installs it: only the
  vectors are committed (crates/wick-engine/tests/goldens/embed/minilm.json), the model is pulled.
- tiny-qwen3-embed: a seeded random-weight Qwen3 decoder (Qwen3Model, no head) with the
  Qwen3-Embedding recipe (last-token pooling, Normalize, an EOS appended by the tokenizer's
  post-processor, a `query` instruction prompt, Matryoshka dimensions declared in config.json),
  built here with the tiny BPE tokenizer of hf_tiny_models.py. The model directory is committed
  (a few hundred kB) next to its vectors.

Each golden holds the sentences, the ids sentence-transformers' tokenizer gives them and the
vectors `SentenceTransformer(dir).encode(...)` returns, with and without prompts. For the
Matryoshka case the expected vector is the full one cut to the length and renormalised (what
wick and the OpenAI API return; sentence-transformers' `truncate_dim` cuts without renormalising).
The script is deterministic.

Run in the reference environment:
    target/goldens/venv/bin/python scripts/goldens/embeddings.py [--minilm DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from sentence_transformers import SentenceTransformer
from tokenizers import processors
from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_models as tiny  # noqa: E402  (the shared tiny tokenizer and weight init)

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "crates/wick-engine/tests/goldens/embed"

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leapt over a sleepy hound!",
    "Embeddings map text to vectors; similar meanings land close together.",
    "Ünïcödé, CAPITALS and punctuation: does it (still) work?",
    "x",
    # Longer than MiniLM's max_seq_length (256 word pieces): cut the way sentence-transformers cuts.
    " ".join(["The miller wrote the numbers of boats in his book every single morning."] * 30),
]
QUERY_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
MATRYOSHKA = [64, 32, 16]
TRUNCATE_TO = 32


def vectors(model: SentenceTransformer, texts, **kw) -> list[list[float]]:
    out = model.encode(texts, batch_size=len(texts), convert_to_tensor=True, **kw)
    return out.to(torch.float32).tolist()


def ids_of(model: SentenceTransformer, texts) -> list[list[int]]:
    feats = model.preprocess(texts) if hasattr(model, "preprocess") else model.tokenize(texts)
    return [
        [int(t) for t, m in zip(row, mask) if m]
        for row, mask in zip(feats["input_ids"].tolist(), feats["attention_mask"].tolist())
    ]


def write(path: Path, golden: dict) -> None:
    path.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def minilm(model_dir: Path) -> None:
    model = SentenceTransformer(str(model_dir), device="cpu")
    golden = {
        "model": "all-MiniLM-L6-v2",
        "sentences": SENTENCES,
        "ids": ids_of(model, SENTENCES),
        "vectors": vectors(model, SENTENCES),
    }
    write(OUT / "minilm.json", golden)


def build_tiny_qwen3(out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    config = Qwen3Config(
        vocab_size=tiny.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, **tiny.common_ids())
    torch.manual_seed(tiny.SEED)
    model = Qwen3Model(config).eval()
    tiny.init_weights(model, gemma_norms=False, seed=tiny.variant_seed("qwen3-embed"))
    config.architectures = ["Qwen3Model"]
    config.save_pretrained(out_dir)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["matryoshka_dimensions"] = MATRYOSHKA
    cfg.pop("transformers_version", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tiny.add_legacy_rope_keys(cfg_path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    tok = tiny.build_tokenizer()
    # Qwen3-Embedding's tokenizer appends <|endoftext|> to every text; its state is pooled.
    eos = tiny.SPECIAL_TOKENS[tiny.PAD_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, tiny.PAD_ID)])
    tok.save(str(out_dir / "tokenizer.json"))
    tok_cfg = tiny.tokenizer_config()
    del tok_cfg["chat_template"]
    del tok_cfg["add_bos_token"], tok_cfg["add_eos_token"]
    tok_cfg["padding_side"] = "right"
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    if AutoTokenizer.from_pretrained(out_dir)("ab")["input_ids"][-1] != tiny.PAD_ID:
        raise SystemExit("the tiny embedder's tokenizer does not append <|endoftext|>")

    (out_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ], indent=2) + "\n")
    (out_dir / "1_Pooling").mkdir()
    (out_dir / "1_Pooling/config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True}, indent=2) + "\n")
    (out_dir / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 128, "do_lower_case": False}, indent=2) + "\n")
    (out_dir / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": f"Instruct: {QUERY_INSTRUCTION}\nQuery:", "document": ""},
        "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2) + "\n")


def tiny_qwen3() -> None:
    model_dir = OUT / "tiny-qwen3-embed"
    build_tiny_qwen3(model_dir)
    model = SentenceTransformer(str(model_dir), device="cpu")
    full = vectors(model, SENTENCES)
    cut = torch.nn.functional.normalize(torch.tensor(full)[:, :TRUNCATE_TO], dim=-1).tolist()
    golden = {
        "model": "tiny-qwen3-embed",
        "sentences": SENTENCES,
        "ids": ids_of(model, SENTENCES),
        "vectors": full,
        "query_instruction": QUERY_INSTRUCTION,
        "query_vectors": vectors(model, SENTENCES, prompt_name="query"),
        "truncate_to": TRUNCATE_TO,
        "truncated_vectors": cut,
    }
    write(OUT / "tiny-qwen3-embed.json", golden)


def main() -> int:
    home = Path(os.environ.get("WICK_HOME") or Path.home() / ".cache/wick")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, default=home / "models/all-minilm-l6-v2",
                        help="the all-MiniLM-L6-v2 directory (`wick pull minilm` puts it here)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    if not (args.minilm / "model.safetensors").is_file():
        raise SystemExit(f"{args.minilm} has no model.safetensors: run `wick pull minilm`")
    minilm(args.minilm)
    tiny_qwen3()
    return 0


if __name__ == "__main__":
    sys.exit(main())
