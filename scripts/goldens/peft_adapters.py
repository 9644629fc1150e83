#!/usr/bin/env python3
"""LoRA adapters on a tiny model and their transformers + PEFT outputs, as goldens for wick.

On the tiny random Llama of hf_tiny_models.py (crates/wick-engine/tests/goldens/hf/llama) this
writes three seeded random adapters, every factor non-zero (a zero lora_B would test nothing):

- peft_a: PEFT, rank 4, lora_alpha 8, all seven projections of both layers;
- peft_b: PEFT, rank 8, lora_alpha 16, use_rslora, q/v/down of layer 1 only (layers_to_transform);
- mlx_c: mlx-lm format (adapters.safetensors, lora_a [in, r], lora_b [r, out],
  lora_parameters.scale 2.0), all projections.

and records PEFT's logits at every position of a few id sequences with no adapter, each adapter,
and the stacks peft_a+mlx_c and peft_a+peft_b (PEFT with several active adapters sums their
deltas), plus a 16-token greedy continuation of each. Everything lands in
crates/wick-engine/tests/goldens/adapters/. The script is deterministic.

The hybrid families get their own goldens in crates/wick-engine/tests/goldens/adapters/hybrid/:
for each of the tiny Qwen 3.5, Gemma 4 and Gemma 4 MoE (hf_tiny_models.py), adapter `a` (rank 4,
lora_alpha 8, target_modules="all-linear": the DeltaNet projections, Qwen 3.5's gated q_proj,
Gemma 4's per-layer-input projections and expert router) and adapter `b` (rank 2, rsLoRA, a few
targets), with PEFT's logits at every position under none, a and b. Gemma 4's experts are 3-D
parameters, which all-linear does not reach, so no adapter here targets them. --hybrid writes
only these.

Adapters on the tiny Gemma 4 MoE's stacked experts (PEFT's `target_parameters`) get theirs in
crates/wick-engine/tests/goldens/adapters/experts/ (`expert_goldens`; --experts writes only these).

With --smollm2-out DIR it instead writes a random rank-16 PEFT adapter shaped for
SmolLM2-135M (30 layers, hidden 576, ffn 1536, 9/3 heads) for the benchmarks (not committed).

Run in the reference environment:
    target/goldens/venv/bin/python scripts/goldens/peft_adapters.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "crates/wick-engine/tests/goldens/hf/llama"
OUT = ROOT / "crates/wick-engine/tests/goldens/adapters"
SEED = 20251202
FACTOR_STD = 0.15
GREEDY_NEW_TOKENS = 16
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODULE_PATH = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
CASES = {
    "len7": [282, 421, 420, 400, 302, 491, 33],
    "len19": [1, 87, 300, 301, 302, 45, 46, 200, 201, 202, 17, 18, 19, 400, 401, 402, 403, 9, 10],
}


def base_model():
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def randomize_lora(model, adapter_name: str, seed: int) -> None:
    """Seeded normal values in every lora_A/lora_B of `adapter_name` (in module order)."""
    g = torch.Generator().manual_seed(seed)
    for name, module in sorted(model.named_modules(), key=lambda kv: kv[0]):
        if hasattr(module, "lora_A") and adapter_name in module.lora_A:
            for w in (module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight):
                with torch.no_grad():
                    w.copy_(torch.randn(w.shape, generator=g) * FACTOR_STD)


def save_peft(model, adapter_name: str, out: Path) -> None:
    tmp = Path(tempfile.mkdtemp())
    model.save_pretrained(tmp, selected_adapters=[adapter_name])
    src = tmp if adapter_name == "default" else tmp / adapter_name
    out.mkdir(parents=True, exist_ok=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(src / f, out / f)
    cfg = json.loads((out / "adapter_config.json").read_text())
    # An absolute path of this machine would make the file differ between runs/machines.
    cfg["base_model_name_or_path"] = "tiny-random-llama"
    # PEFT keeps target_modules as a set: its order changes from run to run.
    if isinstance(cfg.get("target_modules"), list):
        cfg["target_modules"] = sorted(cfg["target_modules"])
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(tmp)


def make_peft(name: str, config: LoraConfig, seed: int) -> Path:
    model = get_peft_model(base_model(), config)
    randomize_lora(model, "default", seed)
    out = OUT / name
    save_peft(model, "default", out)
    return out


def make_mlx(name: str, rank: int, scale: float, seed: int) -> tuple[Path, Path]:
    """An mlx-lm adapter, and the same adapter as a PEFT directory (lora_alpha = scale * rank)
    for the reference computation (kept out of the goldens)."""
    config = LoraConfig(r=rank, lora_alpha=scale * rank, target_modules=ALL_TARGETS, lora_dropout=0.0)
    model = get_peft_model(base_model(), config)
    randomize_lora(model, "default", seed)
    peft_copy = Path(tempfile.mkdtemp()) / name
    save_peft(model, "default", peft_copy)
    tensors = {}
    for mod_name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            path = mod_name.replace("base_model.model.", "", 1)
            tensors[f"{path}.lora_a"] = module.lora_A["default"].weight.detach().T.contiguous()
            tensors[f"{path}.lora_b"] = module.lora_B["default"].weight.detach().T.contiguous()
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(tensors.items())), out / "adapters.safetensors")
    layers = model.config.num_hidden_layers
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": layers,
                "lora_parameters": {
                    "rank": rank,
                    "scale": scale,
                    "dropout": 0.0,
                    "keys": [MODULE_PATH[t] for t in ALL_TARGETS],
                },
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    return out, peft_copy


@torch.no_grad()
def logits_of(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def greedy(model, ids: list[int]) -> list[int]:
    seq = list(ids)
    out = []
    for _ in range(GREEDY_NEW_TOKENS):
        nxt = int(logits_of(model, seq)[-1].argmax())
        out.append(nxt)
        seq.append(nxt)
    return out


def with_adapters(dirs: list[tuple[str, Path]]):
    model = PeftModel.from_pretrained(base_model(), dirs[0][1], adapter_name=dirs[0][0])
    for name, d in dirs[1:]:
        model.load_adapter(d, adapter_name=name)
    names = [n for n, _ in dirs]
    model.base_model.set_adapter(names if len(names) > 1 else names[0])
    model.eval()
    return model


def goldens() -> None:
    for old in ("peft_a", "peft_b", "mlx_c", "logits.safetensors", "reference.json"):
        p = OUT / old
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    a = make_peft("peft_a", LoraConfig(r=4, lora_alpha=8, target_modules=ALL_TARGETS, lora_dropout=0.0), SEED + 1)
    b = make_peft(
        "peft_b",
        LoraConfig(
            r=8,
            lora_alpha=16,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "down_proj"],
            layers_to_transform=[1],
            lora_dropout=0.0,
        ),
        SEED + 2,
    )
    _c, c_peft = make_mlx("mlx_c", rank=4, scale=2.0, seed=SEED + 3)
    selections = {
        "none": None,
        "peft_a": [("peft_a", a)],
        "peft_b": [("peft_b", b)],
        "mlx_c": [("mlx_c", c_peft)],
        "peft_a+mlx_c": [("peft_a", a), ("mlx_c", c_peft)],
        "peft_a+peft_b": [("peft_a", a), ("peft_b", b)],
    }
    tensors = {}
    reference = {
        "base": "hf/llama",
        "torch": torch.__version__,
        "peft": __import__("peft").__version__,
        "cases": CASES,
        "greedy_new_tokens": GREEDY_NEW_TOKENS,
        "selections": {},
    }
    base_logits = {}
    for sel, dirs in selections.items():
        model = base_model() if dirs is None else with_adapters(dirs)
        entry = {"greedy": {}, "max_abs_diff_from_base": {}}
        for case, ids in CASES.items():
            lg = logits_of(model, ids)
            tensors[f"{sel}.{case}.logits"] = lg.contiguous()
            if dirs is None:
                base_logits[case] = lg
            else:
                entry["max_abs_diff_from_base"][case] = float((lg - base_logits[case]).abs().max())
            entry["greedy"][case] = greedy(model, ids)
        reference["selections"][sel] = entry
    shutil.rmtree(c_peft.parent)
    save_file(dict(sorted(tensors.items())), OUT / "logits.safetensors")
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    for sel, e in reference["selections"].items():
        print(sel, e["max_abs_diff_from_base"], e["greedy"]["len7"][:6])


HYBRID_OUT = OUT / "hybrid"
HYBRID_IDS = [1, 87, 300, 301, 302, 45, 46, 200, 201, 202, 17, 18, 19, 400, 401]
# Adapter b's targets per model: a few projections of each kind the family adds.
HYBRID_B_TARGETS = {
    "qwen35": ["in_proj_qkv", "in_proj_a", "out_proj", "q_proj", "down_proj"],
    "gemma4": ["q_proj", "v_proj", "per_layer_input_gate", "per_layer_projection", "up_proj"],
    "gemma4_moe": ["k_proj", "o_proj", "gate_proj", "proj"],
}


def hybrid_base(name: str):
    model = AutoModelForCausalLM.from_pretrained(
        ROOT / "crates/wick-engine/tests/goldens/hf" / name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model


def hybrid_goldens() -> None:
    if HYBRID_OUT.exists():
        shutil.rmtree(HYBRID_OUT)
    HYBRID_OUT.mkdir(parents=True)
    tensors = {}
    reference = {
        "torch": torch.__version__,
        "peft": __import__("peft").__version__,
        "ids": HYBRID_IDS,
        "models": {},
    }
    for i, (name, b_targets) in enumerate(HYBRID_B_TARGETS.items()):
        configs = {
            "a": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
            "b": LoraConfig(r=2, lora_alpha=4, use_rslora=True, target_modules=b_targets, lora_dropout=0.0),
        }
        entry = {"adapters": {}, "max_abs_diff_from_base": {}}
        base_logits = logits_of(hybrid_base(name), HYBRID_IDS)
        tensors[f"{name}.none.logits"] = base_logits.contiguous()
        for j, (sel, config) in enumerate(configs.items()):
            torch.manual_seed(SEED)
            model = get_peft_model(hybrid_base(name), config)
            randomize_lora(model, "default", SEED + 10 * i + j)
            model.eval()
            out = HYBRID_OUT / name / sel
            save_peft(model, "default", out)
            cfg = json.loads((out / "adapter_config.json").read_text())
            cfg["base_model_name_or_path"] = f"tiny-random-{name}"
            (out / "adapter_config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
            targeted = sorted(
                {n.split(".layers.")[-1].split(".", 1)[-1] if ".layers." in n else n.rsplit(".", 1)[-1]
                 for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
            )
            # Reload from the saved files, as wick will.
            lg = logits_of(with_adapters_on(hybrid_base(name), [(sel, out)]), HYBRID_IDS)
            tensors[f"{name}.{sel}.logits"] = lg.contiguous()
            entry["adapters"][sel] = targeted
            entry["max_abs_diff_from_base"][sel] = float((lg - base_logits).abs().max())
        reference["models"][name] = entry
        print(name, entry)
    save_file(dict(sorted(tensors.items())), HYBRID_OUT / "logits.safetensors")
    (HYBRID_OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


EXPERTS_OUT = OUT / "experts"


def expert_goldens() -> None:
    """Adapters on the tiny Gemma 4 MoE's stacked experts (PEFT's `target_parameters`): `e`
    (rank 2, lora_alpha 4) on both experts.gate_up_proj and experts.down_proj and on q_proj;
    `d` (rank 4, rsLoRA) on experts.down_proj only. PEFT's logits at every position of
    HYBRID_IDS under none, e and d, reloaded from the saved files."""
    if EXPERTS_OUT.exists():
        shutil.rmtree(EXPERTS_OUT)
    EXPERTS_OUT.mkdir(parents=True)
    name = "gemma4_moe"
    configs = {
        "e": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"], lora_dropout=0.0),
        "d": LoraConfig(r=4, lora_alpha=4, use_rslora=True, target_modules=[],
                        target_parameters=["experts.down_proj"], lora_dropout=0.0),
    }
    tensors = {}
    reference = {
        "torch": torch.__version__,
        "peft": __import__("peft").__version__,
        "model": name,
        "ids": HYBRID_IDS,
        "max_abs_diff_from_base": {},
    }
    base_logits = logits_of(hybrid_base(name), HYBRID_IDS)
    tensors["none.logits"] = base_logits.contiguous()
    for j, (sel, config) in enumerate(configs.items()):
        torch.manual_seed(SEED)
        model = get_peft_model(hybrid_base(name), config)
        randomize_lora(model, "default", SEED + 100 + j)
        model.eval()
        out = EXPERTS_OUT / sel
        save_peft(model, "default", out)
        cfg = json.loads((out / "adapter_config.json").read_text())
        cfg["base_model_name_or_path"] = f"tiny-random-{name}"
        (out / "adapter_config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
        lg = logits_of(with_adapters_on(hybrid_base(name), [(sel, out)]), HYBRID_IDS)
        tensors[f"{sel}.logits"] = lg.contiguous()
        reference["max_abs_diff_from_base"][sel] = float((lg - base_logits).abs().max())
    print(reference)
    save_file(dict(sorted(tensors.items())), EXPERTS_OUT / "logits.safetensors")
    (EXPERTS_OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


def with_adapters_on(base, dirs: list[tuple[str, Path]]):
    model = PeftModel.from_pretrained(base, dirs[0][1], adapter_name=dirs[0][0])
    model.eval()
    return model


def smollm2(out: Path, rank: int = 16, seed: int = SEED) -> None:
    """A random PEFT adapter for SmolLM2-135M: 30 layers, hidden 576, ffn 1536, 9/3 heads of 64."""
    h, f, layers, q, kv = 576, 1536, 30, 9 * 64, 3 * 64
    shapes = {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "down_proj": (h, f),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for t, (o, n) in shapes.items():
            p = f"base_model.model.model.layers.{i}.{MODULE_PATH[t]}"
            tensors[f"{p}.lora_A.weight"] = torch.randn((rank, n), generator=g) * 0.02
            tensors[f"{p}.lora_B.weight"] = torch.randn((o, rank), generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": ALL_TARGETS,
                "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "task_type": "CAUSAL_LM",
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote a rank-{rank} SmolLM2 adapter to {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2-out", type=Path, help="write a random rank-16 SmolLM2 adapter here instead")
    ap.add_argument("--hybrid", action="store_true", help="write only the Qwen 3.5 / Gemma 4 goldens")
    ap.add_argument("--experts", action="store_true", help="write only the Gemma 4 expert-adapter goldens")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    if args.smollm2_out:
        smollm2(args.smollm2_out, args.rank, args.seed)
    elif args.hybrid:
        hybrid_goldens()
    elif args.experts:
        expert_goldens()
    else:
        goldens()
        hybrid_goldens()
        expert_goldens()
