"""Test media and the transformers processors' tensors for them (wick-media's goldens).

Writes small real files (PNG with alpha, EXIF-rotated JPEG, lossless WebP, GIF, BMP, TIFF,
a 16 kHz mono WAV and a 44.1 kHz stereo WAV) under crates/wick-media/tests/data/, and what
transformers 5.24's PIL image processors (Gemma 3, Gemma 4, Qwen-VL) and Gemma 4's audio
feature extractor make of them:
raw little-endian f32 files plus `goldens.json` naming shapes and token counts.

Run in the venv regen.sh makes (requirements.txt): python scripts/goldens/media_processors.py
"""

import io
import json
import math
import pathlib

import numpy as np
import PIL.Image
import soundfile
from transformers.image_utils import load_image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

OUT = pathlib.Path(__file__).resolve().parents[2] / "crates" / "wick-media" / "tests" / "data"
RNG = np.random.default_rng(27)

# Gemma 3 square sizes: one downscale and one upscale of the ~60 px test images.
GEMMA3_SIZES = [32, 80]
# Gemma 4 with a 4 px patch keeps the tensors small while exercising the same size rule
# (multiples of patch × pool, within max_soft_tokens × pool² patches).
GEMMA4 = {"patch_size": 4, "pooling_kernel_size": 3, "max_soft_tokens": 70}
# Qwen-VL's smart resize with small patches and pixel budgets, so that the ~60 px test images
# are rounded, scaled up and scaled down: Qwen 3.5's mean/std 0.5, and Qwen2.5-VL's CLIP values.
QWEN = [
    {"patch_size": 8, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 48 * 48,
     "max_pixels": 64 * 64, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 16 * 16,
     "max_pixels": 40 * 40, "image_mean": [0.48145466, 0.4578275, 0.40821073],
     "image_std": [0.26862954, 0.26130258, 0.27577711]},
]


def smooth_rgb(w, h):
    """A gradient with noise: resampling errors show up, compression stays plausible."""
    y, x = np.mgrid[0:h, 0:w]
    r = 255 * x / max(w - 1, 1)
    g = 255 * y / max(h - 1, 1)
    b = 128 + 100 * np.sin(x / 5.0) * np.cos(y / 7.0)
    img = np.stack([r, g, b], axis=-1) + RNG.normal(0, 12, (h, w, 3))
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def exif_with_orientation(value):
    exif = PIL.Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


def write_images():
    files = {}
    rgba = np.concatenate(
        [smooth_rgb(61, 47), np.clip(RNG.integers(0, 256, (47, 61, 1)), 0, 255).astype(np.uint8)],
        axis=-1,
    )
    rgba[:10, :10, 3] = 0  # fully transparent corner
    rgba[-8:, -8:, 3] = 255  # opaque corner
    PIL.Image.fromarray(rgba, "RGBA").save(OUT / "alpha.png")
    files["alpha.png"] = "png"

    # Stored landscape 64×40 with orientation 6 (rotate 90° clockwise to view): portrait.
    PIL.Image.fromarray(smooth_rgb(64, 40)).save(
        OUT / "exif_rotated.jpg", quality=90, exif=exif_with_orientation(6)
    )
    files["exif_rotated.jpg"] = "jpeg"

    PIL.Image.fromarray(smooth_rgb(50, 70)).save(OUT / "lossless.webp", lossless=True)
    files["lossless.webp"] = "webp"

    frames = [PIL.Image.fromarray(smooth_rgb(40, 30)).quantize(64) for _ in range(2)]
    frames[0].save(OUT / "two_frames.gif", save_all=True, append_images=frames[1:], duration=100)
    files["two_frames.gif"] = "gif"

    PIL.Image.fromarray(smooth_rgb(33, 21)).save(OUT / "plain.bmp")
    files["plain.bmp"] = "bmp"

    PIL.Image.fromarray(smooth_rgb(45, 30)).save(OUT / "plain.tiff")
    files["plain.tiff"] = "tiff"
    return files


def write_audio():
    t16 = np.arange(int(16000 * 1.3)) / 16000
    mono = 0.4 * np.sin(2 * math.pi * 440 * t16) + 0.2 * np.sin(2 * math.pi * 1234 * t16)
    mono += RNG.normal(0, 0.02, mono.shape)
    soundfile.write(OUT / "mono16k.wav", mono, 16000, subtype="PCM_16")
    # The same clip in the compressed containers, for the decoder's tests (complete and cut).
    soundfile.write(OUT / "mono16k.flac", mono, 16000, subtype="PCM_16")
    soundfile.write(OUT / "mono16k.ogg", mono, 16000, format="OGG", subtype="VORBIS")
    soundfile.write(OUT / "mono16k.mp3", mono, 16000, format="MP3")

    t44 = np.arange(int(44100 * 1.1)) / 44100
    left = 0.5 * np.sin(2 * math.pi * 300 * t44) + RNG.normal(0, 0.01, t44.shape)
    right = 0.3 * np.sin(2 * math.pi * 2500 * t44) + RNG.normal(0, 0.01, t44.shape)
    soundfile.write(OUT / "stereo44k.wav", np.stack([left, right], axis=-1), 44100, subtype="PCM_16")
    return {"mono16k.wav": 16000, "stereo44k.wav": 44100}


