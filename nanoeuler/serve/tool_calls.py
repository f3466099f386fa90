"""Tool calls in a chat reply: the formats models write them in, and the reply as OpenAI's message.

A model offered tools (the request's `tools`, passed to its chat template as transformers passes them) calls
one by writing it in its family's format. The format is read off the chat template, the first row of FORMATS
whose mark the template holds (a template that writes `<tool_call>` expects its model to answer with it),
else GENERIC, as llama-server chooses its parser:

    hermes   (Hermes, Qwen2.5, Qwen3)  <tool_call>{"name": "f", "arguments": {...}}</tool_call>, one per call
    mistral  (Mistral, Devstral)       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
    llama3   (Llama 3.1-3.3)           {"name": "f", "parameters": {...}}, the whole reply, or after <|python_tag|>
    generic  (any other)               the whole reply one JSON object: {"name", "arguments"}, {"tool_call": {...}}
                                       or {"tool_calls": [...]}

With tool_choice "required" or a named function the reply is constrained (call_grammar) to one call in the
format, its arguments valid under the function's parameters schema.

A call names an offered function and carries a JSON object of arguments; a reply holding anything else
(not JSON, an unknown name, arguments that are not an object) is not a call and stays content. The content
of a reply with calls is its text outside them, as written. While a reply streams, its text may go out up
to where a call might begin (`streamable`): a format's opening mark, or the whole reply for a JSON one.

    parse(format_of(QWEN), 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
          {"get_weather"})  ->  ('Let me look.', [("get_weather", {"city": "Oslo"})])
"""
from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass

Call = tuple[str, dict]   # (function name, arguments)


def _json(text: str):
    """text as one JSON value, else None."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(obj, arguments: tuple[str, ...] = ("arguments",)) -> Call | None:
    """{"name": "f", "arguments": {...}} (or another key of `arguments`) -> ("f", {...}); else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments if k in obj), None)
    return (obj["name"], args) if isinstance(args, dict) else None


def _calls(values: list, arguments: tuple[str, ...] = ("arguments",)) -> list[Call] | None:
    """Each value a call, else None."""
    calls = [_call(v, arguments) for v in values]
    return None if not calls or None in calls else calls


def hermes(text: str) -> tuple[str, list[Call]] | None:
    """<tool_call>{json}</tool_call> blocks (the last may be cut by the end of the reply); content around them."""
    blocks = list(re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL))
    calls = _calls([_json(m.group(1)) for m in blocks])
    if calls is None:
        return None
    content = "".join(text[a:b] for a, b in zip([0, *(m.end() for m in blocks)], [*(m.start() for m in blocks), len(text)]))
    return content, calls


def mistral(text: str) -> tuple[str, list[Call]] | None:
    """[TOOL_CALLS] then a JSON list of calls; content before it."""
    content, mark, rest = text.partition("[TOOL_CALLS]")
    value = _json(rest) if mark else None
    calls = _calls(value if isinstance(value, list) else [value])
    return None if calls is None else (content, calls)


def llama3(text: str) -> tuple[str, list[Call]] | None:
    """A JSON call with "parameters" (or "arguments"), the whole reply or after <|python_tag|>."""
    content, mark, rest = text.partition("<|python_tag|>")
    call = _call(_json(rest if mark else text), ("parameters", "arguments"))
    return None if call is None else (content if mark else "", [call])


def generic(text: str) -> tuple[str, list[Call]] | None:
    """The whole reply one JSON object: a call, {"tool_call": call} or {"tool_calls": [call, ...]}."""
    value = _json(text)
    if isinstance(value, dict) and "tool_calls" in value and isinstance(value["tool_calls"], list):
        calls = _calls(value["tool_calls"])
    else:
        calls = _calls([value.get("tool_call", value) if isinstance(value, dict) else value])
    return None if calls is None else ("", calls)


@dataclass(frozen=True)
class Format:
    name: str
    marks: tuple[str, ...]                                   # strings in a chat template that name the format
    parse: Callable[[str], tuple[str, list[Call]] | None]   # reply -> (content, calls), or None: not a call
    opens: tuple[str, ...]                                   # strings in a reply where a call begins
    whole: bool                                              # a reply that is one JSON object may be a call
    forced: tuple[str, str]                                  # a forced call's text before and after its JSON


FORMATS = (
    Format("hermes", ("<tool_call>",), hermes, ("<tool_call>",), False, ("<tool_call>\n", "\n</tool_call>")),
    Format("mistral", ("[TOOL_CALLS]",), mistral, ("[TOOL_CALLS]",), False, ("[TOOL_CALLS][", "]")),
    Format("llama3", ("<|python_tag|>", "ipython<|end_header_id|>"), llama3, ("<|python_tag|>",), True, ("", "")),
)
GENERIC = Format("generic", (), generic, (), True, ("", ""))


def format_of(template: str) -> Format:
    """The format a chat template's model writes its calls in: the first row whose mark it holds, else GENERIC."""
    return next((f for f in FORMATS if any(m in template for m in f.marks)), GENERIC)


def parse(fmt: Format, text: str, names: set[str]) -> tuple[str, list[Call]]:
    """A reply -> (content, calls of offered functions); a reply that is not a call is (text, [])."""
    found = fmt.parse(text)
    if found is None or any(name not in names for name, _ in found[1]):
        return text, []
    return found


def call_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call of one of tools (as the template takes them): {"name": its name,
    "arguments": an object valid under its parameters}, name first."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def call_grammar(fmt: Format, tools: list[dict], g) -> str:
    """The grammar of a reply that is exactly one call of one of tools in fmt (tool_choice "required" or a
    named function), for g (infer/grammar.py's Grammars): hermes '<tool_call>\n{call}\n</tool_call>', mistral
    '[TOOL_CALLS][{call}]', llama3 and generic the call alone ({"name", "arguments"}: both parse it)."""
    before, after = fmt.forced
    return g.lark(" ".join(r for r in (g.text_rule(before), g.json_rule(call_schema(tools)), g.text_rule(after)) if r))


def call_id() -> str:
    """A fresh call id: 9 letters and digits, the one form every template takes back (Mistral's demands it)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def streamable(fmt: Format, text: str) -> int:
    """How much of a reply so far may stream as content: its text before anything that might begin a call
    (an opening mark, or its start: a whole JSON reply), less the spaces just before that (they may be the
    call's).   hermes, 'Sure.\n<tool' -> 5 ('Sure.')"""
    if fmt.whole and (not text.strip() or text.lstrip().startswith("{")):
        return 0
    cut = len(text)
    for mark in fmt.opens:
        found = text.find(mark)
        partial = next((len(text) - n for n in range(min(len(mark) - 1, len(text)), 0, -1)
                        if text.endswith(mark[:n])), len(text))   # the end of text begins the mark
        cut = min(cut, found if found >= 0 else partial)
    return len(text[:cut].rstrip())


def openai_calls(calls: list[Call], streamed: bool = False) -> list[dict]:
    """Calls as OpenAI's message.tool_calls (arguments a JSON string; `index` too in a stream's delta)."""
    out = [{"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}} for name, args in calls]
    return [{"index": i, **c} for i, c in enumerate(out)] if streamed else out
