"""`wick get`, `wick serve ORG/NAME`, `wick fit`, `wick gc` and /library, /fit, /downloads
against a local stand-in of the Hugging Face Hub (hub_standin.py), with faults injected:
a cut connection, corrupted bytes, 404, 401, a slow server and a killed download."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub
import pytest

from conftest import SMOLLM, WickServer, ensure_binary, require_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_standin import Fault, HubStandin, Repo, model_repo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "hf" / "llama"
TINY_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
REPO = "org/tiny-llama"


def tiny_repo(**kw) -> Repo:
    repo = model_repo(TINY, TINY_FILES)
    for k, v in kw.items():
        setattr(repo, k, v)
    return repo


@pytest.fixture
def env(tmp_path):
    """An environment with its own HF cache, HF home (no token file) and wick store."""
    e = dict(os.environ)
    for k in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT"):
        e.pop(k, None)
    e.update(
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_CACHE=str(tmp_path / "hub"),
        WICK_HOME=str(tmp_path / "wick"),
        HF_HUB_DISABLE_XET="1",
    )
    return e


def wick(env, *args, check=True, timeout=120):
    p = subprocess.run([str(ensure_binary()), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, f"wick {' '.join(args)} exited {p.returncode}:\n{p.stderr}"
    return p


def blobs(env, repo=REPO) -> list[Path]:
    d = Path(env["HF_HUB_CACHE"]) / ("models--" + repo.replace("/", "--")) / "blobs"
    return sorted(d.iterdir()) if d.exists() else []


@pytest.fixture
def hub():
    hubs = []

    def make(repos):
        h = HubStandin(repos)
        hubs.append(h)
        return h

    yield make
    for h in hubs:
        h.close()


def test_standin_is_faithful_to_huggingface_hub(hub, tmp_path):
    """huggingface_hub itself downloads from the stand-in: what wick is tested against is the Hub's API."""
    h = hub({REPO: tiny_repo()})
    path = huggingface_hub.snapshot_download(REPO, cache_dir=tmp_path, endpoint=h.url)
    for name in TINY_FILES:
        assert (Path(path) / name).read_bytes() == (TINY / name).read_bytes()


def test_get_writes_the_hf_cache_layout(hub, env):
    h = hub({REPO: tiny_repo()})
    env["HF_ENDPOINT"] = h.url
    out = wick(env, "get", REPO)
    repo = h.repos[REPO]
    cache = Path(env["HF_HUB_CACHE"]) / "models--org--tiny-llama"
    snapshot = Path(out.stdout.strip())
    assert snapshot == cache / "snapshots" / repo.commit
    assert (cache / "refs" / "main").read_text() == repo.commit
    for name in TINY_FILES:
        link = snapshot / name
        assert link.is_symlink()
        assert os.readlink(link) == f"../../blobs/{repo.etag(name)}"
        assert link.read_bytes() == (TINY / name).read_bytes()
    # LFS files are named by sha256, the rest by git blob sha1.
    assert repo.etag("model.safetensors") == hashlib.sha256((TINY / "model.safetensors").read_bytes()).hexdigest()
    assert len(repo.etag("config.json")) == 40

    # huggingface_hub recognises what wick wrote, and finds the files offline.
    info = huggingface_hub.scan_cache_dir(env["HF_HUB_CACHE"])
    assert not info.warnings, info.warnings
    (r,) = info.repos
    assert r.repo_id == REPO and r.repo_type == "model"
    (rev,) = r.revisions
    assert rev.commit_hash == repo.commit and rev.refs == frozenset({"main"})
    assert sorted(f.file_name for f in rev.files) == sorted(TINY_FILES)
    p = huggingface_hub.hf_hub_download(REPO, "config.json", cache_dir=env["HF_HUB_CACHE"], local_files_only=True)
    assert Path(p).read_bytes() == (TINY / "config.json").read_bytes()

    # A second get downloads nothing.
    before = len(h.log)
    again = wick(env, "get", REPO)
    assert "0.0 MB downloaded" in again.stderr
    assert not [entry for entry in h.log[before:] if "/resolve/" in entry[1]]

    # ls sees it with its architecture and parameters.
    ls = wick(env, "ls", "--json")
    rows = [json.loads(line) for line in ls.stdout.splitlines()]
    row = next(r for r in rows if r["name"] == REPO)
    assert row["arch"] == "llama" and row["params"] > 0 and row["context_length"] == 2048
    assert "chat" in row["capabilities"]


