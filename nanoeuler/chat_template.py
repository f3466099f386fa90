"""Chat templates: the one way a conversation becomes a model's prompt (chat, serve, sft, dpo, export).

A tokenizer carries its model's Jinja chat template (`tok.chat_template`: imported from a GGUF's
`tokenizer.chat_template` or a Hugging Face `chat_template`, or set with `--chat-template FILE`); without
one it is ours, the SPEC Alpaca template written in Jinja (`alpaca_template`). Templates are rendered as
transformers' `apply_chat_template(messages, tools=..., documents=..., **kwargs)` renders them, with the
variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools` and `documents` (None
unless given) and any other a caller names (`variables`: the API's `chat_template_kwargs`, chat's
`--template-var`, e.g. enable_thinking). A template is never trusted: it is compiled and rendered in a sandbox in a
worker process (template_worker.py), bounded in time and memory, so a hostile or endless template is one
line naming it and the rest of the process (serve's other requests) goes on meanwhile.

    render(CHATML, [{"role": "user", "content": "Hi"}], tok, add_generation_prompt=True)
    -> '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'

The rendered text is encoded with the specials it names parsed as specials, the tokenizer's bos put first
unless the text already starts with it. A reply ends at any of `tok.stop_ids` (eos and end-of-turn).
"""
from __future__ import annotations

import json
from pathlib import Path

from . import template_worker
from .errors import UserError

MAX_TEMPLATE = 1 << 20  # characters (or bytes of a file): real templates take a few KB, tool-calling ones ~30 KB
HEADER = ("Below is an instruction that describes a task. "   # the SPEC Alpaca template's first paragraph
          "Write a response that appropriately completes the request.\n\n")
EXAMPLES_PER_TRIP = 32  # training examples rendered in one trip to a template worker (3 renders each)
PROBE = "nanoeulerProbeReply"  # a reply no template trims, escapes or splits: shows where a reply is written


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


BUNDLED = Path(__file__).resolve().parent / "assets" / "chat_templates"   # name.jinja: `--chat-template name`


def bundled_templates() -> dict[str, Path]:
    """The chat templates shipped with nanoeuler, by name: {"gemma": .../gemma.jinja} (Gemma's turn format,
    for a Gemma base model, whose file carries no template)."""
    return {p.stem: p for p in sorted(BUNDLED.glob("*.jinja"))}


def template_of(tok) -> str:
    """The template the tokenizer's model speaks: its own, else ours."""
    return tok.chat_template if tok.chat_template is not None else alpaca_template()


def with_template_file(tok, path: str | Path | None):
    """tok with the Jinja template of file `path` (the `--chat-template FILE` option), or of the bundled
    template of that name when no such file exists (`bundled_templates`: "gemma"); tok itself when None.
    The file must be UTF-8 and compile (each refused in one line naming it)."""
    if path is None:
        return tok
    path = Path(path)
    if not path.exists() and str(path) in bundled_templates():
        path = bundled_templates()[str(path)]
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEMPLATE + 1)
    except OSError as e:
        raise UserError(f"--chat-template {path}: cannot read it ({e.strerror or e}); a file, or a bundled template: "
                        f"{', '.join(bundled_templates())}") from None
    if len(data) > MAX_TEMPLATE:
        raise UserError(f"--chat-template {path}: larger than {MAX_TEMPLATE >> 20} MiB, not a chat template")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--chat-template {path}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
    try:
        template_worker.render(text, [], bos="", eos="")  # a syntax error is reported now, before any work
    except UserError as e:
        raise UserError(f"{e} in --chat-template {path}") from None
    return tok.replace(chat_template=text)


# ------------------------------------------------------------------------------------------- rendering

RESERVED = ("messages", "add_generation_prompt")  # variables the conversation sets, never a caller


def render(template: str, messages: list[dict], tok, add_generation_prompt: bool = False,
           variables: dict | None = None) -> str:
    """The conversation as the template writes it (any failure, the template's own or a bound: one UserError);
    variables: the template's other variables ({"tools": [...], "enable_thinking": False}, JSON values)."""
    return render_many(template, [(messages, add_generation_prompt)], tok, variables)[0]


