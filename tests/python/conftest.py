"""Fixtures: build `target/release/wick` if needed, start `wick serve` servers on free ports,
wait for /health, and stop them with SIGTERM (checking they exit 0)."""
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
WICK = ROOT / "target" / "release" / "wick"
TEMPLATES = Path(__file__).resolve().parent / "templates"
WICK_HOME = Path(os.environ.get("WICK_HOME", Path.home() / ".cache" / "wick"))
QWEN = WICK_HOME / "models" / "qwen2.5-coder-0.5b-instruct" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOLLM = WICK_HOME / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# Small generations keep the suite fast on two cores.
SHORT = 16

# The tool the tool-calling tests offer: a function and, below, its shape in each API.
WEATHER_FUNCTION = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name"}},
        "required": ["city"],
    },
}
# Chat completions: the `tools` list.
WEATHER = [{"type": "function", "function": WEATHER_FUNCTION}]
# Responses: one entry of `tools`.
WEATHER_RESPONSES = {"type": "function", **WEATHER_FUNCTION}
# Anthropic Messages: one entry of `tools`.
WEATHER_ANTHROPIC = {
    "name": WEATHER_FUNCTION["name"],
    "description": WEATHER_FUNCTION["description"],
    "input_schema": WEATHER_FUNCTION["parameters"],
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes minutes on two cores (real agent clients)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_binary() -> Path:
    if not WICK.exists() or os.environ.get("WICK_BUILD") == "1":
        subprocess.run(["cargo", "build", "--release", "-p", "wick"], cwd=ROOT, check=True)
    return WICK


def require_model(path: Path, name: str) -> Path:
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `wick pull {name}`")
    return path


class WickServer:
    """One `wick serve` process."""

    def __init__(self, *args: str, api_key: str | None = None, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="wick-serve-", suffix=".log", delete=False)
        cmd = [str(ensure_binary()), "serve", *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        full_env = dict(os.environ, WICK_LOG=os.environ.get("WICK_LOG", "info"), **(env or {}))
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self.wait_ready()

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"wick serve exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.base + "/health", timeout=1.0).status_code == 200:
                    self.ready_s = time.monotonic() - self.started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError(f"wick serve not ready after {timeout}s:\n{self.logs()}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=60.0)

    def stats(self) -> dict:
        with self.http() as h:
            return h.get("/stats").json()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"wick serve ignored SIGTERM:\n{self.logs()}")
        return self.proc.returncode


def _serve(*args, **kw):
    server = WickServer(*args, **kw)
    yield server
    code = server.stop()
    assert code == 0, f"wick serve exited with {code}:\n{server.logs()}"


@pytest.fixture(scope="session")
def server():
    """The default model (SmolLM2-135M-Instruct), default settings."""
    require_model(SMOLLM, "smollm2-135m-instruct")
    yield from _serve()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def think_server():
    """The default model with a chat template that opens <think> in the generation prompt."""
    require_model(SMOLLM, "smollm2-135m-instruct")
    yield from _serve("--chat-template", str(TEMPLATES / "think.jinja"))


@pytest.fixture(scope="session")
def qwen_server():
    """Qwen2.5-Coder-0.5B-Instruct for tool calling."""
    require_model(QWEN, "qwen2.5-coder-0.5b-instruct")
    yield from _serve(str(QWEN), "--model-id", "qwen2.5-coder-0.5b-instruct")
