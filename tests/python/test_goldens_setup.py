"""scripts/goldens stays regenerable by its one command: every script is run by regen.sh, and
every package a script imports is pinned in requirements.txt. (Static checks: no server, no
model, no reference packages needed.)"""

import ast
import re
import sys
from pathlib import Path

GOLDENS = Path(__file__).resolve().parents[2] / "scripts" / "goldens"

# Import name -> distribution name on PyPI, for the third-party modules the scripts use.
DISTRIBUTIONS = {
    "PIL": "pillow",
    "jinja2": "jinja2",
    "librosa": "librosa",
    "llama_cpp": "llama-cpp-python",
    # llama.cpp's converter package, as vendored in the pinned llama-cpp-python's sdist
    # (gguf_tiny.py unpacks it from there).
    "conversion": "llama-cpp-python",
    "numpy": "numpy",
    "peft": "peft",
    "safetensors": "safetensors",
    "sentence_transformers": "sentence-transformers",
    "soundfile": "soundfile",
    "tokenizers": "tokenizers",
    "torch": "torch",
    "transformers": "transformers",
    "trl": "trl",
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def scripts() -> list[Path]:
    found = sorted(GOLDENS.glob("*.py"))
    assert found, f"no scripts in {GOLDENS}"
    return found


def pinned() -> dict[str, str]:
    pins = {}
    for line in (GOLDENS / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([0-9][A-Za-z0-9.+]*)", line)
        assert match, f"requirements.txt: {line!r} is not pinned as name==version"
        pins[normalize(match[1])] = match[2]
    return pins


def top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__"}


def test_every_imported_package_is_pinned():
    pins = pinned()
    # The scripts import each other (e.g. a shared tiny-model writer); those are not packages.
    local = {p.stem for p in scripts()}
    for script in scripts():
        for module in sorted(top_level_imports(script) - local):
            assert module in DISTRIBUTIONS, f"{script.name} imports {module}: add its distribution here and pin it"
            dist = normalize(DISTRIBUTIONS[module])
            assert dist in pins, f"{script.name} imports {module}, but {dist} is not in requirements.txt"


def test_regen_runs_every_script():
    regen = (GOLDENS / "regen.sh").read_text()
    run_lines = {m for m in re.findall(r"^run (scripts/goldens/\S+\.py)$", regen, re.M)}
    for script in scripts():
        assert f"scripts/goldens/{script.name}" in run_lines, f"regen.sh does not run {script.name}"
