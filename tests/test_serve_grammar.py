"""Constrained decoding (infer/grammar.py) through the OpenAI API: response_format "json_object" / "json_schema"
and tool_choice "required" / a named function, with the real `openai` client against a server on 127.0.0.1.

The tiny model's weights know nothing of JSON: the grammar alone makes its replies valid. Every reply is
checked with the `jsonschema` library against the schema the client sent. The vocabulary adapter is checked on
the tiny tokenizer and, when `make models` has fetched them, on SmolLM2's byte-level BPE and Gemma 3's
SentencePiece vocabulary (byte-fallback <0xNN> tokens, "▁" spaces)."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_fixtures import ServerThread, shared_checkpoint  # noqa: E402

from nanoeuler.infer.engine import Batcher, Job  # noqa: E402
from nanoeuler.infer.grammar import SPECIAL, Grammars, closed, vocabulary  # noqa: E402
from nanoeuler.serve import tool_calls  # noqa: E402

WORDS = ["Zürich", "日本", "🙂 ok", "naïve", "Ødegaard", "a\"b", "x\\ny"]


def random_schema(rng: np.random.Generator, depth: int = 0) -> dict:
    """A random JSON schema whose every value is bounded (strings by maxLength, arrays by maxItems, integers
    by a range): a model of random weights can only finish it by the grammar. Objects nest, fields may be
    optional, strings, enums and keys carry non-ASCII text; numbers are multiples of 0.25."""
    kinds = ["string", "enum", "const", "integer", "number", "boolean", "nullable", "array"] + (["object"] * (depth < 2))
    kind = kinds[rng.integers(len(kinds))]
    if kind == "string":
        return {"type": "string", "maxLength": int(rng.integers(1, 8))}
    if kind == "enum":
        return {"enum": [str(w) for w in rng.choice(WORDS, size=int(rng.integers(1, 4)), replace=False)]}
    if kind == "const":
        return {"const": str(rng.choice(WORDS))}
    if kind == "integer":
        low = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": low, "maximum": low + int(rng.integers(0, 1000))}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25}  # (else SmolLM2 may write
        # digits until max_tokens: nothing in JSON ends a fraction)
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "nullable":
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": int(rng.integers(0, 4))}
    names = [f"{w}{i}" for i, w in enumerate(rng.choice(["id", "größe", "name", "tags", "日付", "v"],
                                                         size=int(rng.integers(1, 5))))]
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names}, "required": required}


def top_schema(rng) -> dict:
    s = random_schema(rng)
    return s if s.get("type") == "object" else {"type": "object", "properties": {"value": s}, "required": ["value"]}


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def serve(model, tok, **kw):
    from nanoeuler.serve.app import create_app
    return ServerThread(create_app(model, tok, "tiny", **kw))


def client_of(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def ask_many(client, n_requests: int, seed: int, max_tokens: int) -> list[tuple[dict, list[str], list[str]]]:
    """n_requests requests with random schemas, 8 at a time, varied: chat whole, chat streamed, chat with n=2,
    completions -> (schema, the replies' texts, their finish reasons) per request."""
    schemas = [top_schema(np.random.default_rng([seed, i])) for i in range(n_requests)]
    messages = [{"role": "user", "content": "Answer in JSON."}]

    def one(i):
        schema, common = schemas[i], {"model": "tiny", "max_tokens": max_tokens, "seed": i}
        way = i % 4
        if way == 0:
            r = client.chat.completions.create(messages=messages, response_format=schema_format(schema), **common)
            return schema, [c.message.content for c in r.choices], [c.finish_reason for c in r.choices]
        if way == 1:
            chunks = list(client.chat.completions.create(messages=messages, response_format=schema_format(schema),
                                                         stream=True, **common))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return schema, [text], [next(c.choices[0].finish_reason for c in chunks[::-1] if c.choices)]
        if way == 2:
            r = client.chat.completions.create(messages=messages, response_format=schema_format(schema), n=2,
                                               temperature=1.5, **common)
            return schema, [c.message.content for c in r.choices], [c.finish_reason for c in r.choices]
        r = client.completions.create(prompt="To be, or not", extra_body={"response_format": schema_format(schema)},
                                      **common)
        return schema, [r.choices[0].text], [r.choices[0].finish_reason]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n_requests)))


