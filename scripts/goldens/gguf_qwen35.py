#!/usr/bin/env python3
"""The tiny Qwen 3.5 golden as llama.cpp's converter writes it, for wick's GGUF loader test.

Converts crates/wick-engine/tests/goldens/hf/qwen35 (made by hf_tiny_qwen35.py) with the
`convert_hf_to_gguf.py` of llama.cpp as vendored in llama-cpp-python 0.3.36's sdist, to an
f32 GGUF: crates/wick-engine/tests/goldens/gguf/qwen35-f32.gguf. The f32 file holds the
checkpoint's numbers exactly (up to the converter's own transforms), so wick's logits from it
must equal transformers' logits stored beside the checkpoint (tests/hf_qwen35.rs).

The golden's tokenizer is a 512-token stand-in whose pre-tokenizer hash the converter does not
know; the conversion names it `qwen2` (the tokenizer is not what the test checks).

Run in the reference environment (scripts/goldens/regen.sh):
    target/goldens/venv/bin/python scripts/goldens/gguf_qwen35.py [SDIST]
SDIST: llama_cpp_python-0.3.36.tar.gz (default: the copy `wick pull` keeps in
$WICK_HOME/downloads, ~/.cache/wick by default).
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = ROOT / "crates/wick-engine/tests/goldens"
SOURCE = GOLDENS / "hf/qwen35"
OUT = GOLDENS / "gguf/qwen35-f32.gguf"
SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"


def main() -> None:
    home = Path(os.environ.get("WICK_HOME", Path.home() / ".cache/wick"))
    sdist = Path(sys.argv[1]) if len(sys.argv) > 1 else home / "downloads" / SDIST_NAME
    if not sdist.is_file():
        sys.exit(f"no llama-cpp-python sdist at {sdist} (`wick pull` fetches it)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with tarfile.open(sdist) as tar:
            top = tar.getnames()[0].split("/")[0]
            vendored = f"{top}/vendor/llama.cpp/"
            wanted = [
                m for m in tar.getmembers()
                if m.name.startswith(vendored)
                and m.name[len(vendored):].split("/")[0]
                in ("convert_hf_to_gguf.py", "conversion", "gguf-py")
            ]
            tar.extractall(tmp, members=wanted, filter="data")
        llama = tmp / vendored
        # Only the weights and config: the stored logits are not the model's.
        model = tmp / "model"
        model.mkdir()
        for f in SOURCE.iterdir():
            if f.name not in ("logits.safetensors", "reference.json"):
                shutil.copy(f, model / f.name)
        sys.path[:0] = [str(llama / "gguf-py"), str(llama)]
        import conversion.base as base  # noqa: E402 (the vendored converter's package)

        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
        OUT.parent.mkdir(parents=True, exist_ok=True)
        sys.argv = ["convert_hf_to_gguf.py", str(model), "--outtype", "f32",
                    "--outfile", str(OUT), "--no-mtp"]
        runpy.run_path(str(llama / "convert_hf_to_gguf.py"), run_name="__main__")
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