def test_cut_connection_resumes_with_range(hub, env):
    h = hub({REPO: tiny_repo(faults={"model.safetensors": Fault(cut_after=200_000)})})
    env["HF_ENDPOINT"] = h.url
    out = wick(env, "get", REPO)
    ranges = h.ranges("/model.safetensors")
    assert ranges[0] is None and ranges[1] == "bytes=200000-", (ranges, out.stderr)
    snapshot = Path(out.stdout.strip())
    assert (snapshot / "model.safetensors").read_bytes() == (TINY / "model.safetensors").read_bytes()
    assert not [b for b in blobs(env) if b.name.endswith(".incomplete")]


def test_corrupted_file_is_refused_and_not_published(hub, env):
    h = hub({REPO: tiny_repo(faults={"model.safetensors": Fault(corrupt=True)})})
    env["HF_ENDPOINT"] = h.url
    out = wick(env, "get", REPO, check=False)
    assert out.returncode != 0
    assert "model.safetensors" in out.stderr and "does not match" in out.stderr and "sha256" in out.stderr, out.stderr
    etag = h.repos[REPO].etag("model.safetensors")
    names = [b.name for b in blobs(env)]
    assert etag not in names and f"{etag}.incomplete" not in names, names
    assert not (Path(env["HF_HUB_CACHE"]) / "models--org--tiny-llama" / "snapshots").exists()
    # Once the server sends the right bytes, the same command succeeds.
    h.repos[REPO].faults.clear()
    wick(env, "get", REPO)


def test_not_found_and_unauthorized(hub, env):
    h = hub({REPO: tiny_repo(token="secret")})
    env["HF_ENDPOINT"] = h.url
    missing = wick(env, "get", "org/nope", check=False)
    assert missing.returncode != 0 and ("401" in missing.stderr or "404" in missing.stderr), missing.stderr
    denied = wick(env, "get", REPO, check=False)
    assert denied.returncode != 0 and "401" in denied.stderr and "HF_TOKEN" in denied.stderr, denied.stderr
    # The token file huggingface-cli login writes is read.
    Path(env["HF_HOME"]).mkdir(parents=True, exist_ok=True)
    (Path(env["HF_HOME"]) / "token").write_text("secret\n")
    wick(env, "get", REPO)
    # A commit id as the revision: every blob is already verified, so nothing is fetched
    # (the injected 404 on config.json is never hit) and no ref is written for it.
    h.repos[REPO].faults["config.json"] = Fault(status=404)
    again = wick(env, "get", REPO, "--revision", h.repos[REPO].commit, check=False)
    assert again.returncode == 0, again.stderr
    refs = Path(env["HF_HUB_CACHE"]) / "models--org--tiny-llama" / "refs"
    assert sorted(p.name for p in refs.iterdir()) == ["main"]
    # A file that answers 404 fails at once, naming it (no retry loop).
    h.repos[REPO].faults["model.safetensors"] = Fault(status=404)
    for b in blobs(env):
        if b.name == h.repos[REPO].etag("model.safetensors"):
            b.unlink()
    missing_file = wick(env, "get", REPO, check=False)
    assert missing_file.returncode != 0 and "model.safetensors" in missing_file.stderr and "404" in missing_file.stderr
    h.repos[REPO].faults.clear()
    bad_rev = wick(env, "get", f"{REPO}@nonexistent", check=False)
    assert bad_rev.returncode != 0 and "404" in bad_rev.stderr, bad_rev.stderr


def test_slow_server_completes(hub, env):
    h = hub({REPO: tiny_repo(faults={"model.safetensors": Fault(rate=400_000)})})
    env["HF_ENDPOINT"] = h.url
    start = time.monotonic()
    out = wick(env, "get", REPO)
    assert time.monotonic() - start > 1.0, "the fault slowed the download"
    assert (Path(out.stdout.strip()) / "model.safetensors").read_bytes() == (TINY / "model.safetensors").read_bytes()


