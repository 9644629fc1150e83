#!/usr/bin/env python3
"""A tiny random-weight Qwen2.5-VL with its vision tower, and its transformers outputs, as goldens.

Qwen2_5_VLForConditionalGeneration small enough to commit: a 2-layer Qwen2 text model (biased
Q/K/V, GQA 4/2, head 16, contiguous M-RoPE sections [2, 3, 3]) and a 3-block vision tower
(width 32, 2 heads, RMSNorms, SwiGLU MLPs, 8-pixel patches, temporal patch 2, 2×2 merge,
window attention over 2×2 merged windows (window_size 32 px) in blocks 0 and 2, full attention
in block 1). The tokenizer, chat template and prompts are hf_tiny_qwen35_vision.py's.

Pixels come from transformers' PIL image processor (Qwen2VLImageProcessorPil with the CLIP
mean/std Qwen2.5-VL uses) on the two test images of
hf_tiny_gemma3_vision.py and the second one turned to portrait, with min/max pixels small
enough that one image is scaled up by the rounding and the others scaled down by the pixel
budget. Input ids expand each image as Qwen3VLProcessor does: `<|vision_start|>`,
`<|image_pad|>` × (t·h·w / merge²), `<|vision_end|>`.
Cases: one image, two images with text between, text only, text before two adjacent images,
an image in an earlier turn of a multi-turn chat; logits at every position, the 3-D M-RoPE
position ids transformers computes, plus a greedy continuation with an image.

Everything lands in crates/wick-engine/tests/goldens/hf/qwen25_vl/. Deterministic.

    python scripts/goldens/hf_tiny_qwen25_vl.py   # in the venv regen.sh makes (requirements.txt)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_models as base  # noqa: E402
import hf_tiny_qwen35_vision as q35  # noqa: E402
from hf_tiny_qwen35_vision import (  # noqa: E402
    BOS_ID, EOS_ID, IMAGE_ID, MERGE, PAD_ID, PATCH, TEMPORAL, VIDEO_ID, VISION_END_ID,
    VISION_START_ID, VOCAB_SIZE)

NAME = "qwen25_vl"
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


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


def main() -> int:
    return q35.write_golden(NAME, Qwen2_5_VLForConditionalGeneration, config(), init_weights,
                            mean=CLIP_MEAN, std=CLIP_STD)


if __name__ == "__main__":
    sys.exit(main())