def save_f32(name, array):
    np.ascontiguousarray(array, dtype="<f4").tofile(OUT / name)
    return name


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = {"images": [], "audio": []}
    for name, fmt in write_images().items():
        image = load_image(str(OUT / name))  # applies EXIF orientation
        entry = {"file": name, "format": fmt, "width": image.width, "height": image.height}
        entry["gemma3"] = []
        for size in GEMMA3_SIZES:
            proc = Gemma3ImageProcessorPil(size={"height": size, "width": size})
            pixels = proc(image, return_tensors="np")["pixel_values"][0]
            stem = name.replace(".", "_")
            entry["gemma3"].append(
                {"size": size, "shape": list(pixels.shape),
                 "values": save_f32(f"{stem}.gemma3_{size}.f32", pixels)}
            )
        proc = Gemma4ImageProcessorPil(**GEMMA4)
        out = proc(image, return_tensors="np")
        n = int(out["num_soft_tokens_per_image"][0])
        # Unpatchify the real patches back to [c, h, w].
        pos = out["image_position_ids"][0]
        real = pos[:, 0] >= 0
        p = GEMMA4["patch_size"]
        gw, gh = int(pos[real, 0].max()) + 1, int(pos[real, 1].max()) + 1
        patches = out["pixel_values"][0][real].reshape(gh, gw, p, p, 3)
        chw = patches.transpose(4, 0, 2, 1, 3).reshape(3, gh * p, gw * p)
        entry["gemma4"] = {**GEMMA4, "shape": list(chw.shape), "soft_tokens": n,
                           "values": save_f32(f"{name.replace('.', '_')}.gemma4.f32", chw)}
        entry["qwen"] = []
        for k, q in enumerate(QWEN):
            proc = Qwen2VLImageProcessorPil(
                patch_size=q["patch_size"], merge_size=q["merge_size"],
                temporal_patch_size=q["temporal_patch_size"],
                size={"shortest_edge": q["min_pixels"], "longest_edge": q["max_pixels"]},
                image_mean=q["image_mean"], image_std=q["image_std"])
            out = proc(image, return_tensors="np")
            _, gh, gw = (int(v) for v in out["image_grid_thw"][0])
            p, m, t = q["patch_size"], q["merge_size"], q["temporal_patch_size"]
            # Patch rows (window row, window column, row, column; each [c][frame][y][x]) back
            # to the first frame's [c, h, w].
            rows = out["pixel_values"].reshape(gh // m, gw // m, m, m, 3, t, p, p)[:, :, :, :, :, 0]
            chw = rows.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p)
            entry["qwen"].append({**q, "shape": list(chw.shape),
                                  "soft_tokens": gh * gw // (m * m),
                                  "values": save_f32(f"{name.replace('.', '_')}.qwen{k}.f32", chw)})
        manifest["images"].append(entry)

    extractor = Gemma4AudioFeatureExtractor()
    for name, rate in write_audio().items():
        samples, sr = soundfile.read(OUT / name, dtype="float32")
        entry = {"file": name, "rate": sr, "channels": 1 if samples.ndim == 1 else samples.shape[1]}
        if samples.ndim == 2:
            samples = samples.mean(axis=1, dtype=np.float32)
        if sr != 16000:
            import librosa  # the usual way callers bring audio to 16 kHz (soxr_hq)

            samples = librosa.resample(samples, orig_sr=sr, target_sr=16000).astype(np.float32)
            entry["resampled_by"] = "librosa soxr_hq"
        out = extractor([samples], return_tensors="np")
        feats = out["input_features"][0]
        mask = out["input_features_mask"][0]
        t = len(mask)
        for _ in range(2):
            t_out = (t + 2 - 3) // 2 + 1
            mask = mask[::2][:t_out]
            t = len(mask)
        entry.update({"samples_16k": len(samples), "shape": list(feats.shape),
                      "soft_tokens": int(mask.sum()),
                      "values": save_f32(f"{name.replace('.', '_')}.mel.f32", feats)})
        manifest["audio"].append(entry)

    (OUT / "goldens.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
