"""Training tokens/s of wick against PyTorch + PEFT on the same CPU, interleaved in one run.

Both train a rank-8 LoRA on all seven projections of SmolLM2-135M in f32 with AdamW, SFT
over every position of BATCH sequences of SEQ random tokens, on THREADS threads; each round
runs wick's `train_speed` example, then the same steps in PyTorch. PyTorch's model is built
from SmolLM2-135M's config with random weights (the speed does not depend on their values);
wick reads the GGUF named on the command line (dequantized to f32).

python scripts/bench_train.py MODEL.gguf [BATCH SEQ STEPS THREADS ROUNDS]
"""
import subprocess
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                           tie_word_embeddings=True)


def torch_tokens_per_s(batch, seq, steps, threads):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMOLLM2_135M).float()
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.01)
    ids = torch.randint(0, SMOLLM2_135M.vocab_size, (batch, seq))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch * seq / (time.perf_counter() - t)


def main():
    model = sys.argv[1]
    batch, seq, steps, threads, rounds = (int(x) for x in (sys.argv[2:] + ["4", "256", "3", "2", "3"][len(sys.argv) - 2:]))
    exe = ROOT / "target/release/examples/train_speed"
    ratios = []
    for r in range(rounds):
        out = subprocess.run([str(exe), model, str(batch), str(seq), str(steps), str(threads)],
                             capture_output=True, text=True, check=True).stdout
        wick = float(out.split("tokens/s")[1].split()[0])
        pt = torch_tokens_per_s(batch, seq, steps, threads)
        ratios.append(wick / pt)
        print(f"round {r + 1}: wick {wick:.1f} tok/s, PyTorch+PEFT {pt:.1f} tok/s, ratio {wick / pt:.2f}", flush=True)
    print(f"median ratio wick/PyTorch {sorted(ratios)[len(ratios) // 2]:.2f} over {rounds} rounds "
          f"(batch {batch} x seq {seq}, {threads} threads, torch {torch.__version__})")


if __name__ == "__main__":
    main()