@pytest.fixture(scope="module")
def tiny():
    _, model, tok = shared_checkpoint()
    return model, tok


def test_sixty_json_schema_replies_of_random_weights_all_validate(tiny):
    model, tok = tiny
    with serve(model, tok, max_batch=8) as srv:
        results = ask_many(client_of(srv), 60, seed=1, max_tokens=400)
    replies = [(s, t, f) for s, texts, reasons in results for t, f in zip(texts, reasons)]
    assert len(replies) == 75   # 60 requests, 15 of them with n=2
    bad = [(s, t) for s, t, f in replies if not valid(t, s)]
    assert not bad, bad[:3]
    assert {f for _, _, f in replies} == {"stop"}   # each ended by its grammar, none cut by max_tokens


def test_json_schema_replies_of_smollm2_all_validate():
    from real_models import real_model

    from argparse import Namespace

    from nanoeuler.cli.sample import load_for_decoding
    model, tok = load_for_decoding(Namespace(ckpt=str(real_model("smollm2"))))
    with serve(model, tok, max_batch=8, ctx_len=512) as srv:
        results = ask_many(client_of(srv), 52, seed=2, max_tokens=300)
    replies = [(s, t) for s, texts, _ in results for t in texts]
    bad = [(s, t) for s, t in replies if not valid(t, s)]
    assert len(replies) == 65 and not bad, bad[:3]


def test_json_object_logprobs_n_and_the_grammar_ending_the_reply(tiny):
    """json_object: any JSON object; logprobs are those of the masked distribution (the refused tokens have
    none); ignore_eos cannot carry a reply past its grammar's end; a schema that does not compile is a 400."""
    model, tok = tiny
    with serve(model, tok, max_batch=4) as srv:
        client = client_of(srv)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                           max_tokens=300, logprobs=True, top_logprobs=5, seed=3,
                                           response_format={"type": "json_object"})
        for c in r.choices:
            assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict)
            for entry in c.logprobs.content:
                assert all(np.isfinite(t.logprob) for t in entry.top_logprobs) and np.isfinite(entry.logprob)
        first = r.choices[0].logprobs.content[0]
        assert first.token.startswith("{") and {t.token[:1] for t in first.top_logprobs} == {"{"}
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        r = client.completions.create(model="tiny", prompt="x", max_tokens=50, temperature=0,
                                      extra_body={"response_format": schema_format(schema), "ignore_eos": True})
        assert r.choices[0].finish_reason == "stop" and valid(r.choices[0].text, schema)
        with pytest.raises(openai.BadRequestError, match="response_format") as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           response_format=schema_format({"type": "bogus"}))
        assert e.value.body["param"] == "response_format"


def test_a_constrained_greedy_reply_is_the_same_from_the_prefix_cache_and_beside_others(tiny):
    model, tok = tiny
    g = Grammars(tok, model.config.vocab_size)
    grammar = g.constraint(g.json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 9}}}))
    prompt = tok.encode("To be, or not to be, that is the question: " * 3)

    def run(jobs_beside: int) -> list[list[int]]:
        out, b = [[], []], Batcher(model, max_batch=4, prefix_bytes=1 << 24)
        for i in range(2):   # the second job finds the first's prompt in the prefix cache
            for _ in range(jobs_beside):
                b.submit(Job(tok.encode("Hamlet"), 20, temperature=1.0, seed=i))
            b.submit(Job(prompt, 100, stop_ids=tuple(tok.stop_ids), constraint=grammar.copy(),
                         on_event=lambda kind, *a, i=i: out[i].append(a[0]) if kind == "token" else None))
            while b.step():
                pass
        assert b.hits >= 1
        return out
    (first, cached), beside = run(0), run(3)
    assert first == cached == beside[0] == beside[1] and valid(tok.decode(first), {"type": "object"})


