"""Constrained decoding: the tokens a job may sample next, kept to a grammar (with llguidance, the `grammar` extra).

A request's `response_format` (any JSON object, or a JSON schema) or a forced tool call is a grammar; each of
its jobs holds its own matcher (a Constraint). Before each sampling the engine asks the constraint for the
tokens that keep the reply a prefix of a sentence of the grammar and sets every other token's logit to -inf
(sampling and logprobs both read the masked logits); the sampled token then advances the matcher. When the
grammar is complete the end-of-turn tokens are allowed; when nothing but an end can follow, the job ends.

llguidance was chosen by measurement against xgrammar and outlines-core on our tokenizers (bench/grammar.py,
figures in docs/serving.md): it compiles a schema in milliseconds (xgrammar in tens to hundreds, outlines-core
builds a whole-vocabulary index per schema: seconds on a 262,144-token vocabulary), builds its view of a
vocabulary as fast as outlines-core and several times faster than xgrammar, masks in the same order of time
as xgrammar on the large vocabulary, and imports nothing else (xgrammar imports torch, which the library must
not need).

The vocabulary adapter (`vocabulary`): llguidance reads a vocabulary as each token's bytes, a special token as
b"\\xff" + its name (so that no text ever matches it). Ours come from `tok.token_bytes` (byte-level BPE: the
token's bytes; SentencePiece: its piece with "▁" as a space, a byte-fallback <0xNN> token its byte). A token is
text when encoding its text without specials gives exactly that token: every ordinary token, and the special
ones that are text to our encoder too (Gemma's user-defined "\\n", "\\n\\n", "[multimodal]"); control,
unknown and unused tokens are special, and so is every end-of-turn token (text that happened to be one would
end the reply where the grammar is not done). (A byte-level vocabulary's token of the byte 0xFF reads as
special to llguidance too: that byte never occurs in UTF-8, so no grammar of text needs it.)

    vocabulary(smollm2)[:3]  ->  [b'\\xff<|endoftext|>', b'\\xff<|im_start|>', b'\\xff<|im_end|>']
    vocabulary(smollm2)[216] ->  b' '
"""
from __future__ import annotations

import json

import numpy as np

from ..errors import UserError

SPECIAL = b"\xff"  # llguidance's mark of a special token: no text matches it
# JSON as the model most likely writes it (json.dumps' separators), no other whitespace: a reply cannot
# wander into endless spaces or newlines, and every choice the grammar leaves is content
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed(schema):
    """schema with every object that lists its "properties" closed to others unless it says otherwise
    (additionalProperties false), as llama.cpp's and xgrammar's JSON grammars read a schema: a reply then holds
    the keys the schema names, not keys of the model's invention. A bare {"type": "object"} stays any object.

        closed({"properties": {"a": {"properties": {}}}})
            -> {"properties": {"a": {"properties": {}, "additionalProperties": False}}, "additionalProperties": False}
    """
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions", "patternProperties"):  # maps of schemas
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties", "not", "contains"):
        if key in out:
            out[key] = closed(out[key])
    if isinstance(schema.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


def first_line(e) -> str:
    """An error's first line (llguidance's parser errors go on with many lines of its state)."""
    return str(e).strip().split("\n")[0]


class GrammarError(UserError):
    """A grammar (schema) llguidance cannot compile, or the grammar extra is not installed."""


def require_llguidance():
    """The llguidance module, or GrammarError naming the extra that installs it."""
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the mask helpers)
    except ImportError:
        raise GrammarError("constrained decoding needs the llguidance package: pip install 'nanoeuler[grammar]'")
    return llguidance


def text_ids(tok) -> np.ndarray:
    """bool [vocab]: token i is text (encoding its text without specials gives [i]); see the module docstring."""
    is_text = np.ones(tok.vocab_size, dtype=bool)
    for i in tok.special_tokens.values():
        is_text[i] = tok.encode(tok.token_bytes(i).decode("utf-8", "replace")) == [i]
    is_text[list(tok.stop_ids)] = False
    return is_text


def vocabulary(tok, size: int | None = None) -> list[bytes]:
    """Each token's bytes as llguidance reads them: text tokens their bytes, special ones SPECIAL + their name;
    size (the model's vocabulary, >= the tokenizer's): ids past the tokenizer's are special, never sampled."""
    is_text = text_ids(tok)
    out = [tok.token_bytes(i) if is_text[i] else SPECIAL + tok.token_bytes(i) for i in range(tok.vocab_size)]
    return out + [SPECIAL + f"<[{i}]>".encode() for i in range(tok.vocab_size, size or tok.vocab_size)]


class _Wrapped:
    """The tokenizer as llguidance.TokenizerWrapper takes it: tokens, eos and bos ids, bytes -> ids."""

    def __init__(self, tok, size: int | None):
        self.tokens = vocabulary(tok, size)
        self.eos_token_id, self.bos_token_id = tok.stop_ids[0], tok.bos_id
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t.startswith(SPECIAL)]
        self.tok = tok

    def __call__(self, data: bytes) -> list[int]:
        return self.tok.encode_bytes(data)


