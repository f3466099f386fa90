"""A tiny synthetic batch source and config for training-loop tests (also run in subprocesses)."""
import numpy as np

from conftest import tiny_config

TINY = tiny_config(vocab_size=32, dim=16, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=8, ffn_hidden=24, n_mtp=2)


class SyntheticSource:
    """Sequences that count upwards mod V from a random start: learnable, deterministic given the rng."""

    bytes_per_token = 2.0

    def __init__(self, batch_size=4, cfg=TINY, mask_fraction=0.0):
        self.batch_size, self.cfg, self.mask_fraction = batch_size, cfg, mask_fraction

    def _batch(self, starts):
        L = self.cfg.ctx_len + self.cfg.n_mtp
        return (starts[:, None] + np.arange(L)) % self.cfg.vocab_size  # [B, T+K]

    def next_batch(self, rng):
        tokens = self._batch(rng.integers(0, self.cfg.vocab_size, self.batch_size))
        if not self.mask_fraction:
            return tokens, None
        return tokens, rng.random(tokens.shape) >= self.mask_fraction

    def eval_batches(self):
        yield self._batch(np.arange(0, self.cfg.vocab_size, 3)), None

    def describe(self):
        return {"synthetic": True, "batch_size": self.batch_size}


def run(out_dir, steps, stop_after=None, resume=False, seed=0, ckpt_every=3, mask_fraction=0.0, **kw):
    from nanoeuler import Model
    from nanoeuler.training.train import TrainConfig, run_training
    model = Model.load(out_dir) if resume else Model.init(TINY, seed=seed)
    tcfg = TrainConfig(steps=steps, batch_size=4, lr=1e-2, warmup=2, eval_every=4, eval_batches=0,
                       ckpt_every=ckpt_every, seed=seed, **kw)
    summary = run_training(model, None, SyntheticSource(mask_fraction=mask_fraction), out_dir, tcfg, resume=resume,
                           stop_after=stop_after,
                           progress=False)
    return model, summary
