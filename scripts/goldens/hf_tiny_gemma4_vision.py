#!/usr/bin/env python3
"""A tiny random-weight Gemma 4 with its vision tower, and its transformers outputs, as goldens.

Gemma4ForConditionalGeneration small enough to commit: hf_tiny_gemma4.py's `gemma4` text shape
(PLE, KV sharing, sliding/full layers), a 2-layer Gemma 4 vision encoder (patch embedder with 2-D
position tables, axial rotary embeddings, 8-pixel patches, 3×3 pooling) and the embedder that
projects pooled patches into the text model. Two variants: `gemma4_vision` (causal attention over
the soft tokens, as the small Gemma 4 checkpoints) and `gemma4_vision_bidir`
(`use_bidirectional_attention: "vision"`: an image's soft tokens see each other), and a small
third, `gemma4_vision_clipped` (one-image case only): the tower with `use_clipped_linears`
(every linear clamps its input and output to stored bounds that do cut values) and
`standardize` (pooled rows shifted and scaled by stored vectors), as the large checkpoints
ship it.

The references are transformers' eager outputs as generate() computes them on its first pass:
pixel values, patch positions and soft-token counts from Gemma4ImageProcessorPil (aspect-preserving
resize to whole 3×3 blocks of patches, at most 70 soft tokens) on the two test images of
hf_tiny_gemma3_vision.py (copied here), input_ids with each image expanded as Gemma4Processor
does (begin-of-image, the soft tokens, end-of-image), and mm_token_type_ids. Cases: one image,
two images, text only; logits at every position, plus a greedy continuation with an image.

A small chat template (Gemma 4's turn markers; an image part renders as `<|image|>`, which the
processor expands, text parts verbatim) renders `CHAT_MESSAGES` to the `one_image` prompt
exactly (checked here with transformers' own renderer and expansion), so a server given
those messages and image_a.png must reply with the greedy continuation.

    python scripts/goldens/hf_tiny_gemma4_vision.py   # in the venv regen.sh makes (requirements.txt)
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
from transformers import Gemma4Config, Gemma4ForConditionalGeneration
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_models as base  # noqa: E402
import hf_tiny_gemma4 as g4  # noqa: E402

VOCAB_SIZE = 512
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>",
            "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BOI_ID, EOI_ID, IMAGE_ID = 6, 7, 8
BOA_ID, EOA_ID, AUDIO_ID, VIDEO_ID = 9, 10, 11, 12
PATCH = 8
POOL = 3
MAX_SOFT_TOKENS = 70  # the smallest budget the processor accepts
GREEDY_NEW_TOKENS = 12
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<|turn>' + role + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
# The one_image case as a chat request (the image part is image_a.png).
CHAT_MESSAGES = [{"role": "user", "content": [
    {"type": "text", "text": "What is in "}, {"type": "image"},
    {"type": "text", "text": " this picture?"}]}]


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
        "extra_special_tokens": {"boi_token": "<|image>", "eoi_token": "<image|>",
                                 "image_token": "<|image|>"},
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def config(bidirectional: bool, clipped: bool = False) -> Gemma4Config:
    _, text = g4.variants()["gemma4"]
    text = text.to_dict()
    text.update(vocab_size=VOCAB_SIZE, vocab_size_per_layer_input=VOCAB_SIZE,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                use_bidirectional_attention="vision" if bidirectional else None)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, patch_size=PATCH, pooling_kernel_size=POOL,
        position_embedding_size=64, rms_norm_eps=1e-6,
        use_clipped_linears=clipped, standardize=clipped)
    return Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None,
        boi_token_id=BOI_ID, eoi_token_id=EOI_ID, image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID, boa_token_id=BOA_ID, eoa_token_index=EOA_ID,
        audio_token_id=AUDIO_ID, tie_word_embeddings=True)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """hf_tiny_gemma4's conventions (norms multiply directly, centred on 1) for every tower."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                post = ".post_attention_layernorm." in name or ".post_feedforward_layernorm" in name
                centre = 1.0 + base.GEMMA_POST_NORM_OFFSET if post and ".vision_tower." not in name else 1.0
                param.copy_(centre + base.NORM_STD * noise)
            elif "layer_scalar" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            else:
                param.copy_(base.WEIGHT_STD * noise)


