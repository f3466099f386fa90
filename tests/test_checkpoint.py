"""Checkpoint directories: atomic saves (a crash or a full disk leaves the old or the new set, never a mix),
a journal that is rolled forward only when provably ours (never through a link, never outside the run),
read-only loads that change nothing, no non-finite weights saved or loaded, one process per run."""
import errno
import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import snapshot, tiny_config

from nanoeuler import Model
from nanoeuler import checkpoint as ckpt
from nanoeuler.errors import UserError

TINY = tiny_config()


def _assert_same(a: Model, b: Model):
    for n in a.params:
        assert np.array_equal(a.params[n], b.params[n]), n


def _interrupted_save(run, new: Model, moved: int = 1):
    """Leave run as a save killed after step 2 with `moved` files already moved into place."""
    real = ckpt.recover
    calls = {"n": 0}

    def crash(run_dir, read_only=False):
        calls["n"] += 1
        if calls["n"] == 2:   # the recover() that moves the committed files: die after `moved` moves
            commit = run_dir / ckpt.COMMIT
            for f in sorted(p for p in commit.iterdir() if p.name != ckpt.JOURNAL)[:moved]:
                f.replace(run_dir / f.name)
            raise KeyboardInterrupt
        return real(run_dir, read_only)

    ckpt.recover = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            new.save(run)
    finally:
        ckpt.recover = real


# ---- atomicity ------------------------------------------------------------------------------------
def test_failing_write_keeps_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    old = Model.init(TINY, seed=1)
    old.save(run)
    new = Model.init(TINY.replace(ffn_hidden=32), seed=2)
    writers = ckpt.model_writers(new.config, new.params)

    def failing(path):
        path.write_bytes(b"half a fi")
        raise OSError(errno.ENOSPC, "No space left on device")

    writers["config.json"] = failing  # model.safetensors written, then the disk fills up
    with pytest.raises(UserError, match="disk is full.*previous checkpoint is intact"):
        ckpt.save_files(run, writers)
    loaded = Model.load(run)
    assert loaded.config == TINY
    _assert_same(loaded, old)
    assert not (run / ckpt.STAGING).exists()


def test_full_disk_in_the_real_tensor_writer_keeps_old_files(tmp_path, monkeypatch):
    """ENOSPC half-way through writing model.safetensors (the real writer, Python's open patched)."""
    run = tmp_path / "run"
    old = Model.init(TINY, seed=1)
    old.save(run)
    before = snapshot(run)

    class FullDisk(io.BytesIO):
        def write(self, data):
            super().write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "open", lambda path, mode="r", *a, **k: FullDisk() if "w" in mode else open(path, mode, *a, **k),
                        raising=False)
    with pytest.raises(UserError, match="disk is full"):
        Model.init(TINY, seed=2).save(run)
    monkeypatch.undo()
    assert snapshot(run) == before
    _assert_same(Model.load(run), old)


def test_full_disk_is_one_line_from_the_cli(tmp_path, monkeypatch, capsys):
    from nanoeuler.cli import main
    run = tmp_path / "run"
    Model.init(TINY, seed=1).save(run)

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "tensors_writer", lambda *a, **k: enospc)
    monkeypatch.setattr("nanoeuler.cli.info.run", lambda args: Model.init(TINY, seed=2).save(run))
    code = main(["info", str(run)])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and err.startswith("error: ") and "disk is full" in err


def test_crash_between_renames_rolls_forward(tmp_path):
    run = tmp_path / "run"
    Model.init(TINY, seed=1).save(run)
    new = Model.init(TINY.replace(ffn_hidden=32), seed=2)
    _interrupted_save(run, new)
    assert (run / ckpt.COMMIT).is_dir()  # a half-moved set is on disk ...
    loaded = Model.load(run)           # ... and loading completes it
    assert loaded.config == new.config
    _assert_same(loaded, new)
    assert not (run / ckpt.COMMIT).exists()


# ---- the journal is ours or it is refused ---------------------------------------------------------
def test_symlinked_commit_is_refused_and_nothing_moves(tmp_path):
    run, victim = tmp_path / "run", tmp_path / "victim"
    Model.init(TINY, seed=1).save(run)
    victim.mkdir()
    (victim / "precious.txt").write_text("do not move me")
    (victim / "model.safetensors").write_bytes(b"not yours")
    (run / ckpt.COMMIT).symlink_to(victim)
    before = snapshot(tmp_path)
    for read_only in (False, True):
        with pytest.raises(UserError, match="link.*left untouched"):
            Model.load(run, read_only=read_only)
        assert snapshot(tmp_path) == before


@pytest.mark.parametrize("defect", ["no journal", "foreign journal", "unlisted file", "wrong size", "link inside",
                                    "missing file", "bad name"])