class Grammars:
    """One per server: the tokenizer as llguidance's (built once), grammars compiled into constraints.

        g = Grammars(tok); c = g.constraint(g.json_schema({"type": "object"}))
    """

    def __init__(self, tok, vocab_size: int | None = None):
        ll = require_llguidance()
        self.vocab_size = vocab_size or tok.vocab_size
        if not tok.stop_ids:
            raise GrammarError("constrained decoding needs a tokenizer with an end-of-text token")
        wrapped = _Wrapped(tok, self.vocab_size)
        self.tokenizer = ll.LLTokenizer(ll.TokenizerWrapper(wrapped), eos_token=list(tok.stop_ids))
        self.specials = {name: i for name, i in tok.special_tokens.items()
                         if wrapped.tokens[i].startswith(SPECIAL)}  # name -> id of the special (not text) tokens
        self.ends = np.zeros(self.vocab_size, dtype=bool)  # [V]: the tokens that end a reply
        self.ends[list(tok.stop_ids)] = True
        self.ll = ll

    # ---- grammars: llguidance's grammar text ----
    def json_schema(self, schema: dict | None) -> str:
        """The grammar of JSON values valid under schema, its objects closed (`closed`); None: any JSON object."""
        try:
            return self.ll.LLMatcher.grammar_from_json_schema(
                {"type": "object"} if schema is None else closed(schema), overrides=JSON_OPTIONS)
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(f"the JSON schema is not usable: {e}"[:500])

    def lark(self, rule: str) -> str:
        """The grammar whose start rule is `rule` (Lark syntax; llguidance's %json {schema} included)."""
        return self.ll.LLMatcher.grammar_from_lark(f"start: {rule}\n")

    def json_rule(self, schema: dict) -> str:
        """A Lark item matching JSON valid under schema, written as json_schema writes it (JSON_OPTIONS)."""
        return "%json " + json.dumps({**closed(schema), "x-guidance": JSON_OPTIONS}, ensure_ascii=False)

    def text_rule(self, text: str) -> str:
        """A Lark item matching text, its special tokens' names as those tokens: "<tool_call>\n" -> '<[id]> "\n"'
        where <tool_call> is a special token, '"<tool_call>\n"' where it is text."""
        names = sorted((n for n in self.specials if n and n in text), key=len, reverse=True)
        if not names:
            return json.dumps(text, ensure_ascii=False) if text else ""
        name = next(n for n in names if text.find(n) == min(text.find(m) for m in names))
        before, _, after = text.partition(name)
        return " ".join(p for p in (self.text_rule(before), f"<[{self.specials[name]}]>", self.text_rule(after)) if p)

    def constraint(self, grammar: str, name: str = "the grammar") -> Constraint:
        """A fresh matcher of grammar; GrammarError (its message) when llguidance cannot compile it, or when it
        allows no reply but the empty one (a schema that is only a $ref loop: no JSON value matches it).
        name: what the request called it (its field), in the errors of its decoding (Constraint)."""
        try:
            m = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(f"the grammar does not compile: {e}"[:500])
        if m.is_error():
            raise GrammarError(f"the grammar does not compile: {m.get_error()}"[:500])
        c = Constraint(m, self.vocab_size, name)
        if not (c.allowed() & ~self.ends).any():
            raise GrammarError("the grammar matches no reply but the empty one (no value satisfies the schema)")
        return c


class Constraint:
    """One job's matcher: `allowed()` the tokens that may come next, `advance(token)` after each one sampled.

        c.allowed()      -> bool [V]      (computed once per position)
        c.advance(t)     -> None; c.finished: nothing but an end may follow (the reply is complete)
    """

    def __init__(self, matcher, vocab_size: int, name: str = "the grammar"):
        self.matcher, self.vocab_size, self.name = matcher, vocab_size, name
        self.bits = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)  # [1, words]: llguidance's mask
        self._allowed: np.ndarray | None = None

    def copy(self) -> Constraint:
        """A matcher of the same grammar, in the same state (the n choices of a request: compiled once)."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size, self.name)

    def allowed(self) -> np.ndarray:
        """bool [V]: may each token come next."""
        if self._allowed is None:
            from llguidance.numpy import fill_next_token_bitmask
            fill_next_token_bitmask(self.matcher, self.bits)
            bits = np.unpackbits(self.bits.view(np.uint8), bitorder="little")  # [32 * words]
            self._allowed = bits[:self.vocab_size].astype(bool)
        return self._allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] with every token that may not come next at -inf (a copy). GrammarError (the request's
        fault: its grammar, not the engine) when the grammar has come to a dead end or failed."""
        allowed = self.allowed()
        if not allowed.any():
            raise self._failed(self.matcher.get_error() or "a dead end: no token may come next")
        return np.where(allowed, logits, -np.inf)

    def advance(self, token: int) -> None:
        self._allowed = None
        if not self.matcher.consume_token(int(token)):
            raise self._failed(self.matcher.get_error() or f"token {token} refused")

    def _failed(self, why: str) -> GrammarError:
        """The error of a grammar that fails while decoding: one that recurses without end (a schema whose
        every value would contain itself) exhausts llguidance's parser at its first tokens."""
        return GrammarError(f"{self.name} failed while decoding (a schema with no finite value?): "
                            f"{first_line(why)}"[:300])

    @property
    def finished(self) -> bool:
        """The reply is complete and nothing but an end may follow."""
        return self.matcher.is_stopped()

