"""Tool calls through the OpenAI API (serve/tool_calls.py, serve/protocol.py): the real `openai` client against
a server on 127.0.0.1 whose model's replies are forced (its sampling scripted), so a call round-trips in each
family's format with its real chat template (llama.cpp's models/templates, when fetched) or a Hermes-style one:
request with tools -> message.tool_calls (and delta.tool_calls) -> a follow-up carrying the assistant's calls
and the tool's result renders as transformers renders it."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_fixtures import ServerThread  # noqa: E402

from nanoeuler import Config, Model  # noqa: E402
from nanoeuler.chat_template import render  # noqa: E402
from nanoeuler.data.corpus import bundled_works  # noqa: E402
from nanoeuler.serve import tool_calls  # noqa: E402
from nanoeuler.serve.protocol import ChatRequest, chat_messages  # noqa: E402
from nanoeuler.tokenizer import Tokenizer  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
          "strict": False}}]   # a field the template sees as the client sent it
NAMES = {"get_weather"}
HERMES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.tool_calls %}"
          "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}"
          "<|im_end|>\n{% endfor %}{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GENERIC = HERMES.replace("<tool_call>", "[").replace("</tool_call>", "]")
THINKING = "{% if enable_thinking is sameas false %}{{ raise_exception('thinking is off') }}{% endif %}" + HERMES
ARGS = {"city": "Zürich"}
# (template: a file of llama.cpp's models/templates or inline, its format, the reply that calls get_weather, content)
CASES = [
    ("Qwen-Qwen2.5-7B-Instruct", "hermes", ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                            '{"city": "Zürich"}}\n</tool_call>'), "Let me check.\n"),
    ("Qwen-Qwen3-0.6B", "hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
                                   '</tool_call>'), None),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "hermes",
     '<tool_call>\n{"arguments": {"city": "Zürich"}, "name": "get_weather"}\n</tool_call>', None),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3", '{"name": "get_weather", "parameters": {"city": "Zürich"}}', None),
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}', None),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich"}}]', None),
    (HERMES, "hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>', None),
    (GENERIC, "generic", '{"tool_call": {"name": "get_weather", "arguments": {"city": "Zürich"}}}', None),
]


def templates_dir() -> Path:
    src = Path(os.environ.get("LLAMA_CPP_SRC") or Path(__file__).resolve().parent.parent / ".cache" / "llama-cpp-python")
    return src / "vendor" / "llama.cpp" / "models" / "templates"


def template_text(name: str) -> str:
    if "{" in name:
        return name
    path = templates_dir() / f"{name}.jinja"
    if not path.is_file():
        pytest.skip("llama.cpp's templates are not fetched: run `make llama-src` (or set LLAMA_CPP_SRC)")
    return path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer.train([bundled_works()["hamlet"][:20000]], 300, progress=False)
    return t


@pytest.fixture(scope="module")
def model(tok):
    """Untrained: its replies are forced (`script`); a context long enough for templates that list tools."""
    return Model.init(Config(vocab_size=tok.vocab_size, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=4096,
                             ffn_hidden=32, n_mtp=1), seed=0)


@pytest.fixture
def script(monkeypatch):
    """script(tok, text): the next sampled tokens (at temperature 0.5) spell text in tok, then its eos."""
    from nanoeuler.infer import engine
    real, queue = engine.sample_token, []

    def scripted(logits, temperature, *a, **k):
        if temperature == 0.5 and queue:
            return queue.pop(0)
        return real(logits, temperature, *a, **k)
    monkeypatch.setattr(engine, "sample_token", scripted)
    return lambda tok, text: queue.__setitem__(slice(None), tok.encode(text) + [tok.eos_id])


def serve(model, tok):
    from nanoeuler.serve.app import create_app
    return ServerThread(create_app(model, tok, "tiny", max_batch=2))


def client_of(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Weather in Zürich?"}]
SAMPLING = {"model": "tiny", "temperature": 0.5, "max_tokens": 300}


@pytest.mark.parametrize("name, fmt, reply, content", CASES, ids=[c[0][:30] if "{" not in c[0] else c[1] + "-inline"
                                                                   for c in CASES])
def test_a_tool_call_round_trips_through_the_openai_client(tok, model, script, name, fmt, reply, content):
    template = template_text(name)
    assert tool_calls.format_of(template).name == fmt
    round_trip(tok.replace(chat_template=template), model, script, reply, content)


def test_a_tool_call_round_trips_on_smollm2s_own_tokenizer_and_template(script):
    """The published SmolLM2-135M-Instruct's tokenizer and ChatML template (which writes neither tools nor calls:
    the generic JSON format), a model of its vocabulary."""
    from real_models import real_model

    from nanoeuler.interop.gguf_file import GGUFFile
    from nanoeuler.interop.gguf_import import gguf_tokenizer
    meta = GGUFFile(real_model("smollm2")).meta
    smol = gguf_tokenizer(meta, len(meta["tokenizer.ggml.tokens"]))
    assert tool_calls.format_of(smol.chat_template) is tool_calls.GENERIC
    model = Model.init(Config(vocab_size=smol.vocab_size, dim=16, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=1024,
                              ffn_hidden=32, n_mtp=1), seed=0)
    round_trip(smol, model, script, '{"name": "get_weather", "arguments": {"city": "Zürich"}}', None)


def round_trip(tok, model, script, reply, content):
    """With tok's template: a request offering TOOLS answered `reply` is a call of get_weather(ARGS) after
    `content`, whole and streamed; the follow-up with the call and its result renders as transformers renders
    it and is answered with content."""
    template = tok.chat_template
    with serve(model, tok) as srv:
        client = client_of(srv)
        script(tok, reply)
        r = client.chat.completions.create(messages=ASK, tools=TOOLS, **SAMPLING)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == content
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == ARGS and len(call.id) == 9 and call.id.isalnum()

        script(tok, reply)
        chunks = list(client.chat.completions.create(messages=ASK, tools=TOOLS, stream=True, **SAMPLING))
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
               [(0, "get_weather", ARGS)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        streamed = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
        assert "".join(streamed) == (content or "")
        if content:   # its content streamed before the call's delta (the spaces before a call: with the call)
            last = next(c.choices[0].delta for c in chunks if c.choices[0].delta.tool_calls)
            assert "".join(streamed[:-1]) == content.rstrip() and last.content == content[len(content.rstrip()):]

        follow = [*ASK, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
        script(tok, "It is 21 °C.")
        r = client.chat.completions.create(messages=follow, tools=TOOLS, **SAMPLING)
        assert r.choices[0].message.content == "It is 21 °C." and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok.to_hf_json()),
                                              bos_token=tok.bos_token, eos_token=tok.eos_token)
    oracle = [*ASK, {"role": "assistant", "content": content or "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    request = ChatRequest.model_validate({"model": "tiny", "messages": follow, "tools": TOOLS})
    assert render(template, chat_messages(request.messages), tok, True, request.template_variables()) == \
        hf.apply_chat_template(oracle, tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True)


def test_a_reply_that_is_not_a_call_stays_content_and_tool_choice_none_is_honoured(tok, model, script):
    with serve(model, tok.replace(chat_template=HERMES)) as srv:
        client = client_of(srv)
        for reply in ("Sunny, I think.", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
                      '<tool_call>{"name": "get_weather", "arguments": "Zürich"}</tool_call>', "<tool_call>{oops"):
            script(tok, reply)
            r = client.chat.completions.create(messages=ASK, tools=TOOLS, **SAMPLING)
            assert r.choices[0].message.content == reply and r.choices[0].message.tool_calls is None
            assert r.choices[0].finish_reason == "stop"
        call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
        script(tok, call)   # "none": tools not offered (not in the prompt), a call's text is content
        r = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="none", **SAMPLING)
        assert r.choices[0].message.content == call and r.choices[0].finish_reason == "stop"
        assert r.usage.prompt_tokens == len(tok.encode(render(HERMES, ASK, tok, True)))
        # ("required" and a named function constrain the reply to a call: tests/test_serve_grammar.py)
        with pytest.raises(openai.BadRequestError, match="arguments must be a JSON object"):
            client.chat.completions.create(messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "abc", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}]},
                {"role": "tool", "tool_call_id": "abc", "content": "x"}], **SAMPLING)


@pytest.mark.parametrize("names, ok", [(["get_weather", "web.search", "a-b_9"], True), ([""], False),
                                       (["get weather"], False), (['x"y'], False), (["f" * 65], False),
                                       (["get_weather", "get_weather"], False)])
def test_a_tool_is_named_as_openai_names_one_and_once(names, ok):
    """An empty name, one with a space or a quote, one past 64 characters, or two tools of one name are refused
    (400): a call names the function it makes, and could not be told apart or parsed back."""
    from pydantic import ValidationError
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]
    body = {"model": "tiny", "messages": ASK, "tools": tools}
    if ok:
        assert [t.function.name for t in ChatRequest.model_validate(body).tools] == names
    else:
        with pytest.raises(ValidationError):
            ChatRequest.model_validate(body)


def test_chat_template_kwargs_reach_the_template(tok, model, script):
    with serve(model, tok.replace(chat_template=THINKING)) as srv:
        client = client_of(srv)
        script(tok, "Hi.")
        assert client.chat.completions.create(messages=ASK, **SAMPLING).choices[0].message.content == "Hi."
        with pytest.raises(openai.BadRequestError, match="thinking is off"):
            client.chat.completions.create(messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                           **SAMPLING)
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set 'messages'"):
            client.chat.completions.create(messages=ASK, extra_body={"chat_template_kwargs": {"messages": []}},
                                           **SAMPLING)


@pytest.mark.parametrize("fmt, text, want", [
    ("hermes", ('a<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>b<tool_call>{"name": "f", '
                '"arguments": {}}'), ("ab", [("f", {"x": 1}), ("f", {})])),   # the last cut by the end of the reply
    ("hermes", "<tool_call>not json</tool_call>", None),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "f", "arguments": {}}]',
     ("ok ", [("f", {"x": 1}), ("f", {})])),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {"x": 1}}', ("", [("f", {"x": 1})])),
    ("llama3", '{"name": "f", "arguments": {"x": 1}}', ("", [("f", {"x": 1})])),
    ("llama3", '{"name": "f"}', None),
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "f", "arguments": {"y": "ü"}}]}',
     ("", [("f", {}), ("f", {"y": "ü"})])),
    ("generic", '{"name": "f", "arguments": {}} trailing', None),
    ("generic", '{"name": "g", "arguments": {}}', None),   # g is not offered
])
def test_each_format_parses_calls_and_leaves_anything_else_content(fmt, text, want):
    row = next(f for f in (*tool_calls.FORMATS, tool_calls.GENERIC) if f.name == fmt)
    assert tool_calls.parse(row, text, {"f"}) == (want or (text, []))


@pytest.mark.parametrize("fmt, text, n", [
    ("hermes", "Sure.\n<tool", 5), ("hermes", "Sure.\n<tool_call>{", 5), ("hermes", "a < b", 5),
    ("hermes", "a <", 1), ("mistral", "ok [TOOL", 2), ("llama3", '  {"na', 0), ("llama3", "  ", 0),
    ("llama3", "Hi <|python", 2), ("generic", "Hi {", 4), ("generic", "{", 0),
])
def test_a_stream_holds_back_only_what_might_begin_a_call(fmt, text, n):
    row = next(f for f in (*tool_calls.FORMATS, tool_calls.GENERIC) if f.name == fmt)
    assert tool_calls.streamable(row, text) == n
