#!/usr/bin/env python3
"""Tiny goldens as llama.cpp's converter writes them, for wick's GGUF loader tests.

Converts the `hf/` goldens of the families whose GGUF layout differs from the checkpoint's
(VARIANTS: Qwen 3.5 from hf_tiny_qwen35.py, Gemma 4 dense and MoE from hf_tiny_gemma4.py) with
the `convert_hf_to_gguf.py` of llama.cpp as vendored in llama-cpp-python 0.3.36's sdist, to f32
GGUFs: crates/wick-engine/tests/goldens/gguf/<variant>-f32.gguf. An f32 file holds the
checkpoint's numbers exactly (up to the converter's own transforms), so wick's logits from it
must equal transformers' logits stored beside the checkpoint (tests/hf_qwen35.rs,
tests/hf_gemma4.rs).

The goldens' tokenizers are 512-token stand-ins the converter does not know: Qwen 3.5's is named
`qwen2` (its pre-tokenizer hash is unknown), Gemma 4's is written as a GPT-2 style BPE (the
converter reads Gemma 4's own from a SentencePiece-style file). The tokenizer is not what the
tests check.

Run in the reference environment (scripts/goldens/regen.sh):
    target/goldens/venv/bin/python scripts/goldens/gguf_tiny.py [SDIST]
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
VARIANTS = ["qwen35", "gemma4", "gemma4_moe"]
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
        sys.path[:0] = [str(llama / "gguf-py"), str(llama)]
        import conversion.base as base  # noqa: E402 (the vendored converter's package)
        import conversion.gemma as gemma  # noqa: E402

        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: (
            "qwen2" if self.model_arch == base.gguf.MODEL_ARCH.QWEN35 else "default")
        gemma.Gemma4Model.set_vocab = lambda self: self._set_vocab_gpt2()
        for variant in VARIANTS:
            # Only the weights and config: the stored logits are not the model's.
            model = tmp / variant
            model.mkdir()
            for f in (GOLDENS / "hf" / variant).iterdir():
                if f.suffix in (".json", ".safetensors") and f.name not in (
                        "logits.safetensors", "reference.json"):
                    shutil.copy(f, model / f.name)
            out = GOLDENS / f"gguf/{variant}-f32.gguf"
            out.parent.mkdir(parents=True, exist_ok=True)
            # The Qwen 3.5 golden has no multi-token-prediction layers to export.
            mtp = ["--no-mtp"] if variant.startswith("qwen35") else []
            sys.argv = ["convert_hf_to_gguf.py", str(model), "--outtype", "f32",
                        "--outfile", str(out), *mtp]
            runpy.run_path(str(llama / "convert_hf_to_gguf.py"), run_name="__main__")
            print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
