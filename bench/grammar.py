"""Benchmark the grammar libraries for constrained decoding on our tokenizers: llguidance, xgrammar, outlines-core.

For the published SmolLM2-135M-Instruct (byte-level BPE, 49,152 tokens) and Gemma 3 270M (SentencePiece,
262,144 tokens, byte-fallback <0xNN> tokens) from `make models`, each library is given the same vocabulary
(nanoeuler/infer/grammar.py's `vocabulary`: each token's bytes, special tokens marked) and the same JSON
schemas (SCHEMAS: nested objects, arrays, enums, numbers, optional fields, unicode strings), and measured:

    tokenizer_s   building the library's view of the vocabulary (once per server)
    compile_ms    one schema into a matcher, the mean over the schemas (once per request)
    mask_us       one next-token mask, the mean over every position of every schema's document (per token)
    valid         every token of a valid document (json.dumps of DOCS, encoded by our tokenizer) allowed at
                  its position, and an end allowed after the last, for every schema: "5/5"
    rejects       a token that breaks the schema refused at the first position (a "[" where an object begins),
                  and every token allowed there begins with "{"

Each (library, model) runs in its own process with a time limit (--timeout): outlines-core builds a
whole-vocabulary index per schema, which on 262,144 tokens may not finish in it ("timeout" then).
The machine's load average is printed; figures from a busy machine are upper bounds.

    .venv/bin/python bench/grammar.py                    # ~2-5 minutes
    .venv/bin/python bench/grammar.py --libs llguidance --models smollm2 --json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

LIBS = ("llguidance", "xgrammar", "outlines-core")
MODELS = ("smollm2", "gemma3")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "city": {"type": "string"}, "temp_c": {"type": "number"},
        "sky": {"enum": ["clear", "cloudy", "rain"]}}, "required": ["city", "temp_c", "sky"]},
    {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["id", "tags"]}},
        "note": {"type": "string"}}, "required": ["items"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"},
                                                  "admin": {"type": "boolean"}}, "required": ["first", "admin"]},
        "score": {"type": "number"}, "level": {"type": "integer"}}, "required": ["user", "score"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": ["integer", "null"]},
                                      "genres": {"type": "array", "items": {"enum": ["drama", "comedy"]}}},
     "required": ["title", "year", "genres"]},
]
DOCS = [
    {"name": "Zoë Ødegaard", "age": 31},
    {"city": "Zürich 日本", "temp_c": -3.25, "sky": "cloudy"},
    {"items": [{"id": 1, "tags": ["a", "bé"]}, {"id": 22, "tags": []}], "note": "line\nbreak"},
    {"user": {"first": "Ana", "last": "Lee", "admin": False}, "score": 1e-3, "level": 7},
    {"title": "Ḿ🙂x", "year": None, "genres": ["drama", "comedy"]},
]


def load_tokenizer(name: str):
    from real_models import models_dir, FILES
    from nanoeuler.interop.gguf_file import GGUFFile
    from nanoeuler.interop.gguf_import import gguf_tokenizer
    f = GGUFFile(models_dir() / FILES[name])
    tok = gguf_tokenizer(f.meta, len(f.meta["tokenizer.ggml.tokens"]))
    tok.encode("warm up")  # its tables, built on first use: not the grammar library's time
    return tok


# ---- each library behind the same three calls: build(vocab), compile(schema), then mask / advance ----
class LLGuidance:
    def __init__(self, tok):
        from nanoeuler.infer.grammar import Grammars
        self.g = Grammars(tok)

    def compile(self, schema):
        return self.g.constraint(self.g.json_schema(schema))

    @staticmethod
    def mask(m) -> np.ndarray:
        return m.allowed()

    @staticmethod
    def advance(m, token: int) -> None:
        m.advance(token)


class XGrammar:
    def __init__(self, tok):
        import xgrammar as xgr
        from nanoeuler.infer.grammar import SPECIAL, vocabulary
        vocab = [b"" if t.startswith(SPECIAL) else t for t in vocabulary(tok)]  # empty: special, to xgrammar
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=list(tok.stop_ids))
        self.compiler, self.xgr, self.V = xgr.GrammarCompiler(info, cache_enabled=False), xgr, tok.vocab_size
        self.bits = np.zeros((1, (self.V + 31) // 32), dtype=np.int32)

    def compile(self, schema):
        cg = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        return self.xgr.GrammarMatcher(cg)

    def mask(self, m) -> np.ndarray:
        m.fill_next_token_bitmask(self.bits)
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.V].astype(bool)

    @staticmethod
    def advance(m, token: int) -> None:
        assert m.accept_token(token)


class OutlinesCore:
    def __init__(self, tok):
        from outlines_core import Vocabulary
        from nanoeuler.infer.grammar import SPECIAL, vocabulary
        words: dict[bytes, list[int]] = {}
        for i, t in enumerate(vocabulary(tok)):
            if not t.startswith(SPECIAL):
                words.setdefault(t, []).append(i)
        self.vocab, self.V = Vocabulary(tok.stop_ids[0], words), tok.vocab_size
        self.bits = np.zeros((self.V + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema
        return Guide(Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern="[ ]?"), self.vocab))

    def mask(self, m) -> np.ndarray:
        m.write_mask_into(self.bits.ctypes.data, self.bits.size, 4)
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.V].astype(bool)

    @staticmethod
    def advance(m, token: int) -> None:
        m.advance(token, return_tokens=False)


KINDS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def measure(lib: str, model: str) -> dict:
    """The figures of one library on one model's tokenizer (the module docstring)."""
    tok = load_tokenizer(model)
    t = time.perf_counter()
    lib_ = KINDS[lib](tok)
    out = {"tokenizer_s": round(time.perf_counter() - t, 3)}
    compile_s, mask_s, valid = [], [], 0
    ends = set(tok.stop_ids)
    for schema, doc in zip(SCHEMAS, DOCS):
        t = time.perf_counter()
        m = lib_.compile(schema)
        compile_s.append(time.perf_counter() - t)
        ok = True
        for token in tok.encode(json.dumps(doc, ensure_ascii=False)):
            t = time.perf_counter()
            allowed = lib_.mask(m)
            mask_s.append(time.perf_counter() - t)
            if not allowed[token]:
                ok = False
                break
            lib_.advance(m, token)
        valid += ok and bool(ends & set(np.flatnonzero(lib_.mask(m)).tolist()))
    first = lib_.mask(lib_.compile(SCHEMAS[0]))  # [V]: where an object begins
    opens = [i for i in np.flatnonzero(first).tolist() if tok.token_bytes(i).startswith(b"{")]
    out.update(compile_ms=round(1e3 * float(np.mean(compile_s)), 2), mask_us=round(1e6 * float(np.mean(mask_s)), 1),
               mask_p99_us=round(1e6 * float(np.percentile(mask_s, 99)), 1), valid=f"{valid}/{len(SCHEMAS)}",
               rejects=not first[tok.encode("[")[0]] and len(opens) == int(first.sum()) > 0)
    return out


