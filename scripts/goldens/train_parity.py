"""Goldens for wick-train's parity with transformers + PEFT + TRL (crates/wick-train/tests/trl_parity.rs).

On the tiny random Llama of crates/wick-engine/tests/goldens/hf/llama (f32, CPU), with a PEFT LoRA
of rank 4, alpha 8 on all seven projections whose A and B are both non-zero (B = 0 would make
A's gradient 0), it records:
  - sft:  loss and LoRA gradients of a two-sequence batch, the loss being what TRL's SFTTrainer
          takes from the model: mean cross-entropy over the completion tokens (labels -100 on the
          prompt and the padding);
  - dpo:  TRL DPOTrainer's sigmoid loss (beta 0.1), summed completion log-probs, the reference
          being the same PEFT model with the adapter disabled;
  - orpo: TRL ORPOTrainer's loss (lambda 0.1): its chosen NLL over the full chosen sequence plus
          its odds_ratio_loss on mean completion log-probs (TRL's own function is called);
  - sft3: the factors after 3 optimizer steps as HF Trainer takes them: each step two
          micro-batches of one sequence whose losses are divided by the step's completion
          tokens (num_items_in_batch), clip_grad_norm_, torch AdamW (weight decay 0.01) with
          LoRA+ param groups (B at 2x the rate), get_cosine_schedule_with_warmup(1 warm-up, 4).

`--family NAME` makes the same goldens on another tiny random model of
crates/wick-engine/tests/goldens/hf (default llama, into tests/goldens/parity; another family into
tests/goldens/parity_NAME): the families the old Llama-only trainer refused (qwen2's Q/K/V biases,
qwen3's Q/K norms, gemma2's soft caps, sliding window, sandwich norms and GELU-tanh, starcoder2's
LayerNorm with biases and ungated GELU MLP, whose modules PEFT names c_fc / c_proj; phi3's and
glm4's fused qkv_proj / gate_up_proj, one LoRA pair per fused module; gemma4's per-layer
inputs and KV-shared layers, which have no k_proj / v_proj; gemma4_moe's routed experts; qwen35's
gated DeltaNet layers, whose in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj are adapted
too, and whose q_proj holds the attention output gate's rows) train through the engine's decoder.
For the families of STEP_FAMILIES (gemma4, gemma4_moe, qwen35) it also
records the logits of the SFT sequences after one AdamW step of each objective from the initial
factors ({case}_step_logits). Attention runs as transformers' eager implementation (the soft
caps need it).

TRL's ORPO pieces (`get_batch_logps`, `odds_ratio_loss`) are called where trl imports; without it
they are written out below as TRL 1.16 defines them (reference.json says which:
"orpo_terms"). The llama goldens were made with TRL itself, and the written-out forms reproduce
them (run `--family llama --check-llama` to compare).

Run from the repository root with the pinned environment (scripts/goldens/requirements.txt plus
trl==1.16.0): python scripts/goldens/train_parity.py [--family qwen2]
"""
import argparse
import json
import math
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
import peft
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

try:
    import trl
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
except ImportError:
    trl = None

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "crates/wick-engine/tests/goldens/hf/llama"
OUT = ROOT / "crates/wick-train/tests/goldens/parity"
RANK, ALPHA, BETA, LAMBDA = 4, 8.0, 0.1, 0.1
# Families whose goldens also hold the logits after one AdamW step of each objective, at this
# rate (weight decay 0.01, no clipping).
STEP_FAMILIES, STEP_LR = {"gemma4", "gemma4_moe", "qwen35"}, 1e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Families whose checkpoints name the projections otherwise: StarCoder 2's ungated MLP.
# Phi-3 and GLM-4 hold Q/K/V or gate/up fused, one LoRA pair per fused module.
FAMILY_TARGETS = {"starcoder2": ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"],
                  "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                  "glm4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
                  # PEFT 0.21 has no default for qwen3_5; every linear layer, the DeltaNet
                  # projections included (wick's --target-modules all).
                  "qwen35": TARGETS + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                       "out_proj"]}

# (tokens, prompt_len): the loss reads tokens[max(1, prompt_len):].
SFT = [([1, 17, 250, 3, 99, 411, 7, 7, 128, 500, 64, 2], 5), ([1, 300, 42, 8, 77, 19, 250, 31, 2], 3)]
PAIRS = [
    ([1, 45, 200, 13, 9], [310, 22, 87, 2], [5, 5, 120, 400, 66, 2]),
    ([1, 71, 402], [11, 230, 98, 150, 2], [499, 3, 2]),
]


