"""A conversation with an instruction-tuned model: its turns rendered with the chat template, the oldest
dropped when they do not fit, and a reply generated with `session.generate`.

`chat` (cli/chat.py: the REPL commands around it) and `serve`'s /v1/chat/completions (serve/protocol.py:
the prompt only) build the prompt the same way, `Chat.context`.

    chat = Chat(model, tok, temperature=0); g = chat.reply("Who speaks?", on_text=print)
"""
from __future__ import annotations

import numpy as np

from ..chat_template import prompt_ids
from . import session, step


class Chat:
    """The conversation state (messages, sampling settings) and one turn: `reply`."""

    def __init__(self, model, tok, temperature=0.7, top_k=None, top_p=None, seed=None, max_new_tokens=128,
                 speculative=True, ctx_len=None, template_vars=None):
        self.model, self.tok = model, tok
        self.template_vars = template_vars or {}  # the chat template's other variables (tools, enable_thinking)
        self.ctx_len = ctx_len or model.config.ctx_len  # positions prompt and reply share (serve: its --ctx)
        self.temperature, self.top_k, self.top_p, self.max_new = temperature, top_k, top_p, max_new_tokens
        self.speculative = speculative  # greedy replies only: sampling is one token per forward
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
        How many exchanges go is found by bisection (a few renders, not one per exchange: each render is a trip
        to the template worker), starting from the last budget ones (each renders to a token at least).
        ctx is the Chat's ctx_len; however small, the prompt keeps at least its last token."""
        ctx = self.ctx_len
        limit = max(1, ctx - min(self.max_new, 8))                    # what a prompt may keep (>= 1)
        budget = min(limit, ctx - min(self.max_new, ctx // 4))       # what the kept turns may take
        turns = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]
        starts = turns[:1] + [i for i in turns[1:] if messages[i]["role"] == "user"] + [len(messages) - 1]

        def without(k):  # messages less their k oldest exchanges (k = len(starts) - 1: every earlier turn)
            return [m for i, m in enumerate(messages) if i >= starts[k] or m["role"] == "system"]
        rendered = {}

        def fits(k):
            rendered[k] = prompt_ids(self.tok, without(k), self.template_vars)
            return len(rendered[k]) <= budget
        lo, hi = max(0, len(starts) - 1 - budget), len(starts) - 1  # the least k that fits lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
        ids = rendered[lo] if lo in rendered else prompt_ids(self.tok, without(lo), self.template_vars)
        messages[:] = without(lo)
        self.dropped_turns += lo
        self.cut = max(0, len(ids) - limit)  # prompt tokens left out
        return ids[self.cut:]

    def reply(self, text: str, on_text=lambda piece: None, on_prompt=lambda ids: None) -> session.Generation | None:
        """One turn: the user's text, a reply streamed as text pieces to on_text (never a cut UTF-8 character;
        the stop token not shown) -> the generation, or None when interrupted (Ctrl-C: the turn is kept with
        an empty reply). on_prompt(ids) sees the prompt first (`dropped_turns` and `cut` then say what of the
        conversation no longer fit). The conversation then holds both messages."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.context(messages)
        on_prompt(ids)
        dec, stops = session.StreamDecoder(self.tok), self.tok.stop_ids

        def stream(token):
            if token not in stops:
                on_text(dec.feed(token))
        speculate = self.speculative and self.temperature == 0
        seed = int(self.rng.integers(2**31))
        try:
            if self.fused is None:
                self.fused = step.fuse_weights(self.model.config, self.model.params)
            g = session.generate(self.model, ids, self.max_new, self.temperature, self.top_k, self.top_p, seed,
                                 stop_ids=stops, mode="speculative" if speculate else "cache", on_token=stream,
                                 fused=self.fused)
        except KeyboardInterrupt:
            g = None
        on_text(dec.flush())
        self.last_reply, self.last_stopped = (g.ids, g.stopped) if g is not None else ([], False)
        self.messages = messages + [{"role": "assistant", "content": self.tok.decode(self.last_reply)}]
        return g