def test_killed_download_resumes(hub, env):
    data = hashlib.sha256(b"seed").digest() * (3 * 1024 * 1024 // 32)
    repo = Repo(files={"config.json": b"{}", "model.safetensors": data},
                faults={"model.safetensors": Fault(rate=300_000)})
    h = hub({"org/big": repo})
    env["HF_ENDPOINT"] = h.url
    proc = subprocess.Popen([str(ensure_binary()), "get", "org/big"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    etag = repo.etag("model.safetensors")
    part = Path(env["HF_HUB_CACHE"]) / "models--org--big" / "blobs" / f"{etag}.incomplete"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not part.exists() or part.stat().st_size < 400_000):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    have = part.stat().st_size
    assert 0 < have < len(data)
    # The dead process's lock is stale; the partial file is resumed, not restarted.
    repo.faults.clear()
    out = wick(env, "get", "org/big")
    last = h.ranges("/model.safetensors")[-1]
    assert last is not None and int(last.split("=")[1].rstrip("-")) >= have, last
    assert (Path(out.stdout.strip()) / "model.safetensors").read_bytes() == data
    # Nothing is left for gc but what a dry run lists: the dry run removes nothing.
    gc = wick(env, "gc", "--json")
    assert json.loads(gc.stdout)["removed"] is False


def test_gguf_repo_asks_for_a_quant(hub, env):
    h = hub({"org/gguf": Repo(files={"m.Q4_K_M.gguf": b"a" * 100, "m.Q8_0.gguf": b"b" * 200, "README.md": b"r"})})
    env["HF_ENDPOINT"] = h.url
    out = wick(env, "get", "org/gguf", check=False)
    assert out.returncode != 0 and "--include" in out.stderr and "m.Q8_0.gguf" in out.stderr, out.stderr
    ok = wick(env, "get", "org/gguf", "--include", "*Q4_K_M*")
    assert sorted(p.name for p in Path(ok.stdout.strip()).iterdir()) == ["m.Q4_K_M.gguf"]


def test_serve_fetches_by_repo_name(hub, env):
    h = hub({REPO: tiny_repo()})
    env["HF_ENDPOINT"] = h.url
    server = WickServer(REPO, env=env)
    try:
        with server.http() as c:
            models = c.get("/v1/models").json()
            assert models["data"][0]["id"] == REPO
            r = c.post("/v1/completions", json={"model": REPO, "prompt": "hello", "max_tokens": 3})
            assert r.status_code == 200, r.text
            downloads = c.get("/downloads").json()["downloads"]
            assert downloads[0]["repo_id"] == REPO and downloads[0]["state"] == "done"
            assert downloads[0]["files_done"] == downloads[0]["files_total"] == len(TINY_FILES)
            library = c.get("/library").json()["models"]
            row = next(m for m in library if m["repo_id"] == REPO)
            assert row["serving"] is True and row["model_type"] == "llama"
            assert row["assessment"]["fits"] is True
            fit = c.get("/fit", params={"ctx": 1024}).json()
            assert fit["report"]["context_tokens"] == 1024
            # 2 layers × 2 (K, V) × 2 KV heads × 16 dims × 4 bytes (f32 for safetensors) × 1024.
            assert fit["report"]["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * 1024
            bad = c.get("/fit", params={"ctx": "-3"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "ctx"
    finally:
        assert server.stop() == 0, server.logs()
    # Served again offline: the cache is used, the Hub is not asked for files.
    before = len(h.log)
    server = WickServer(REPO, env=env)
    assert server.stop() == 0
    assert not [e for e in h.log[before:] if "/resolve/" in e[1]]


def test_fit_smollm2_reports_exact_f16_kv():
    require_model(SMOLLM, "smollm2-135m-instruct")
    out = subprocess.run([str(ensure_binary()), "fit", str(SMOLLM), "--ctx", "4096", "--kv-type", "f16", "--json"],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    # 30 layers × 2 (K, V) × 3 KV heads × 64 dims × 2 bytes × 4096 tokens.
    assert r["kv_bytes"] == 30 * 2 * 3 * 64 * 2 * 4096 == 94_371_840
    # Weights are the tensor bytes, a little less than the file (header, metadata, vocab).
    size = SMOLLM.stat().st_size
    assert 0.9 * size < r["weights_bytes"] < size
    assert r["total_bytes"] == r["weights_bytes"] + r["kv_bytes"] + r["transient_bytes"]
    for key in ("usable_bytes", "fits", "max_context", "predicted_decode_tps"):
        assert key in r
    assert r["arch"] == "llama" and r["quant"] == "Q4_1"


def test_serve_refuses_a_context_that_cannot_fit():
    require_model(SMOLLM, "smollm2-135m-instruct")
    p = subprocess.run([str(ensure_binary()), "serve", str(SMOLLM), "--memory-budget", "0.05", "--port", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "does not fit" in p.stderr and "weights" in p.stderr, p.stderr
