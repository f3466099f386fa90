"""Shared by the serve tests: a small trained checkpoint (tokenizer + model), a server on a thread, and a
hold on the engine's steps.

The model is trained for a few seconds on Hamlet lines separated by </s>, so greedy text is not a single
repeated token, logits have clear winners, and replies end with </s> on their own.
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from nanoeuler import Config, Model
from nanoeuler.data.corpus import bundled_works
from nanoeuler.tokenizer import Tokenizer

CTX = 256


def train_checkpoint(path, steps: int = 150, seed: int = 0):
    """Train a tiny model on Hamlet lines (</s> after each) and save it with its tokenizer at path."""
    from nanoeuler.optim import AdamW
    text = bundled_works()["hamlet"][:40000]
    tok = Tokenizer.train([text], 300, progress=False)
    ids = []
    for line in text.splitlines():
        if line.strip():
            ids += tok.encode(line.strip()) + [tok.eos_id]
    ids = np.array(ids)
    cfg = Config(vocab_size=tok.vocab_size, dim=48, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=CTX,
                 ffn_hidden=96, n_mtp=2)
    model = Model.init(cfg, seed=seed)
    opt = AdamW(model.params, lr=1e-2, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    L = 32 + cfg.n_mtp
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - L, 16)
        _, _, grads = model.loss_and_grads(np.stack([ids[s:s + L] for s in starts]))
        opt.step(model.params, grads)
    model.save(path, tokenizer=tok)
    return model, tok


_CACHE = {}


def shared_checkpoint():
    """train_checkpoint once per test process (the serve test files share it) -> (dir, model, tok)."""
    if "ckpt" not in _CACHE:
        import atexit
        import shutil
        import tempfile
        root = tempfile.mkdtemp(prefix="nanoeuler-serve-")
        atexit.register(shutil.rmtree, root, True)
        d = f"{root}/tiny"
        _CACHE["ckpt"] = (d, *train_checkpoint(d))
    return _CACHE["ckpt"]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 (an ephemeral port) in a thread of this process, as run_server does
    (read_timeout: http_protocol's, default READ_TIMEOUT).

        with ServerThread(app) as srv: requests to srv.url ...
    """

    def __init__(self, app, read_timeout: float | None = None):
        import uvicorn

        from nanoeuler.serve.transport import READ_TIMEOUT, bind, http_protocol
        self.app = app
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http_protocol(read_timeout or READ_TIMEOUT),
                                                   ws="none",
                                                   lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(20)


HOLD_SECONDS = 30   # the longest one step is held, so a test whose expectation fails ends instead of hanging


def no_job_starting(batcher) -> bool:
    """A `hold_engine_steps` condition: hold while no job waits for a row or fills its row's cache (a new
    request's jobs get in, through their prompts, to their first token; the running ones advance meanwhile)."""
    return batcher.stats()["queued"] == 0 and batcher.n_dec == sum(s is not None for s in batcher.slots)


@contextlib.contextmanager
def hold_engine_steps(monkeypatch, holding=None):
    """Within: after each engine step that leaves a row busy, the engine waits while holding(batcher) (default:
    always) until the yielded Event is set (or for HOLD_SECONDS), so a test sees its jobs running
    however fast the machine would run them to their end. The tiny model makes hundreds of tokens a second
    here and more on a faster machine: a test that looks at a job "still running" without a hold races it.

        with hold_engine_steps(monkeypatch) as release, http.stream(...) as stream:
            next(stream.iter_lines())   # a token made; the engine waits: the job holds its row
            ... look ...; release.set()
    """
    from nanoeuler.infer.engine import Batcher
    release, step = threading.Event(), Batcher.step

    def held_step(self):
        busy = step(self)
        lapse = time.monotonic() + HOLD_SECONDS
        while busy and any(self.slots) and not release.is_set() and time.monotonic() < lapse:
            if holding is None:
                release.wait(max(0.0, lapse - time.monotonic()))
            elif holding(self):
                release.wait(0.005)
            else:
                break
        return busy
    monkeypatch.setattr(Batcher, "step", held_step)
    try:
        yield release
    finally:
        release.set()
        monkeypatch.setattr(Batcher, "step", step)
