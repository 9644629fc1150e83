#!/usr/bin/env python3
"""A tiny random-weight Gemma 3 with its vision tower, and its transformers outputs, as goldens.

Gemma3ForConditionalGeneration small enough to commit: a 4-layer text model (sliding and full
layers, a sliding window narrower than an image's soft tokens so that the window and the
bidirectional image block meet), a 2-layer SigLIP tower on 64×64 pixels in 8×8 patches, and the
projector pooling its 8×8 patch grid to 16 soft tokens. The tokenizer is a byte-level BPE trained
here whose special tokens include Gemma 3's image tokens at the ids the config names.

The references are transformers' eager outputs as generate() computes them on its first pass:
input_ids with each image expanded as Gemma3Processor does (`\\n\\n<start_of_image>`, the soft
tokens, `<end_of_image>\\n\\n`), token_type_ids marking the soft tokens (bidirectional attention
among one image's soft tokens), and pixel_values from Gemma3ImageProcessorPil on the two test
images this script draws (committed next to the model). Cases: one image, two images, text only;
logits at every position, plus a greedy continuation with an image.

Everything lands in crates/wick-engine/tests/goldens/hf/gemma3_vision/. Deterministic.

    python scripts/goldens/hf_tiny_gemma3_vision.py   # in the venv regen.sh makes (requirements.txt)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
import tokenizers
from PIL import Image, ImageDraw
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_models as base  # noqa: E402

NAME = "gemma3_vision"
VOCAB_SIZE = 512
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
            "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BOI_ID, EOI_ID, IMAGE_ID = 6, 7, 8
IMAGE_SIZE = 64
PATCH = 8
TOKENS_PER_IMAGE = 16
SLIDING_WINDOW = 8
GREEDY_NEW_TOKENS = 12
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# A Gemma 3-style chat template written for this model: turns between <start_of_turn> and
# <end_of_turn>, the assistant's role named "model", each image a <start_of_image> marker.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] | trim }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([base.TRAINING_TEXT] * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    for i, t in enumerate(SPECIALS):
        if tok.token_to_id(t) != i:
            raise SystemExit(f"special token {t} is not id {i}")
    return tok


def tokenizer_config() -> dict:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIALS)
        },
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def config() -> Gemma3Config:
    text = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES), layer_types=list(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=SLIDING_WINDOW, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        query_pre_attn_scalar=16, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_channels=3, image_size=IMAGE_SIZE, patch_size=PATCH, layer_norm_eps=1e-6,
        vision_use_head=False)
    return Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI_ID, eoi_token_index=EOI_ID, image_token_index=IMAGE_ID,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=True)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """hf_tiny_models' random weights with each tower's norm convention: the text model's and
    the projector's RMSNorms multiply by 1 + w (centred on 0, the post norms on
    GEMMA_POST_NORM_OFFSET), SigLIP's LayerNorms by w (centred on 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and name.endswith(".bias"):
                param.copy_(base.NORM_STD * noise)
            elif "norm" in name:
                if ".vision_tower." in name:
                    centre = 1.0
                elif ".post_attention_layernorm." in name or ".post_feedforward_layernorm." in name:
                    centre = base.GEMMA_POST_NORM_OFFSET
                else:
                    centre = 0.0
                param.copy_(centre + base.NORM_STD * noise)
            else:
                param.copy_(base.WEIGHT_STD * noise)


def draw_images(out_dir: Path) -> list[Path]:
    """Two small deterministic test images (not square, so the processor's resize matters)."""
    a = Image.new("RGB", (48, 40))
    for y in range(40):
        for x in range(48):
            a.putpixel((x, y), (x * 5, y * 6, 255 - x * 3))
    d = ImageDraw.Draw(a)
    d.ellipse((8, 6, 30, 28), fill=(250, 240, 20))
    d.rectangle((30, 20, 44, 36), fill=(20, 30, 200))
    b = Image.new("RGB", (80, 64), (30, 120, 60))
    d = ImageDraw.Draw(b)
    d.polygon([(40, 4), (76, 60), (4, 60)], fill=(220, 40, 40))
    d.line((0, 0, 79, 63), fill=(255, 255, 255), width=3)
    paths = [out_dir / "image_a.png", out_dir / "image_b.png"]
    for img, p in zip((a, b), paths):
        img.save(p, optimize=True)
    return paths


def image_block() -> str:
    return "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS_PER_IMAGE + "<end_of_image>\n\n"


