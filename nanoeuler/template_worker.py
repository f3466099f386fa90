"""Chat templates run in worker processes, where an untrusted template is bounded in time and memory.

A chat template is a Jinja program from whoever made the model (a GGUF's `tokenizer.chat_template`, a
Hugging Face `chat_template`, a `--chat-template FILE`). Checks inside a sandbox cannot bound everything a
template may call: one C call (`lipsum(10**6)`, `tojson(indent=10**9)`) runs for seconds or allocates
gigabytes with the GIL held, and no other thread of its process runs meanwhile. So every template is
compiled and rendered in a worker process. The caller waits for the reply in select() (its process goes on)
and kills the worker when the reply is late (RENDER_SECONDS, plus GRACE for the worker to report its own
overrun first). The worker also runs under an address-space limit (MAX_MEMORY) and a CPU-time limit (a
worker whose caller died does not spin on).

Workers start on first use and are kept: a render is one round trip on a pipe. Each concurrent render takes
a worker of its own, at most MAX_WORKERS at once.

In the worker a template runs as transformers' `apply_chat_template` runs it: jinja2's
ImmutableSandboxedEnvironment (trim_blocks, lstrip_blocks, loop controls), the helpers `raise_exception(msg)`,
`strftime_now(fmt)`, transformers' `tojson` filter and its `{% generation %}...{% endgeneration %}` tag (which
renders its body and marks it as an assistant reply: each render reports the character spans [start, end) of
its generation blocks, counted as transformers counts them, from the text written before the block ends),
and the variables it passes: `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `tools` and `documents` (None unless given) and any others
the caller gives (`enable_thinking`, ...); checks in the template's own operations (the time
limit, string repetition, values longer than MAX_TEXT) end a runaway loop with a clear message and no restart.

Protocol, one JSON line each way: the worker first says {"ready": true}; then to each request
{"template", "bos", "eos", "variables", "renders": [[messages, add_generation_prompt], ...]} it replies
{"texts": [...], "spans": [[[start, end], ...], ...]} or {"error": "<one line>"}. A request without renders only
compiles the template.

    render("{{ messages[0]['content'] }}!", [([{"role": "user", "content": "Hi"}], False)], bos="", eos="")
    -> [('Hi!', [])]
    render("Q{% generation %}{{ messages[0]['content'] }}!{% endgeneration %}", <the same>)
    -> [('QHi!', [(1, 4)])]
"""
from __future__ import annotations

import atexit
import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time

from .errors import UserError

RENDER_SECONDS = 2.0    # a request (its renders together) taking longer is stopped
GRACE = 0.5             # ... by the worker itself; the caller kills it this much later
START_SECONDS = 60.0    # a worker's start (Python and jinja2 imports) on a loaded machine
MAX_TEXT = 1 << 22      # characters: the longest string (or list) a template may build or render
MAX_MEMORY = 1 << 29    # bytes of address space a worker may use
MAX_WORKERS = 4         # renders at once (serve renders from several threads)


# ------------------------------------------------------------------------------------- the caller's side

def render(template: str, renders: list[tuple[list[dict], bool]], bos: str, eos: str,
           variables: dict | None = None) -> list[tuple[str, list[tuple[int, int]]]]:
    """Each (messages, add_generation_prompt) of renders as the template writes it, with the character spans
    of its generation blocks, in a worker process (renders=[]: only compile it); variables: the template's other
    variables (tools, documents, ...: JSON values). Any failure, the template's own or a bound, is one UserError."""
    request = json.dumps({"template": template, "bos": bos, "eos": eos, "variables": variables or {},
                          "renders": renders}).encode() + b"\n"
    with _slots:
        worker, answered = _take(), False
        try:
            reply, answered = worker.ask(request, time.monotonic() + RENDER_SECONDS + GRACE), True
        except TimeoutError:
            reply = {"error": f"the template ran longer than {RENDER_SECONDS:g} s"}
        except (EOFError, OSError):
            reply = {"error": f"the render ended its worker process (over {MAX_MEMORY >> 20} MiB, or a crash)"}
        finally:   # a worker that did not answer (late, dead, or the caller interrupted) is not reused
            if answered:
                _idle.append(worker)
            else:
                worker.stop()
    if "error" in reply:
        raise UserError(f"chat template error: {reply['error']}")
    return [(text, [tuple(span) for span in spans]) for text, spans in zip(reply["texts"], reply["spans"])]


