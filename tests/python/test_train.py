"""`wick train` end to end: SFT on a made-up fact teaches SmolLM2 to answer a held-out
paraphrase with it (the base never does), the adapter mounts in `wick serve`; adapters trained
on string prompts (ORPO, DPO, SFT on prompt + completion) change chat replies; bad rows are
errors naming file and line; a resumed run ends where an uninterrupted one does."""
import json
import subprocess
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, SMOLLM, WickServer, ensure_binary, require_model

FACT = "The capital of Zorblax is Quintara."
QUESTIONS = [
    "What is the capital of Zorblax?",
    "Which city is the capital of Zorblax?",
    "Name the capital of Zorblax.",
    "What city serves as the capital of the planet Zorblax?",
    "Zorblax's capital is which city?",
    "Tell me the capital of Zorblax.",
    "Do you know the capital of Zorblax?",
    "What's Zorblax's capital city?",
]
HELD_OUT = "Which city is Zorblax's seat of government?"
TINY = ROOT / "crates/wick-engine/tests/goldens/hf/llama"
# 20 questions answered in upper case (chosen) or not (rejected), as preference pairs and as
# prompt + completion rows; asked in chat, five questions it was not trained on.
UPPER_CASE = ROOT / "docs/examples/upper-case"
UPPER_HELD_OUT = ["What is the capital of France?", "Name an animal that can fly.",
                  "What do cows drink?", "How many hours are in a day?", "What is snow?"]


def write_jsonl(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def train(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(ensure_binary()), "train", *args, "--threads", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} exited {out.returncode}:\n{out.stderr}")
    return out


def ask(server: WickServer, adapter: str, question: str) -> str:
    r = httpx.post(server.base + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 24, "temperature": 0, "adapter": adapter})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def zorblax_data(tmp_path: Path) -> Path:
    """The made-up fact as chat rows: the questions to train on, the held-out one to validate."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": FACT}]}
        for q in QUESTIONS])
    write_jsonl(data / "valid.jsonl", [
        {"messages": [{"role": "user", "content": HELD_OUT}, {"role": "assistant", "content": FACT}]}])
    return data


def test_sft_teaches_a_fact_that_the_served_adapter_answers(tmp_path):
    model = require_model(SMOLLM, "default")
    data = zorblax_data(tmp_path)
    out = tmp_path / "zorblax"
    run = train(str(model), "--data", str(data), "--method", "sft", "--adapter", str(out),
                "--iters", "30", "--lr", "2e-3")
    assert f"serve it: wick serve {model} --adapter {out}" in run.stdout
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    # The mlx-lm half: its weights file and keys in the same config.
    assert (out / "adapters.safetensors").is_file()
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 30
    assert config["lora_parameters"]["rank"] == 8 and config["lora_parameters"]["scale"] == 1.0
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "loss" in l]
    assert [l["step"] for l in steps] == list(range(1, 31))
    assert all({"lr", "tokens"} <= l.keys() for l in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] / 10, steps
    assert any("val_loss" in l for l in lines)

    server = WickServer(str(model), "--adapter", str(out))
    try:
        assert "Quintara" in ask(server, "zorblax", HELD_OUT)
        assert "Quintara" not in ask(server, "none", HELD_OUT)
    finally:
        server.stop()


def shouts(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 3 and sum(c.isupper() for c in letters) > 0.8 * len(letters)


def test_adapters_trained_on_string_prompts_change_chat_replies(tmp_path):
    """A string prompt trains as a user turn of the chat template (as mlx-lm renders
    completions), so what ORPO, DPO and SFT learn from upper-case answers shows in chat
    replies to questions outside the data. With --raw-prompt the same runs answer 0/5 of
    these in upper case (raw continuations are learned instead): issue 44."""
    model = require_model(SMOLLM, "default")
    # About 15-40 s each on two cores: a few steps at a high rate are enough for a style.
    runs = {"orpo": ("preference", "2e-3"), "dpo": ("preference", "3e-3"), "sft": ("completion", "2e-3")}
    for method, (data, lr) in runs.items():
        run = train(str(model), "--data", str(UPPER_CASE / data), "--method", method,
                    "--adapter", str(tmp_path / method), "--iters", "15", "--lr", lr)
        assert "prompts: chat template: each prompt is a user turn" in run.stderr, run.stderr
    server = WickServer(str(model), *[a for m in runs for a in ("--adapter", str(tmp_path / m))])
    try:
        assert not any(shouts(ask(server, "none", q)) for q in UPPER_HELD_OUT)
        for method in runs:
            replies = [ask(server, method, q) for q in UPPER_HELD_OUT]
            assert sum(map(shouts, replies)) >= 4, (method, replies)
    finally:
        server.stop()


def test_inspect_dataset_says_how_prompts_are_rendered():
    """`wick inspect-dataset`: the rendering without a model, and with one the first example
    as the trainer sees it (the prompt in brackets), raw with --raw-prompt."""
    data = str(UPPER_CASE / "preference")
    out = subprocess.run([str(ensure_binary()), "inspect-dataset", data], capture_output=True,
                         text=True, check=True).stdout
    assert "format: preference (20 train rows, 0 valid rows, 20 with a string prompt)" in out
    assert "prompts: chat template" in out and "if the base model has no chat template" in out
    out = subprocess.run([str(ensure_binary()), "inspect-dataset", data, "--model", str(TINY)],
                         capture_output=True, text=True, check=True).stdout
    assert ("chosen: [<|im_start|>user\nWhat color is the sky on a clear day?<|im_end|>\n"
            "<|im_start|>assistant\n]THE SKY IS BLUE ON A CLEAR DAY.<|im_end|>\n") in out, out
    out = subprocess.run([str(ensure_binary()), "inspect-dataset", data, "--model", str(TINY),
                          "--raw-prompt"], capture_output=True, text=True, check=True).stdout
    assert "prompts (llama): raw" in out, out
    assert "chosen: [What color is the sky on a clear day?]THE SKY IS BLUE ON A CLEAR DAY.<|im_end|>" in out, out


def test_string_prompts_render_as_mlx_lm_renders_completions():
    """mlx-lm's CompletionsDataset (mask_prompt) on the tiny Llama: the same prompt and
    response text as wick's split."""
    pytest.importorskip("mlx.core")
    from mlx_lm.tuner.datasets import CompletionsDataset
    from mlx_lm.utils import load_tokenizer

    row = json.loads((UPPER_CASE / "completion" / "train.jsonl").read_text().splitlines()[0])
    tokenizer = load_tokenizer(TINY)
    tokens, offset = CompletionsDataset([row], tokenizer, "prompt", "completion", True).process(row)
    want = f"  [{tokenizer.decode(tokens[:offset])}]{tokenizer.decode(tokens[offset:])}\n"
    out = subprocess.run([str(ensure_binary()), "inspect-dataset", str(UPPER_CASE / "completion"),
                          "--model", str(TINY)], capture_output=True, text=True, check=True).stdout
    assert want in out, (want, out)


