#!/usr/bin/env python3
"""A tiny random-weight Gemma 4 with its audio tower, and its transformers outputs, as goldens.

Gemma4ForConditionalGeneration small enough to commit: hf_tiny_gemma4.py's `gemma4` text shape
(PLE, KV sharing, sliding/full layers), the tokenizer of hf_tiny_gemma4_vision.py (with the
<|audio>, <audio|>, <|audio|> specials) and a 2-layer Gemma 4 audio Conformer with the real
structure at small widths: the SSCP subsampler (two 3×3 stride-2 convolutions with LayerNorm
and ReLU; the first keeps 128 channels because the projection's input width is
`channels[0] / 4 × channels[1]`, which must equal the 32 frequency rows left of 128 mel bins),
the sinusoidal relative positions, chunked local attention (chunk 12, left context 13, right 0,
logit cap 50), the light depthwise causal convolution, half-step feed-forwards, clipped linears
with finite random bounds (so the clipping shows), the output projection and `embed_audio`.

The references are transformers' eager outputs: input_features and input_features_mask from
Gemma4AudioFeatureExtractor on the WAVs of the wick-media tests (16 kHz mono; 44.1 kHz stereo
averaged and brought to 16 kHz with librosa's soxr_hq, as media_processors.py does),
the tower's projected rows (`embed_audio` of the valid frames), input_ids with the clip expanded
as Gemma4Processor does (begin-of-audio, one soft token per valid subsampled frame, end-of-audio),
and logits at every position for a mono clip, a stereo clip and text only, plus a greedy
continuation with the mono clip. A chat template (audio parts as <|audio|>) is written with the
tokenizer so the directory can be served. A second model, `gemma4_audio_vision`, adds
hf_tiny_gemma4_vision.py's vision tower, with the logits of one prompt holding an image and the
mono clip.

    python scripts/goldens/hf_tiny_gemma4_audio.py   # in the venv regen.sh makes (requirements.txt)
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import librosa
import numpy as np
import soundfile
import torch
import transformers
import tokenizers
from safetensors.torch import save_file
from transformers import Gemma4Config, Gemma4ForConditionalGeneration
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_tiny_models as base  # noqa: E402
import hf_tiny_gemma4 as g4  # noqa: E402
import hf_tiny_gemma4_vision as g4v  # noqa: E402

NAME = "gemma4_audio"
GREEDY_NEW_TOKENS = 12
AUDIO_ID = g4v.AUDIO_ID

# A Gemma 4-style chat template written for this model: turns between <|turn> and <turn|>,
# the assistant's role named "model", each audio part an <|audio|> marker, each image an
# <|image|> marker, text parts trimmed.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<|turn>' + role + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] | trim }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)


def config(vision: bool = False) -> Gemma4Config:
    _, text = g4.variants()["gemma4"]
    text = text.to_dict()
    text.update(vocab_size=g4v.VOCAB_SIZE, vocab_size_per_layer_input=g4v.VOCAB_SIZE,
                bos_token_id=g4v.BOS_ID, eos_token_id=g4v.EOS_ID, pad_token_id=g4v.PAD_ID)
    audio = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        subsampling_conv_channels=[128, 8], conv_kernel_size=5, residual_weight=0.5,
        attention_chunk_size=12, attention_context_left=13, attention_context_right=0,
        attention_logit_cap=50.0, use_clipped_linears=True, rms_norm_eps=1e-6,
        output_proj_dims=24)
    vision_config = g4v.config(False).vision_config.to_dict() if vision else None
    return Gemma4Config(
        text_config=text, vision_config=vision_config, audio_config=audio,
        boi_token_id=g4v.BOI_ID, eoi_token_id=g4v.EOI_ID, image_token_id=g4v.IMAGE_ID,
        video_token_id=g4v.VIDEO_ID, boa_token_id=g4v.BOA_ID, eoa_token_index=g4v.EOA_ID,
        audio_token_id=AUDIO_ID, tie_word_embeddings=True)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """hf_tiny_gemma4_vision's weights, the audio tower's logit-scaling vector near zero, and
    finite clip bounds on every clipped linear (a random band around ±1.5) so clipping acts."""
    g4v.init_weights(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if ".audio_tower." not in f".{name}" or not name.rsplit(".", 1)[-1] in (
                    "input_min", "input_max", "output_min", "output_max"):
                continue
            bound = 1.0 + torch.rand((), generator=gen)
            buf.copy_(-bound if name.endswith("_min") else bound)


@torch.no_grad()
def logits_of(model, ids, feats=None, mask=None) -> torch.Tensor:
    kwargs = {}
    if feats is not None:
        kwargs = {"input_features": feats, "input_features_mask": mask}
    out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                use_cache=False, **kwargs)
    return out.logits[0].float().contiguous()


def spans(ids: list[int]) -> list[list[int]]:
    out = []
    for i, t in enumerate(ids):
        if t == AUDIO_ID and (i == 0 or ids[i - 1] != AUDIO_ID):
            out.append([i, 0])
        if t == AUDIO_ID:
            out[-1][1] += 1
    return out


def load_clip(path: Path) -> np.ndarray:
    samples, rate = soundfile.read(path, dtype="float32")
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float32)
    if rate != 16000:
        samples = librosa.resample(samples, orig_sr=rate, target_sr=16000).astype(np.float32)
    return samples


def build_both(root: Path, clip: dict, image_path: Path) -> None:
    """`gemma4_audio_vision`: the same shapes with hf_tiny_gemma4_vision.py's vision tower as
    well, and one prompt holding an image and the mono clip. The image is stored as the
    `[3, h, w]` pixels the server hands the engine (the processor's patches put back)."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    name = "gemma4_audio_vision"
    out_dir = root / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    seed = base.variant_seed(name)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration._from_config(config(vision=True), attn_implementation="eager",
                                                         dtype=torch.float32)
    init_weights(model, seed)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = g4v.build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(g4v.tokenizer_config(), indent=2) + "\n")
    processor = Gemma4ImageProcessorPil(patch_size=g4v.PATCH, pooling_kernel_size=g4v.POOL,
                                        max_soft_tokens=g4v.MAX_SOFT_TOKENS)
    processor.save_pretrained(out_dir)
    inputs = processor(images=[Image.open(image_path).convert("RGB")], return_tensors="pt")
    px, pos = inputs["pixel_values"].float(), inputs["image_position_ids"]
    real = (pos[0] != -1).all(-1)
    n_image = int(real.sum()) // g4v.POOL**2
    gw, gh = int(pos[0][real, 0].max()) + 1, int(pos[0][real, 1].max()) + 1
    p = g4v.PATCH
    chw = px[0][real].reshape(gh, gw, p, p, 3).permute(4, 0, 2, 1, 3).reshape(3, gh * p, gw * p)
    n_audio = clip["soft_tokens"]
    body = ("Compare<|image>" + "<|image|>" * n_image + "<image|>with<|audio>"
            + "<|audio|>" * n_audio + "<audio|>please.")
    text = f"<bos><|turn>user\n{body}<turn|>\n<|turn>model\n"
    ids = tok.encode(text).ids
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    pixel_values=px, image_position_ids=pos, input_features=clip["x"],
                    input_features_mask=clip["m"], use_cache=False)
    logits = out.logits[0].float().contiguous()
    with torch.no_grad():
        blind = model(input_ids=torch.tensor([ids]), pixel_values=px, image_position_ids=pos,
                      use_cache=False).logits[0].float()
    diff = float((blind - logits).abs().max())
    if diff < 1e-2:
        raise SystemExit(f"{name}: the audio does not change the logits")
    save_file({"both.logits": logits, "image": chw.contiguous(), "mono16k.features": clip["x"][0].contiguous()},
              str(out_dir / "logits.safetensors"), metadata={"format": "pt"})
    spans_ = [[i, 0] for i, t in enumerate(ids) if t in (g4v.IMAGE_ID, AUDIO_ID) and ids[i - 1] != t]
    for sp in spans_:
        t = ids[sp[0]]
        while sp[0] + sp[1] < len(ids) and ids[sp[0] + sp[1]] == t:
            sp[1] += 1
    reference = {
        "variant": name, "architecture": type(model).__name__,
        "transformers": transformers.__version__, "torch": torch.__version__, "seed": seed,
        "image": image_path.name, "image_shape": list(chw.shape),
        "clip": {kk: vv for kk, vv in clip.items() if kk not in ("x", "m")},
        "cases": [{"name": "both", "text": text, "ids": ids, "spans": spans_,
                   "argmax": logits.argmax(-1).tolist(), "min_top2_gap": base.top2_gap(logits),
                   "max_diff_without_audio": diff}],
    }
    (out_dir / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"{name}: {total} bytes; image {n_image} + audio {n_audio} soft tokens; diff without audio {diff:.2e}")


