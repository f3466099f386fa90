"""Chat templates (nanoeuler/chat_template.py): ChatML, Llama-3 and ours (Alpaca) render exactly as
transformers' apply_chat_template (the oracle), ours exactly as the SPEC template; SFT masks exactly the
assistant span of an imported ChatML model, and with a template's {% generation %} blocks exactly transformers'
assistant_masks; chat stops at <|im_end|> without showing it; export keeps the
template; a hostile or endless template is one line, within its time bound, and the process goes on
meanwhile; a non-UTF-8 template file is one line naming it."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gguf_fixtures import CHATML, chatml_model, chatml_tokenizer, write_gguf

from nanoeuler.chat_template import alpaca_template, prompt_ids, render
from nanoeuler.errors import UserError
from nanoeuler.training.sft import prompt_text
from nanoeuler.training.sft import render as sft_render
from nanoeuler.tokenizer import Tokenizer

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# the helpers transformers gives a template: tojson, raise_exception, loop controls
HELPERS = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
           "{{ m | tojson }}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "  And  3+3?\n"}],
    [{"role": "user", "content": "ümlaut \"quotes\" <b>html</b> 日本"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "fine"}],
]
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>")


@pytest.fixture(scope="module")
def tok():
    from nanoeuler.data.corpus import bundled_works
    t = Tokenizer.train([bundled_works()["hamlet"][:20000]], 330, specials=SPECIALS, progress=False)
    return Tokenizer.from_dict(t.to_dict() | {"bos": "<|begin_of_text|>", "eos": "<|endoftext|>"})


@pytest.fixture(scope="module")
def hf(tok):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    return transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok.to_hf_json()),
                                                bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")


@pytest.mark.parametrize("name, template", [("chatml", CHATML), ("llama3", LLAMA3), ("helpers", HELPERS),
                                            ("alpaca", None)])
@pytest.mark.parametrize("gen", [False, True])
def test_render_equals_transformers_apply_chat_template(tok, hf, name, template, gen):
    template = template or alpaca_template()
    for messages in CONVERSATIONS:
        if gen and messages[-1]["role"] == "assistant":
            continue
        theirs = hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen)
        assert render(template, messages, tok, gen) == theirs
        if gen and name != "alpaca":  # ids too; a tokenizer's bos goes first unless the template writes it
            d = {k: v for k, v in tok.to_dict().items() if name == "llama3" or k != "bos"}
            t = Tokenizer.from_dict(d | {"chat_template": template})
            ids = hf.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=gen)
            assert prompt_ids(t, messages) == list(ids if isinstance(ids, list) else ids["input_ids"])


def test_ours_renders_the_spec_template_byte_for_byte(tok):
    t = alpaca_template()
    assert render(t, [{"role": "user", "content": "Say hi."}], tok, True) == prompt_text("Say hi.")
    two = [{"role": "system", "content": "S"}, {"role": "user", "content": "A"}, {"role": "assistant", "content": "B"},
           {"role": "user", "content": "C", "instruction": "C", "input": "x"}]
    assert render(t, two, tok, True) == prompt_text("S\n\nA") + "B<|endoftext|>" + prompt_text("C", "x")
    ids, mask = sft_render(tok, "Add", "2 and 3", "5")
    prompt = tok.encode(prompt_text("Add", "2 and 3"), add_bos=True)
    assert ids == prompt + tok.encode("5") + [tok.eos_id]
    assert mask == [False] * len(prompt) + [True] * (len(ids) - len(prompt))


@pytest.fixture(scope="module")
def chatml_run(tmp_path_factory):
    from nanoeuler.interop.gguf_import import import_gguf
    d = tmp_path_factory.mktemp("chatml")
    t = chatml_tokenizer()
    import_gguf(write_gguf(d / "m.gguf", chatml_model(t), t, "Q8_0"), d / "run", progress=False)
    return d / "run"


def test_sft_on_an_imported_chatml_model_masks_exactly_the_assistant_span(chatml_run):
    from nanoeuler.checkpoint import load_tokenizer
    tok = load_tokenizer(chatml_run)
    assert tok.chat_template == CHATML
    ids, mask = sft_render(tok, "Name a play.", "", "Hamlet")
    on = [i for i, m in zip(ids, mask) if m]
    first = mask.index(True)
    assert tok.decode(ids[:first]) == "<|im_start|>user\nName a play.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(on) == "Hamlet<|im_end|>" and on[-1] == tok.special_tokens["<|im_end|>"]
    assert mask == [False] * first + [True] * len(on) + [False] * (len(mask) - first - len(on))
    assert tok.decode(ids[first + len(on):]) == "\n"  # the newline after the end of turn carries no loss


def test_chat_renders_chatml_as_transformers_and_hides_the_stop_token(chatml_run, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer

    from nanoeuler.infer import session
    from nanoeuler import Model
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.cli.chat import Repl
    from nanoeuler.infer.chat import Chat
    tok = load_tokenizer(chatml_run)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok.to_hf_json()))
    end = tok.special_tokens["<|im_end|>"]
    reply = tok.encode("Hello there")
    seen = {}

    def fake_generate(model, ids, n, *a, stop_ids=(), on_token=None, **k):
        seen["prompt"], seen["stops"] = ids, stop_ids
        for t in reply + [end]:
            on_token(t)
        return session.Generation(ids=list(reply), stopped=True)
    monkeypatch.setattr(session, "generate", fake_generate)
    chat = Repl(Chat(Model.load(chatml_run), tok, temperature=0, max_new_tokens=8))
    out = []
    chat.handle("Hi there", out.append)
    chat.handle("And again", out.append)
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello there"},
                {"role": "user", "content": "And again"}]
    text = hf.apply_chat_template(messages, chat_template=CHATML, tokenize=False, add_generation_prompt=True)
    assert tok.decode(seen["prompt"]) == text and end in seen["stops"]
    assert "".join(out) == "Hello there\nHello there\n"  # <|im_end|> ends the reply and is not shown


def test_export_writes_the_template_and_import_keeps_it(chatml_run, tmp_path):
    import json

    from nanoeuler import Model
    from nanoeuler.checkpoint import load_tokenizer
    from nanoeuler.interop.gguf_export import export_gguf
    from nanoeuler.interop.gguf_import import load_gguf
    from nanoeuler.interop.hf import export_hf
    from nanoeuler.interop.hf import load_hf_folder
    m, tok = Model.load(chatml_run), load_tokenizer(chatml_run)
    export_hf(m, tok, tmp_path / "hf", progress=False)
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    hf_tok = load_hf_folder(tmp_path / "hf")[2]
    assert hf_tok.chat_template == CHATML and hf_tok.stop_ids == tok.stop_ids
    (tmp_path / "hf" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # newer transformers' file
    assert load_hf_folder(tmp_path / "hf")[2].chat_template == "{{ messages[0]['content'] }}"
    g_tok = load_gguf(export_gguf(m, tok, tmp_path / "m.gguf", "f32", progress=False))[2]
    assert g_tok.chat_template == CHATML


@pytest.mark.parametrize("template, match", [
    ("{{ ''.__class__.__mro__ }}", "SecurityError|UndefinedError"),
    ("{{ raise_exception('boom') }}", "TemplateError: boom"),
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
    ("{{ 'ab' * 10**9 }}", "repetition|power"),
    ("{{ ('ab' * 1000) * 4000000 }}", "repetition"),   # the count under the bound, 8e9 characters: refused before
                                                       # it allocates (not by the worker's memory bound)
    ("{% set ns = namespace(s='ab') %}{% for i in range(80) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "more than"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}{% endfor %}"
     "{% endfor %}", "ran longer than"),
    ("{{ messages.append(1) }}", "SecurityError"),
])
def test_a_hostile_or_endless_template_is_one_bounded_error(tok, template, match):
    t0 = time.monotonic()
    with pytest.raises(UserError, match=f"chat template error: .*({match})") as e:
        render(template, [{"role": "user", "content": "x"}], tok, True)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 10


def test_chat_template_option_overrides_and_a_bad_file_is_one_line(chatml_run, tmp_path, monkeypatch, capsys):
    from nanoeuler.cli import main
    (tmp_path / "bad.jinja").write_text("{% if %}")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--ckpt", str(chatml_run), "--chat-template", str(tmp_path / "bad.jinja")]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: chat template error: TemplateSyntaxError") and err.count("\n") == 1
    assert err.rstrip().endswith(f"in --chat-template {tmp_path / 'bad.jinja'}")
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}{{ m.content }}|{% endfor %}")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/tokens\n"))
    assert main(["chat", "--ckpt", str(chatml_run), "--chat-template", str(tmp_path / "plain.jinja"),
                 "--max-new-tokens", "2", "--temperature", "0", "--dtype", "float32"]) == 0


@pytest.mark.parametrize("command", [["chat", "--dtype", "float32"], ["serve", "--port", "0", "--dtype", "float32"],
                                     ["sft", "--out", "OUT"], ["dpo", "--out", "OUT"]])
def test_a_template_file_that_is_not_utf8_is_one_line_naming_it(chatml_run, tmp_path, capsys, command):
    from nanoeuler.cli import main
    bad = tmp_path / "latin1.jinja"
    bad.write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    ckpt = {"chat": "--ckpt", "serve": "--ckpt", "sft": "--base", "dpo": "--sft"}[command[0]]
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in command] + [ckpt, str(chatml_run), "--chat-template", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: --chat-template {bad}: not UTF-8 text (byte 7 is 0xe9)\n"
    assert not (tmp_path / "out").exists()


HOSTILE = {"lipsum": "{{ lipsum(10**6) }}",                         # one C-level call: no check inside runs
           "tojson": "{{ messages | tojson(indent=10**9) }}",       # a gigabyte of indentation
           "loop": "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}"}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_render_ends_in_time_while_the_process_goes_on(tok, name):
    """A hostile render in another thread ends with one line within the bound (RENDER_SECONDS + GRACE), and
    this thread meanwhile keeps encoding text without a long pause (an in-process render held the GIL in
    lipsum for a minute: a concurrent request waited as long); the next render works."""
    from nanoeuler.template_worker import GRACE, RENDER_SECONDS
    assert render("{{ 'warm' }}", [], tok) == "warm"   # a worker is started and waiting
    result = {}

    def hostile():
        t0 = time.monotonic()
        try:
            render(HOSTILE[name], [{"role": "user", "content": "x"}], tok)
        except UserError as e:
            result["error"] = str(e)
        result["seconds"] = time.monotonic() - t0
    thread = threading.Thread(target=hostile, daemon=True)
    start = last = time.monotonic()
    thread.start()
    pauses = []
    while thread.is_alive() and time.monotonic() - start < 30:
        tok.encode("To be, or not to be, that is the question")   # the plain operation
        now = time.monotonic()
        pauses.append(now - last)
        last = now
    assert "\n" not in result.get("error", "not ended") and result["error"].startswith("chat template error:")
    assert result["seconds"] < RENDER_SECONDS + GRACE + 1.5, result
    assert max(pauses, default=0.0) < 0.5   # (none: the render ended before this thread's first)
    assert render("{{ messages[0]['content'] }}", [{"role": "user", "content": "Hi"}], tok) == "Hi"


def test_workers_are_kept_and_reused(tok, monkeypatch):
    """A render is a trip to a waiting worker, not a new process (chat and serve render on every request)."""
    from nanoeuler import template_worker
    assert render("{{ 'warm' }}", [], tok) == "warm"
    started, real = [], template_worker.Worker.__init__
    monkeypatch.setattr(template_worker.Worker, "__init__", lambda self: started.append(1) or real(self))
    for i in range(20):
        assert render("{{ messages[0]['content'] }}", [{"role": "user", "content": str(i)}], tok) == str(i)
    assert not started


def test_a_runaway_loop_is_ended_by_its_worker_which_is_kept(tok, monkeypatch):
    """The template's own operations check the time limit: a loop ends with the limit's message from the
    worker itself, which answered, so it is kept for the next render (not killed and started again)."""
    from nanoeuler import template_worker
    assert render("{{ 'warm' }}", [], tok) == "warm"
    started, real = [], template_worker.Worker.__init__
    monkeypatch.setattr(template_worker.Worker, "__init__", lambda self: started.append(1) or real(self))
    with pytest.raises(UserError, match="ran longer than"):
        render(HOSTILE["loop"], [{"role": "user", "content": "x"}], tok)
    assert render("{{ 'again' }}", [], tok) == "again"
    assert not started


@pytest.mark.parametrize("name", ["lipsum", "tojson"])
def test_chat_with_a_hostile_template_is_one_line(chatml_run, tmp_path, name):
    (tmp_path / "t.jinja").write_text(HOSTILE[name])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "nanoeuler", "chat", "--ckpt", str(chatml_run), "--dtype", "float32",
                        "--chat-template", str(tmp_path / "t.jinja")], input="hi\n", capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: chat template error:") and p.stderr.count("\n") == 1
    assert time.monotonic() - t0 < 60


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a process's CPU time from /proc")
def test_a_worker_whose_caller_died_stops(tmp_path):
    """The caller is killed during a render that no check interrupts (lipsum: ~27 s of CPU before it would
    run out of memory): its worker ends within seconds of CPU (its CPU limit) instead of running on."""
    script = ("import sys, json, time; from nanoeuler.template_worker import Worker; w = Worker(); "
              "print(w.proc.pid, flush=True); r = {'template': '{{ lipsum(10**7, min=1, max=2) }}', 'bos': '', "
              "'eos': '', 'renders': [[[], False]]}; w.ask(json.dumps(r).encode() + b'\\n', time.monotonic() + 600)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    pid = int(caller.stdout.readline())
    time.sleep(0.5)
    caller.kill()
    caller.wait()
    while True:
        try:
            stat = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        except FileNotFoundError:
            return
        if stat[0] in "ZX":   # ended (a zombie until its new parent reaps it)
            return
        cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime
        if cpu > 15:
            os.kill(pid, 9)
            pytest.fail(f"the orphaned worker has used {cpu:.0f} s of CPU and runs on")
        time.sleep(0.2)


def test_the_bundled_gemma_template_writes_gemma_turns_and_masks_the_reply(tmp_path):
    """`--chat-template gemma` (a Gemma base model's file has no template): the turn format of Gemma's own
    tokenizer_config.json (system message before the first user turn, contents trimmed, the assistant as
    "model"), rendered as transformers renders it; SFT's mask covers the reply and its <end_of_turn> only;
    a name that is neither a file nor a bundled template is one line naming the bundled ones."""
    from nanoeuler.chat_template import bundled_templates, with_template_file
    from nanoeuler.data.corpus import bundled_works
    specials = ("<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
    t = Tokenizer.train([bundled_works()["hamlet"][:20000]], 320, specials=specials, progress=False)
    t = Tokenizer.from_dict(t.to_dict() | {"bos": "<bos>", "eos": "<eos>"}).replace(stops=["<end_of_turn>"])
    gemma = with_template_file(t, "gemma")
    assert gemma.chat_template == bundled_templates()["gemma"].read_text(encoding="utf-8")
    conversation = CONVERSATIONS[1]
    text = render(gemma.chat_template, conversation, gemma, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4"
                    "<end_of_turn>\n<start_of_turn>user\nAnd  3+3?<end_of_turn>\n<start_of_turn>model\n")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(t.to_hf_json()),
                                              bos_token="<bos>", eos_token="<eos>")
    assert hf.apply_chat_template(conversation, chat_template=gemma.chat_template, tokenize=False,
                                  add_generation_prompt=True) == text
    ids, mask = sft_render(gemma, "Name a play.", "", "Hamlet")
    on = [i for i, m in zip(ids, mask) if m]
    assert gemma.decode(ids[:mask.index(True)]) == "<bos><start_of_turn>user\nName a play.<end_of_turn>\n" \
                                                   "<start_of_turn>model\n"
    assert gemma.decode(on) == "Hamlet<end_of_turn>" and gemma.decode(ids[len(ids) - mask[::-1].index(True):]) == "\n"
    with pytest.raises(UserError, match="a file, or a bundled template: gemma"):
        with_template_file(t, tmp_path / "nope")


# ---- template variables (tools, documents, chat_template_kwargs) and llama.cpp's real templates ------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
DOCUMENTS = [{"title": "Zürich", "text": "A city on a lake."}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
TOOL_CONVERSATIONS = {
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "multi-turn": CONVERSATIONS[1],
    "non-ascii": [{"role": "user", "content": "ümlaut \"quotes\" <b>html</b> 日本"}],
    "tool calls": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Zürich?"},
                   {"role": "assistant", "content": "", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
                   {"role": "assistant", "content": "21 °C."}, {"role": "user", "content": "Thanks"}],
}
TOOL_CONVERSATIONS["answered"] = TOOL_CONVERSATIONS["tool calls"][:5]   # ends with the reply: no generation prompt
VARIABLES = [{}, {"tools": TOOLS}, {"tools": TOOLS, "documents": DOCUMENTS, "enable_thinking": False}]


def llama_cpp_templates() -> list[Path]:
    """llama.cpp's models/templates/*.jinja (real models' templates) in llama-cpp-python's unpacked source
    distribution: $LLAMA_CPP_SRC, else .cache/llama-cpp-python where `make llama-src` puts it."""
    src = Path(os.environ.get("LLAMA_CPP_SRC") or Path(__file__).resolve().parent.parent / ".cache" / "llama-cpp-python")
    return sorted((src / "vendor" / "llama.cpp" / "models" / "templates").glob("*.jinja"))


def agrees_with_transformers(tok, hf, template, messages, variables):
    """Our render of messages with variables (add_generation_prompt unless it ends with the assistant's reply)
    is transformers' apply_chat_template's, or both refuse the conversation (ours: one UserError)."""
    gen = messages[-1]["role"] != "assistant"
    try:
        theirs = hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen,
                                        **variables)
    except Exception:  # noqa: BLE001 (the template's own refusal, any type)
        with pytest.raises(UserError, match="chat template error"):
            render(template, messages, tok, gen, variables)
        return False
    assert render(template, messages, tok, gen, variables) == theirs
    return True


@pytest.mark.parametrize("path", llama_cpp_templates() or [None], ids=lambda p: p.stem if p else "absent")
def test_llama_cpps_templates_render_as_transformers_with_tools_documents_and_kwargs(tok, hf, path):
    if path is None:
        pytest.skip("llama.cpp's templates are not fetched: run `make llama-src` (or set LLAMA_CPP_SRC)")
    template = path.read_text(encoding="utf-8")
    for messages in TOOL_CONVERSATIONS.values():
        for variables in VARIABLES:
            agrees_with_transformers(tok, hf, template, messages, variables)


def test_variables_reach_the_template_as_transformers_passes_them(tok, hf):
    template = ("{{ tools | tojson }}|{{ documents | tojson }}|{{ enable_thinking is defined }}|"
                "{% if enable_thinking is defined %}{{ enable_thinking }}{% endif %}|{{ bos_token }}{{ eos_token }}")
    messages = TOOL_CONVERSATIONS["system"]
    for variables in [*VARIABLES, {"enable_thinking": True, "bos_token": "B"}]:
        assert agrees_with_transformers(tok, hf, template, messages, variables)
    assert render(template, messages, tok, variables={"tools": TOOLS}).startswith('[{"type": "function"')
    with pytest.raises(UserError, match="template variable 'messages' is the conversation's own"):
        render(template, messages, tok, variables={"messages": []})


def test_the_generation_tag_renders_its_body(tok, hf):
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}!"
                "{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}")
    assert agrees_with_transformers(tok, hf, template, CONVERSATIONS[1], {})
    assert render(template, CONVERSATIONS[1][:3], tok) == "Be brief.\nWhat is 2+2?\n4!"


def test_chat_template_var_reaches_the_template_as_json_else_a_string(chatml_run, tmp_path, monkeypatch, capsys):
    from nanoeuler.cli import main
    from nanoeuler.infer import session
    seen = {}

    def fake_generate(model, ids, n, *a, **k):
        seen["prompt"] = ids
        return session.Generation(ids=[], stopped=True)
    monkeypatch.setattr(session, "generate", fake_generate)
    (tmp_path / "vars.jinja").write_text("{{ enable_thinking is sameas false }} {{ who }} {{ n + 1 }} "
                                         "{{ messages[0].content }}")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--ckpt", str(chatml_run), "--chat-template", str(tmp_path / "vars.jinja"),
                 "--template-var", "enable_thinking=false", "--template-var", "who=Ada Lovelace",
                 "--template-var", "n=41", "--dtype", "float32"]) == 0
    from nanoeuler.checkpoint import load_tokenizer
    assert load_tokenizer(chatml_run).decode(seen["prompt"]) == "True Ada Lovelace 42 hello"
    for bad in ("novalue", "messages=[]", "2x=1"):
        assert main(["chat", "--ckpt", str(chatml_run), "--template-var", bad]) != 0
        err = capsys.readouterr().err
        assert err.startswith("error: --template-var") and err.count("\n") == 1 and ("KEY=VALUE" in err or "the conversation's own" in err)


# ---- sft's masks from the template's {% generation %} blocks (transformers' return_assistant_tokens_mask) --------
GEN_CHATML = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
              "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
              "{{ '\\n' }}{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# a block that begins inside a word: ' t' + 'he end.' -> the token ' the' overlaps the block, and counts
MID_WORD = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ ' t' }}{% generation %}{{ m['content'] }}"
            "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
REPLIES = ["Hamlet", " leading space, ümlaut and 日本 ", "two\n\nlines and a last newline\n", "he end."]


def generation_templates() -> list[tuple[str, str]]:
    """(name, template): ours above and llama.cpp's real templates with {% generation %} (when fetched)."""
    real = [(p.stem, p.read_text(encoding="utf-8")) for p in llama_cpp_templates()
            if re.search(r"{%-?\s*generation\s*-?%}", p.read_text(encoding="utf-8"))]
    return [("chatml-generation", GEN_CHATML), ("mid-word", MID_WORD), *real]


@pytest.mark.parametrize("name, template", generation_templates(), ids=[n for n, _ in generation_templates()])
def test_sft_masks_are_transformers_assistant_masks_when_the_template_has_generation_blocks(tok, hf, name, template):
    from nanoeuler.chat_template import example
    t = tok.replace(chat_template=template)
    conversations = [[*messages, {"role": "assistant", "content": reply}]
                     for messages in ([CONVERSATIONS[0][0]], CONVERSATIONS[1], TOOL_CONVERSATIONS["system"])
                     for reply in REPLIES]
    for conversation in conversations:
        theirs = hf.apply_chat_template(conversation, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
        ids, mask = example(t, conversation[:-1], conversation[-1]["content"], generation=True)
        bos = [] if theirs["input_ids"][:1] == [tok.bos_id] else [tok.bos_id]   # ours puts bos first if not written
        assert ids == bos + theirs["input_ids"], conversation
        assert mask == [False] * len(bos) + [bool(m) for m in theirs["assistant_masks"]], conversation
        assert sum(mask) > 0
    messages = [{"role": "user", "content": "Name a play."}]
    ids, mask = sft_render(t, "Name a play.", "", "Hamlet")   # sft takes the same path
    assert (ids, mask) == example(t, messages, "Hamlet", generation=True)


def test_generation_blocks_set_the_mask_only_for_sft_and_a_block_with_no_token_is_refused(tok):
    from nanoeuler.chat_template import check_training_template, example
    from nanoeuler.training.sft import render_all
    t = tok.replace(chat_template=GEN_CHATML.replace("{{ m['content'] + '<|im_end|>' }}{% endgeneration %}",
                                                     "{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>' }}"))
    ids, mask = sft_render(t, "Name a play.", "", "Hamlet")
    assert t.decode([i for i, m in zip(ids, mask) if m]) == "Hamlet"   # the block's, not end-of-turn too
    old_ids, old_mask = example(t, [{"role": "user", "content": "Name a play."}], "Hamlet")   # dpo: today's rule
    assert t.decode([i for i, m in zip(old_ids, old_mask) if m]).startswith("Hamlet<|im_end|>")
    record = {"instruction": "Name a play.", "input": "", "output": "Hamlet"}
    (row_ids, row_mask), = render_all(t, [record], 64).examples
    assert row_ids.tolist() == ids and row_mask.tolist() == mask
    empty = tok.replace(chat_template=GEN_CHATML.replace("{{ m['content'] + '<|im_end|>' }}{% endgeneration %}",
                                                         "{% endgeneration %}{{ m['content'] + '<|im_end|>' }}"))
    with pytest.raises(UserError, match="generation blocks hold none of the tokens"):
        check_training_template(empty, generation=True)
    check_training_template(empty)   # dpo's rule does not read the blocks
