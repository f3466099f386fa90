"""Chat templates: the one way a conversation becomes a model's prompt (chat, serve, sft, dpo, export).

A tokenizer carries its model's Jinja chat template (`tok.chat_template`: imported from a GGUF's
`tokenizer.chat_template` or a Hugging Face `chat_template`, or set with `--chat-template FILE`); without
one it is ours, the SPEC Alpaca template written in Jinja (`alpaca_template`). Templates are rendered as
transformers' `apply_chat_template` renders them: jinja2's ImmutableSandboxedEnvironment (trim_blocks,
lstrip_blocks, loop controls), the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
and the helpers `raise_exception(msg)`, `strftime_now(fmt)` and the `tojson` filter. A template is never
trusted: the sandbox refuses attribute tricks, and a render is bounded (RENDER_SECONDS, MAX_TEXT: string
repetition, concatenation and powers are checked), so a hostile or endless template is one line naming it.

    render(CHATML, [{"role": "user", "content": "Hi"}], tok, add_generation_prompt=True)
    -> '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'

The rendered text is encoded with the specials it names parsed as specials, the tokenizer's bos put first
unless the text already starts with it. A reply ends at any of `tok.stop_ids` (eos and end-of-turn).
"""
from __future__ import annotations

import json
import threading
import time
from functools import lru_cache
from pathlib import Path

from .errors import UserError

RENDER_SECONDS = 2.0    # a render taking longer is stopped
MAX_TEXT = 1 << 22      # characters: the longest string (or list) a template may build
HEADER = ("Below is an instruction that describes a task. "   # the SPEC Alpaca template's first paragraph
          "Write a response that appropriately completes the request.\n\n")
_clock = threading.local()  # .deadline of the render running in this thread (serve renders in several)


def alpaca_template() -> str:
    """The SPEC Alpaca template in Jinja, rendering exactly as `sft.prompt_text` + output + eos: each user turn
    (its instruction: message['instruction'] if given, else its content; its optional message['input'] the
    `### Input:` block) ends with '### Response:\\n', each assistant turn is its content + eos_token. A system
    message goes in front of the next instruction, separated by a blank line. add_generation_prompt adds
    nothing (the user turn already ends with the response header)."""
    def lit(s: str) -> str:
        return json.dumps(s)  # a JSON string is a valid Jinja string literal

    return ("{% set ns = namespace(system='') %}"
            "{% for message in messages %}"
            "{% if message['role'] == 'system' %}"
            "{% set ns.system = ns.system + message['content'] + " + lit("\n\n") + " %}"
            "{% elif message['role'] == 'user' %}"
            "{% set text = message['instruction'] if message['instruction'] is defined else message['content'] %}"
            "{{ " + lit(HEADER + "### Instruction:\n") + " + ns.system + text + " + lit("\n\n") + " }}"
            "{% set ns.system = '' %}"
            "{% if message['input'] is defined and message['input'] %}"
            "{{ " + lit("### Input:\n") + " + message['input'] + " + lit("\n\n") + " }}"
            "{% endif %}"
            "{{ " + lit("### Response:\n") + " }}"
            "{% elif message['role'] == 'assistant' %}"
            "{{ message['content'] + eos_token }}"
            "{% else %}"
            "{{ raise_exception('the Alpaca template has only system, user and assistant turns') }}"
            "{% endif %}"
            "{% endfor %}")


def template_of(tok) -> str:
    """The template the tokenizer's model speaks: its own, else ours."""
    return tok.chat_template if tok.chat_template is not None else alpaca_template()


def with_template_file(tok, path: str | Path | None):
    """tok with the Jinja template of file `path` (the `--chat-template FILE` option); tok itself when None."""
    if path is None:
        return tok
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--chat-template {path}: cannot read it ({e.strerror or e})") from None
    compiled(text)  # a syntax error is reported now, naming the file
    return tok.replace(chat_template=text)


# ------------------------------------------------------------------------------------------- rendering