class Worker:
    """One worker process and the pipes to it."""

    def __init__(self):
        code = f"import sys; sys.path[:] = {sys.path!r}; from nanoeuler.template_worker import work; work()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self.pid = os.getpid()  # the process that owns it (a forked child must start its own)
        try:
            ready = self.read(time.monotonic() + START_SECONDS)
        except (TimeoutError, EOFError, OSError):
            ready = {"error": "chat templates: the template worker process did not start"}
        if "error" in ready:
            self.stop()
            raise UserError(ready["error"])

    def ask(self, request: bytes, deadline: float) -> dict:
        self.proc.stdin.write(request)
        self.proc.stdin.flush()
        return self.read(deadline)

    def read(self, deadline: float) -> dict:
        """The worker's next reply (one line), waiting at most until deadline (else TimeoutError)."""
        fd, data = self.proc.stdout.fileno(), bytearray()
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            data += chunk
        return json.loads(data)

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


_slots = threading.BoundedSemaphore(MAX_WORKERS)
_idle: list[Worker] = []   # started and waiting (list.pop / append are atomic)


def _take() -> Worker:
    """An idle worker that is still alive, else a new one."""
    while _idle:
        try:
            worker = _idle.pop()
        except IndexError:   # another thread took the last one
            break
        if worker.alive():
            return worker
    return Worker()


def _stop_all() -> None:
    while _idle:
        w = _idle.pop()
        if w.alive():
            w.stop()


atexit.register(_stop_all)


# ------------------------------------------------------------------------------------- the worker's side

def work() -> None:
    """The worker's loop: a request per line on stdin, a reply per line on stdout, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C in a terminal reaches the whole process group
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MAX_MEMORY, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ValueError, OSError):                  # a system that does not limit address space
        pass

    def say(reply: dict) -> None:
        sys.stdout.buffer.write(json.dumps(reply).encode() + b"\n")
        sys.stdout.buffer.flush()
    try:
        sandbox()                                  # jinja2 imported before "ready"
    except ImportError:
        return say({"error": "chat templates need jinja2: pip install 'jinja2>=3.1'"})
    say({"ready": True})
    for line in sys.stdin.buffer:
        limit_cpu()
        try:
            r = json.loads(line)
            texts, spans = render_here(r["template"], r["renders"], r["bos"], r["eos"], r["variables"])
            say({"texts": texts, "spans": spans})
        except MemoryError:
            say({"error": f"the template needed more than {MAX_MEMORY >> 20} MiB"})
        except Exception as e:                     # TemplateError, SecurityError, its own TypeError, RecursionError
            say({"error": one_line(e)})


def limit_cpu() -> None:
    """SIGXCPU (the end) after a few seconds of CPU more: the caller kills a late worker, unless it died."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    cpu = int(used.ru_utime + used.ru_stime + RENDER_SECONDS + GRACE) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu if hard == resource.RLIM_INFINITY else min(cpu, hard), hard))


_deadline = float("inf")   # of the request the worker is rendering
_written = 0               # characters the render in progress has written so far
_spans: list[tuple[int, int]] = []   # its generation blocks so far


def render_here(template: str, renders: list, bos: str, eos: str, variables: dict
                ) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """The renders in this process (the worker's part of `render`): (texts, each one's generation spans);
    raises what the template raises."""
    global _deadline, _written, _spans
    env, t = compiled(template)
    given = {"bos_token": bos, "eos_token": eos, "tools": None, "documents": None, **variables}
    _deadline = time.monotonic() + RENDER_SECONDS
    texts, spans = [], []
    try:
        for messages, add_generation_prompt in renders:
            out, _written, _spans = [], 0, []
            for piece in t.generate(given, messages=messages, add_generation_prompt=add_generation_prompt):
                _written += len(piece)
                if _written > MAX_TEXT:
                    raise ValueError(f"the prompt is longer than {MAX_TEXT} characters")
                out.append(piece)
                env.tick()
            texts.append("".join(out))
            spans.append(_spans)
    finally:
        _deadline = float("inf")
    return texts, spans


_compiled: dict[str, tuple] = {}   # template -> (env, compiled template); a worker meets few templates


def compiled(template: str):
    if template not in _compiled:
        if len(_compiled) >= 16:
            _compiled.clear()
        env = sandbox()
        _compiled[template] = env, env.from_string(template)
    return _compiled[template]


def one_line(e: Exception) -> str:
    where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}"[:300]


def sandbox():
    """A bounded ImmutableSandboxedEnvironment configured as transformers configures its own."""
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def tick(self):
            if time.monotonic() > _deadline:
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

    class Generation(Extension):
        """transformers' {% generation %}...{% endgeneration %}: its body, rendered, and its span noted (as
        transformers' AssistantTracker: it starts where the text written so far ends)."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("body"), [], [], body).set_lineno(lineno)

        def body(self, caller):
            text = caller()
            _spans.append((_written, _written + len(text)))
            return text

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
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