def test_commit_not_provably_ours_is_refused_untouched(tmp_path, defect):
    run = tmp_path / "run"
    Model.init(TINY, seed=1).save(run)
    _interrupted_save(run, Model.init(TINY, seed=2), moved=0)
    commit = run / ckpt.COMMIT
    journal = json.loads((commit / ckpt.JOURNAL).read_text())
    outside = tmp_path / "outside.txt"
    outside.write_text("outside")
    if defect == "no journal":
        (commit / ckpt.JOURNAL).unlink()
    elif defect == "foreign journal":
        (commit / ckpt.JOURNAL).write_text(json.dumps({"files": journal["files"]}))
    elif defect == "unlisted file":
        (commit / "extra.bin").write_bytes(b"x")
    elif defect == "wrong size":
        with open(commit / "config.json", "a") as f:
            f.write(" ")
    elif defect == "link inside":
        (commit / "config.json").unlink()
        (commit / "config.json").symlink_to(outside)
    elif defect == "missing file":
        (commit / "config.json").unlink()
        (run / "config.json").unlink()
    elif defect == "bad name":
        journal["files"]["../outside.txt"] = 7
        (commit / ckpt.JOURNAL).write_text(json.dumps(journal))
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="left untouched"):
        Model.load(run)
    assert snapshot(tmp_path) == before


def test_symlinked_staging_is_removed_as_a_name_only(tmp_path):
    run, victim = tmp_path / "run", tmp_path / "victim"
    Model.init(TINY, seed=1).save(run)
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    (run / ckpt.STAGING).symlink_to(victim)
    Model.init(TINY, seed=2).save(run)
    assert (victim / "keep.txt").read_text() == "keep"
    assert not os.path.lexists(run / ckpt.STAGING)


def test_read_only_load_changes_nothing_and_reads_the_new_set(tmp_path, capsys):
    run = tmp_path / "run"
    Model.init(TINY, seed=1).save(run)
    new = Model.init(TINY.replace(ffn_hidden=32), seed=2)
    _interrupted_save(run, new, moved=1)
    (run / ckpt.STAGING).mkdir()          # a half-written staging from another crash
    before = snapshot(run)
    loaded = Model.load(run, read_only=True)
    assert "not yet moved into place" in capsys.readouterr().err
    assert snapshot(run) == before
    assert loaded.config == new.config
    _assert_same(loaded, new)
    Model.load(run)                        # a writing load completes it
    assert not (run / ckpt.COMMIT).exists() and not (run / ckpt.STAGING).exists()


# ---- never save or load non-finite weights -------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_never_saved(tmp_path, bad):
    run = tmp_path / "run"
    old = Model.init(TINY, seed=1)
    old.save(run)
    before = snapshot(run)
    broken = Model.init(TINY, seed=2)
    broken.params["layers.0.ffn.up.weight"][3, 4] = bad
    with pytest.raises(UserError, match="layers.0.ffn.up.weight has 1 non-finite"):
        broken.save(run)
    assert snapshot(run) == before


def test_non_finite_optimizer_state_is_never_saved(tmp_path):
    moments = {"m.x": np.zeros(3, np.float32), "v.x": np.array([0, np.inf, 0], np.float32)}
    with pytest.raises(UserError, match="optimizer state: tensor v.x"):
        ckpt.save_files(tmp_path / "run", {"optimizer.safetensors": ckpt.optimizer_writer(moments)})
    assert not (tmp_path / "run" / "optimizer.safetensors").exists()
    ckpt.tensors_writer({"r": np.full(2, np.nan)}, allow_nonfinite=True)   # NaN as a marker: explicitly allowed


def test_non_finite_weights_are_never_loaded(tmp_path):
    from safetensors.numpy import save_file
    run = tmp_path / "run"
    model = Model.init(TINY, seed=1)
    model.save(run)
    model.params["norm.weight"][0] = np.nan
    save_file(model.params, str(run / "model.safetensors"))   # as a NaN run of an older version left it
    with pytest.raises(UserError, match="norm.weight has 1 non-finite"):
        Model.load(run, read_only=True)


# ---- one process per run ---------------------------------------------------------------------------
def test_lock_held_by_another_process_names_it(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.argv = ["nanoeuler", "train", "--out", {str(run)!r}]
        from nanoeuler.checkpoint import run_lock
        with run_lock({str(run)!r}):
            print("locked", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=rf"in use by another process \(pid {holder.pid}: nanoeuler train --out"):
            with ckpt.run_lock(run):
                pass
    finally:
        holder.kill()
        holder.wait()
    with ckpt.run_lock(run):      # the kernel released it with the process
        with pytest.raises(UserError, match=f"pid {os.getpid()}"):
            with ckpt.run_lock(run):   # and a second holder in this very process is refused too
                pass


def test_lock_refuses_a_file_and_a_linked_lock(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        with ckpt.run_lock(tmp_path / "file"):
            pass
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ckpt.LOCK).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match="cannot lock"):
        with ckpt.run_lock(tmp_path / "run"):
            pass
    assert not (tmp_path / "elsewhere").exists()


def test_model_and_checkpoint_import_no_circle():
    """checkpoint.py validates a load with config.check_params: it never imports model.py."""
    import ast
    tree = ast.parse(open(ckpt.__file__).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "model" not in imported and "config" in imported