def batch_logps(logits, labels, average):
    """TRL 1.16's ORPOTrainer.get_batch_logps (decoder-only, label pad -100)."""
    if trl is not None:
        return ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    mask = labels != -100
    labels[labels == -100] = 0
    per_token = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    total = (per_token * mask).sum(-1)
    return total / mask.sum(-1) if average else total


def odds_ratio_losses(chosen, rejected):
    """TRL 1.16's ORPOTrainer.odds_ratio_loss: beta * logsigmoid(log odds ratio), per pair."""
    if trl is not None:
        fake = types.SimpleNamespace(beta=LAMBDA, accelerator=types.SimpleNamespace(device="cpu"))
        losses, *_ = ORPOTrainer.odds_ratio_loss(fake, chosen, rejected)
        return losses
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    return LAMBDA * F.logsigmoid(log_odds)


def model_with_lora(family):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32, attn_implementation="eager")
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                     target_modules=FAMILY_TARGETS.get(family, TARGETS),
                     init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    # init_lora_weights=False leaves B random too; scale both to keep the logits moderate.
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.empty(p.shape).uniform_(-0.3, 0.3, generator=gen))
    return model


def factor_key(name):
    # PEFT's parameter names carry the adapter name; its saved files do not.
    return name.replace(".default", "")


def lora_params(model):
    return {factor_key(n): p for n, p in model.named_parameters() if "lora_" in n}


def pad(seqs):
    t = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (t - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (t - len(s)) for s in seqs])
    return ids, mask


def sft_loss_sum(model, seqs):
    """Sum of completion-token cross-entropy and the token count."""
    ids, mask = pad([s for s, _ in seqs])
    labels = ids.clone()
    for i, (s, p) in enumerate(seqs):
        labels[i, : max(1, p)] = -100
        labels[i, len(s):] = -100
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    lab = labels[:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1),
                            ignore_index=-100, reduction="sum")
    return total, int((lab != -100).sum())


def completion_logps(model, seqs, average):
    ids, mask = pad([s for s, _ in seqs])
    labels = ids.clone()
    for i, (s, p) in enumerate(seqs):
        labels[i, :p] = -100
        labels[i, len(s):] = -100
    logits = model(input_ids=ids, attention_mask=mask).logits
    return batch_logps(logits, labels, average), logits, ids, mask


def pairs_as_seqs():
    chosen = [(p + c, len(p)) for p, c, _ in PAIRS]
    rejected = [(p + r, len(p)) for p, _, r in PAIRS]
    return chosen + rejected


def grads_of(model, loss):
    model.zero_grad()
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in lora_params(model).items()}


def sft_loss(model):
    total, n = sft_loss_sum(model, SFT)
    return total / n


def dpo_loss(model):
    """DPO (sigmoid): TRL's per-sequence -logsigmoid(beta * delta), delta of summed log-ratios;
    and the pairs' accuracy."""
    seqs = pairs_as_seqs()
    n_pairs = len(PAIRS)
    logps, *_ = completion_logps(model, seqs, average=False)
    with model.disable_adapter(), torch.no_grad():
        ref_logps, *_ = completion_logps(model, seqs, average=False)
    pc, pr = logps[:n_pairs], logps[n_pairs:]
    rc, rr = ref_logps[:n_pairs], ref_logps[n_pairs:]
    delta = (pc - rc) - (pr - rr)
    accuracy = (BETA * (pc - rc) > BETA * (pr - rr)).float().mean().item()
    return (-F.logsigmoid(BETA * delta)).mean(), accuracy


def orpo_loss(model):
    """ORPO: TRL's chosen NLL (full chosen sequence, padding masked) and its odds_ratio_loss."""
    seqs = pairs_as_seqs()
    n_pairs = len(PAIRS)
    logps, logits, ids, mask = completion_logps(model, seqs, average=True)
    labels = torch.where(mask == 1, ids, -100)
    lc = logits[:n_pairs, :-1].reshape(-1, logits.shape[-1])
    nll = F.cross_entropy(lc, labels[:n_pairs, 1:].reshape(-1), ignore_index=-100)
    losses = odds_ratio_losses(logps[:n_pairs], logps[n_pairs:])
    return nll - losses.mean()


