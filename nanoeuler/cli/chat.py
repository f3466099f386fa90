"""`nanoeuler chat --ckpt RUN`: a REPL around an instruction-tuned model.

Each line you type is a user message; the conversation is rendered with the checkpoint's chat template
(chat_template.py: the model's own, e.g. ChatML, or ours, the SPEC Alpaca template) and the reply streams
until an end-of-turn / eos token (not shown). Earlier turns stay while they fit the context, oldest dropped
first. Commands:

    /reset        forget the conversation         /temp X    set the temperature (0 = greedy)
    /topk N       sample from the N most likely   /tokens    how the last reply was tokenized
    /help         this list                       Ctrl-D     exit
"""
from __future__ import annotations

import sys

from .args import add_template_arg, escape_control
from .sample import add_sampling_args, check_sampling_args, check_temperature, decoding_model

HELP = """commands:
  /reset     forget the conversation so far
  /temp X    set the sampling temperature (0 = greedy, else 0.01 .. 100)
  /topk N    sample only from the N most likely tokens (0 = all)
  /tokens    show how the last reply was tokenized
  /help      show this list
  Ctrl-D     exit"""


def register(sub) -> None:
    p = sub.add_parser("chat", help="talk to an instruction-tuned checkpoint (REPL)",
                       description="A read-eval-print loop: each line is a user message, the conversation is "
                                   "rendered with the checkpoint's chat template (its own, e.g. ChatML for an "
                                   "imported instruct model, else the SPEC Alpaca template) and the reply streams "
                                   "until an end-of-turn token. Earlier turns are kept while they fit the context. "
                                   "Type /help for the commands; Ctrl-D exits.")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (an SFT run or an imported instruct model)")
    add_template_arg(p)
    add_sampling_args(p, temperature=0.7, max_new=128)
    p.set_defaults(run=run)


