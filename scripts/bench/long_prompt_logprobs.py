#!/usr/bin/env python3
"""Log-probabilities of a ~2k-token prompt from `wick serve` against transformers (f32,
eager attention) on an f32 checkpoint: how far wick's long-prompt path (prompt chunks of
512 rows past 1024 keys, whose attention runs as matrix products) moves each prompt
token's log-probability.

The f32 checkpoint is made here from a GGUF file with transformers' own GGUF loader
(its weights dequantized to f32 and saved as safetensors), so real weights need no hub
access. wick serves that directory (f32 weights, f32 KV cache: the precise path) in each
configuration given with --config, e.g. `WICK_PROMPT_ATTENTION=bf16` for the bf16
attention products that f32 models took before the precision followed the weights.

    VENV/bin/python scripts/bench/long_prompt_logprobs.py \\
        --gguf ~/.cache/wick/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out target/f32/smollm2 --tokens 2048 \\
        --config default= --config bf16=WICK_PROMPT_ATTENTION=bf16

Needs torch, transformers (with gguf) and a built wick (--wick). Prints, per
configuration, the largest and mean |Δ log p| of the prompt's tokens, over all positions
and over those past 1024.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def make_checkpoint(gguf: Path, out: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "model.safetensors").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers refuses to save a model it read from GGUF: write the dequantized
    # weights and the plain configuration ourselves.
    from safetensors.torch import save_file

    tied = getattr(model.config, "tie_word_embeddings", False)
    weights = {k: v.detach().to(torch.float32).contiguous().clone()
               for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(out)


def prompt_ids(out: Path, n: int):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    root = Path(__file__).resolve().parents[2]
    text = "".join((root / p).read_text() for p in ["docs/architecture.md", "docs/benchmarks.md"])
    ids = tok(text)["input_ids"][:n]
    if len(ids) < n:
        sys.exit(f"the text gives only {len(ids)} tokens")
    return ids


def reference(out: Path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    # log p(ids[i] | ids[:i]) for i ≥ 1.
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wick_scores(wick: str, out: Path, ids, env_extra: dict, threads: int):
    port = free_port()
    env = dict(os.environ, WICK_THREADS=str(threads), **env_extra)
    server = subprocess.Popen(
        [wick, "serve", str(out), "--port", str(port), "--kv-type", "f32",
         "--prompt-cache", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit("wick serve exited: " + server.stderr.read()[-2000:])
                time.sleep(0.5)
        body = json.dumps({"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0,
                           "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        reply = json.load(urllib.request.urlopen(req, timeout=3600))
        got = reply["choices"][0]["logprobs"]["token_logprobs"]
        return got[1:len(ids)]
    finally:
        server.terminate()
        server.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="the f32 checkpoint's directory")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--wick", default="target/release/wick")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", action="append", default=[],
                    help="NAME=VAR=VALUE[,VAR=VALUE] environment of one wick run ('NAME=' for none)")
    args = ap.parse_args()
    make_checkpoint(args.gguf, args.out)
    ids = prompt_ids(args.out, args.tokens)
    want = reference(args.out, ids)
    results = {}
    for spec in args.config or ["default="]:
        name, _, env_text = spec.partition("=")
        env = dict(kv.split("=", 1) for kv in env_text.split(",") if kv)
        got = wick_scores(args.wick, args.out, ids, env, args.threads)
        diff = [abs(g - w) for g, w in zip(got, want)]
        late = diff[1023:]  # targets at positions ≥ 1024
        results[name] = {
            "env": env,
            "max_abs_diff": max(diff),
            "mean_abs_diff": sum(diff) / len(diff),
            "max_abs_diff_past_1024": max(late),
            "mean_abs_diff_past_1024": sum(late) / len(late),
        }
        r = results[name]
        print(f"{name:>10}: max |Δ log p| {r['max_abs_diff']:.2e} (past 1024: "
              f"{r['max_abs_diff_past_1024']:.2e}), mean {r['mean_abs_diff']:.2e} "
              f"(past 1024: {r['mean_abs_diff_past_1024']:.2e})", flush=True)
    print(json.dumps({"gguf": args.gguf.name, "tokens": len(ids), "results": results}))


if __name__ == "__main__":
    main()
