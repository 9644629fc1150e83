#!/usr/bin/env python3
"""Tiny random-weight Hugging Face models and their transformers outputs, as goldens for wick.

For each architecture variant this builds a seeded, float32, random-weight causal LM small enough
to commit (a few hundred kB), a byte-level BPE tokenizer trained here on fixed text, and the
reference outputs of transformers' eager implementation: logits at every position and the hidden
state after every decoder layer for several id sequences, plus a greedy continuation.

Everything lands in crates/wick-engine/tests/goldens/hf/<variant>/; the file formats are described
in scripts/goldens/README.md. The script is deterministic: run it twice and the files are the same.

Run in the reference environment (made by scripts/goldens/regen.sh, which runs every golden script):
    target/goldens/venv/bin/python scripts/goldens/hf_tiny_models.py [VARIANT ...]
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
import tokenizers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Glm4Config,
    Glm4ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)

VOCAB_SIZE = 512
SEED = 20240601
WEIGHT_STD = 0.15
NORM_STD = 0.1
# Gemma normalizes each sublayer's output (post_attention_layernorm, post_feedforward_layernorm)
# before adding it to the residual stream. With offsets near 0 those additions stay small next to
# the sqrt(hidden)-scaled embedding, and a tied lm_head then just predicts the input token again.
# Real Gemma checkpoints carry large post-norm weights too; offset 2 (scale about 3) keeps every
# layer visible in the logits.
GEMMA_POST_NORM_OFFSET = 2.0
GREEDY_NEW_TOKENS = 16
LONG_LEN = 40

# Special tokens laid out like SmolLM2: <|endoftext|> = 0 (pad), <|im_start|> = 1 (bos),
# <|im_end|> = 2 (eos).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Fixed training text for the tokenizer (written for this script).
TRAINING_TEXT = """
The river ran slowly past the mill, and the miller watched the water turn the great wheel.
Every morning he walked to the bridge, counted the boats, and wrote the numbers in his book:
three barges, seven rowing boats, eleven fishing boats, and one small yacht with a red sail.
When the rain came in autumn, the river rose, and the wheel turned faster than ever before.
The children of the village liked to sit on the wall and guess how many sacks of flour the
mill would grind before sunset. Their guesses were 120, 240, 360 and sometimes 1000.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are in a week? Answer: There are seven days in a week.
Question: What colour is the sky on a clear day? Answer: The sky is blue on a clear day.
def add(a, b):
    return a + b

def greet(name):
    print("Hello, " + name + "!")