def _child(lib, model, queue):
    try:
        queue.put(measure(lib, model))
    except Exception as e:  # a library that fails on a vocabulary says how, in the table
        queue.put({"error": f"{type(e).__name__}: {e}"[:200]})


def run_limited(lib: str, model: str, timeout: float) -> dict:
    queue = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_child, args=(lib, model, queue))
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return {"error": f"timeout ({timeout:g} s)"}
    return queue.get() if not queue.empty() else {"error": f"exit {p.exitcode}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per (library, model)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        for lib in args.libs.split(","):
            rows.append({"model": model, "lib": lib, **run_limited(lib, model, args.timeout)})
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"load": load, "rows": rows}))
        return
    print(f"\nload average {load:.2f} ({os.cpu_count()} cores)")
    print(f"{'model':8} {'library':14} {'tokenizer s':>11} {'compile ms':>10} {'mask us':>8} {'p99 us':>8} "
          f"{'valid':>5} {'rejects':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:8} {r['lib']:14} {r['error']}")
            continue
        print(f"{r['model']:8} {r['lib']:14} {r['tokenizer_s']:11.2f} {r['compile_ms']:10.2f} {r['mask_us']:8.1f} "
              f"{r['mask_p99_us']:8.1f} {r['valid']:>5} {str(r['rejects']):>7}")


if __name__ == "__main__":
    main()
