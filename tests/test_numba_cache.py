"""numba's on-disk cache of our kernels is keyed on every kernel source (nanoeuler/numba_cache.py): a kernel
that inlines code of another file (infer/kernels.py inlines fast/vmath.vexp) must not be loaded stale
after that other file changed."""
import importlib

import numba
import numpy as np

from nanoeuler import numba_cache
from nanoeuler.infer import kernels, pool


def test_digest_follows_every_file(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import numba\n")
    b.write_text("x = 1\n")
    before = numba_cache.digest([a, b])
    b.write_text("x = 2\n")
    assert numba_cache.digest([a, b]) != before
    assert numba_cache.kernel_sources(tmp_path) == [a]  # only what numba compiles from


def test_kernel_sources_cover_the_kernels_and_their_constants():
    names = {p.relative_to(numba_cache.PACKAGE).as_posix() for p in numba_cache.kernel_sources()}
    assert {"infer/kernels.py", "infer/gemv.py", "infer/attention_kernels.py", "infer/pool.py", "infer/float16.py",
            "infer/qkernels.py", "infer/sampling.py", "fast/vmath.py", "fast/kernels.py", "fast/engine.py",
            "tokenizer/bpe_fast.py", "ops/gelu.py"} <= names


def test_a_kernel_is_stamped_with_the_sources_it_may_inline(monkeypatch):
    """kernels._round's stamp changes when any kernel source changes (here: the digest), so numba
    finds its cache index stale and compiles afresh; functions outside the package keep numba's own stamp."""
    locator = kernels._round._cache._impl.locator
    stamp = locator.get_source_stamp()
    assert stamp[1] == numba_cache.sources_digest()
    assert kernels.step._cache._impl.locator.get_source_stamp()[1] == stamp[1]
    assert pool._serve._cache._impl.locator.get_source_stamp()[1] == stamp[1]  # the step's pieces, file by file
    monkeypatch.setattr(numba_cache, "sources_digest", lambda: "vmath.py edited")
    assert locator.get_source_stamp() != stamp

    @numba.njit(cache=True)
    def outside(x):
        return x + 1
    assert outside(np.int64(1)) == 2
    assert not isinstance(outside._cache._impl.locator.get_source_stamp(), tuple)


def test_compiled_before_is_false_until_a_kernel_is_in_the_cache_for_this_cpu(tmp_path, monkeypatch):
    """A kernel never compiled (its cache empty) or whose source changed (its index stale) compiles at its first
    call: compiled_before says so; once compiled and saved, it loads."""
    monkeypatch.undo()
    (tmp_path / "fresh_kernel.py").write_text("import numba\n\n\n@numba.njit(cache=True)\n"
                                              "def twice(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fresh_kernel
    assert not numba_cache.compiled_before(fresh_kernel.twice)
    assert fresh_kernel.twice(np.int64(3)) == 6
    assert numba_cache.compiled_before(fresh_kernel.twice)
    (tmp_path / "fresh_kernel.py").write_text("import numba\n\n\n@numba.njit(cache=True)\n"
                                              "def twice(x):\n    return x + x\n")
    importlib.reload(fresh_kernel)
    assert not numba_cache.compiled_before(fresh_kernel.twice)   # its source changed: the cached one is stale


def test_a_decoding_layout_built_on_a_cold_cache_says_once_that_kernels_compile(monkeypatch, capsys):
    """Before the first decoding step compiles (a minute or two, silent otherwise), one stderr line says what
    the wait is; a second layout in the same process, or a warm cache, says nothing."""
    from conftest import tiny_config
    from nanoeuler.infer.step import fuse_weights
    from nanoeuler.model import Model
    monkeypatch.undo()
    monkeypatch.setattr(numba_cache, "noted", set())
    monkeypatch.setattr(numba_cache, "compiled_before", lambda dispatcher: dispatcher is not kernels.step)
    model = Model.init(tiny_config(), seed=0)
    assert "decode" in fuse_weights(model.config, model.params)   # (the fused step's layout: kernels on)
    fuse_weights(model.config, model.params)
    err = capsys.readouterr().err
    assert err == ("note: compiling the decoding kernels for this CPU, once (about a minute or two on 2 cores; numba "
                   "keeps them in its cache for later runs)\n")
    monkeypatch.setattr(numba_cache, "noted", set())
    monkeypatch.setattr(numba_cache, "compiled_before", lambda dispatcher: True)
    fuse_weights(model.config, model.params)
    assert capsys.readouterr().err == ""
