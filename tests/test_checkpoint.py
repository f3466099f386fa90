"""Checkpoint saves are one atomic unit: a crash at any point leaves the old or the new set, never a mix."""
import numpy as np
import pytest

from nanoeuler import Config, Model
from nanoeuler import checkpoint as ckpt

TINY = Config(vocab_size=40, dim=16, n_heads=4, n_kv_heads=2, n_layers=1, ctx_len=8, ffn_hidden=24, n_mtp=2)


def _assert_same(a: Model, b: Model):
    for n in a.params:
        assert np.array_equal(a.params[n], b.params[n]), n


def test_failing_write_keeps_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    old = Model.init(TINY, seed=1)
    old.save(run)
    new = Model.init(TINY.replace(ffn_hidden=32), seed=2)
    writers = ckpt.model_writers(new.config, new.params)

    def failing(path):
        path.write_bytes(b"half a fi")
        raise OSError("No space left on device")

    writers["config.json"] = failing  # model.safetensors written, then the disk fills up
    with pytest.raises(OSError):
        ckpt.save_files(run, writers)
    loaded = Model.load(run)
    assert loaded.config == TINY
    _assert_same(loaded, old)
    assert not (run / ckpt.STAGING).exists()


def test_crash_between_renames_rolls_forward(tmp_path, monkeypatch):
    run = tmp_path / "run"
    Model.init(TINY, seed=1).save(run)
    new = Model.init(TINY.replace(ffn_hidden=32), seed=2)
    real_recover = ckpt.recover
    calls = {"n": 0}

    def crash_in_commit(run_dir):
        calls["n"] += 1
        if calls["n"] == 2:  # the recover() that moves the committed files: die after the first move
            commit = run_dir / ckpt.COMMIT
            first = sorted(commit.iterdir())[0]
            first.replace(run_dir / first.name)
            raise KeyboardInterrupt
        return real_recover(run_dir)

    monkeypatch.setattr(ckpt, "recover", crash_in_commit)
    with pytest.raises(KeyboardInterrupt):
        new.save(run)
    monkeypatch.setattr(ckpt, "recover", real_recover)
    assert (run / ckpt.COMMIT).is_dir()  # a half-moved set is on disk ...
    loaded = Model.load(run)           # ... and loading completes it
    assert loaded.config == new.config
    _assert_same(loaded, new)
    assert not (run / ckpt.COMMIT).exists()