def render_many(template: str, renders: list[tuple[list[dict], bool]], tok, variables: dict | None = None) -> list[str]:
    """render of each (messages, add_generation_prompt), in one trip to a template worker."""
    return [text for text, _ in render_marked(template, renders, tok, variables)]


def render_marked(template: str, renders: list[tuple[list[dict], bool]], tok, variables: dict | None = None
                  ) -> list[tuple[str, list[tuple[int, int]]]]:
    """render_many's texts, each with the character spans [start, end) of the template's generation blocks in it."""
    if len(template) > MAX_TEMPLATE:
        raise UserError(f"chat template error: the template is longer than {MAX_TEMPLATE} characters")
    variables = variables or {}
    if taken := [k for k in RESERVED if k in variables]:
        raise UserError(f"template variable {taken[0]!r} is the conversation's own; it cannot be set")
    eos = tok.eos_token if tok.eos_token in tok.special_tokens else ""
    return template_worker.render(template, renders, bos=tok.bos_token or "", eos=eos, variables=variables)


def encode(tok, text: str) -> list[int]:
    """Rendered text -> ids: specials parsed, bos first unless the template wrote it."""
    add_bos = tok.bos_token is not None and not text.startswith(tok.bos_token)
    return tok.encode(text, allow_special=True, add_bos=add_bos)


def prompt_ids(tok, messages: list[dict], variables: dict | None = None) -> list[int]:
    """The conversation followed by the opening of the assistant's reply: what the model continues."""
    return encode(tok, render(template_of(tok), messages, tok, add_generation_prompt=True, variables=variables))


def example(tok, messages: list[dict], reply: str, generation: bool = False) -> tuple[list[int], list[bool]]:
    """A training example (SFT, DPO) -> (ids, mask): the mask is True on exactly the reply's tokens and the
    end-of-turn token after it. With generation=True (sft) and a template that marks replies with
    {% generation %} blocks, the mask is the template's instead: `generation_masked`. Otherwise it is found by
    rendering, never by guessing strings: the prompt is the render with
    add_generation_prompt, the full render must begin with it, and a render with the reply PROBE shows what
    the template writes around a reply (refused unless it writes it exactly once, in one piece, and the real
    reply, not as nothing, in the same place). The mask ends at the first stop id after the reply (ChatML's newline after
    <|im_end|> carries no loss).

        ChatML, reply "Red.":  prompt '<|im_start|>user\\nColour?<|im_end|>\\n<|im_start|>assistant\\n'
                               full   prompt + 'Red.<|im_end|>\\n'     mask on 'Red.<|im_end|>'
        a template writing the reply twice ('Red.</s>Red.</s>'): refused
    """
    return examples(tok, [(messages, reply)], generation)[0]


def examples(tok, items: list[tuple[list[dict], str]], generation: bool = False) -> list[tuple[list[int], list[bool]]]:
    """example of each (messages, reply), EXAMPLES_PER_TRIP of them to a trip to the template worker."""
    def answered(messages, content):
        return [*messages, {"role": "assistant", "content": content}]
    out = []
    for i in range(0, len(items), EXAMPLES_PER_TRIP):
        chunk = items[i:i + EXAMPLES_PER_TRIP]
        renders = [r for messages, reply in chunk
                   for r in ((messages, True), (answered(messages, PROBE), False), (answered(messages, reply), False))]
        done = render_marked(template_of(tok), renders, tok)
        for j, (_, reply) in enumerate(chunk):
            (prompt, _), (probed, _), (full, spans) = done[3 * j:3 * j + 3]
            out.append(generation_masked(tok, full, spans, reply) if generation and spans
                       else masked(tok, prompt, probed, full, reply))
    return out