def test_rows_with_grammars_and_without_decode_in_one_step(tiny):
    """The grammar works in each row's sampling; the decoding step stays one forward over every row."""
    model, tok = tiny
    g = Grammars(tok, model.config.vocab_size)
    grammar = g.constraint(g.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 40}))
    b = Batcher(model, max_batch=4)
    for i in range(4):
        b.submit(Job(tok.encode("Hamlet"), 30, temperature=1.0, seed=i, constraint=grammar.copy() if i % 2 else None))
    while b.step():
        pass
    assert max(b.batch_sizes) == 4 and b.batch_sizes.count(4) >= 25


LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # every value holds itself
NO_VALUE = [{"$ref": "#"}, LOOP, ENDLESS, {"enum": []}, {"type": "string", "minLength": 3, "maxLength": 2},
            {"type": "object", "properties": {"a": LOOP}, "required": ["a"]}]


def test_a_schema_no_value_satisfies_is_a_400_and_the_rows_beside_go_on(tiny):
    """A schema without a finite JSON value is the request's error, streamed or not: refused where it compiles
    to nothing but the empty reply ($ref loops: a 200 with "" before), a 400 (not the engine's 500) where its
    recursion exhausts the parser at its first tokens; a tool whose parameters are such a schema, forced, too.
    A plain request decoding beside them is not disturbed."""
    model, tok = tiny
    with serve(model, tok, max_batch=4) as srv:
        client = client_of(srv)
        hi = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
        with ThreadPoolExecutor(1) as pool:
            beside = pool.submit(client.chat.completions.create, **{**hi, "max_tokens": 200}, seed=1,
                                 extra_body={"ignore_eos": True})
            for schema in NO_VALUE:
                with pytest.raises(openai.BadRequestError, match="response_format|schema|grammar") as e:
                    client.chat.completions.create(response_format=schema_format(schema), **hi)
                assert e.value.status_code == 400, (schema, e.value.body)
            chunks = client.chat.completions.create(response_format=schema_format(ENDLESS), stream=True, **hi)
            with pytest.raises(openai.APIError, match="failed while decoding") as e:
                list(chunks)
            assert e.value.body["code"] == "invalid_value"
            tool = {"type": "function", "function": {"name": "f", "parameters": ENDLESS}}
            with pytest.raises(openai.BadRequestError, match="tool_choice"):
                client.chat.completions.create(tools=[tool], tool_choice="required", **hi)
            assert beside.result().usage.completion_tokens == 200


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                              "unit": {"enum": ["°C", "°F"]}}, "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"]}}}]
CHAT = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "  # (tools: too long for ctx 256)
TEMPLATES = {"hermes": CHAT + "{# answers <tool_call> #}", "generic": CHAT}


@pytest.mark.parametrize("fmt", TEMPLATES)
def test_a_forced_tool_choice_is_always_a_valid_call(tiny, fmt):
    model, tok = tiny
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "max_tokens": 200}
    with serve(model, tok.replace(chat_template=TEMPLATES[fmt]), max_batch=4) as srv:
        client = client_of(srv)
        for seed in range(6):
            named = seed % 2 == 0
            choice = {"type": "function", "function": {"name": "add"}} if named else "required"
            if seed < 3:
                r = client.chat.completions.create(tool_choice=choice, seed=seed, **ask)
                assert r.choices[0].finish_reason == "tool_calls"
                (call,) = r.choices[0].message.tool_calls
                name, arguments = call.function.name, call.function.arguments
            else:
                chunks = list(client.chat.completions.create(tool_choice=choice, seed=seed, stream=True, **ask))
                (delta,) = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
                name, arguments = delta.function.name, delta.function.arguments
            assert name == "add" if named else name in ("add", "get_weather")
            tool = next(t for t in TOOLS if t["function"]["name"] == name)
            assert valid(arguments, tool["function"]["parameters"])
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "nope"}}, **ask)


def test_without_the_grammar_library_a_constrained_request_is_a_clear_400(tiny, monkeypatch):
    model, tok = tiny
    monkeypatch.setitem(sys.modules, "llguidance", None)   # `import llguidance` now fails
    with serve(model, tok, max_batch=2) as srv:
        client = client_of(srv)
        with pytest.raises(openai.BadRequestError, match=r"pip install 'nanoeuler\[grammar\]'") as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           response_format={"type": "json_object"})
        assert e.value.body["param"] == "response_format"
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.choices[0].message.content is not None   # everything else is served