def main() -> int:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    repo = Path(__file__).resolve().parents[2]
    out_dir = repo / "crates" / "wick-engine" / "tests" / "goldens" / "hf" / NAME
    wavs = [repo / "crates" / "wick-media" / "tests" / "data" / n for n in ("mono16k.wav", "stereo44k.wav")]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tokenizers {tokenizers.__version__}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    seed = base.variant_seed(NAME)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration._from_config(config(), attn_implementation="eager",
                                                         dtype=torch.float32)
    init_weights(model, seed)
    model.eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = g4v.build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    tok_cfg = g4v.tokenizer_config()
    tok_cfg["extra_special_tokens"].update(boa_token="<|audio>", eoa_token="<audio|>",
                                           audio_token="<|audio|>")
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    extractor = Gemma4AudioFeatureExtractor()
    extractor.save_pretrained(out_dir)
    for p in wavs:
        shutil.copy(p, out_dir / p.name)
    model = Gemma4ForConditionalGeneration.from_pretrained(out_dir, attn_implementation="eager",
                                                            dtype=torch.float32)
    model.eval()

    tensors = {}
    clips = {}
    for p in wavs:
        samples = load_clip(p)
        feats = extractor([samples], return_tensors="pt")
        x, m = feats["input_features"].float(), feats["input_features_mask"].bool()
        with torch.no_grad():
            audio = model.model.get_audio_features(x, m, return_dict=True)
        valid = audio.attention_mask[0]
        rows = audio.pooler_output[0][valid]
        key = p.stem
        tensors[f"{key}.features"] = x[0].contiguous()
        tensors[f"{key}.rows"] = rows.float().contiguous()
        # What Gemma4Processor writes for the clip: the frame mask through the two stride-2
        # convolutions, counted.
        mask = m[0].tolist()
        for _ in range(2):
            mask = mask[::2][:(len(mask) + 2 - 3) // 2 + 1]
        processor_tokens = sum(mask)
        if processor_tokens != rows.shape[0]:
            raise SystemExit(f"{key}: the processor counts {processor_tokens} soft tokens, the tower {rows.shape[0]}")
        ms = len(samples) * 1000 / 16000
        clips[key] = {"file": p.name, "samples_16k": len(samples), "frames": int(x.shape[1]),
                      "valid_frames": int(m[0].sum()), "soft_tokens": int(rows.shape[0]),
                      "ceil_ms_over_40": math.ceil(ms / 40), "x": x, "m": m}

    block = lambda key: "<|audio>" + "<|audio|>" * clips[key]["soft_tokens"] + "<audio|>"
    turn = lambda body: f"<bos><|turn>user\n{body}<turn|>\n<|turn>model\n"
    cases = {
        "mono": (turn(f"Transcribe{block('mono16k')}this clip."), "mono16k"),
        "stereo": (turn(f"Transcribe{block('stereo44k')}this clip."), "stereo44k"),
        "text_only": (turn("What is the capital of France?"), None),
    }
    metas = []
    for case, (text, key) in cases.items():
        ids = tok.encode(text).ids
        feats = (clips[key]["x"], clips[key]["m"]) if key else (None, None)
        logits = logits_of(model, ids, *feats)
        tensors[f"{case}.logits"] = logits
        meta = {"name": case, "text": text, "ids": ids, "spans": spans(ids), "clip": key,
                "argmax": logits.argmax(-1).tolist(), "min_top2_gap": base.top2_gap(logits)}
        if key is not None:
            blind = logits_of(model, ids)
            meta["max_diff_without_audio"] = float((blind - logits).abs().max())
            if meta["max_diff_without_audio"] < 1e-2:
                raise SystemExit(f"{case}: the audio does not change the logits")
        metas.append(meta)
    ids = metas[0]["ids"]
    x, m = clips["mono16k"]["x"], clips["mono16k"]["m"]
    out = model.generate(input_ids=torch.tensor([ids]), input_features=x, input_features_mask=m,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS)
    continuation = out[0, len(ids):].tolist()
    # A prompt holding more audio soft tokens than the clip gives is not a valid input, so the
    # continuation stops before a generated one.
    if AUDIO_ID in continuation:
        continuation = continuation[:continuation.index(AUDIO_ID)]
    seq = list(ids)
    for t in continuation:
        if int(logits_of(model, seq, x, m)[-1].argmax()) != t:
            raise SystemExit("generate() disagrees with the uncached argmax loop")
        seq.append(t)
    save_file(tensors, str(out_dir / "logits.safetensors"), metadata={"format": "pt"})
    reference = {
        "variant": NAME, "architecture": type(model).__name__,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "tokenizers": tokenizers.__version__, "dtype": "float32", "attn_implementation": "eager",
        "seed": seed, "audio_token_id": AUDIO_ID,
        "clips": {k: {kk: vv for kk, vv in v.items() if kk not in ("x", "m")} for k, v in clips.items()},
        "cases": metas,
        "greedy": {"case": "mono", "max_new_tokens": GREEDY_NEW_TOKENS,
                   "continuation_ids": continuation},
    }
    (out_dir / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"{NAME}: {total} bytes; clips {[(k, v['soft_tokens'], v['ceil_ms_over_40']) for k, v in clips.items()]}; "
          f"greedy {continuation}; "
          + ", ".join(f"{m['name']} {len(m['ids'])} ids gap {m['min_top2_gap']:.2e} "
                      f"diff {m.get('max_diff_without_audio', 0):.2e}" for m in metas))
    build_both(out_dir.parent, clips["mono16k"], out_dir.parent / "gemma3_vision" / "image_a.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