def generation_masked(tok, text: str, spans: list[tuple[int, int]], reply: str) -> tuple[list[int], list[bool]]:
    """(ids, mask) of a conversation whose template marks the assistant's turns with {% generation %} blocks,
    as transformers' apply_chat_template(..., return_assistant_tokens_mask=True) makes them: the whole text
    encoded at once, the mask True on every token that overlaps a span (what the template puts in the block,
    end-of-turn token and all). Refused when the blocks hold no token.

        ChatML with '{% generation %}{{ content }}<|im_end|>{% endgeneration %}', reply "Red.":
        text '<|im_start|>user\nColour?<|im_end|>\n<|im_start|>assistant\nRed.<|im_end|>\n'   mask on 'Red.<|im_end|>'
    """
    ids = encode(tok, text)
    ends = token_ends(tok, text, ids)
    starts = [0] + ends[:-1]
    spans = [(utf8_length(text[:a]), utf8_length(text[:b])) for a, b in spans]    # characters -> bytes
    mask = [any(end > a and start < b for a, b in spans) for start, end in zip(starts, ends)]
    if not any(mask):
        raise UserError(f"chat template error: the template's generation blocks hold none of the tokens of the reply "
                        f"{reply[:40]!r}, so there is nothing to train on")
    return ids, mask


def token_ends(tok, text: str, ids: list[int]) -> list[int]:
    """Where each token of ids (`encode(tok, text)`) ends in text's UTF-8 bytes: a token spells its bytes, except
    a bos that encode put in front of the text and a SentencePiece prefix space the text lacks, which spell nothing.

        text 'Hi there', ids of ['<s>', 'Hi', ' there'] -> [0, 2, 8]
    """
    data, at, ends = text.encode("utf-8", "surrogatepass"), 0, []
    for k, i in enumerate(ids):
        piece = tok.token_bytes(i)
        if data.startswith(piece, at):
            at += len(piece)
        elif k == 0 and i == tok.bos_id:
            pass
        elif piece[:1] == b" " and data.startswith(piece[1:], at):
            at += len(piece) - 1
        else:
            raise UserError("chat template error: the tokenizer's tokens do not spell the rendered conversation "
                            f"(token {k}, {piece[:20]!r}: a normalizer changed the text), so the template's "
                            "generation blocks cannot be found among them")
        ends.append(at)
    return ends


def utf8_length(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def masked(tok, prompt: str, probed: str, full: str, reply: str) -> tuple[list[int], list[bool]]:
    """example's (ids, mask) from its three renders: the prompt, the conversation answered with PROBE, with reply."""
    before, after = around_reply(prompt, probed)
    start, stop = len(prompt) + len(before), len(full) - len(after)   # the reply as written: full[start:stop]
    if not (full.startswith(prompt + before) and full.endswith(after) and stop >= start) or (reply and stop == start):
        raise UserError(f"chat template error: the template writes the reply {reply[:40]!r} as nothing or elsewhere "
                        "than other replies, so its tokens cannot be found")
    tail = full[len(prompt):]
    head, ids = encode(tok, prompt), tok.encode(tail, allow_special=True)
    stops = set(tok.stop_ids)
    in_reply = sum(t in stops for t in tok.encode(full[len(prompt):stop], allow_special=True))
    ends = [i + 1 for i, t in enumerate(ids) if t in stops][in_reply:]
    end = ends[0] if ends else len(ids)
    return head + ids, [False] * len(head) + [True] * end + [False] * (len(ids) - end)


def around_reply(prompt: str, probed: str) -> tuple[str, str]:
    """(what the template writes between the prompt and a reply, what after it) from the render `probed` of a
    conversation answered with PROBE; refused unless probed begins with prompt and holds PROBE once after it."""
    if not probed.startswith(prompt):
        raise UserError("chat template error: the rendered conversation does not begin with its rendered prompt "
                        "(add_generation_prompt), so the reply's tokens cannot be found")
    tail = probed[len(prompt):]
    if tail.count(PROBE) != 1:
        raise UserError(f"chat template error: the template writes an assistant reply {tail.count(PROBE)} times "
                        "after the prompt (it must write it once, in one piece), so the loss mask cannot cover it")
    before, _, after = tail.partition(PROBE)
    return before, after


def check_training_template(tok, generation: bool = False) -> None:
    """Refuse now, before any data or model is read, a template that sft and dpo cannot train on (`example`)."""
    example(tok, [{"role": "user", "content": "Name a colour."}], "Red.", generation)