def init_clip_buffers(model: torch.nn.Module, seed: int) -> None:
    """Clip bounds tight enough to cut activations (0.5 to 1.5 either side of 0) and a
    standardization that moves every channel."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buf.fill_(-0.5 - float(torch.rand(1, generator=gen)))
            elif name.endswith(("input_max", "output_max")):
                buf.fill_(0.5 + float(torch.rand(1, generator=gen)))
            elif name.endswith("std_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen))
            elif name.endswith("std_scale"):
                buf.copy_(0.5 + torch.rand(buf.shape, generator=gen))


@torch.no_grad()
def logits_of(model, ids, px, pos, block: bool = True) -> torch.Tensor:
    """Logits at every position; `block` passes mm_token_type_ids (what the bidirectional
    variant's image block is built from)."""
    kwargs = {}
    if px is not None:
        kwargs = {"pixel_values": px, "image_position_ids": pos}
        if block:
            kwargs["mm_token_type_ids"] = torch.tensor([[int(t == IMAGE_ID) for t in ids]])
    out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                use_cache=False, **kwargs)
    return out.logits[0].float().contiguous()


def spans(ids: list[int]) -> list[list[int]]:
    out = []
    for i, t in enumerate(ids):
        if t == IMAGE_ID and (i == 0 or ids[i - 1] != IMAGE_ID):
            out.append([i, 0])
        if t == IMAGE_ID:
            out[-1][1] += 1
    return out