def main():
    global BASE, OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="llama", help="a tiny model of crates/wick-engine/tests/goldens/hf")
    ap.add_argument("--check-llama", action="store_true",
                    help="compare with the committed llama goldens instead of writing")
    args = ap.parse_args()
    BASE = ROOT / "crates/wick-engine/tests/goldens/hf" / args.family
    if args.family != "llama":
        OUT = OUT.with_name(f"parity_{args.family}")
    if args.check_llama:
        OUT = Path("/tmp") / "train_parity_check"
    OUT.mkdir(parents=True, exist_ok=True)
    model = model_with_lora(args.family)
    init = {k: p.detach().clone() for k, p in lora_params(model).items()}
    save_file({k: v.contiguous() for k, v in init.items()}, OUT / "init.safetensors")
    tensors, ref = {}, {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                    "peft": peft.__version__,
                                    "trl": trl.__version__ if trl is not None else None},
                        "family": args.family,
                        "target_modules": FAMILY_TARGETS.get(args.family, TARGETS),
                        "orpo_terms": "trl" if trl is not None else "written out (TRL 1.16)",
                        "rank": RANK, "alpha": ALPHA, "beta": BETA, "lambda": LAMBDA,
                        "sft": [{"tokens": s, "prompt_len": p} for s, p in SFT],
                        "pairs": [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]}

    # SFT: the mean over the batch's completion tokens.
    loss = sft_loss(model)
    ref["sft_loss"] = loss.item()
    for k, g in grads_of(model, loss).items():
        tensors[f"sft.{k}"] = g

    loss, ref["dpo_accuracy"] = dpo_loss(model)
    ref["dpo_loss"] = loss.item()
    for k, g in grads_of(model, loss).items():
        tensors[f"dpo.{k}"] = g

    loss = orpo_loss(model)
    ref["orpo_loss"] = loss.item()
    for k, g in grads_of(model, loss).items():
        tensors[f"orpo.{k}"] = g

    # The updated adapter: from the initial factors, one AdamW step on each objective, then
    # the logits of the SFT sequences (each alone, rows after rows) under the new factors.
    if args.family in STEP_FAMILIES:
        ref["step"] = {"lr": STEP_LR, "weight_decay": 0.01}
        for case, objective in (("sft", sft_loss), ("dpo", lambda m: dpo_loss(m)[0]),
                                ("orpo", orpo_loss)):
            with torch.no_grad():
                for k, p in lora_params(model).items():
                    p.copy_(init[k])
            params = list(lora_params(model).values())
            opt = torch.optim.AdamW(params, lr=STEP_LR, betas=(0.9, 0.999), eps=1e-8,
                                    weight_decay=0.01)
            opt.zero_grad()
            objective(model).backward()
            opt.step()
            with torch.no_grad():
                rows = [model(input_ids=torch.tensor([s])).logits[0] for s, _ in SFT]
            tensors[f"{case}_step_logits"] = torch.cat(rows)
        with torch.no_grad():
            for k, p in lora_params(model).items():
                p.copy_(init[k])

    # Three optimizer steps of SFT with accumulation, clipping, LoRA+ and the schedule (the
    # optimizer does not depend on the family: the llama goldens only).
    norms = []
    if args.family == "llama":
        lr, clip, wd, ratio, warmup, total_steps = 1e-2, 0.5, 0.01, 2.0, 1, 4
        params = lora_params(model)
        groups = [{"params": [p for k, p in params.items() if "lora_A" in k], "lr": lr},
                  {"params": [p for k, p in params.items() if "lora_B" in k], "lr": lr * ratio}]
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
        sched = get_cosine_schedule_with_warmup(opt, warmup, total_steps)
        for _ in range(3):
            opt.zero_grad()
            n_items = sum(len(s) - max(1, p) for s, p in SFT)
            for micro in SFT:
                total, _ = sft_loss_sum(model, [micro])
                (total / n_items).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
            sched.step()
        ref["sft3"] = {"lr": lr, "clip": clip, "weight_decay": wd, "lora_plus_ratio": ratio,
                       "warmup": warmup, "total_steps": total_steps, "grad_norms": norms}
        for k, p in lora_params(model).items():
            tensors[f"sft3.{k}"] = p.detach().clone()

    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT / "reference.safetensors")
    (OUT / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(json.dumps({k: ref[k] for k in ("sft_loss", "dpo_loss", "orpo_loss")}), norms)
    if args.check_llama:
        want = json.loads((ROOT / "crates/wick-train/tests/goldens/parity/reference.json").read_text())
        for k in ("sft_loss", "dpo_loss", "orpo_loss"):
            print(k, ref[k], want[k], abs(ref[k] - want[k]) / abs(want[k]))


if __name__ == "__main__":
    main()