def sandbox():
    """A bounded ImmutableSandboxedEnvironment configured as transformers configures its own."""
    try:
        from jinja2.exceptions import SecurityError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError("chat templates need jinja2: pip install 'jinja2>=3.1'") from None

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def tick(self):
            if time.monotonic() > getattr(_clock, "deadline", float("inf")):
                raise SecurityError(f"the template ran longer than {RENDER_SECONDS:g} s")

        def call_binop(self, context, operator, left, right):
            self.tick()
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError(f"power {right!r:.20} is too large")
            if operator == "*":  # "ab" * 10**9 must fail before it allocates
                n, seq = (left, right) if isinstance(left, int) else (right, left)
                if isinstance(n, int) and hasattr(seq, "__len__") and n * len(seq) > MAX_TEXT:
                    raise SecurityError(f"a repetition of more than {MAX_TEXT} items")
            out = super().call_binop(context, operator, left, right)
            if hasattr(out, "__len__") and len(out) > MAX_TEXT:
                raise SecurityError(f"a value of more than {MAX_TEXT} items")
            return out

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            __self.tick()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            self.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self.tick()
            return super().getitem(obj, argument)

    from jinja2.ext import loopcontrols
    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: no HTML escaping (unlike jinja's own), unicode kept."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def strftime_now(fmt: str) -> str:
    from datetime import datetime
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compiled(template: str):
    """The compiled template (a syntax error is a UserError naming it)."""
    env = sandbox()
    try:
        return env, env.from_string(template)
    except Exception as e:
        raise UserError(f"chat template error: {one_line(e)}") from None


def one_line(e: Exception) -> str:
    where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}"[:300]


def render(template: str, messages: list[dict], tok, add_generation_prompt: bool = False) -> str:
    """The conversation as the template writes it (any failure, sandbox or time bound: one UserError)."""
    env, t = compiled(template)
    eos = tok.eos_token if tok.eos_token in tok.special_tokens else ""
    _clock.deadline = time.monotonic() + RENDER_SECONDS
    out, n = [], 0
    try:
        for piece in t.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                bos_token=tok.bos_token or "", eos_token=eos):
            n += len(piece)
            if n > MAX_TEXT:
                raise UserError(f"chat template error: the prompt is longer than {MAX_TEXT} characters")
            out.append(piece)
            env.tick()
    except UserError:
        raise
    except Exception as e:  # TemplateError, SecurityError, the template's own TypeError / RecursionError ...
        raise UserError(f"chat template error: {one_line(e)}") from None
    finally:
        _clock.deadline = float("inf")
    return "".join(out)


def encode(tok, text: str) -> list[int]:
    """Rendered text -> ids: specials parsed, bos first unless the template wrote it."""
    add_bos = tok.bos_token is not None and not text.startswith(tok.bos_token)
    return tok.encode(text, allow_special=True, add_bos=add_bos)


def prompt_ids(tok, messages: list[dict]) -> list[int]:
    """The conversation followed by the opening of the assistant's reply: what the model continues."""
    return encode(tok, render(template_of(tok), messages, tok, add_generation_prompt=True))


def example(tok, messages: list[dict], reply: str) -> tuple[list[int], list[bool]]:
    """A training example (SFT, DPO) -> (ids, mask): the mask is True on exactly the reply's tokens and its
    end-of-turn token. Found by rendering with and without the reply, never by guessing strings: the prompt
    is the render with add_generation_prompt, the reply is what the full render adds to it, and the mask
    ends at the last stop id in it (ChatML's newline after <|im_end|> carries no loss)."""
    template = template_of(tok)
    prompt = render(template, messages, tok, add_generation_prompt=True)
    full = render(template, [*messages, {"role": "assistant", "content": reply}], tok)
    if not full.startswith(prompt):
        raise UserError("chat template error: the rendered conversation does not begin with its rendered prompt "
                        "(add_generation_prompt), so the reply's tokens cannot be found")
    head = encode(tok, prompt)
    tail = tok.encode(full[len(prompt):], allow_special=True)
    stops = set(tok.stop_ids)
    end = max((i + 1 for i, t in enumerate(tail) if t in stops), default=len(tail))
    return head + tail, [False] * len(head) + [True] * end + [False] * (len(tail) - end)