def build(name: str, bidirectional: bool, root: Path, image_paths: list[Path],
          clipped: bool = False) -> None:
    out_dir = root / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    seed = base.variant_seed(name)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration._from_config(config(bidirectional, clipped),
                                                         attn_implementation="eager", dtype=torch.float32)
    init_weights(model, seed)
    if clipped:
        init_clip_buffers(model, seed)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    processor = Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=POOL,
                                        max_soft_tokens=MAX_SOFT_TOKENS)
    processor.save_pretrained(out_dir)
    for p in image_paths:
        shutil.copy(p, out_dir / p.name)
    model = Gemma4ForConditionalGeneration.from_pretrained(out_dir, attn_implementation="eager",
                                                            dtype=torch.float32)
    model.eval()

    images = [Image.open(p).convert("RGB") for p in image_paths]
    inputs = processor(images=images, return_tensors="pt")
    px, pos = inputs["pixel_values"].float(), inputs["image_position_ids"]
    # The model pools each image's real (unpadded) patches 3×3: that many soft tokens. (On
    # these images the processor's own num_soft_tokens_per_image says one more, which the
    # model then refuses; the count the model takes is the one recorded.)
    counts = [int((p != -1).all(-1).sum()) // POOL**2 for p in pos]
    processor_counts = [int(n) for n in inputs["num_soft_tokens_per_image"]]
    block = lambda k: "<|image>" + "<|image|>" * counts[k] + "<image|>"
    turn = lambda body: f"<bos><|turn>user\n{body}<turn|>\n<|turn>model\n"
    cases = {
        "one_image": (turn(f"What is in {block(0)} this picture?"), slice(0, 1)),
        "two_images": (turn(f"Compare {block(0)} with {block(1)} please."), slice(0, 2)),
        "text_only": (turn("What is the capital of France?"), None),
    }
    if clipped:
        cases = {"one_image": cases["one_image"]}
    # Every variant reads the same pixels: stored once, with the first variant.
    tensors = {} if name != "gemma4_vision" else {
        "pixel_values": px.contiguous(), "image_position_ids": pos.to(torch.int64).contiguous()}
    metas = []
    for case, (text, sel) in cases.items():
        ids = tok.encode(text).ids
        logits = logits_of(model, ids, None if sel is None else px[sel], None if sel is None else pos[sel])
        tensors[f"{case}.logits"] = logits
        meta = {"name": case, "text": text, "ids": ids, "spans": spans(ids),
                "argmax": logits.argmax(-1).tolist(), "min_top2_gap": base.top2_gap(logits)}
        if sel is not None:
            blind = logits_of(model, ids, None, None)
            meta["max_diff_without_pixels"] = float((blind - logits).abs().max())
            if meta["max_diff_without_pixels"] < 1e-2:
                raise SystemExit(f"{name} {case}: the image does not change the logits")
            if clipped:
                for module in model.modules():
                    if hasattr(module, "use_clipped_linears"):
                        module.use_clipped_linears = False
                unclipped = logits_of(model, ids, px[sel], pos[sel])
                for module in model.modules():
                    if hasattr(module, "use_clipped_linears"):
                        module.use_clipped_linears = True
                meta["max_diff_unclipped"] = float((unclipped - logits).abs().max())
                if meta["max_diff_unclipped"] < 1e-2:
                    raise SystemExit(f"{name} {case}: the clip bounds do not cut anything")
            if bidirectional:
                causal = logits_of(model, ids, px[sel], pos[sel], block=False)
                meta["max_diff_causal_image"] = float((causal - logits).abs().max())
                if meta["max_diff_causal_image"] < 1e-2:
                    raise SystemExit(f"{name} {case}: bidirectional attention does not show")
        metas.append(meta)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(out_dir)
    rendered = hf_tok.apply_chat_template(CHAT_MESSAGES, tokenize=False, add_generation_prompt=True)
    if rendered.replace("<|image|>", block(0), 1) != cases["one_image"][0]:
        raise SystemExit(f"{name}: the chat template renders {rendered!r}, not the one_image prompt")
    ids = metas[0]["ids"]
    tt = torch.tensor([[int(t == IMAGE_ID) for t in ids]])
    out = model.generate(input_ids=torch.tensor([ids]), pixel_values=px[:1], image_position_ids=pos[:1],
                         mm_token_type_ids=tt, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS)
    continuation = out[0, len(ids):].tolist()
    # A random model may write the image soft token; a prompt holding one more soft token than
    # images is not a valid input, so the continuation stops before it.
    if IMAGE_ID in continuation:
        continuation = continuation[:continuation.index(IMAGE_ID)]
    seq = list(ids)
    for t in continuation:
        if int(logits_of(model, seq, px[:1], pos[:1])[-1].argmax()) != t:
            raise SystemExit(f"{name}: generate() disagrees with the uncached argmax loop")
        seq.append(t)
    save_file(tensors, str(out_dir / "logits.safetensors"), metadata={"format": "pt"})
    reference = {
        "variant": name, "architecture": type(model).__name__,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "tokenizers": tokenizers.__version__, "dtype": "float32", "attn_implementation": "eager",
        "seed": seed, "image_token_id": IMAGE_ID, "images": [p.name for p in image_paths],
        "num_soft_tokens_per_image": counts,
        "processor_num_soft_tokens_per_image": processor_counts,
        "pixel_shapes": [list(img.size[::-1]) for img in images],
        "cases": metas,
        "greedy": {"case": "one_image", "max_new_tokens": GREEDY_NEW_TOKENS,
                   "continuation_ids": continuation},
        "chat": {"case": "one_image", "messages": CHAT_MESSAGES, "images": ["image_a.png"],
                 "rendered": rendered},
    }
    (out_dir / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"{name}: {total} bytes; soft tokens {counts}; greedy {continuation}; "
          + ", ".join(f"{m['name']} {len(m['ids'])} ids gap {m['min_top2_gap']:.2e}" for m in metas))


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[2]
    root = repo / "crates" / "wick-engine" / "tests" / "goldens" / "hf"
    images = [root / "gemma3_vision" / "image_a.png", root / "gemma3_vision" / "image_b.png"]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tokenizers {tokenizers.__version__}")
    build("gemma4_vision", False, root, images)
    build("gemma4_vision_bidir", True, root, images)
    build("gemma4_vision_clipped", False, root, images, clipped=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
