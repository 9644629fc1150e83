"""`wick train` end to end: SFT on a made-up fact teaches SmolLM2 to answer a held-out
paraphrase with it (the base never does), the adapter mounts in `wick serve`; bad rows are
errors naming file and line; a resumed run ends where an uninterrupted one does."""
import json
import subprocess
from pathlib import Path

import httpx

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


def test_sft_teaches_a_fact_that_the_served_adapter_answers(tmp_path):
    model = require_model(SMOLLM, "default")
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": FACT}]}
        for q in QUESTIONS])
    write_jsonl(data / "valid.jsonl", [
        {"messages": [{"role": "user", "content": HELD_OUT}, {"role": "assistant", "content": FACT}]}])
    out = tmp_path / "zorblax"
    run = train(str(model), "--data", str(data), "--method", "sft", "--adapter", str(out),
                "--iters", "30", "--lr", "2e-3")
    assert f"serve it: wick serve {model} --adapter {out}" in run.stdout
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
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
    common = ["--data", str(data), "--method", "sft", "--iters", "6", "--lr", "1e-2",
              "--batch", "2", "--seq", "32"]
    straight = tmp_path / "straight"
    train(str(TINY), *common, "--adapter", str(straight), "--save-every", "3")
    ckpt = straight / "checkpoints" / "step-000003"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "optimizer.safetensors").is_file()
    resumed = tmp_path / "resumed"
    run = train(str(TINY), *common, "--adapter", str(resumed), "--resume", str(ckpt))
    assert "at step 3" in run.stderr
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
