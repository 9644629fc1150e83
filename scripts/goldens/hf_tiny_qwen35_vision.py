#!/usr/bin/env python3
"""A tiny random-weight Qwen 3.5 with its vision tower, and its transformers outputs, as goldens.

Qwen3_5ForConditionalGeneration small enough to commit: hf_tiny_qwen35.py's `qwen35` text shape
(three DeltaNet layers around one full-attention layer, a quarter of the head rotated with
interleaved M-RoPE sections [2, 1, 1]) and a 2-block vision tower (width 32, 2 heads, 8-pixel
patches, temporal patch 2, 2×2 merge, a 4×4 learned position grid interpolated to each image).
The tokenizer is a byte-level BPE trained here whose special tokens include Qwen's vision tokens.

Pixels come from transformers' PIL image processor (Qwen2VLImageProcessorPil, the class
Qwen 3.5 checkpoints name, with Qwen 3.5's mean/std 0.5) on the two test images of
hf_tiny_gemma3_vision.py and the second one turned to portrait, with min/max pixels small
enough that one image is scaled up by the rounding and the others scaled down by the pixel
budget. Input ids expand each image as Qwen3VLProcessor does: `<|vision_start|>`,
`<|image_pad|>` × (t·h·w / merge²), `<|vision_end|>`.
Cases: one image, two images with text between, text only, text before two adjacent images,
an image in an earlier turn of a multi-turn chat; logits at every position, the 3-D M-RoPE
position ids transformers computes, plus a greedy continuation with an image.

Everything lands in crates/wick-engine/tests/goldens/hf/qwen35_vision/. Deterministic.

    python scripts/goldens/hf_tiny_qwen35_vision.py   # in the venv regen.sh makes (requirements.txt)
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
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_models as base  # noqa: E402

NAME = "qwen35_vision"
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


def config() -> Qwen3_5Config:
    text = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True},
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
        patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
        out_hidden_size=64, num_position_embeddings=16, hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    return Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID, vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID, tie_word_embeddings=False)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """hf_tiny_qwen35's random weights for the text model (RMSNorms multiply by 1 + w, the
    DeltaNet output norm by w), and LayerNorms centred on 1 in the vision tower."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if ".visual." in name and "norm" in name and name.endswith(".bias"):
                param.copy_(base.NORM_STD * noise)
            elif ".visual." in name and "norm" in name:
                param.copy_(1.0 + base.NORM_STD * noise)
            elif ".visual." in name and "pos_embed" in name:
                param.copy_(0.5 * noise)
            elif name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + base.NORM_STD * noise)
            elif "norm" in name:
                param.copy_(base.NORM_STD * noise)
            elif name.endswith("A_log"):
                param.copy_(-0.5 + 0.5 * noise)
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * noise)
            elif "conv1d" in name:
                param.copy_(0.4 * noise)
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
    return write_golden(NAME, Qwen3_5ForConditionalGeneration, config(), init_weights,
                        mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])


def write_golden(golden: str, model_class, model_config, init, mean: list[float],
                 std: list[float]) -> int:
    """Builds golden `golden` (model, tokenizer, processor, pixels, logits, positions, greedy
    continuation) from a multimodal Qwen class, its tiny config and its weight initializer;
    hf_tiny_qwen25_vl.py uses it too."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[2]
    out_dir = repo / "crates" / "wick-engine" / "tests" / "goldens" / "hf" / golden
    images_dir = out_dir.parent / "gemma3_vision"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tokenizers {tokenizers.__version__}")

    seed = base.variant_seed(golden)
    torch.manual_seed(seed)
    model = model_class._from_config(model_config, attn_implementation="eager",
                                     dtype=torch.float32)
    init(model, seed)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)

    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        image_mean=mean, image_std=std)
    processor.save_pretrained(out_dir)

    model = model_class.from_pretrained(out_dir, attn_implementation="eager",
                                        dtype=torch.float32)
    model.eval()

    names = ["image_a.png", "image_b.png", "image_c.png"]
    for n in names[:2]:
        shutil.copy(images_dir / n, out_dir / n)
    # A portrait picture (image_b turned a quarter): more merged rows than columns, so the
    # text after it resumes past its rows, where the landscape ones resume past their columns.
    Image.open(out_dir / names[1]).transpose(Image.Transpose.ROTATE_90).save(out_dir / names[2])
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
        # Text before two adjacent images of different grids and aspect ratios (the portrait
        # one first), nothing after.
        "text_then_images": (turn(f"Describe {image_block(tokens[2])}{image_block(tokens[0])}"),
                             [2, 0]),
        # A portrait image in the first user turn, an assistant reply, then a second user turn
        # of text: every later position is shifted by the image.
        "image_then_turns": (turn(f"{image_block(tokens[2])} What is this?")
                             + "A small picture.<|im_end|>\n"
                             + turn("And the colours?"), [2]),
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
        "variant": golden,
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
    print(f"{golden}: {total} bytes; images {image_meta}; greedy {continuation}; "
          + ", ".join(f"{c['name']} {len(c['ids'])} ids gap {c['min_top2_gap']:.2e}" for c in case_meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