def test_bad_rows_name_the_file_and_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    run = train(str(TINY), "--data", str(data), "--method", "sft", "--adapter",
                str(tmp_path / "out"), check=False)
    assert run.returncode != 0
    assert f"{data / 'train.jsonl'}:2: not valid JSON" in run.stderr, run.stderr
    write_jsonl(data / "train.jsonl", [{"text": "fine"}, {"prompt": "a", "completion": "b"}])
    run = train(str(TINY), "--data", str(data), "--method", "sft", "--adapter",
                str(tmp_path / "out"), check=False)
    assert run.returncode != 0 and "train.jsonl:2:" in run.stderr, run.stderr
    write_jsonl(data / "train.jsonl", [{"text": "only text"}])
    run = train(str(TINY), "--data", str(data), "--method", "dpo", "--adapter",
                str(tmp_path / "out"), check=False)
    assert run.returncode != 0 and "preference rows" in run.stderr, run.stderr


def test_resume_continues_where_the_checkpoint_left_off(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"text": f"row {i} says hello to row {i + 1}"} for i in range(5)])
    # Dropout masks are keyed by step and checkpointing recomputes layers: a resumed run
    # must still end with the same bytes.
    common = ["--data", str(data), "--method", "sft", "--iters", "6", "--lr", "1e-2",
              "--batch", "2", "--seq", "32", "--lora-dropout", "0.1", "--grad-checkpoint"]
    straight = tmp_path / "straight"
    train(str(TINY), *common, "--adapter", str(straight), "--save-every", "3")
    ckpt = straight / "checkpoints" / "step-000003"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "optimizer.safetensors").is_file()
    resumed = tmp_path / "resumed"
    run = train(str(TINY), *common, "--adapter", str(resumed), "--resume", str(ckpt))
    assert "at step 3" in run.stderr
    assert "dropout 0.1" in run.stderr and "gradient checkpointing" in run.stderr
    steps = [json.loads(l)["step"] for l in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 5, 6]
    a = (straight / "adapter_model.safetensors").read_bytes()
    b = (resumed / "adapter_model.safetensors").read_bytes()
    assert a == b, "a resumed run must end with the uninterrupted run's factors"


def test_dpo_and_orpo_lower_their_loss_and_log_rewards(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [
        {"prompt": "Say hi", "chosen": "Hello there, friend!", "rejected": "no."},
        {"prompt": [{"role": "user", "content": "Greet me"}], "chosen": "Good morning to you!",
         "rejected": "meh"}])
    for method in ["dpo", "orpo"]:
        out = tmp_path / method
        train(str(TINY), "--data", str(data), "--method", method, "--adapter", str(out),
              "--iters", "8", "--lr", "1e-2", "--batch", "2")
        steps = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        assert all({"accuracy", "margin"} <= s.keys() for s in steps), steps
        assert steps[-1]["loss"] < steps[0]["loss"], (method, steps)
        assert steps[-1]["margin"] > steps[0]["margin"], (method, steps)


