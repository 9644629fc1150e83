"""`wick fuse` and the adapter tools over HTTP, end to end on SmolLM2: a model fused with a
freshly trained adapter, served without it, answers the base-with-adapter's greedy tokens;
an adapter merged with itself at half weight each answers as the adapter alone; the export
endpoint writes the same model as `wick fuse` into the store. mlx-lm reads the Hugging Face
folders `wick fuse` writes: an f32 one as the base with the adapter, an MLX-quantized one as
mlx-lm's own fuse of it. The fine-tune page exports a finished job's adapter."""
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import SMOLLM, WickServer, ensure_binary, require_model
from test_train import HELD_OUT, TINY, train, write_jsonl, zorblax_data
from test_webui import Page, browser  # noqa: F401 (a fixture)


def fuse(model, adapter: Path, out: Path) -> subprocess.CompletedProcess:
    run = subprocess.run([str(ensure_binary()), "fuse", str(model), "--adapter", str(adapter),
                          "--save-path", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run


def reply(server: WickServer, adapter: str) -> str:
    r = httpx.post(server.base + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": HELD_OUT}],
        "max_tokens": 16, "temperature": 0, "adapter": adapter})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def test_fused_model_merge_and_export_answer_as_the_adapter(tmp_path):
    model = require_model(SMOLLM, "default")
    adapter = tmp_path / "zorblax"
    train(str(model), "--data", str(zorblax_data(tmp_path)), "--method", "sft",
          "--adapter", str(adapter), "--iters", "20", "--lr", "2e-3")
    fused = tmp_path / "fused"
    run = fuse(model, adapter, fused)
    assert f"serve it: wick serve {fused}" in run.stdout
    [gguf] = fused.glob("*.gguf")

    home = tmp_path / "home"
    server = WickServer(str(model), "--adapter", str(adapter), env={"WICK_HOME": str(home)})
    try:
        with_adapter = reply(server, "zorblax")
        assert "Quintara" in with_adapter
        assert reply(server, "none") != with_adapter

        with server.http() as http:
            merged = http.post("/api/finetune/merge", json={
                "adapter_a": "zorblax", "adapter_b": str(adapter), "scales": [0.5, 0.5]}).json()
            assert merged["ok"], merged
            path = Path(merged["merged_path"])
            assert path.parent == home / "adapters" and path.name.startswith("merged-")
            stats = merged["stats"]
            assert stats["rank"] == 16 and stats["shared_modules"] == stats["modules"] == 210
            listed = http.get("/v1/adapters/available").json()["adapters"]
            assert str(path) in [a["path"] for a in listed]
            r = http.post("/v1/adapters", json={"id": "half", "path": str(path)})
            assert r.status_code == 200, r.text
            missing = http.post("/api/finetune/merge", json={
                "adapter_a": "zorblax", "adapter_b": "no-such-adapter"})
            assert missing.status_code == 400
            assert missing.json()["error"]["param"] == "adapter_b"

            exported = http.post("/api/finetune/export", json={"adapter_path": "zorblax"},
                                 timeout=300).json()
            assert exported["ok"], exported
            out = Path(exported["export_path"])
            assert out.parent == home / "models"
            manifest = exported["manifest"]
            assert manifest["modules"] == 210 and manifest["dtype"] == "f16 (from Q4_1)"
            [file] = manifest["files"]
            assert (out / file["name"]).stat().st_size == file["bytes"]
            assert (out / file["name"]).read_bytes() == gguf.read_bytes(), \
                "the export differs from wick fuse's output"
        assert reply(server, "half") == with_adapter
    finally:
        server.stop()

    listed = subprocess.run([str(ensure_binary()), "ls"], capture_output=True, text=True,
                            env=dict(os.environ, WICK_HOME=str(home)))
    assert out.name in listed.stdout, listed.stdout

    plain = WickServer(str(fused))
    try:
        assert reply(plain, "none") == with_adapter
    finally:
        plain.stop()


def test_mlx_lm_reads_fused_folders(tmp_path):
    mx = pytest.importorskip("mlx.core")
    from mlx_lm import convert, load
    import numpy as np

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"text": f"row {i} says hello to row {i + 1} and more"} for i in range(6)])
    adapter = tmp_path / "adapter"
    train(str(TINY), "--data", str(data), "--method", "sft", "--adapter", str(adapter), "--iters", "4",
          "--lr", "1e-2", "--seq", "32", "--rank", "4", "--scale", "2")
    tokens = mx.array([[1, 17, 250, 3, 99, 411, 7, 7, 128, 500, 64]])

    def logits(path: Path, adapter_path: Path | None = None):
        model, _ = load(str(path), adapter_path=str(adapter_path) if adapter_path else None)
        return np.array(model(tokens).astype(mx.float32))

    fuse(TINY, adapter, tmp_path / "fused")
    want = logits(TINY, adapter)
    assert np.abs(want - logits(TINY)).max() > 0.1, "the adapter changes nothing"
    assert np.abs(logits(tmp_path / "fused") - want).max() < 1e-4

    # A 4-bit base: wick re-quantizes each fused module as mlx-lm's fuse does.
    quantized = tmp_path / "q4"
    convert(str(TINY), mlx_path=str(quantized), quantize=True, q_group_size=32, q_bits=4)
    fuse(quantized, adapter, tmp_path / "wick-q4")
    subprocess.run([sys.executable, "-m", "mlx_lm", "fuse", "--model", str(quantized),
                    "--adapter-path", str(adapter), "--save-path", str(tmp_path / "mlx-q4")],
                   check=True, capture_output=True, timeout=300)
    ours, theirs = logits(tmp_path / "wick-q4"), logits(tmp_path / "mlx-q4")
    assert np.abs(ours - theirs).max() < 1e-4


def test_the_fine_tune_page_exports_a_finished_job(browser, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"text": f"row {i} says hello to row {i + 1}"} for i in range(4)])
    home = tmp_path / "home"
    server = WickServer(str(TINY), env={"WICK_HOME": str(home)})
    ui = Page(browser, server.base)
    try:
        page = ui.open("finetune")
        page.wait_for_function("() => document.getElementById('ft-model')?.value.length > 0")
        page.fill("#ft-data", str(data))
        for name, value in {"iters": 3, "max_seq_length": 32}.items():
            page.fill(f"#ft-{name}", str(value))
        page.fill("#ft-output", str(tmp_path / "adapter"))
        assert page.is_disabled("#ft-export")
        page.click("#ft-start")
        page.wait_for_selector(".finetune-page[data-state='done']", timeout=120_000)
        page.click("#ft-export")
        page.wait_for_function("() => /Exported as fused-/.test(document.getElementById('ft-export-result').textContent)")
        [out] = (home / "models").iterdir()
        assert str(out) in page.text_content("#ft-export-result")
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
        ui.assert_clean()
    finally:
        ui.context.close()
        server.stop()