for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")
Le chat dort sur le canapé pendant que la pluie tombe doucement sur la ville.
Der Hund läuft schnell über die Wiese und spielt mit dem Ball.
El sol brilla sobre el mar y los pájaros cantan en los árboles.
1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20.
one two three four five six seven eight nine ten eleven twelve.
The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the warm sun.
A user asked the assistant a question, and the assistant gave a short and helpful answer.
"""

# Texts whose token ids are the model inputs.
TEXT_LEN7 = "The river ran slowly past the mill, and the"
TEXT_LONG = (
    "When the rain came in autumn, the children of the village sat on the wall and counted "
    "the boats: three barges, seven rowing boats and one small yacht with a red sail. "
    "The miller wrote the numbers in his book every morning."
)
TEXT_PAIR_A = "The quick brown fox"
TEXT_PAIR_B = "def greet(name):\n    print(\"Hello, \" + name)"
GREEDY_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer shared by every tiny model."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise SystemExit(f"special token {t} is not id {i}")
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json in the long-standing Hub layout (chat template inline)."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "model_max_length": 2048,
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path):
    """Write tokenizer.json + tokenizer_config.json and load them back through transformers."""
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    loaded = AutoTokenizer.from_pretrained(out_dir)
    probe = TEXT_LONG + "<|im_end|>"
    if loaded(probe, add_special_tokens=True)["input_ids"] != tok.encode(probe).ids:
        raise SystemExit("transformers tokenizes differently from the saved tokenizer.json")
    return loaded


def add_legacy_rope_keys(config_path: Path) -> None:
    """transformers 5 writes rope settings only under `rope_parameters`; most configs on the Hub
    carry the older top-level keys. Write both (same values) so either kind of reader works."""
    config = json.loads(config_path.read_text())
    rope = config["rope_parameters"]
    if "full_attention" in rope:  # Gemma 3: one entry per attention kind
        config["rope_theta"] = rope["full_attention"]["rope_theta"]
        config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    else:
        config["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def common_ids() -> dict:
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def variants() -> dict:
    """Variant name -> (model class, config). Each one exercises different code paths."""
    return {
        # Llama, separate lm_head, GQA 4 query heads / 2 kv heads, non-default rope theta and eps.
        "llama": (LlamaForCausalLM, LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False, **common_ids())),
        # Llama with lm_head tied to the embedding (SmolLM2 style), MQA (1 kv head), 3 layers.
        "llama_tied": (LlamaForCausalLM, LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, **common_ids())),
        # Qwen2: q/k/v projections carry biases (always on in Qwen2), GQA 4/2.
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(
            vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, **common_ids())),
        # Qwen3: per-head q/k RMSNorm, head_dim 32 while hidden/heads is 16, GQA 4/2, tied.
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(
            vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=True, **common_ids())),
        # Gemma3 text: sliding window 8 on layers 0 and 2, full attention on layer 1, different
        # rope bases for local and global layers, query_pre_attn_scalar 24 != head_dim 32, MQA,
        # (1 + w) norms including q/k norms and the extra pre/post feed-forward norms, GELU-tanh,
        # embeddings scaled by sqrt(hidden), tied lm_head.
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
            vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=2048,
            rms_norm_eps=1e-6, final_logit_softcapping=None, attn_logit_softcapping=None,
            tie_word_embeddings=True, **common_ids())),
    }


# MiniCPM (a `llama` config with scale_emb / scale_depth / dim_model_base; not in transformers)
# computes exactly what Granite does with these multipliers: the reference is a Granite model, and
# the committed config.json is rewritten into MiniCPM's form (see `minicpm_config`).
MINICPM = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 16}
MINICPM_LAYERS, MINICPM_HIDDEN, MINICPM_HEAD_DIM = 2, 64, 16


def dense_variants() -> dict:
    """The mainstream dense families: each turns on the switches its name says."""
    small = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, **common_ids())
    return {
        # Mistral: sliding window 8 on every layer, YaRN scaling (factor 4 over 16 positions).
        "mistral": (MistralForCausalLM, MistralConfig(
            num_hidden_layers=2, max_position_embeddings=64, sliding_window=8, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16},
            tie_word_embeddings=False, **small)),
        # Phi-3: fused qkv_proj / gate_up_proj, rotary on half of each head, LongRoPE (short
        # factors within the 64 trained positions, cos/sin times sqrt(1 + ln 4 / ln 64)).
        "phi3": (Phi3ForCausalLM, Phi3Config(
            num_hidden_layers=2, max_position_embeddings=256, original_max_position_embeddings=64,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5,
                             "short_factor": [1.0, 1.3, 1.9, 2.6],
                             "long_factor": [1.5, 2.5, 4.0, 8.0]},
            tie_word_embeddings=False, **small)),
        # Gemma 2: (1 + w) sandwich norms, GELU-tanh, sqrt(hidden) embeddings, sliding window 8
        # on layers 0 and 2, attention soft cap 3 and final soft cap 5 (both bite at these sizes).
        "gemma2": (Gemma2ForCausalLM, Gemma2Config(
            num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
            max_position_embeddings=2048, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
            tie_word_embeddings=True, **{**small, "num_key_value_heads": 1})),
        # OLMo 2: norms after attention and MLP only, q/k RMSNorm over all heads at once.
        "olmo2": (Olmo2ForCausalLM, Olmo2Config(
            num_hidden_layers=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False, **small)),
        # Granite: embedding / residual / attention multipliers and a logit divisor, Llama 3
        # rope scaling.
        "granite": (GraniteForCausalLM, GraniteConfig(
            num_hidden_layers=2, max_position_embeddings=2048, embedding_multiplier=6.0,
            residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32},
            tie_word_embeddings=False, **small)),
        # StarCoder 2: LayerNorm with bias, c_fc -> GELU-tanh -> c_proj with biases, biased
        # q/k/v/o, linear rope scaling (factor 2), tied lm_head.
        "starcoder2": (Starcoder2ForCausalLM, Starcoder2Config(
            num_hidden_layers=2, max_position_embeddings=2048, norm_epsilon=1e-5, use_bias=True,
            sliding_window=None,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            tie_word_embeddings=True, **small)),
        # SmolLM 3: no rotary embedding on layer 1 (NoPE), tied.
        "smollm3": (SmolLM3ForCausalLM, SmolLM3Config(
            num_hidden_layers=3, max_position_embeddings=2048, no_rope_layers=[1, 0, 1],
            rope_parameters={"rope_type": "default", "rope_theta": 2000000.0},
            tie_word_embeddings=True, **small)),
        # GLM-4: sandwich norms under GLM's names, fused gate_up_proj, q/k/v biases, rotary on
        # the first half of each head in interleaved pairs.
        "glm4": (Glm4ForCausalLM, Glm4Config(
            num_hidden_layers=2, head_dim=16, max_position_embeddings=2048, attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5},
            tie_word_embeddings=False, **small)),
        # MiniCPM, through Granite (see MINICPM above); an untied lm_head (tied to the x12
        # embedding the random model only predicts its input).
        "minicpm": (GraniteForCausalLM, GraniteConfig(
            num_hidden_layers=MINICPM_LAYERS, max_position_embeddings=2048,
            embedding_multiplier=MINICPM["scale_emb"],
            residual_multiplier=MINICPM["scale_depth"] / MINICPM_LAYERS ** 0.5,
            attention_multiplier=MINICPM_HEAD_DIM ** -0.5,
            logits_scaling=MINICPM_HIDDEN / MINICPM["dim_model_base"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False, **small)),
    }


def minicpm_config(config_path: Path) -> None:
    """Rewrite the saved Granite config.json into MiniCPM's form: model_type llama plus
    scale_emb / scale_depth / dim_model_base in place of Granite's multipliers."""
    config = json.loads(config_path.read_text())
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling"):
        del config[key]
    config.update(MINICPM, model_type="llama", architectures=["MiniCPMForCausalLM"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def init_weights(model: torch.nn.Module, gemma_norms: bool, seed: int) -> None:
    """Large-variance random weights so that logits are far from uniform and errors show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and name.endswith(".bias"):
                # LayerNorm shifts (StarCoder 2) are centred on zero.
                param.copy_(NORM_STD * noise)
            elif "norm" in name:
                if not gemma_norms:
                    centre = 1.0
                elif ".post_attention_layernorm." in name or ".post_feedforward_layernorm." in name:
                    centre = GEMMA_POST_NORM_OFFSET
                else:
                    # Gemma stores norm weights as offsets from 1 (it multiplies by 1 + w).
                    centre = 0.0
                param.copy_(centre + NORM_STD * noise)
            else:
                param.copy_(WEIGHT_STD * noise)


def variant_seed(name: str) -> int:
    return SEED + int(hashlib.sha256(name.encode()).hexdigest()[:6], 16)


@torch.no_grad()
def forward_all(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [seq, vocab] and the residual stream [layers + 2, seq, hidden] for one sequence.

    hidden[0] is the input of the first decoder layer (the embedding, scaled for Gemma),
    hidden[i] for 1 <= i <= layers is the output of decoder layer i, and hidden[layers + 1] is
    the output of the final norm (what the lm_head sees).
    """
    captured: list[torch.Tensor] = []

    def grab(_module, _args, output):
        captured.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    layers = model.model.layers
    hooks = [layer.register_forward_hook(grab) for layer in layers]
    hooks.append(model.model.norm.register_forward_hook(grab))
    try:
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    embed = out.hidden_states[0][0]
    stream = torch.stack([embed] + [c[0] for c in captured])
    if stream.shape[0] != len(layers) + 2:
        raise SystemExit(f"captured {stream.shape[0]} hidden states, wanted {len(layers) + 2}")
    if not torch.equal(stream[-1], out.hidden_states[-1][0]):
        raise SystemExit("final-norm output differs from transformers' last hidden state")
    return out.logits[0].float().contiguous(), stream.float().contiguous()


@torch.no_grad()
def greedy(model, ids: list[int]) -> tuple[list[int], bool, float]:
    """model.generate(do_sample=False), cross-checked against an argmax loop without KV cache."""
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    new = out[0, len(ids):].tolist()
    manual: list[int] = []
    gaps: list[float] = []
    seq = list(ids)
    for _ in range(GREEDY_NEW_TOKENS):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        gaps.append(top2_gap(logits))
        token = int(logits.argmax())
        manual.append(token)
        seq.append(token)
        if token == EOS_ID:
            break
    if manual != new:
        raise SystemExit(f"generate() {new} disagrees with the uncached argmax loop {manual}")
    return new, bool(new and new[-1] == EOS_ID), min(gaps)


@torch.no_grad()
def window_effect(out_dir: Path, ids: list[int], logits: torch.Tensor, window: int) -> dict:
    """Show that the golden depends on the sliding window: rerun with the window wider than the
    sequence. Rows before `window` must not change, the rows after must."""
    wide = Gemma3ForCausalLM.from_pretrained(out_dir, attn_implementation="eager",
                                             dtype=torch.float32, sliding_window=4096)
    wide.eval()
    diff = (wide(torch.tensor([ids]), use_cache=False).logits[0] - logits).abs().max(-1).values
    inside, beyond = float(diff[:window].max()), float(diff[window:].min())
    if inside > 1e-5 or beyond < 1e-2:
        raise SystemExit(f"sliding window has the wrong effect: {inside} inside, {beyond} beyond")
    return {"window_max_diff_inside": inside, "window_min_diff_beyond": beyond}


def top2_gap(logits: torch.Tensor) -> float:
    """Smallest distance between the best and second-best logit over the rows: how much
    numerical noise an argmax comparison tolerates."""
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def tensor_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_variant(name: str, cls, config, raw_tokenizer: Tokenizer, root: Path) -> None:
    out_dir = root / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)

    torch.manual_seed(variant_seed(name))
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    gemma_norms = isinstance(config, (Gemma3TextConfig, Gemma2Config))
    init_weights(model, gemma_norms=gemma_norms, seed=variant_seed(name))
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    add_legacy_rope_keys(out_dir / "config.json")
    tokenizer = save_tokenizer(raw_tokenizer, out_dir)

    # Reload from disk so the references come from exactly the committed files.
    model = cls.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    if model.config.rope_parameters != config.rope_parameters:
        raise SystemExit(f"reloaded rope parameters {model.config.rope_parameters} differ")

    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    long_ids = enc(TEXT_LONG)
    if len(long_ids) < LONG_LEN:
        raise SystemExit(f"long text has only {len(long_ids)} tokens")
    cases = {
        "len1": enc("The")[:1],
        "len7": enc(TEXT_LEN7)[:7],
        "len40": long_ids[:LONG_LEN],
        "pair_a": enc(TEXT_PAIR_A),
        "pair_b": enc(TEXT_PAIR_B),
    }
    assert len(cases["len1"]) == 1 and len(cases["len7"]) == 7

    tensors = {}
    case_meta = []
    for case_name, ids in cases.items():
        logits, hidden = forward_all(model, ids)
        tensors[f"{case_name}.logits"] = logits
        tensors[f"{case_name}.hidden"] = hidden
        case_meta.append({"name": case_name, "ids": ids, "argmax": logits.argmax(-1).tolist(),
                          "min_top2_gap": top2_gap(logits)})

    checks = {"self_predicted_len40": sum(
        a == b for a, b in zip(cases["len40"], tensors["len40.logits"].argmax(-1).tolist()))}
    if checks["self_predicted_len40"] > 4:
        raise SystemExit(f"{name}: the model mostly predicts its input token; weights too weak")
    if isinstance(config, Gemma3TextConfig):
        checks.update(window_effect(out_dir, cases["len40"], tensors["len40.logits"],
                                    config.sliding_window))

    prompt = tokenizer.apply_chat_template(GREEDY_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = enc(prompt)
    continuation, hit_eos, greedy_gap = greedy(model, prompt_ids)

    save_file(tensors, str(out_dir / "logits.safetensors"), metadata={"format": "pt"})
    if name == "minicpm":
        minicpm_config(out_dir / "config.json")
    reference = {
        "variant": name,
        "architecture": type(model).__name__ + (" (as MiniCPM)" if name == "minicpm" else ""),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "dtype": "float32",
        "attn_implementation": "eager",
        "seed": variant_seed(name),
        "num_hidden_layers": config.num_hidden_layers,
        "cases": case_meta,
        "checks": checks,
        "pairs": [["pair_a", "pair_b"]],
        "greedy": {
            "prompt": prompt,
            "prompt_ids": prompt_ids,
            "max_new_tokens": GREEDY_NEW_TOKENS,
            "continuation_ids": continuation,
            "stopped_at_eos": hit_eos,
            "min_top2_gap": greedy_gap,
        },
        "sha256": {
            f.name: tensor_digest(f)
            for f in sorted(out_dir.iterdir())
            if f.suffix == ".safetensors"
        },
    }
    (out_dir / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")

    total = sum(f.stat().st_size for f in out_dir.iterdir())
    files = ", ".join(f"{f.name} {f.stat().st_size}" for f in sorted(out_dir.iterdir()))
    gaps = [c["min_top2_gap"] for c in case_meta] + [greedy_gap]
    print(f"{name}: min top-2 gap {min(gaps):.2e} (greedy {greedy_gap:.2e})")
    print(f"{name}: {total} bytes ({files}); greedy {continuation}"
          f"{' (eos)' if hit_eos else ''}; len7 argmax {case_meta[1]['argmax']}")


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[2]
    root = repo / "crates" / "wick-engine" / "tests" / "goldens" / "hf"
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tokenizers {tokenizers.__version__}")
    wanted = set(sys.argv[1:])
    for name, (cls, config) in {**variants(), **dense_variants()}.items():
        if not wanted or name in wanted:
            build_variant(name, cls, config, tokenizer, root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
