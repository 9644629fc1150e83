#!/usr/bin/env python3
"""A tiny random-weight Qwen2.5-VL with its vision tower, and its transformers outputs, as goldens.

Qwen2_5_VLForConditionalGeneration small enough to commit: a 2-layer Qwen2 text model (biased
Q/K/V, GQA 4/2, head 16, contiguous M-RoPE sections [2, 3, 3]) and a 3-block vision tower
(width 32, 2 heads, RMSNorms, SwiGLU MLPs, 8-pixel patches, temporal patch 2, 2×2 merge,
window attention over 2×2 merged windows (window_size 32 px) in blocks 0 and 2, full attention
in block 1). The tokenizer, chat template and prompts are hf_tiny_qwen35_vision.py's.

Pixels come from transformers' PIL image processor (Qwen2VLImageProcessorPil with the CLIP
mean/std Qwen2.5-VL uses) on the two test images of
hf_tiny_gemma3_vision.py, with min/max pixels small enough that one image is scaled up by the
rounding and the other scaled down by the pixel budget. Input ids expand each image as
Qwen3VLProcessor does: `<|vision_start|>`, `<|image_pad|>` × (t·h·w / merge²), `<|vision_end|>`.
Cases: one image, two images, text only; logits at every position, the 3-D M-RoPE position ids
transformers computes, plus a greedy continuation with an image.

Everything lands in crates/wick-engine/tests/goldens/hf/qwen25_vl/. Deterministic.

    python scripts/goldens/hf_tiny_qwen25_vl.py   # in the venv regen.sh makes (requirements.txt)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
import tokenizers
from PIL import Image
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_models as base  # noqa: E402

NAME = "qwen25_vl"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
VOCAB_SIZE = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VISION_START_ID, VISION_END_ID, IMAGE_ID, VIDEO_ID = 3, 4, 5, 6
PATCH = 8
MERGE = 2
TEMPORAL = 2
MIN_PIXELS = 32 * 32
MAX_PIXELS = 64 * 64
GREEDY_NEW_TOKENS = 12

# A Qwen-style chat template written for this model: each image part becomes
# <|vision_start|><|image_pad|><|vision_end|>, which the processor expands.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
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
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIALS)
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "image_token": "<|image_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def config() -> Qwen2_5_VLConfig:
    text = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": [2, 3, 3]},
        max_position_embeddings=2048, rms_norm_eps=1e-6,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    vision = dict(
        depth=3, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3,
        patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
        window_size=32, fullatt_block_indexes=[1], out_hidden_size=64, hidden_act="silu",
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID, vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID, tie_word_embeddings=False)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """hf_tiny_models' random weights: every RMSNorm here multiplies by w (centred on 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name or ".ln_q." in name:
                param.copy_(1.0 + base.NORM_STD * noise)
            else:
                param.copy_(base.WEIGHT_STD * noise)


def image_block(tokens: int) -> str:
    return "<|vision_start|>" + "<|image_pad|>" * tokens + "<|vision_end|>"