class Chat:
    """The conversation state and the commands; `handle(line, write)` does one REPL step."""

    def __init__(self, model, tok, temperature=0.7, top_k=None, top_p=None, seed=None, max_new_tokens=128,
                 speculative=True):
        import numpy as np
        self.model, self.tok = model, tok
        self.temperature, self.top_k, self.top_p, self.max_new = temperature, top_k, top_p, max_new_tokens
        self.speculative = speculative
        self.replay = seed is not None  # a seeded chat replays the same text: its sampling stays plain
        self.rng = np.random.default_rng(seed)
        self.messages: list[dict] = []  # the conversation so far ({"role", "content"}), rendered anew each turn
        self.last_reply: list[int] = []
        self.last_stopped = False
        self.dropped_turns = 0
        self.cut = 0
        self.fused = None  # the model's inference layout, made at the first reply and kept (the model never changes)

    def context(self, messages: list[dict]) -> list[int]:
        """The prompt ids of messages (the conversation, its last message the new one). While earlier turns
        leave no room for a reply (min(max_new_tokens, ctx/4) tokens) the oldest exchange (a user message
        and what follows it up to the next one; system messages stay) is removed from messages. A prompt that
        alone leaves fewer than 8 positions keeps only its end (the window then moves on as generation needs).
        How many exchanges go is found by bisection (a few renders, not one per exchange: a conversation of
        1000 short messages took 27 s), starting from the last budget ones (each renders to a token at least)."""
        from ..chat_template import prompt_ids
        ctx = self.model.config.ctx_len
        limit, budget = ctx - min(self.max_new, 8), ctx - min(self.max_new, ctx // 4)
        turns = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]
        starts = turns[:1] + [i for i in turns[1:] if messages[i]["role"] == "user"] + [len(messages) - 1]

        def without(k):  # messages less their k oldest exchanges (k = len(starts) - 1: every earlier turn)
            return [m for i, m in enumerate(messages) if i >= starts[k] or m["role"] == "system"]
        rendered = {}

        def fits(k):
            rendered[k] = prompt_ids(self.tok, without(k))
            return len(rendered[k]) <= budget
        lo, hi = max(0, len(starts) - 1 - budget), len(starts) - 1  # the least k that fits lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        ids = rendered[lo] if lo in rendered else prompt_ids(self.tok, without(lo))
        messages[:] = without(lo)
        self.dropped_turns += lo
        self.cut = max(0, len(ids) - limit)  # prompt tokens left out
        return ids[self.cut:]

    def handle(self, line: str, write) -> None:
        line = line.strip()
        if not line:
            return
        if line.startswith("/"):
            return self.command(line, write)
        from ..generate import StreamDecoder, fuse_weights, generate
        messages = self.messages + [{"role": "user", "content": line}]
        dropped = self.dropped_turns
        ids = self.context(messages)
        if self.cut:
            write(f"(your message is longer than the context: kept its last {len(ids)} tokens)\n")
        elif self.dropped_turns > dropped:
            write(f"(dropped the {self.dropped_turns - dropped} oldest turn(s) to fit the context)\n")
        dec = StreamDecoder(self.tok)
        stops = self.tok.stop_ids

        def stream(token):
            if token not in stops:
                write(escape_control(dec.feed(token)))
        speculate = self.speculative and (self.temperature == 0 or not self.replay)
        seed = int(self.rng.integers(2**31))
        try:
            if self.fused is None:
                self.fused = fuse_weights(self.model.config, self.model.params)
            g = generate(self.model, ids, self.max_new, self.temperature, self.top_k, self.top_p, seed,
                         stop_ids=stops, mode="speculative" if speculate else "cache",
                         on_token=stream, fused=self.fused)
            reply, self.last_stopped = g.ids, g.stopped
            note = "" if g.stopped else f"  [stopped at {self.max_new} tokens]"
        except KeyboardInterrupt:
            reply, note, self.last_stopped = [], "  [interrupted]", False
        write(escape_control(dec.flush()) + note + "\n")
        self.last_reply = reply
        self.messages = messages + [{"role": "assistant", "content": self.tok.decode(reply)}]

    def command(self, line: str, write) -> None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/help":
            write(HELP + "\n")
        elif name == "/reset":
            self.messages.clear()
            self.last_reply = []
            write("(conversation cleared)\n")
        elif name == "/temp":
            from ..errors import UserError
            from ..generate import MIN_TEMPERATURE
            try:
                value = check_temperature("/temp", arg)
            except UserError as e:
                return write(f"{e}\nusage: /temp X   with X = 0 (greedy) or in [{MIN_TEMPERATURE:g}, 100]\n")
            self.temperature = value
            write(f"(temperature {value:g}{', greedy' if value == 0 else ''})\n")
        elif name == "/topk":
            try:
                value = int(arg)
                if value < 0:
                    raise ValueError
            except ValueError:
                return write("usage: /topk N   with N >= 0 (0 = no limit, as --top-k 0)\n")
            self.top_k = value or None
            write(f"(top-k {value or 'off'})\n")
        elif name == "/tokens":
            if not self.last_reply:
                return write("(no reply yet)\n")
            pieces = [f"{t}:{self.tok.token_bytes(t).decode('utf-8', 'backslashreplace')!r}" for t in self.last_reply]
            write(f"{len(self.last_reply)} token{'s' * (len(self.last_reply) != 1)}{' + </s>' if self.last_stopped else ''}: " + " ".join(pieces) + "\n")
        else:
            write(f"unknown command {name}; type /help\n")


def run(args) -> int:
    from ..checkpoint import check_vocab, load_tokenizer
    from ..model import Model
    check_sampling_args(args)
    from ..chat_template import with_template_file
    model, tok = Model.load(args.ckpt, read_only=True), load_tokenizer(args.ckpt, read_only=True)
    check_vocab(model.config, tok)
    tok = with_template_file(tok, args.chat_template)
    from ..memory import check_inference_fits
    check_inference_fits(model.config)
    chat = Chat(decoding_model(model, args), tok, args.temperature, args.top_k, args.top_p, args.seed, args.max_new_tokens,
                speculative=not args.no_speculative)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass

    def write(text):
        sys.stdout.write(text)
        sys.stdout.flush()
    write(f"nanoeuler chat: {args.ckpt} ({model.n_params():,} parameters, context {model.config.ctx_len} tokens). "
          f"/help for commands, Ctrl-D to exit.\n")
    while True:
        try:
            line = input("> ") if interactive else _read_piped(write)
        except EOFError:
            write("\n")
            return 0
        except KeyboardInterrupt:
            write("\n(Ctrl-D to exit)\n")
            continue
        chat.handle(line, write)


def _read_piped(write) -> str:
    """Piped input: echo the prompt and the line, so a transcript reads like a terminal session."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    write("> " + line if line.endswith("\n") else "> " + line + "\n")
    return line
