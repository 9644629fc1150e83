#!/usr/bin/env python3
"""A served Qwen-VL model against transformers, through /v1/chat/completions.

Sends chat requests of several image layouts to a running `wick serve MODEL_DIR` and compares
the first generated token's top-5 log-probs with transformers' on the same messages: the
model's own chat template (rendered by transformers), images decoded by PIL and prepared by
the PIL image processor (Qwen2VLImageProcessorPil, the backend wick follows), and the forward
pass given `mm_token_type_ids` as Qwen's processors make them. The layouts: an image first,
text before an image, two adjacent images of different sizes and aspect ratios, two images
with text between and after, an image in an earlier turn followed by an assistant reply and
another user turn, images to scale up and far down, PNG, JPEG and WebP.

Works on a Qwen2.5-VL or Qwen 3.5 (vision) checkpoint directory, e.g. the tiny goldens:

    wick serve crates/wick-engine/tests/goldens/hf/qwen25_vl --port 8091 &
    python scripts/served_qwen_vl.py crates/wick-engine/tests/goldens/hf/qwen25_vl \
        --url http://127.0.0.1:8091

Exits 1 when a log-prob differs by more than --tol (default 1e-3) from transformers'.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import urllib.request

import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

PAD = "<|image_pad|>"


def picture(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colour fields with a disc and some noise: photo-like enough for every codec."""
    gen = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    r = 127 + 120 * torch.sin(x / (7.0 + seed)) * torch.cos(y / 11.0)
    g = x * 255.0 / width
    b = ((x - width / 3) ** 2 + (y - height / 2) ** 2 < (min(width, height) / 3) ** 2) * 190.0 + 30
    noise = torch.randn(height, width, 3, generator=gen) * 12
    rgb = (torch.stack([r, g, b], -1) + noise).clamp(0, 255).to(torch.uint8)
    return Image.fromarray(rgb.numpy())


def encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({} if fmt == "PNG" else {"quality": 85}))
    return buf.getvalue()


IMAGES = {
    "landscape": (picture(48, 32, 1), "PNG"),
    "portrait": (picture(40, 72, 2), "PNG"),
    "tiny": (picture(20, 12, 3), "PNG"),
    "photo": (picture(640, 480, 4), "JPEG"),
    "wide": (picture(1000, 300, 5), "WEBP"),
}


def user(*parts):
    return {"role": "user", "content": [
        {"type": "image", "image": p[1:]} if p.startswith("@") else {"type": "text", "text": p}
        for p in parts]}


CASES = {
    "image_first": [user("@landscape", "What is this?")],
    "text_before_image": [user("What is in", "@portrait", " this picture?")],
    "text_then_two_images": [user("Compare", "@landscape", "@portrait")],
    "two_images_text_between": [user("Compare", "@photo", " with ", "@wide", " please.")],
    "scaled_up": [user("@tiny", "What?")],
    "image_in_earlier_turn": [user("@portrait", "What is this?"),
                              {"role": "assistant", "content": "A small picture."},
                              user("And the colours?")],
    "three_images": [user("@wide", "One", "@tiny", "two", "@photo", "three.")],
}


def reference(model, tok, proc, image_token_id, messages):
    """transformers' first-token log-probs for `messages`."""
    images = [Image.open(io.BytesIO(encoded(*IMAGES[p["image"]]))).convert("RGB")
              for m in messages if isinstance(m["content"], list)
              for p in m["content"] if p["type"] == "image"]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kwargs = {}
    if images:
        batch = proc(images=images, return_tensors="pt")
        merge = proc.merge_size ** 2
        pieces = text.split(PAD)
        if len(pieces) != len(images) + 1:
            raise SystemExit(f"the template wrote {len(pieces) - 1} image pads for {len(images)} images")
        counts = [int(t * h * w) // merge for t, h, w in batch["image_grid_thw"].tolist()]
        text = pieces[0] + "".join(PAD * n + rest for n, rest in zip(counts, pieces[1:]))
        kwargs = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if images:
        kwargs["mm_token_type_ids"] = torch.tensor([[int(t == image_token_id) for t in ids]])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kwargs)
    return torch.log_softmax(out.logits[0, -1].float(), -1)


def served(url, messages):
    """wick's first-token top-5 for `messages` (images sent as data URLs)."""
    def part(p):
        if p["type"] != "image":
            return p
        image, fmt = IMAGES[p["image"]]
        data = base64.b64encode(encoded(image, fmt)).decode()
        return {"type": "image_url", "image_url": {"url": f"data:image/{fmt.lower()};base64,{data}"}}
    msgs = [m if isinstance(m["content"], str) else {**m, "content": [part(p) for p in m["content"]]}
            for m in messages]
    body = json.dumps({"model": "m", "messages": msgs, "max_tokens": 1, "temperature": 0,
                       "logprobs": True, "top_logprobs": 5}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--tol", type=float, default=1e-3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(args.model_dir)
    model = AutoModelForImageTextToText.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tok = PreTrainedTokenizerFast.from_pretrained(args.model_dir)
    proc = Qwen2VLImageProcessorPil.from_pretrained(args.model_dir)
    # Token texts as the server reports them (several ids may share one, e.g. partial bytes).
    ids_of: dict[str, list[int]] = {}
    for i in range(len(tok)):
        ids_of.setdefault(tok.decode([i]), []).append(i)
    worst = 0.0
    for name, messages in CASES.items():
        ref = reference(model, tok, proc, config.image_token_id, messages)
        got = served(args.url, messages)
        err = max(min((abs(t["logprob"] - ref[i].item()) for i in ids_of.get(t["token"], [])),
                      default=float("inf")) for t in got)
        worst = max(worst, err)
        top = [tok.decode([i]) for i in ref.topk(5).indices.tolist()]
        print(f"{name:26s} max |Δ logprob| {err:.2e}  wick {[t['token'] for t in got]}  "
              f"transformers {top}")
    print(f"worst {worst:.2e} (tolerance {args.tol})")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