def unpatchify(patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """The first frame of the processor's patch rows back as a `[3, h, w]` image (rows are in
    merge-window order: block row, block column, row in block, column in block; each row is
    `[channel][frame][y][x]`)."""
    m = MERGE
    x = patches.reshape(grid_h // m, grid_w // m, m, m, 3, TEMPORAL, PATCH, PATCH)[:, :, :, :, :, 0]
    # (bh, bw, mh, mw, c, py, px) -> (c, bh, mh, py, bw, mw, px)
    x = x.permute(4, 0, 2, 5, 1, 3, 6)
    return x.reshape(3, grid_h * PATCH, grid_w * PATCH).contiguous()


@torch.no_grad()
def logits_of(model, ids: list[int], pixels, grids, positions=None) -> torch.Tensor:
    kwargs = {}
    if pixels is not None:
        kwargs.update(pixel_values=pixels, image_grid_thw=grids,
                      mm_token_type_ids=torch.tensor([[int(t == IMAGE_ID) for t in ids]]))
    if positions is not None:
        kwargs["position_ids"] = positions
    out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                use_cache=False, **kwargs)
    return out.logits[0].float().contiguous()


@torch.no_grad()
def greedy(model, ids: list[int], pixels, grids) -> list[int]:
    """generate(do_sample=False), cross-checked against an argmax loop without a KV cache."""
    mm = torch.tensor([[int(t == IMAGE_ID) for t in ids]])
    out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grids,
                         mm_token_type_ids=mm, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS)
    new = out[0, len(ids):].tolist()
    seq, manual = list(ids), []
    for _ in range(len(new)):
        token = int(logits_of(model, seq, pixels, grids)[-1].argmax())
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
    images_dir = out_dir.parent / "gemma3_vision"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tokenizers {tokenizers.__version__}")

    seed = base.variant_seed(NAME)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config(), attn_implementation="eager",
                                                          dtype=torch.float32)
    init_weights(model, seed)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)

    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        image_mean=CLIP_MEAN, image_std=CLIP_STD)
    processor.save_pretrained(out_dir)

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out_dir, attn_implementation="eager",
                                                             dtype=torch.float32)
    model.eval()

    names = ["image_a.png", "image_b.png"]
    for n in names:
        shutil.copy(images_dir / n, out_dir / n)
    images = [Image.open(out_dir / n).convert("RGB") for n in names]
    batch = processor(images=images, return_tensors="pt")
    pixels, grids = batch["pixel_values"].float(), batch["image_grid_thw"]
    counts = [int(t * h * w) for t, h, w in grids.tolist()]
    tokens = [c // (MERGE * MERGE) for c in counts]
    tensors = {"pixel_values": pixels.contiguous()}
    image_meta = []
    for i, (n, (t, h, w)) in enumerate(zip(names, grids.tolist())):
        first = sum(counts[:i])
        tensors[f"image_{i}.pixels"] = unpatchify(pixels[first:first + counts[i]], h, w)
        image_meta.append({"file": n, "grid_thw": [t, h, w], "height": h * PATCH,
                           "width": w * PATCH, "soft_tokens": tokens[i]})
    if tokens[0] == tokens[1]:
        raise SystemExit(f"both images give {tokens[0]} soft tokens; want different grids")

    enc = lambda text: tok.encode(text).ids
    turn = lambda body: f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"
    cases = {
        "one_image": (turn(f"What is in {image_block(tokens[0])} this picture?"), [0]),
        "two_images": (turn(f"Compare {image_block(tokens[0])} with {image_block(tokens[1])} please."),
                       [0, 1]),
        "text_only": (turn("What is the capital of France?"), []),
    }
    case_meta = []
    for name, (text, which) in cases.items():
        ids = enc(text)
        if which:
            rows = torch.cat([pixels[sum(counts[:i]):sum(counts[:i]) + counts[i]] for i in which])
            grid = grids[which]
        else:
            rows, grid = None, None
        logits = logits_of(model, ids, rows, grid)
        tensors[f"{name}.logits"] = logits
        meta = {"name": name, "text": text, "ids": ids, "spans": spans(ids), "images": which,
                "argmax": logits.argmax(-1).tolist(), "min_top2_gap": base.top2_gap(logits)}
        if which:
            mm = torch.tensor([[int(t == IMAGE_ID) for t in ids]])
            positions, delta = model.model.get_rope_index(torch.tensor([ids]), mm, image_grid_thw=grid)
            # [3, seq] (temporal, row, column), stored as f32 (exact for these small ints).
            tensors[f"{name}.positions"] = positions[:, 0].to(torch.float32).contiguous()
            meta["rope_delta"] = int(delta[0, 0])
            flat = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
            plain = logits_of(model, ids, rows, grid, positions=flat)
            meta["max_diff_1d_positions"] = float((plain - logits).abs().max())
            if meta["max_diff_1d_positions"] < 1e-3:
                raise SystemExit(f"{name}: M-RoPE positions do not change the logits")
        case_meta.append(meta)

    one = case_meta[0]
    one_rows = pixels[:counts[0]]
    continuation = greedy(model, one["ids"], one_rows, grids[:1])

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
        "processor": type(processor).__name__,
        "images": image_meta,
        "cases": case_meta,
        "greedy": {"case": "one_image", "max_new_tokens": GREEDY_NEW_TOKENS,
                   "continuation_ids": continuation},
    }
    (out_dir / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"{NAME}: {total} bytes; images {image_meta}; greedy {continuation}; "
          + ", ".join(f"{c['name']} {len(c['ids'])} ids gap {c['min_top2_gap']:.2e}" for c in case_meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
