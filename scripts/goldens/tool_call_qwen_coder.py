"""Records real Qwen2.5-Coder-0.5B replies to tool-calling prompts (greedy, llama.cpp CPU).

The prompt is rendered with the model's own GGUF chat template (jinja2), so the replies are
what wick will see. Output: crates/wick-chat/tests/corpus/tool_calls/real_qwen2.5_coder.json,
one entry per prompt with the raw reply. The expectations (`calls`, `content`, `failures`) are
written by hand after reviewing each reply; a rerun keeps them for replies that did not change
and leaves new replies without expectations, which makes the corpus test fail until reviewed.

Run: target/goldens/venv/bin/python scripts/goldens/tool_call_qwen_coder.py   (the venv scripts/goldens/regen.sh makes)
"""
import json
import os
import sys

import jinja2
from llama_cpp import Llama

HOME = os.environ.get("WICK_HOME", os.path.expanduser("~/.cache/wick"))
MODEL = os.path.join(HOME, "models/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
OUT = os.path.join(os.path.dirname(__file__), "../../crates/wick-chat/tests/corpus/tool_calls/real_qwen2.5_coder.json")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_files", "description": "Search files in the repository for a pattern",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "max_results": {"type": "integer"}}, "required": ["pattern"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write text to a file",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}},
]

PROMPTS = [
    "What's the weather like in Paris right now?",
    "What is the weather in Tokyo and in Berlin? Use celsius.",
    "Find all TODO comments in the repository, at most 5 results.",
    "Create a file hello.py that prints hello world.",
    "Use the weather tool for São Paulo.",
    "Tell me a joke about programmers.",
    "Search the files for the word 'unsafe'.",
    "Is it raining in London?",
]


def main():
    llm = Llama(model_path=MODEL, n_ctx=4096, n_threads=2, verbose=False, seed=0)
    template = llm.metadata["tokenizer.chat_template"]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False)
    render = env.from_string(template)
    reviewed = {}
    if os.path.exists(OUT):
        with open(OUT) as f:
            reviewed = {(c["name"], c["text"]): c for c in json.load(f)["cases"]}
    cases = []
    for prompt in PROMPTS:
        text = render.render(messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                             add_generation_prompt=True)
        out = llm.create_completion(text, max_tokens=256, temperature=0.0, stop=["<|im_end|>", "<|endoftext|>"])
        reply = out["choices"][0]["text"]
        print(repr(prompt), "->", repr(reply), file=sys.stderr)
        cases.append(reviewed.get((prompt, reply), {"name": prompt, "text": reply}))
    with open(OUT, "w") as f:
        json.dump({"format": "hermes-json", "model": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                   "generator": "llama-cpp-python 0.3.36, greedy, max_tokens 256",
                   "tools": TOOLS, "cases": cases}, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
