"""Hugging Face chat templates: rendered with jinja2 as transformers renders them, plus the
character spans of the assistant turns (what SFT trains on).

A turn's span is found by rendering the conversation up to it with the generation prompt (where
the assistant's reply would start) and up to and including it (where it ends, trailing whitespace
after its end token dropped). That works for any template whose rendering of a prefix of the
conversation is a prefix of the full rendering; templates that rewrite earlier turns (e.g. drop
past reasoning) are reported, not silently mis-masked.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# For tokenizers that ship no template: contents back to back, eos after each assistant turn.
PLAIN_TEMPLATE = (
    "{% if bos_token is defined %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' assistant-mask markup) → its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled in transformers' sandboxed environment (same filters, globals)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render(
    template: jinja2.Template, messages: list[dict], *, add_generation_prompt: bool, special_tokens: dict[str, str]
) -> str:
    """The conversation as text; a template's `raise_exception` becomes a `ValueError`."""
    try:
        return template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


def continue_final(rendered: str, messages: list[dict]) -> str:
    """`rendered` cut right after the last message's content, so that a model continues that message
    (transformers' `continue_final_message`: the template's end-of-turn after it dropped)."""
    final = messages[-1]["content"] if messages else ""
    if not isinstance(final, str) or not final.strip() or final.strip() not in rendered:
        raise ValueError("chat template: continue_final_message needs the last message's text in the rendered chat")
    at = rendered.rindex(final.strip())
    if rendered[at : at + len(final.lstrip())] == final:  # the template kept the message's spacing
        return rendered[: at + len(final.lstrip())]
    return rendered[: at + len(final.strip())]


def render_with_spans(
    template: jinja2.Template, messages: list[dict], *, add_generation_prompt: bool, special_tokens: dict[str, str]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the `[start, end)` character span of each assistant turn."""

    def text(msgs, gen):
        return render(template, msgs, add_generation_prompt=gen, special_tokens=special_tokens)

    full = text(messages, add_generation_prompt)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before, upto = text(messages[:i], True), text(messages[: i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError(
                f"chat template renders messages[{i}] (assistant) differently inside the "
                "full conversation, so its tokens cannot be located; split the "
                "conversation so that it ends at each assistant turn"
            )
        spans.append((len(before), len(upto.rstrip())))
    return full, spans