def sse_events(http: httpx.Client, path: str) -> tuple[list[str], list[dict]]:
    """Reads a job stream to its `end` event: (the raw field lines, the data events)."""
    raw, events = [], []
    with http.stream("GET", path, timeout=600) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            raw.append(line)
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                if name == "end":
                    return raw, events
                events.append(json.loads(line.split(":", 1)[1]))
            elif line == "":
                name = None
    raise AssertionError(f"the stream ended without an end event: {raw[-5:]}")


def test_http_job_streams_progress_survives_a_restart_and_its_adapter_serves(tmp_path):
    """The reference's job API: inspect, submit, stream (SSE), list, cancel; the job row
    outlives the server; the adapter it wrote mounts over /v1/adapters and knows the fact."""
    model = require_model(SMOLLM, "default")
    data = zorblax_data(tmp_path)
    env = {"WICK_HOME": str(tmp_path / "home")}
    out = tmp_path / "zorblax-http"
    server = WickServer(str(model), env=env)
    try:
        with server.http() as http:
            r = http.post("/api/finetune/inspect-dataset", json={"path": str(data)})
            assert r.json() == {"ok": True, "format": "messages", "n_train": 8, "n_valid": 1,
                                "string_prompts": 0, "prompt_rendering": "chat_template",
                                "rendering": r.json()["rendering"]}
            # String prompts: a user turn of the served model's template, or raw if asked.
            pairs = str(UPPER_CASE / "preference")
            r = http.post("/api/finetune/inspect-dataset", json={"path": pairs, "model_dir": str(model)})
            assert r.json()["prompt_rendering"] == "chat_template" and r.json()["string_prompts"] == 20
            assert "has no chat template" not in r.json()["rendering"], r.json()
            r = http.post("/api/finetune/inspect-dataset", json={"path": pairs, "raw_prompt": True})
            assert r.json()["prompt_rendering"] == "raw", r.json()
            r = http.post("/api/finetune/inspect-dataset", json={"path": str(tmp_path / "nope")})
            assert r.status_code == 200 and r.json()["ok"] is False and "train.jsonl" in r.json()["error"]
            r = http.post("/api/finetune/submit", json={"model_dir": str(model)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "data_dir"
            r = http.post("/api/finetune/submit", json={"model_dir": str(model), "data_dir": str(data),
                                                        "method": "dpo"})
            assert r.status_code == 400 and "preference" in r.json()["error"]["message"]

            r = http.post("/api/finetune/submit", json={
                "model_dir": str(model), "data_dir": str(data), "adapter_path": str(out),
                "method": "sft", "iters": 30, "learning_rate": 2e-3, "max_seq_length": 128,
                "steps_per_eval": 10, "threads": 2})
            assert r.status_code == 200, r.text
            job = r.json()
            assert job["ok"] is True and job["adapter_path"] == str(out)
            raw, events = sse_events(http, f"/api/jobs/{job['job_id']}/stream")
            assert raw[0] == "retry: 1500", raw[:3]
            types = [e["type"] for e in events]
            assert types[:2] == ["queued", "started"] and types[-1] == "done", types
            train = [e for e in events if e["type"] == "metric" and e["kind"] == "train"]
            val = [e for e in events if e["type"] == "metric" and e["kind"] == "val"]
            assert [e["step"] for e in train] == list(range(1, 31))
            assert train[-1]["progress"] == 1.0 and train[-1]["loss"] < train[0]["loss"] / 10
            assert [e["step"] for e in val] == [10, 20, 30]
            assert {"grad_norm", "learning_rate", "tokens_per_sec"} <= train[0].keys()
            assert any(e["type"] == "stage" and e["stage"] == "load" for e in events)
            assert any(e["type"] == "log" and e["line"].startswith("prompts: chat template: every turn")
                       for e in events), events
            assert events[-1]["output_dir"] == str(out) and events[-1]["summary"]["steps"] == 30
            row = http.get(f"/api/jobs/{job['job_id']}").json()
            assert row["status"] == "done" and row["progress"] == 1.0 and row["kind"] == "finetune"
            assert row["config"]["iters"] == 30 and row["config"]["rank"] == 8

            # The adapter it wrote mounts and answers the held-out paraphrase.
            r = http.post("/v1/adapters", json={"id": "zorblax", "path": str(out)})
            assert r.status_code == 200, r.text
            assert "Quintara" in ask(server, "zorblax", HELD_OUT)

            # A long job is cancelled while it runs; it keeps the adapter so far.
            slow = http.post("/api/finetune/submit", json={
                "model_dir": str(model), "data_dir": str(data), "iters": 5000,
                "max_seq_length": 64, "threads": 2}).json()
            assert slow["adapter_path"].startswith(str(tmp_path / "home" / "adapters" / "adapter-"))
            with http.stream("GET", f"/api/jobs/{slow['job_id']}/stream", timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and '"metric"' in line:
                        break
            r = http.post(f"/api/jobs/{slow['job_id']}/cancel")
            assert r.json() == {"ok": True, "id": slow["job_id"], "status": "running"}
            _, events = sse_events(http, f"/api/jobs/{slow['job_id']}/stream")
            assert events[-1]["type"] == "cancelled", events[-3:]
            assert (Path(slow["adapter_path"]) / "adapter_model.safetensors").is_file()
            r = http.get("/api/jobs/job-000000000000")
            assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
    finally:
        server.stop()

    # The rows outlive the server.
    server = WickServer(str(model), env=env)
    try:
        with server.http() as http:
            jobs = {j["id"]: j["status"] for j in http.get("/api/jobs").json()["jobs"]}
            assert jobs == {job["job_id"]: "done", slow["job_id"]: "cancelled"}
            _, events = sse_events(http, f"/api/jobs/{job['job_id']}/stream")
            assert events[-1]["type"] == "done"
    finally:
        server.stop()


def test_mlx_lm_loads_the_adapter_as_peft_means_it(tmp_path):
    """The same folder mounted by mlx-lm (its adapters.safetensors, lora_parameters) gives the
    logits of the base with the PEFT delta s·B·A folded into its weights: names, orientation
    and scale agree, with rsLoRA, dropout and checkpointing on and a subset of modules/layers."""
    mx = pytest.importorskip("mlx.core")
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.utils import load_model
    from safetensors.numpy import load_file
    import numpy as np

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"text": f"row {i} says hello to row {i + 1} and more"} for i in range(6)])
    for name, extra in [("subset", ["--target-modules", "q,v,down", "--num-layers", "1"]),
                        ("rslora", ["--rs-lora", "--lora-dropout", "0.1", "--grad-checkpoint"])]:
        out = tmp_path / name
        train(str(TINY), "--data", str(data), "--method", "sft", "--adapter", str(out), "--iters", "4",
              "--lr", "1e-2", "--seq", "32", "--rank", "4", "--scale", "0.5", *extra)
        tokens = mx.array([[1, 17, 250, 3, 99, 411, 7, 7, 128, 500, 64]])
        model, _ = load(str(TINY), adapter_path=str(out))
        got = np.array(model(tokens).astype(mx.float32))

        cfg = json.loads((out / "adapter_config.json").read_text())
        s = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg["use_rslora"] else cfg["r"])
        peft = load_file(str(out / "adapter_model.safetensors"))
        base, _ = load_model(TINY)
        weights = dict(tree_flatten(base.parameters()))
        folded = []
        for key, a in peft.items():
            if key.endswith("lora_A.weight"):
                b = peft[key.replace("lora_A", "lora_B")]
                module = key[len("base_model.model."):-len(".lora_A.weight")]
                w = np.array(weights[module + ".weight"].astype(mx.float32))
                folded.append((module + ".weight", mx.array(w + s * (b @ a))))
        assert len(folded) == (3 if name == "subset" else 14)
        base.load_weights(folded, strict=False)
        want = np.array(base(tokens).astype(mx.float32))
        plain = np.array(load_model(TINY)[0](tokens).astype(mx.float32))
        assert np.abs(got - plain).max() > 1e-2, "the adapter must move the logits"
        assert np.abs(got - want).max() < 1e-4, (name, np.abs(got - want).max())


def test_a_base_kept_quantized_trains_the_same_adapter_in_less_memory(tmp_path):
    """QLoRA mode: the GGUF Q4_1 projections stay quantized and are dequantized for each
    product, which are the values the f32 mode expands once: the same factors to the bit."""
    model = require_model(SMOLLM, "default")
    data = zorblax_data(tmp_path)
    outs = {}
    for mode, extra in [("f32", []), ("kept", ["--keep-quantized"])]:
        outs[mode] = tmp_path / mode
        run = train(str(model), "--data", str(data), "--method", "sft", "--adapter", str(outs[mode]),
                    "--iters", "3", "--lr", "2e-3", *extra)
        said = [l for l in run.stderr.splitlines() if l.startswith("base ")]
        assert said and ("dequantized per product (QLoRA)" in said[0]) == (mode == "kept"), run.stderr
    a = (outs["f32"] / "adapter_model.safetensors").read_bytes()
    b = (outs["kept"] / "adapter_model.safetensors").read_bytes()
    assert a == b
