"""What a LoRA run holds of its frozen base: once a step has packed (bf16) or stacked (float32 q|k|v,
gate|up) the frozen weights, their float32 pages leave the process (the base is a read-only map of its
checkpoint), and whatever reads them later gets the checkpoint's bytes back."""
import mmap

import numpy as np
import pytest

from conftest import tiny_config
from nanoeuler import adapters as ad
from nanoeuler.checkpoint import (drop_pages, file_map, load_model, map_tensors, read_out, release_freed_memory,
                                  save_files)
from nanoeuler.fast import bf16
from nanoeuler.fast.engine import copied_weights
from nanoeuler.training.lora import LoraModel
from nanoeuler.model import Model
from nanoeuler.optim import AdamW

needs_bf16 = pytest.mark.skipif(not bf16.AVAILABLE, reason="this CPU has no AVX512_BF16")


def whole_pages(a: np.ndarray) -> tuple[int, int]:
    """The first and the end page number of a's whole pages."""
    page, addr = mmap.PAGESIZE, a.__array_interface__["data"][0]
    lo = -(-addr // page)
    return lo, max(lo, (addr + a.nbytes) // page)


def resident(a: np.ndarray) -> int:
    """Bytes of a's whole pages that are in this process's memory (/proc/self/pagemap's present bit)."""
    page = mmap.PAGESIZE
    lo, hi = whole_pages(a)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo * 8)
        entries = np.frombuffer(f.read((hi - lo) * 8), np.uint64)
    return int((entries >> np.uint64(63)).sum()) * page


def base_run(tmp_path, arch):
    """A saved float32 base whose matrices span many pages (so that what is held is measurable)."""
    cfg = tiny_config(arch=arch, dim=128, n_heads=4, n_kv_heads=2 if arch == "euler" else 4, ffn_hidden=512,
                      n_layers=2, vocab_size=300, ctx_len=32)
    Model.init(cfg, seed=3).save(tmp_path / "base")
    return tmp_path / "base", cfg


def lora_run(base_dir, arch, precision):
    lcfg = ad.LoraConfig(4, 8.0)
    return LoraModel.new(base_dir, lcfg, seed=1).set_precision(precision)


def tokens_of(cfg, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, cfg.ctx_len + cfg.n_mtp))


def matrices(model):
    return {n: a for n, a in model.base.params.items() if a.ndim == 2 and n not in ("embed.weight", "pos_embed.weight")}


@needs_bf16
@pytest.mark.parametrize("arch", ["euler", "gpt2"])
def test_a_bf16_lora_step_holds_no_float32_copy_of_a_frozen_matrix(tmp_path, arch):
    """After the first bf16 step every frozen matrix (q, k, v, o, the MLP's, the untied heads) is held only
    as its bf16 packs: none of its float32 pages is in memory, step after step. The embedding stays for the
    lookup where it is an untied input (euler); gpt2's tied head is packed, and its float32 goes too: the
    lookup reads a step's rows from the file. The steps' losses are those of the base held in memory."""
    base_dir, cfg = base_run(tmp_path, arch)
    m = lora_run(base_dir, arch, "bf16")
    mats, embed = matrices(m), m.base.params["embed.weight"]
    whole = (whole_pages(embed)[1] - whole_pages(embed)[0]) * mmap.PAGESIZE   # (resident counts those only)
    assert all(resident(a) for a in mats.values()) and resident(embed) >= whole   # loaded (checked finite)
    in_memory = LoraModel(Model(*load_model(base_dir)), m.lcfg, dict(m.params), {"path": "", "sha256": ""})
    in_memory.set_precision("bf16")
    for step in range(2):
        loss = m.loss_and_grads(tokens_of(cfg, step))[0]
        assert loss == in_memory.loss_and_grads(tokens_of(cfg, step))[0]
        assert set(copied_weights(m._ws)) == set(mats)
        held = {n: resident(a) for n, a in mats.items()}
        assert not any(held.values()), held
    assert resident(embed) == 0 if cfg.tie_embeddings else resident(embed) >= whole


@pytest.mark.parametrize("arch", ["euler", "gpt2"])
def test_a_float32_lora_step_holds_one_copy_of_each_stacked_matrix(tmp_path, arch):
    """float32: q|k|v (and gate|up) are read from the workspace's stacks after the first step, so the base's
    own pages of them go; wo, down / proj (read in place) stay."""
    base_dir, cfg = base_run(tmp_path, arch)
    m = lora_run(base_dir, arch, "f32")
    m.loss_and_grads(tokens_of(cfg))
    m.loss_and_grads(tokens_of(cfg, 1))
    stacked = {f"layers.{i}.{w}.weight" for i in range(cfg.n_layers)
               for w in ("attn.wq", "attn.wk", "attn.wv") + (("ffn.gate", "ffn.up") if arch == "euler" else ())}
    assert set(copied_weights(m._ws)) == stacked
    mats = matrices(m)
    assert not any(resident(mats[n]) for n in stacked)
    assert all(resident(a) for n, a in mats.items() if n not in stacked)


