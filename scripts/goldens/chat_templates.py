#!/usr/bin/env python3
"""Reference renderings of real chat templates, made with Python jinja2 set up the way transformers sets it up.

The Rust tests in crates/wick-chat/tests/chat_template_goldens.rs compare wick's minijinja rendering with these
files byte for byte.

Inputs:  crates/wick-chat/tests/goldens/chat_templates/conversations.json (messages, tools, kwargs, the sample)
         $WICK_HOME/assets/llama.cpp/templates/*.jinja (WICK_HOME defaults to ~/.cache/wick)
         crates/wick-chat/tests/goldens/chat_templates/snippets.json (one small template per jinja2 feature)
Outputs: crates/wick-chat/tests/goldens/chat_templates/<template stem>/<conversation>.txt   (the rendering)
         crates/wick-chat/tests/goldens/chat_templates/<template stem>/<conversation>.err   (why it failed)
         crates/wick-chat/tests/goldens/chat_templates/snippets.expected.json   (each snippet's outcome)

An .err file holds one line naming the failure, then the message:
    raise_exception            the template called raise_exception(message); the message follows
    error <ExceptionClass>     anything else (undefined attribute, type error, ...); Python's message follows

Usage:
    python3 scripts/goldens/chat_templates.py            # rewrite the sample's goldens and the snippets
    python3 scripts/goldens/chat_templates.py --all DIR  # render every template into DIR (not committed);
        # then WICK_CHAT_TEMPLATE_GOLDENS_ALL=DIR cargo test -p wick-chat --test chat_template_goldens -- --ignored

The environment mirrors transformers' `_cached_compile_jinja_template` (utils/chat_template_utils.py):
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols]),
the `tojson` filter as json.dumps(ensure_ascii=False, indent, separators, sort_keys), `raise_exception`,
`strftime_now` (here on a fixed clock), `dict` and `namespace`. When transformers is importable, every rendering
is also made with transformers' own compiled template and the two must agree.
"""

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO = Path(__file__).resolve().parents[2]
GOLDENS = REPO / "crates" / "wick-chat" / "tests" / "goldens" / "chat_templates"


def templates_dir() -> Path:
    home = Path(os.environ.get("WICK_HOME", Path.home() / ".cache" / "wick"))
    path = home / "assets" / "llama.cpp" / "templates"
    if not path.is_dir():
        sys.exit(f"{path} is missing: run `wick pull test-assets`")
    return path


class RaisedByTemplate(jinja2.exceptions.TemplateError):
    """What raise_exception raises, so failures can tell it apart from engine errors."""


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` renders its body unchanged, as transformers' AssistantTracker does
    when no assistant mask is requested."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")


def make_environment(now: dt.datetime) -> ImmutableSandboxedEnvironment:
    def raise_exception(message):
        raise RaisedByTemplate(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return now.strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def transformers_compiler(now: dt.datetime):
    """transformers' own compile function with its clock fixed, or None when transformers is not installed."""
    try:
        from transformers.utils import chat_template_utils as ctu
    except Exception:
        return None

    class FixedDatetime(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return now

    ctu.datetime = FixedDatetime
    return ctu._compile_jinja_template


def describe_failure(err: Exception) -> str:
    if isinstance(err, RaisedByTemplate) or type(err) is jinja2.exceptions.TemplateError:
        return f"raise_exception\n{err.message if hasattr(err, 'message') else err}"
    return f"error {type(err).__name__}\n{err}"


def render(compile_fn, source: str, conversation: dict, tools: list, special: dict) -> str:
    context = dict(special)
    context.update(conversation["kwargs"])
    return compile_fn(source).render(
        messages=conversation["messages"],
        tools=tools if conversation["tools"] else None,
        documents=None,
        add_generation_prompt=conversation["add_generation_prompt"],
        **context,
    )


def outcome(compile_fn, source, conversation, tools, special) -> str:
    """'ok\\n' + rendering, or the .err text."""
    try:
        return "ok\n" + render(compile_fn, source, conversation, tools, special)
    except Exception as err:  # every failure is recorded, none stops the run
        return describe_failure(err)


def render_snippets(compile_fn, spec: dict) -> dict:
    """Each snippet rendered with the snippet context as kwargs, as the Rust test renders it:
    {"ok": text}, {"raise_exception": message} or {"error": exception class}."""
    snippets = json.loads((GOLDENS / "snippets.json").read_text(encoding="utf-8"))
    conversation = {"messages": [], "tools": False, "add_generation_prompt": False, "kwargs": snippets["context"]}
    results = {}
    for name, source in snippets["snippets"].items():
        result = outcome(compile_fn, source, conversation, [], spec["special_tokens"])
        if result.startswith("ok\n"):
            results[name] = {"ok": result[3:]}
        else:
            kind, _, message = result.partition("\n")
            if kind == "raise_exception":
                results[name] = {"raise_exception": message}
            else:
                results[name] = {"error": kind.removeprefix("error "), "message": message}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", metavar="DIR", help="render every template into DIR instead of the sample")
    args = parser.parse_args()

    spec = json.loads((GOLDENS / "conversations.json").read_text(encoding="utf-8"))
    now = dt.datetime.fromisoformat(spec["now"])
    env = make_environment(now)
    ours = env.from_string
    theirs = transformers_compiler(now)
    source_dir = templates_dir()

    if args.all:
        out_dir = Path(args.all)
        names = sorted(p.name for p in source_dir.glob("*.jinja"))
    else:
        out_dir = GOLDENS
        names = spec["golden_sample"]

    written = failed = 0
    for name in names:
        source = (source_dir / name).read_text(encoding="utf-8")
        stem = name.removesuffix(".jinja")
        target = out_dir / stem
        target.mkdir(parents=True, exist_ok=True)
        for old in target.iterdir():
            old.unlink()
        accepted_shape = None
        for conv_name, conversation in spec["conversations"].items():
            if conv_name in spec["fallback_shapes"] and accepted_shape is not None and not args.all:
                # The sample keeps the shapes up to the first one the template accepts.
                continue
            result = outcome(ours, source, conversation, spec["tools"], spec["special_tokens"])
            if conv_name in spec["fallback_shapes"] and result.startswith("ok\n"):
                accepted_shape = conv_name
            if theirs is not None:
                check = outcome(theirs, source, conversation, spec["tools"], spec["special_tokens"])
                if check.startswith("ok\n") != result.startswith("ok\n") or (
                    result.startswith("ok\n") and check != result
                ):
                    sys.exit(f"{name} / {conv_name}: this environment and transformers disagree")
            if result.startswith("ok\n"):
                (target / f"{conv_name}.txt").write_bytes(result[3:].encode("utf-8"))
                written += 1
            else:
                (target / f"{conv_name}.err").write_bytes(result.encode("utf-8"))
                failed += 1
    if not args.all:
        results = render_snippets(ours, spec)
        if theirs is not None and render_snippets(theirs, spec) != results:
            sys.exit("snippets: this environment and transformers disagree")
        text = json.dumps(results, ensure_ascii=False, indent=2) + "\n"
        (GOLDENS / "snippets.expected.json").write_text(text, encoding="utf-8")
        print(f"{len(results)} snippets written to snippets.expected.json")
    checked = "cross-checked with transformers" if theirs is not None else "transformers not installed"
    print(f"{len(names)} templates: {written} renderings, {failed} failures recorded in {out_dir} ({checked})")


if __name__ == "__main__":
    main()