def test_the_library_and_the_server_import_without_the_grammar_library():
    code = "import sys; sys.modules['llguidance'] = None; import nanoeuler.serve.app, nanoeuler.infer.grammar"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


# ---- the vocabulary adapter ----------------------------------------------------------------------
def real_tokenizer(name: str):
    from real_models import real_model

    from nanoeuler.interop.gguf_file import GGUFFile
    from nanoeuler.interop.gguf_import import gguf_tokenizer
    meta = GGUFFile(real_model(name)).meta
    return gguf_tokenizer(meta, len(meta["tokenizer.ggml.tokens"]))


TEXT = 'Zürich 日本 🙂\n\n  "q" \t𓀀 ⟨x⟩ end'   # 𓀀: no Gemma token holds it, its bytes are <0xNN> tokens (a literal ▁ reads as a space)


@pytest.mark.parametrize("name", ["tiny", "smollm2", "gemma3"])
def test_the_vocabulary_adapter_is_exact(tiny, name):
    """Every text token is its bytes and nothing else is text; a grammar that is exactly TEXT allows, at every
    position, the tokenizer's own encoding of TEXT, and only tokens whose bytes continue it."""
    tok = tiny[1] if name == "tiny" else real_tokenizer(name)
    vocab = vocabulary(tok)
    marked = {i for i, t in enumerate(vocab) if t != tok.token_bytes(i)}   # the rest are their bytes
    assert set(tok.stop_ids) <= marked <= set(tok.special_tokens.values())
    assert all(vocab[i] == SPECIAL + tok.token_bytes(i) for i in marked)
    ids = tok.encode(TEXT)
    if name == "gemma3":   # byte fallback, and its "\n\n" (a user-defined token that is text)
        assert any(len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids)
        assert tok.special_tokens["\n\n"] in ids and b" " in [tok.token_bytes(i)[:1] for i in ids]
    g = Grammars(tok)
    c = g.constraint(g.lark(g.text_rule(TEXT)))
    rest = TEXT.encode()
    for i in ids:
        allowed = np.flatnonzero(c.allowed())
        assert i in allowed and all(rest.startswith(vocab[j]) for j in allowed)
        c.advance(i)
        rest = rest[len(vocab[i]):]
    assert not rest and c.finished and set(np.flatnonzero(c.allowed())) <= set(tok.stop_ids)


def test_closed_objects_keep_to_their_named_keys():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "c": {"type": "object"}}, "additionalProperties": True}
    out = closed(schema)
    assert out["additionalProperties"] is True and out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["c"] and "additionalProperties" not in schema["properties"]["a"]


@pytest.mark.parametrize("fmt", [*tool_calls.FORMATS, tool_calls.GENERIC], ids=lambda f: f.name)
def test_a_forced_call_in_each_format_is_what_its_parser_reads(tiny, fmt):
    """call_grammar's text in each format, fed as the tokenizer encodes it, is allowed to its end, complete
    there, and parses into the call; a call of a function not offered, or with bad arguments, is refused."""
    tok = tiny[1]
    g = Grammars(tok)
    call = {"name": "add", "arguments": {"a": 4, "b": 51}}
    before, after = fmt.forced
    text = before + json.dumps(call) + after
    c = g.constraint(tool_calls.call_grammar(fmt, TOOLS, g))
    for i in tok.encode(text):
        assert c.allowed()[i]
        c.advance(i)
    assert c.finished
    assert tool_calls.parse(fmt, text, {"add", "get_weather"}) == ("", [("add", call["arguments"])])
    for wrong in ({"name": "launch", "arguments": {}}, {"name": "add", "arguments": {"a": 4, "b": 100}}):
        c = g.constraint(tool_calls.call_grammar(fmt, TOOLS, g))
        ids = tok.encode(before + json.dumps(wrong))
        assert not all(c.allowed()[i] and c.advance(i) is None for i in ids)
