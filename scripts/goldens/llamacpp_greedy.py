#!/usr/bin/env python3
"""Greedy-decoding goldens from llama.cpp (through llama-cpp-python) for wick's engine tests.

For every GGUF model in the store this records, per prompt: the prompt token ids exactly as
llama.cpp tokenizes them, the 32-token greedy continuation, and the top-20 raw logits of the
first generated step. The output is one JSON file per model under
crates/wick-engine/tests/goldens/llamacpp/. It also prints the prompt and decode speed that
llama.cpp reached in the same run (for later benchmarks; not part of the goldens).

Run in the reference environment (made by scripts/goldens/regen.sh, which runs every golden script):
    target/goldens/venv/bin/python scripts/goldens/llamacpp_greedy.py
Models are read from $WICK_HOME/models (default ~/.cache/wick/models).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import llama_cpp
from llama_cpp import Llama

EXPECTED_LLAMA_CPP_PYTHON = "0.3.36"
N_CTX = 2048
N_THREADS = 2
N_BATCH = 512
SEED = 1234
N_CONTINUE = 32
TOP_N = 20

# (store name, file name, instruct?) — store names are the directories under $WICK_HOME/models.
MODELS = [
    ("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", True),
    ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", True),
    ("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", False),
]

LONG_PARAGRAPH = (
    "The history of the lighthouse is, in many ways, the history of coastal trade itself. "
    "Long before electric lamps and rotating Fresnel lenses, sailors relied on bonfires lit on "
    "headlands to mark dangerous reefs and the mouths of harbours. The Pharos of Alexandria, "
    "completed around 280 BC, stood well over a hundred metres tall and was counted among the "
    "wonders of the ancient world. In the centuries that followed, towers of stone and brick "
    "rose along the shores of Europe, each with its own keeper, who trimmed wicks, polished "
    "reflectors and recorded the weather in a logbook. By the nineteenth century, engineers "
    "such as Augustin Fresnel and Robert Stevenson had turned the craft into a science, and "
    "the beam of a single lamp could be seen more than twenty nautical miles out to sea. Today"
)

CODE_SNIPPET = (
    "def fibonacci(n: int) -> list[int]:\n"
    '    """Return the first n Fibonacci numbers."""\n'
    "    result = [0, 1]\n"
    "    while len(result) < n:\n"
    "        result.append(result[-1] + result[-2])\n"
    "    return result[:n]\n"
    "\n"
    "\n"
    "def is_prime(k: int) -> bool:\n"
)


def prompts(instruct: bool) -> list[tuple[str, str]]:
    """The eight raw prompts (no chat template applied by us)."""
    if instruct:
        chat = (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    else:
        # Gemma's own turn markup: also exercises parsing of special tokens in the text.
        chat = (
            "<start_of_turn>user\nWhat is the capital of France? Answer in one sentence."
            "<end_of_turn>\n<start_of_turn>model\n"
        )
    return [
        ("english_prose", "Once upon a time, in a small village at the edge of a great forest, there lived"),
        ("code_snippet", CODE_SNIPPET),
        ("list_numbers", "Shopping list:\n1. eggs (12)\n2. milk, 2 litres\n3. flour - 500 g\n4."),
        ("question", "Question: Why is the sky blue during the day but red at sunset?\nAnswer:"),
        ("non_english", "Le petit prince s'assit sur une pierre et leva les yeux vers le ciel. 東京は日本の首都で、"),
        ("long_paragraph", LONG_PARAGRAPH),
        ("chat_markup", chat),
        ("repetitive", "one two three one two three one two three one two three one two"),
    ]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def last_logits(model: Llama) -> np.ndarray:
    """Raw logits of the last evaluated position (a copy, float32)."""
    ptr = llama_cpp.llama_get_logits_ith(model.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(model.n_vocab(),)).astype(np.float32, copy=True)


def top_n(logits: np.ndarray, n: int) -> list[list]:
    # Stable sort on the negated values: ties keep ascending id order.
    order = np.argsort(-logits, kind="stable")[:n]
    return [[int(i), float(logits[i])] for i in order]


def top2_gap(logits: np.ndarray) -> float:
    """Distance between the best and second-best logit: how close a greedy step is to a tie."""
    second, first = np.partition(logits, -2)[-2:]
    return float(first - second)


def run_case(model: Llama, prompt: str) -> tuple[dict, dict]:
    vocab = model._model.vocab
    ids = model.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
    model.reset()
    t0 = time.perf_counter()
    model.eval(ids)
    t_prompt = time.perf_counter() - t0
    logits = last_logits(model)
    first_top = top_n(logits, TOP_N)

    continuation: list[int] = []
    gaps: list[float] = []
    stopped_at_eog = False
    t_decode = 0.0
    while len(continuation) < N_CONTINUE:
        token = int(np.argmax(logits))  # greedy; first index on ties, like llama.cpp's greedy sampler
        continuation.append(token)
        gaps.append(top2_gap(logits))
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            stopped_at_eog = True
            break
        if len(continuation) == N_CONTINUE:
            break
        t0 = time.perf_counter()
        model.eval([token])
        t_decode += time.perf_counter() - t0
        logits = last_logits(model)

    text = model.detokenize(continuation, prev_tokens=ids, special=True).decode("utf-8", errors="replace")
    case = {
        "prompt_ids": ids,
        "continuation_ids": continuation,
        "stopped_at_eog": stopped_at_eog,
        "continuation_text": text,
        "first_step_top20": first_top,
        "continuation_top2_gaps": gaps,
    }
    # Decode evals = tokens fed back one by one (the last generated token is never evaluated).
    timing = {"prompt_tokens": len(ids), "prompt_s": t_prompt,
              "decode_tokens": len(continuation) - 1, "decode_s": t_decode}
    return case, timing


def main() -> int:
    if llama_cpp.__version__ != EXPECTED_LLAMA_CPP_PYTHON:
        print(f"expected llama-cpp-python {EXPECTED_LLAMA_CPP_PYTHON}, found {llama_cpp.__version__}",
              file=sys.stderr)
        return 1
    wick_home = Path(os.environ.get("WICK_HOME", Path.home() / ".cache" / "wick"))
    repo = Path(__file__).resolve().parents[2]
    out_dir = repo / "crates" / "wick-engine" / "tests" / "goldens" / "llamacpp"
    out_dir.mkdir(parents=True, exist_ok=True)
    perf_lines = []

    for store_name, file_name, instruct in MODELS:
        path = wick_home / "models" / store_name / file_name
        if not path.is_file():
            print(f"missing model {path}: run `wick pull {store_name}`", file=sys.stderr)
            return 1
        model = Llama(str(path), n_ctx=N_CTX, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                      n_batch=N_BATCH, seed=SEED, logits_all=False, verbose=False)
        cases = []
        totals = {"prompt_tokens": 0, "prompt_s": 0.0, "decode_tokens": 0, "decode_s": 0.0}
        # Warm-up pass so the timed run does not pay for first-touch page faults.
        model.reset()
        model.eval(model.tokenize(b"warm up", add_bos=True, special=True))
        for name, prompt in prompts(instruct):
            case, timing = run_case(model, prompt)
            cases.append({"name": name, "prompt": prompt, **case})
            for key in totals:
                totals[key] += timing[key]
            print(f"[{store_name}] {name}: {len(case['prompt_ids'])} prompt ids -> "
                  f"{len(case['continuation_ids'])} ids {case['continuation_text']!r}")
        golden = {
            "model": store_name,
            "file": file_name,
            "sha256": sha256_of(path),
            "llama_cpp_python": llama_cpp.__version__,
            "add_bos": bool(model._model.add_bos_token()),
            "settings": {"n_ctx": N_CTX, "n_threads": N_THREADS, "n_batch": N_BATCH, "seed": SEED,
                         "flash_attn": False, "kv_cache_type": "f16", "max_new_tokens": N_CONTINUE,
                         "sampling": "greedy (argmax of raw logits, first id on ties)"},
            "cases": cases,
        }
        target = out_dir / f"{store_name}.json"
        target.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {target} ({target.stat().st_size} bytes)")
        pp = totals["prompt_tokens"] / totals["prompt_s"]
        tg = totals["decode_tokens"] / totals["decode_s"]
        perf_lines.append(f"{store_name}: prompt {pp:.1f} tok/s ({totals['prompt_tokens']} tokens in "
                          f"{totals['prompt_s']:.2f} s), decode {tg:.1f} tok/s ({totals['decode_tokens']} "
                          f"tokens in {totals['decode_s']:.2f} s)")
        del model

    print(f"\nllama.cpp speed (llama-cpp-python {llama_cpp.__version__}, CPU, {N_THREADS} threads, "
          "wall time measured around eval()):")
    for line in perf_lines:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