@needs_bf16
@pytest.mark.parametrize("arch", ["euler", "gpt2"])
def test_merge_after_a_bf16_run_equals_the_float32_merge_bit_for_bit(tmp_path, arch):
    """The base's pages dropped after packing are read back from the checkpoint unchanged: the run's merged
    model, and that of its saved adapters (lora merge, export), equal the merge of an in-memory float32 base."""
    base_dir, cfg = base_run(tmp_path, arch)
    m = lora_run(base_dir, arch, "bf16")
    opt = AdamW(m.params, lr=1e-2, weight_decay=0.0)
    for step in range(2):
        opt.step(m.params, m.loss_and_grads(tokens_of(cfg, step))[2])
    assert not any(resident(a) for a in matrices(m).values())
    _, params = load_model(base_dir)                                     # float32, in memory
    want = ad.merge_params(cfg, params, m.lcfg, m.params)
    save_files(tmp_path / "run", m.checkpoint_writers())
    for got in (m.merged().params, LoraModel.load(tmp_path / "run").merged().params,
                Model.load(tmp_path / "run").params):
        assert set(got) == set(want)
        assert all(np.array_equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in want)
    assert m.loss(tokens_of(cfg), reference=True) == Model(cfg, want).loss(tokens_of(cfg), reference=True)


def test_mapped_tensors_are_the_files_read_only_and_come_back_after_a_drop(tmp_path):
    base_dir, cfg = base_run(tmp_path, "euler")
    _, params = load_model(base_dir)
    mapped = map_tensors(base_dir / "model.safetensors", "weights")
    assert set(mapped) == set(params)
    assert all(np.array_equal(mapped[n], params[n]) for n in params)
    w = mapped["layers.0.ffn.up.weight"]
    assert not w.flags.writeable and resident(w) > 0                     # read just now
    others = {n: resident(a) for n, a in mapped.items() if a is not w}
    assert w.nbytes - 2 * mmap.PAGESIZE < drop_pages([w]) <= w.nbytes and resident(w) == 0   # its whole pages
    assert {n: resident(a) for n, a in mapped.items() if a is not w} == others   # only w's pages went
    assert np.array_equal(w, params["layers.0.ffn.up.weight"]) and resident(w) > 0   # read back, the same
    assert drop_pages([params["layers.0.ffn.up.weight"]]) == 0           # an array in memory: left alone


def test_read_out_copies_a_mapped_tensor_without_mapping_its_pages(tmp_path):
    """Decoding an import reads its norms with read_out: the same values, a copy in memory, and none of the map's
    pages brought in (through the map, each small norm faulted in up to a 2 MiB folio of the file around it)."""
    base_dir, cfg = base_run(tmp_path, "euler")
    _, params = load_model(base_dir)
    mapped = map_tensors(base_dir / "model.safetensors", "weights")
    w = mapped["layers.0.ffn.up.weight"]
    drop_pages([w])
    assert resident(w) == 0
    got = read_out(w)
    assert resident(w) == 0 and file_map(got) is None and got.flags.writeable
    assert np.array_equal(got, params["layers.0.ffn.up.weight"]) and got.dtype == w.dtype and got.shape == w.shape
    assert all(np.array_equal(read_out(a), params[n]) for n, a in mapped.items())   # every size, 1-D norms too
    assert read_out(params["norm.weight"]) is params["norm.weight"]                 # in memory already: itself


def resident_bytes() -> int:
    """This process's memory (/proc/self/status VmRSS). Not [heap]'s alone: in a long process (the whole suite)
    the main arena may have grown by mmap where a mapping blocked its brk, outside [heap]."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) << 10


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "malloc_trim"), reason="glibc's malloc_trim")
def test_release_freed_memory_hands_the_heaps_free_pages_back():
    """Many small allocations freed, with every 16th kept (so the heap cannot shrink from its top): the allocator
    keeps the freed pages until release_freed_memory hands them back."""
    arrays = [np.ones(1024) for _ in range(8192)]                 # 64 MiB in 8 KB pieces (malloc's heap)
    kept = arrays[::16]
    del arrays
    before = resident_bytes()
    release_freed_memory()
    assert before - resident_bytes() > 32 << 20 and all(a[0] == 1 for a in kept)