@torch.no_grad()
def logits_of(model, ids: list[int], pixels: torch.Tensor | None, block: bool = True) -> torch.Tensor:
    """Logits at every position; `block` passes token_type_ids (the bidirectional image block)."""
    kwargs = {}
    if pixels is not None:
        kwargs["pixel_values"] = pixels
        if block:
            kwargs["token_type_ids"] = torch.tensor([[int(t == IMAGE_ID) for t in ids]])
    out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                use_cache=False, **kwargs)
    return out.logits[0].float().contiguous()


@torch.no_grad()
def greedy(model, ids: list[int], pixels: torch.Tensor) -> list[int]:
    """generate(do_sample=False), cross-checked against an argmax loop without a KV cache."""
    tt = torch.tensor([[int(t == IMAGE_ID) for t in ids]])
    out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, token_type_ids=tt,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS)
    new = out[0, len(ids):].tolist()
    seq, manual = list(ids), []
    for _ in range(len(new)):
        token = int(logits_of(model, seq, pixels)[-1].argmax())
        manual.append(token)
        seq.append(token)
    if manual != new:
        raise SystemExit(f"generate() {new} disagrees with the uncached argmax loop {manual}")
    return new


def spans(ids: list[int]) -> list[list[int]]:
    """[start, len] of each run of soft tokens."""
    out = []
    for i, t in enumerate(ids):
        if t == IMAGE_ID and (i == 0 or ids[i - 1] != IMAGE_ID):
            out.append([i, 0])
        if t == IMAGE_ID:
            out[-1][1] += 1
    return out


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[2]
    out_dir = repo / "crates" / "wick-engine" / "tests" / "goldens" / "hf" / NAME
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tokenizers {tokenizers.__version__}")

    seed = base.variant_seed(NAME)
    torch.manual_seed(seed)
    cfg = config()
    model = Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation="eager",
                                                         dtype=torch.float32)
    init_weights(model, seed)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)

    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(out_dir)

    model = Gemma3ForConditionalGeneration.from_pretrained(out_dir, attn_implementation="eager",
                                                            dtype=torch.float32)
    model.eval()

    images = [Image.open(p).convert("RGB") for p in draw_images(out_dir)]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"].float()
    if tuple(pixels.shape) != (2, 3, IMAGE_SIZE, IMAGE_SIZE):
        raise SystemExit(f"pixel_values shape {tuple(pixels.shape)}")

    enc = lambda text: tok.encode(text).ids
    turn = lambda body: f"<bos><start_of_turn>user\n{body}<end_of_turn>\n<start_of_turn>model\n"
    cases = {
        "one_image": (turn(f"What is in{image_block()}this picture?"), pixels[:1]),
        "two_images": (turn(f"Compare{image_block()}with{image_block()}please."), pixels),
        "text_only": (turn("What is the capital of France?"), None),
    }
    tensors = {"pixel_values": pixels.contiguous()}
    case_meta = []
    for name, (text, px) in cases.items():
        ids = enc(text)
        logits = logits_of(model, ids, px)
        tensors[f"{name}.logits"] = logits
        meta = {"name": name, "text": text, "ids": ids, "spans": spans(ids),
                "images": 0 if px is None else px.shape[0],
                "argmax": logits.argmax(-1).tolist(), "min_top2_gap": base.top2_gap(logits)}
        case_meta.append(meta)
        if px is not None:
            blind = logits_of(model, ids, None)
            meta["max_diff_without_pixels"] = float((blind - logits).abs().max())
            if meta["max_diff_without_pixels"] < 1e-2:
                raise SystemExit(f"{name}: the image does not change the logits")
            causal = logits_of(model, ids, px, block=False)
            meta["max_diff_causal_image"] = float((causal - logits).abs().max())
            if meta["max_diff_causal_image"] < 1e-2:
                raise SystemExit(f"{name}: bidirectional attention in the image does not show")

    one_ids = case_meta[0]["ids"]
    continuation = greedy(model, one_ids, pixels[:1])

    save_file(tensors, str(out_dir / "logits.safetensors"), metadata={"format": "pt"})
    reference = {
        "variant": NAME,
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "dtype": "float32",
        "attn_implementation": "eager",
        "seed": seed,
        "image_token_id": IMAGE_ID,
        "images": ["image_a.png", "image_b.png"],
        "cases": case_meta,
        "greedy": {"case": "one_image", "max_new_tokens": GREEDY_NEW_TOKENS,
                   "continuation_ids": continuation},
    }
    (out_dir / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"{NAME}: {total} bytes; greedy {continuation}; "
          + ", ".join(f"{c['name']} {len(c['ids'])} ids gap {c['min_top2_gap']:.2e}" for c in case_meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
