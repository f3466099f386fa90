"""`nanoeuler chat --ckpt RUN`: a REPL around an instruction-tuned model.

Each line you type is a user message; the conversation is rendered with the checkpoint's chat template
(chat_template.py: the model's own, e.g. ChatML, or ours, the SPEC Alpaca template; `--template-var
enable_thinking=false` gives it a variable) and the reply streams
until an end-of-turn / eos token (not shown). Earlier turns stay while they fit the context, oldest dropped
first. Commands:

    /reset        forget the conversation         /temp X    set the temperature (0 = greedy)
    /topk N       sample from the N most likely   /tokens    how the last reply was tokenized
    /help         this list                       Ctrl-D     exit
"""
from __future__ import annotations

import sys

from .args import add_template_arg, add_template_var_arg, escape_control
from .sample import add_sampling_args, check_sampling_args, check_temperature, load_for_decoding

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
    p.add_argument("--ckpt", required=True, help="checkpoint directory or .gguf file (decoded as the file holds it, each matrix in its type; read only): an SFT run or an instruct model")
    add_template_arg(p)
    add_template_var_arg(p)
    add_sampling_args(p, temperature=0.7, max_new=128)
    p.set_defaults(run=run)


class Repl:
    """The REPL around a conversation (infer/chat.py's Chat): `handle(line, write)` does one step, a message
    or a command.  Repl(Chat(model, tok)).handle("Who speaks?", sys.stdout.write)"""

    def __init__(self, chat):
        self.chat = chat

    def handle(self, line: str, write) -> None:
        line = line.strip()
        if not line:
            return
        if line.startswith("/"):
            return self.command(line, write)
        chat, dropped = self.chat, self.chat.dropped_turns

        def notes(ids):
            if chat.cut:
                write(f"(your message is longer than the context: kept its last {len(ids)} tokens)\n")
            elif chat.dropped_turns > dropped:
                write(f"(dropped the {chat.dropped_turns - dropped} oldest turn(s) to fit the context)\n")
        g = chat.reply(line, lambda piece: write(escape_control(piece)), notes)
        note = "  [interrupted]" if g is None else "" if g.stopped else f"  [stopped at {chat.max_new} tokens]"
        write(note + "\n")

    def command(self, line: str, write) -> None:
        chat = self.chat
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/help":
            write(HELP + "\n")
        elif name == "/reset":
            chat.messages.clear()
            chat.last_reply = []
            write("(conversation cleared)\n")
        elif name == "/temp":
            from ..errors import UserError
            from ..infer.sampling import MIN_TEMPERATURE
            try:
                value = check_temperature("/temp", arg)
            except UserError as e:
                return write(f"{e}\nusage: /temp X   with X = 0 (greedy) or in [{MIN_TEMPERATURE:g}, 100]\n")
            chat.temperature = value
            write(f"(temperature {value:g}{', greedy' if value == 0 else ''})\n")
        elif name == "/topk":
            try:
                value = int(arg)
                if value < 0:
                    raise ValueError
            except ValueError:
                return write("usage: /topk N   with N >= 0 (0 = no limit, as --top-k 0)\n")
            chat.top_k = value or None
            write(f"(top-k {value or 'off'})\n")
        elif name == "/tokens":
            if not chat.last_reply:
                return write("(no reply yet)\n")
            pieces = [f"{t}:{chat.tok.token_bytes(t).decode('utf-8', 'backslashreplace')!r}" for t in chat.last_reply]
            write(f"{len(chat.last_reply)} token{'s' * (len(chat.last_reply) != 1)}{' + </s>' if chat.last_stopped else ''}: " + " ".join(pieces) + "\n")
        else:
            write(f"unknown command {name}; type /help\n")


def run(args) -> int:
    check_sampling_args(args)
    from ..chat_template import with_template_file
    model, tok = load_for_decoding(args)
    tok = with_template_file(tok, args.chat_template)
    from ..infer.chat import Chat
    chat = Repl(Chat(model, tok, args.temperature, args.top_k, args.top_p, args.seed,
                     args.max_new_tokens, speculative=not args.no_speculative,
                     template_vars=dict(args.template_var)))
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
