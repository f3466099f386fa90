"""`nanoeuler check --device gpu`: every kernel against the NumPy reference, then the whole model GPU vs CPU.

Each row compares a GPU result (float32, TF32 off) with the NumPy reference evaluated in float64 on
the very same float32 inputs, so the row measures the GPU's own error:

    rel = max |gpu − ref| / max |ref|          (over the whole tensor; TOLERANCE = 1e-5)

(The CPU check's per-entry relative error compares two float64 computations; float32 results are
judged against the tensor's scale instead, since entries near zero carry only round-off.)
bf16 rows compare against the reference run on the same bf16-rounded operands.

Also here, for scripts/gpu_check.sh: FlashAttention at long contexts against a float64 attention run
on the GPU (`check_flash_long`), and the memory of FlashAttention vs naive T×T attention (`flash_memory`).

Every kernel group, tensor-core case, FlashAttention length and part is its own section (`run_section`):
one that raises becomes a failing row `gpu <name>: ERROR <Type>: <message>`, printed at once, and the
next section runs, so one compile failure never hides the rest of a scarce device run.

    python -m nanoeuler.gpu.check                          # the rows of `nanoeuler check --device gpu`
    python -m nanoeuler.gpu.check --parts rows,tensor-core # scripts/gpu_check.sh quick
    python -m nanoeuler.gpu.check --long                   # every part: + round trip, T = 512..8192, memory
    python tests/gpu_emu/run.py -m nanoeuler.gpu.check --long --small   # the same on the CPU emulator
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .. import ops as ref
from ..training.check import CHECK_CONFIG, Row
from ..config import Config
from ..errors import UserError
from ..optim import AdamW
from .runtime import require_cupy

TOLERANCE = 1e-5


def rel_error(gpu, reference) -> float:
    """max |gpu − reference| / max |reference| (both to float64 on the host)."""
    cp = require_cupy()
    a = cp.asnumpy(gpu).astype(np.float64) if hasattr(gpu, "get") else np.asarray(gpu, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    assert a.shape == r.shape, (a.shape, r.shape)
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    return float(np.max(np.abs(a - r))) / max(scale, 1e-30) if r.size else 0.0


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 value (ties to even), as float32; the host twin of float_to_bf16.

        bf16_round(np.float32([1.00390625, 1.01171875])) -> [1.0, 1.015625]
    """
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (u.astype(np.uint32) << 16).view(np.float32)


def _row(name, gpu, reference) -> Row:
    return Row(f"gpu {name}", rel_error(gpu, reference), int(np.size(reference)))


# ---- guarded sections: one failure is one failing row, and the next section still runs ---------------
def describe(e: BaseException) -> str:
    """`<Type>: <first line of the message>`, short enough for one line."""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}{': ' + first if first else ''}"


def error_row(name: str, e: BaseException) -> Row:
    """A failing row that carries the error: `gpu <name>: ERROR <Type>: <first line>` (error = inf)."""
    return Row(f"gpu {name}: ERROR {describe(e)}", float("inf"), 0)


def run_section(name: str, fn) -> list[Row]:
    """fn() -> rows; an exception becomes one error row, printed to stderr at once (a later timeout
    must not swallow it), and the caller goes on with the next section."""
    try:
        return list(fn())
    except Exception as e:  # a compile error, a CUDA error, a shape bug: report it, keep checking
        row = error_row(name, e)
        print(f"error: {row.name[4:]}", file=sys.stderr, flush=True)
        return [row]


# ---- (a) kernels --------------------------------------------------------------------------------------
def kernel_sections(seed: int = 0) -> list[tuple[str, object]]:
    """(name, thunk -> rows) for every kernel group; each thunk draws from its own seeded generator, so
    one group failing (or being skipped) leaves the others' inputs unchanged."""
    cp = require_cupy()
    from .engine import GpuAdamW, gpu_ops
    from .matmul import from_bf16, set_tf32, to_bf16
    from .ops import GpuOps
    set_tf32(False)
    f64 = lambda x: np.asarray(x, dtype=np.float64)
    g = cp.asarray

    def gen(i):
        rng = np.random.default_rng([seed, i])
        return rng, (lambda *shape: rng.standard_normal(shape).astype(np.float32))

    def convert():  # bf16 conversion: bit-exact against the host rounding
        _, r32 = gen(0)
        x = np.concatenate([r32(1000) * 100, np.float32([0, -0.0, 1.00390625, 1.01171875, 3.0e38, 1e-40])])
        return [_row("convert fp32->bf16->fp32", from_bf16(to_bf16(g(x))), bf16_round(x))]

    def rmsnorm():  # d = 320: more than one pass of 256 threads
        _, r32 = gen(1)
        x, w, dy = r32(3, 7, 320), r32(320), r32(3, 7, 320)
        y_ref, c_ref = ref.rmsnorm_forward(f64(x), f64(w), 1e-5)
        dx_ref, dw_ref = ref.rmsnorm_backward(f64(dy), c_ref)
        ops32 = gpu_ops("f32")
        y, c = ops32.rmsnorm_forward(g(x), g(w), 1e-5)
        dx, dw = ops32.rmsnorm_backward(g(dy), c)
        return [_row("rmsnorm forward", y, y_ref), _row("rmsnorm backward dx", dx, dx_ref),
                _row("rmsnorm backward dw", dw, dw_ref)]

    def rope():
        _, r32 = gen(2)
        B, H, T, hd = 2, 3, 11, 16
        x, dy = r32(B, H, T, hd), r32(B, H, T, hd)
        cos, sin = ref.rope_tables(T, ref.inv_freq(hd, 10000.0), np.float64)
        y_ref, c_ref = ref.rope_forward(f64(x), cos, sin)
        ops32 = gpu_ops("f32")
        cg, sg = ops32.rope_tables(T, ref.inv_freq(hd, 10000.0), np.float32)
        y, c = ops32.rope_forward(g(x), cg, sg)
        return [_row("rope forward", y, y_ref),
                _row("rope backward", ops32.rope_backward(g(dy), c), ref.rope_backward(f64(dy), c_ref))]

    def swiglu():  # wide range of gate values: the sigmoid's tails
        _, r32 = gen(3)
        gg, u, dh = r32(5, 301) * 6, r32(5, 301), r32(5, 301)
        h_ref, c_ref = ref.swiglu_forward(f64(gg), f64(u))
        dg_ref, du_ref = ref.swiglu_backward(f64(dh), c_ref)
        ops32 = gpu_ops("f32")
        h, c = ops32.swiglu_forward(g(gg), g(u))
        dg, du = ops32.swiglu_backward(g(dh), c)
        return [_row("swiglu forward", h, h_ref), _row("swiglu backward dg", dg, dg_ref),
                _row("swiglu backward du", du, du_ref)]

    def cross_entropy():  # ignored rows; V = 1000: several passes per row
        rng, r32 = gen(4)
        z, t = r32(40, 1000) * 3, rng.integers(0, 1000, 40)
        t[::4] = -1
        loss_ref, c_ref = ref.cross_entropy_forward(f64(z), t)
        ops32 = gpu_ops("f32")
        loss, c = ops32.cross_entropy_forward(g(z), g(t))
        return [Row("gpu cross_entropy loss", abs(loss - loss_ref) / abs(loss_ref), 1),
                _row("cross_entropy dlogits", ops32.cross_entropy_backward(0.7, c), ref.cross_entropy_backward(0.7, c_ref))]

    def embedding():
        rng, r32 = gen(5)
        W, ids, dx = r32(50, 24), rng.integers(0, 50, (3, 9)), r32(3, 9, 24)
        ids[0, :3] = 7  # repeated ids must accumulate
        e_ref, c_ref = ref.embedding_forward(ids, f64(W))
        ops32 = gpu_ops("f32")
        e, c = ops32.embedding_forward(g(ids), g(W))
        return [_row("embedding forward", e, e_ref),
                _row("embedding backward", ops32.embedding_backward(g(dx), c), ref.embedding_backward(f64(dx), c_ref))]

    def linear():  # fp32 (exact fp32 cuBLAS) and bf16 (tensor cores, against the reference on rounded operands)
        _, r32 = gen(6)
        x, W, dy = r32(4, 33, 96), r32(80, 96), r32(4, 33, 80)
        y_ref, c_ref = ref.linear_forward(f64(x), f64(W))
        dx_ref, dW_ref = ref.linear_backward(f64(dy), c_ref)
        ops32, ops16 = gpu_ops("f32"), gpu_ops("bf16")
        y, c = ops32.linear_forward(g(x), g(W))
        dx, dW = ops32.linear_backward(g(dy), c)
        rows = [_row("linear fp32 forward", y, y_ref), _row("linear fp32 dx", dx, dx_ref), _row("linear fp32 dW", dW, dW_ref)]
        xb, Wb, dyb = (f64(bf16_round(a)) for a in (x, W, dy))
        y_ref, c_ref = ref.linear_forward(xb, Wb)
        dx_ref, dW_ref = ref.linear_backward(dyb, c_ref)
        y, c = ops16.linear_forward(g(x), g(W))
        dx, dW = ops16.linear_backward(g(dy), c)
        return rows + [_row("linear bf16 forward", y, y_ref), _row("linear bf16 dx", dx, dx_ref),
                       _row("linear bf16 dW", dW, dW_ref)]

    def attention(i, name, shape, bf16=False):
        def run():
            rng, _ = gen(i)
            gops = GpuOps("bf16", tensor_core_attention=False) if bf16 else gpu_ops("f32")
            return _attention_rows(name, rng, *shape, gops)
        return run

    def adamw():  # one fused step against optim.AdamW in float64 (matrix with decay, vector without)
        _, r32 = gen(7)
        shapes = {"w": (30, 20), "b": (20,)}
        p0 = {n: r32(*s) * 0.01 for n, s in shapes.items()}  # small |p|: its fp32 rounding stays far below a step
        grads = {n: r32(*s) for n, s in shapes.items()}
        ref_p = {n: f64(a).copy() for n, a in p0.items()}
        gpu_p = {n: g(a) for n, a in p0.items()}
        opt_ref, opt_gpu = AdamW(ref_p, lr=1e-2), GpuAdamW(gpu_p, lr=1e-2)
        for _ in range(3):
            opt_ref.step(ref_p, {n: f64(a) for n, a in grads.items()})
            opt_gpu.step(gpu_p, {n: g(a) for n, a in grads.items()})
        # judge the update p − p0 (the step is ~lr, far below |p|)
        return [_row(f"adamw update {n}", gpu_p[n] - g(p0[n]), ref_p[n] - f64(p0[n])) for n in shapes]

    # FlashAttention: GQA and MHA, ragged T (not a multiple of any tile), KV-cache decode (Tq < Tk), hd 16/64/128
    attention_cases = {"GQA T=77 hd=64": (2, 6, 2, 77, 77, 64), "MHA T=130 hd=16": (1, 3, 3, 130, 130, 16),
                       "GQA decode Tq=5 Tk=70 hd=64": (2, 4, 2, 5, 70, 64), "GQA T=45 hd=128": (1, 4, 1, 45, 45, 128)}
    sections = [("convert", convert), ("rmsnorm", rmsnorm), ("rope", rope), ("swiglu", swiglu),
                ("cross_entropy", cross_entropy), ("embedding", embedding), ("linear", linear)]
    sections += [(f"attention {name}", attention(10 + i, name, shape))
                 for i, (name, shape) in enumerate(attention_cases.items())]
    sections += [("attention bf16 GQA T=77 hd=64", attention(20, "bf16 GQA T=77 hd=64", (2, 6, 2, 77, 77, 64), True)),
                 ("adamw", adamw)]
    return sections


def check_kernels(seed: int = 0, on_rows=None) -> list[Row]:
    """Every kernel group vs the NumPy reference; a group that raises is one error row, and the rest run.
    `on_rows(rows)` is called after each group (to print as they come)."""
    rows: list[Row] = []
    for name, fn in kernel_sections(seed):
        got = run_section(name, fn)
        rows += got
        if on_rows:
            on_rows(got)
    return rows


def _attention_rows(name, rng, B, H, Hkv, Tq, Tk, hd, gops) -> list[Row]:
    """FlashAttention forward + backward vs the NumPy reference (float64, on the same—or bf16-rounded—inputs)."""
    cp = require_cupy()
    q = rng.standard_normal((B, H, Tq, hd)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Tk, hd)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Tk, hd)).astype(np.float32)
    dy = rng.standard_normal((B, H, Tq, hd)).astype(np.float32)
    cast = bf16_round if gops.bf16 else (lambda a: a)
    y_ref, c_ref = ref.attention_forward(*(cast(a).astype(np.float64) for a in (q, k, v)))
    dq_ref, dk_ref, dv_ref = ref.attention_backward(dy.astype(np.float64), c_ref)
    y, c = gops.attention_forward(cp.asarray(q), cp.asarray(k), cp.asarray(v))
    dq, dk, dv = gops.attention_backward(cp.asarray(dy), c)
    return [_row(f"attention {name} forward", y, y_ref), _row(f"attention {name} dq", dq, dq_ref),
            _row(f"attention {name} dk", dk, dk_ref), _row(f"attention {name} dv", dv, dv_ref)]


BF16_TOLERANCE = 2e-2  # tensor-core attention rounds P and dS to bf16 (8-bit mantissa) before its products


TENSOR_CORE_CASES = {  # name: (B, H, Hkv, Tq, Tk, hd)
    "GQA T=77 hd=64": (2, 6, 2, 77, 77, 64),
    "MHA T=130 hd=32": (1, 3, 3, 130, 130, 32),
    "GQA decode Tq=5 Tk=70 hd=64": (2, 4, 2, 5, 70, 64),
    "gpt shape T=512 hd=64": (1, 12, 4, 512, 512, 64),
}


def check_tensor_core_attention(seed: int = 0, cases: dict = TENSOR_CORE_CASES) -> list[Row]:
    """The WMMA FlashAttention (bf16 mode) vs the float64 reference on the same bf16-rounded q, k, v:
    judged with BF16_TOLERANCE, since P and dS are rounded to bf16 inside. Each case is its own section;
    where the kernels do not compile (`wmma_available`), each case is one failing row that says why."""
    from .ops import GpuOps, wmma_unavailable_reason
    ops = GpuOps("bf16", tensor_core_attention=True)
    rows = []
    for i, (name, (B, H, Hkv, Tq, Tk, hd)) in enumerate(cases.items()):
        def case(i=i, name=name, shape=(B, H, Hkv, Tq, Tk, hd)):
            hd = shape[-1]
            if ops.flash_kernel(hd) != "wmma":  # did not compile here: a failing row, never the fallback's numbers
                why = wmma_unavailable_reason(hd) or f"hd={hd} not supported"
                return [Row(f"gpu attention tensor-core {name}: kernels unavailable ({why[:200]})", float("inf"), 0)]
            return _attention_rows(f"tensor-core {name}", np.random.default_rng([seed, 30 + i]), *shape, ops)
        rows += run_section(f"attention tensor-core {name}", case)
    return rows


def check_bf16_outputs(seed: int = 0) -> list[Row]:
    """rope and swiglu with bf16 outputs (the bf16 mode) vs the float64 reference: within bf16 rounding."""
    cp = require_cupy()
    from .matmul import from_bf16
    from .ops import GpuOps
    rng = np.random.default_rng(seed)
    ops16 = GpuOps("bf16", tensor_core_attention=False)  # rope emits bf16 whenever attention reads bf16
    x = rng.standard_normal((2, 3, 11, 16)).astype(np.float32)
    cos, sin = ref.rope_tables(11, ref.inv_freq(16, 10000.0), np.float64)
    y, _ = ops16.rope_forward(cp.asarray(x), *ops16.rope_tables(11, ref.inv_freq(16, 10000.0), np.float32))
    g, u = (rng.standard_normal((5, 301)).astype(np.float32) * 3 for _ in range(2))
    h, _ = ops16.swiglu_forward(cp.asarray(g), cp.asarray(u))
    assert y.dtype == cp.uint16 and h.dtype == cp.uint16
    return [_row("rope bf16 output", from_bf16(y), ref.rope_forward(x.astype(np.float64), cos, sin)[0]),
            _row("swiglu bf16 output", from_bf16(h), ref.swiglu_forward(g.astype(np.float64), u)[0])]


# ---- (b) the whole model ------------------------------------------------------------------------------
MODEL_CHECK_CONFIG = Config(vocab_size=512, dim=256, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=96,
                            ffn_hidden=384, n_mtp=3)  # hd = 64, the gpt preset's head size


def check_model_gpu(seed: int = 0, config: Config = MODEL_CHECK_CONFIG, batch: int = 3) -> list[Row]:
    """Every parameter's gradient: GPU float32 (TF32 off) vs the CPU reference in float64, same float32 weights."""
    from ..model import Model
    from .engine import loss_and_grads, to_gpu
    from .matmul import set_tf32
    set_tf32(False)
    rng = np.random.default_rng(seed)
    cpu = Model.init(config, seed=seed, dtype=np.float32)
    for p in cpu.params.values():  # larger-than-init weights so every path carries a sizeable gradient
        p += (rng.standard_normal(p.shape) * (0.05 if p.ndim > 1 else 0.3)).astype(np.float32)
    tokens = rng.integers(0, config.vocab_size, (batch, config.ctx_len + config.n_mtp))
    mask = rng.random(tokens.shape) > 0.2
    head0_ref, obj_ref, grads_ref = cpu.astype(np.float64).loss_and_grads(tokens, mask, reference=True)
    head0, obj, grads = loss_and_grads(to_gpu(cpu), tokens, mask, precision="f32")
    rows = [Row("gpu model objective", abs(obj - obj_ref) / abs(obj_ref), 1),
            Row("gpu model head-0 loss", abs(head0 - head0_ref) / abs(head0_ref), 1)]
    return rows + [_row(f"model {name}", grads[name], grads_ref[name]) for name in cpu.params]


def _reference_loss(model, tokens) -> float:
    """The CPU's head-0 loss on the plain NumPy path (no numba JIT: its cache does not travel to a fresh
    device machine, and a cold compile of every kernel would land inside a timed step)."""
    return model.loss(tokens, reference=True)[0]


def check_train_roundtrip(steps: int = 30, seed: int = 0, out_dir=None, min_drop: float = 0.5,
                          config: Config | None = None) -> dict:
    """Train the small preset (or `config`) on the GPU (fp32, one fixed batch, GpuAdamW), save it, load it
    on the CPU: the loss must fall, and the CPU's loss of the saved checkpoint (reference path) must equal
    the GPU's."""
    import tempfile
    from pathlib import Path
    from ..config import PRESETS
    from ..model import Model
    from .engine import GpuModel
    from .matmul import set_tf32
    set_tf32(False)
    cfg = config or PRESETS["small"]
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (8, cfg.ctx_len + cfg.n_mtp))
    gm = GpuModel(Model.init(cfg, seed=seed), precision="f32")
    opt = gm.optimizer(gm.params, lr=3e-3)
    losses = []
    for _ in range(steps):
        head0, _, grads = gm.loss_and_grads(tokens)
        opt.step(gm.params, grads)
        losses.append(head0)
    gpu_loss = gm.loss(tokens)[0]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(out_dir or tmp) / "gpu_run"
        gm.save(run)
        cpu_loss = _reference_loss(Model.load(run), tokens)
    return {"first_loss": float(losses[0]), "last_loss": float(losses[-1]), "gpu_loss_after": float(gpu_loss),
            "cpu_loss_after": float(cpu_loss),
            "ok": bool(losses[-1] < losses[0] - min_drop and abs(gpu_loss - cpu_loss) < 1e-4 * abs(cpu_loss))}


def check_gpu(seed: int = 0, on_rows=None) -> list[Row]:
    """The rows of `nanoeuler check --device gpu`; raises UserError when CuPy or a device is missing.
    Every kernel group and the model check are independent sections (a failure is one error row)."""
    require_cupy()
    rows = check_kernels(seed, on_rows)
    model_rows = run_section("model gradients", lambda: check_model_gpu(seed))
    if on_rows:
        on_rows(model_rows)
    return rows + model_rows


# ---- long contexts and memory (scripts/gpu_check.sh) ----------------------------------------------------
def naive_attention(q, k, v, dy, xp):
    """Attention forward + backward with the whole T×T matrix, in q's dtype, on xp (numpy or cupy).

    The reference formulas of nanoeuler/ops/attention.py, one (batch, head) at a time when float64
    (the long-context reference), all heads at once otherwise (the memory comparison).
    Returns y, dq, dk, dv.
    """
    B, H, T, hd = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    scale = 1.0 / np.sqrt(hd)
    future = xp.triu(xp.ones((T, T), dtype=bool), k=1)
    kk = xp.repeat(k, G, axis=1)  # [B, H, T, hd]: kv head h // G for query head h
    vv = xp.repeat(v, G, axis=1)
    S = (q @ kk.swapaxes(-1, -2)) * scale  # [B, H, T, T]
    S = xp.where(future, -xp.inf, S)
    S -= S.max(axis=-1, keepdims=True)
    P = xp.exp(S)
    del S
    P /= P.sum(axis=-1, keepdims=True)
    y = P @ vv
    dvv = P.swapaxes(-1, -2) @ dy
    dP = dy @ vv.swapaxes(-1, -2)
    dS = P * (dP - xp.sum(dP * P, axis=-1, keepdims=True)) * scale
    del dP, P
    dq = dS @ kk
    dkk = dS.swapaxes(-1, -2) @ q
    del dS
    dk = dkk.reshape(B, Hkv, G, T, hd).sum(axis=2)
    dv = dvv.reshape(B, Hkv, G, T, hd).sum(axis=2)
    return y, dq, dk, dv


def flash_long_one(T: int, B=1, H=12, Hkv=4, hd=64, seed=0) -> dict:
    """FlashAttention (fp32) vs float64 attention at one T: rel errors of y, dq, dk, dv, and kernel times;
    then the tensor-core kernels on the same problem when they compile here (`wmma_available`), their own
    failure kept in "wmma_error" without losing the fp32 result."""
    cp = require_cupy()
    from .ops import flash_backward, flash_forward, wmma_available, wmma_supported, wmma_unavailable_reason
    rng = np.random.default_rng([seed, T])
    q, dy = (cp.asarray(rng.standard_normal((B, H, T, hd)), dtype=cp.float32) for _ in range(2))
    k, v = (cp.asarray(rng.standard_normal((B, Hkv, T, hd)), dtype=cp.float32) for _ in range(2))
    start, mid, end = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
    y, lse = flash_forward(q, k, v)  # compile / warm up both directions
    flash_backward(dy, q, k, v, y, lse)
    start.record()
    y, lse = flash_forward(q, k, v)
    mid.record()
    dq, dk, dv = flash_backward(dy, q, k, v, y, lse)
    end.record()
    end.synchronize()
    fwd_ms, bwd_ms = cp.cuda.get_elapsed_time(start, mid), cp.cuda.get_elapsed_time(mid, end)
    errs = {"y": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    refs = {n: [] for n in errs}
    for b in range(B):  # float64 reference, one kv group at a time to bound memory
        for hk in range(Hkv):
            hs = slice(hk * (H // Hkv), (hk + 1) * (H // Hkv))
            out = naive_attention(q[b:b + 1, hs].astype(cp.float64), k[b:b + 1, hk:hk + 1].astype(cp.float64),
                                  v[b:b + 1, hk:hk + 1].astype(cp.float64), dy[b:b + 1, hs].astype(cp.float64), cp)
            got = (y[b:b + 1, hs], dq[b:b + 1, hs], dk[b:b + 1, hk:hk + 1], dv[b:b + 1, hk:hk + 1])
            for n, o, r in zip(errs, got, out):
                refs[n].append((float(cp.abs(o.astype(cp.float64) - r).max()), float(cp.abs(r).max())))
    for n in errs:  # max |diff| over everything / max |ref| over everything
        errs[n] = max(d for d, _ in refs[n]) / max(m for _, m in refs[n])
    tc = {}
    if wmma_supported(hd):  # the bf16 tensor-core kernels on the same problem: time, and error vs fp32 kernels
        if not wmma_available(hd):
            tc = {"wmma_error": f"kernels unavailable ({wmma_unavailable_reason(hd)})"}
        else:
            try:
                from .matmul import to_bf16
                qb, kb, vb = to_bf16(q), to_bf16(k), to_bf16(v)
                yb, lb = flash_forward(qb, kb, vb, "wmma")
                flash_backward(dy, qb, kb, vb, yb, lb, "wmma")
                start.record()
                yb, lb = flash_forward(qb, kb, vb, "wmma")
                mid.record()
                dqb, _, _ = flash_backward(dy, qb, kb, vb, yb, lb, "wmma")
                end.record()
                end.synchronize()
                tc = {"wmma_fwd_ms": cp.cuda.get_elapsed_time(start, mid), "wmma_bwd_ms": cp.cuda.get_elapsed_time(mid, end),
                      "wmma_rel_y": float(cp.abs(yb - y).max() / cp.abs(y).max()),
                      "wmma_rel_dq": float(cp.abs(dqb - dq).max() / cp.abs(dq).max())}
            except Exception as e:
                tc = {"wmma_error": describe(e)}
    del q, k, v, dy, y, lse, dq, dk, dv
    cp.get_default_memory_pool().free_all_blocks()
    return {"T": T, "B": B, "H": H, "Hkv": Hkv, "hd": hd, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
            **{f"rel_{n}": e for n, e in errs.items()}, **tc}


def check_flash_long(Ts=(512, 2048, 8192), B=1, H=12, Hkv=4, hd=64, seed=0) -> list[dict]:
    """`flash_long_one` at each T; a T that raises (out of memory, a kernel error) is {"T": T, "error": ...}
    and the next T still runs."""
    results = []
    for T in Ts:
        try:
            results.append(flash_long_one(T, B, H, Hkv, hd, seed))
        except Exception as e:
            results.append({"T": T, "error": describe(e)})
    return results


def _peak_bytes(fn) -> tuple[int, float]:
    """(bytes the memory pool held at its peak while fn ran, ms), starting from an empty pool."""
    cp = require_cupy()
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    base = pool.total_bytes()
    peak = [base]
    orig_malloc = pool.malloc

    def malloc(size):  # the pool's held bytes only grow inside malloc: sample them there
        mem = orig_malloc(size)
        peak[0] = max(peak[0], pool.total_bytes())
        return mem

    cp.cuda.set_allocator(malloc)
    t0 = time.perf_counter()
    try:
        fn()
        cp.cuda.Device().synchronize()
    finally:
        cp.cuda.set_allocator(pool.malloc)
    ms = (time.perf_counter() - t0) * 1e3
    pool.free_all_blocks()
    return peak[0] - base, ms


def flash_memory(T=8192, B=1, H=12, Hkv=4, hd=64, seed=0) -> dict:
    """Peak GPU memory (and time) of one fp32 attention forward + backward: FlashAttention vs naive T×T."""
    cp = require_cupy()
    from .ops import flash_backward, flash_forward
    rng = np.random.default_rng(seed)
    q, dy = (cp.asarray(rng.standard_normal((B, H, T, hd)), dtype=cp.float32) for _ in range(2))
    k, v = (cp.asarray(rng.standard_normal((B, Hkv, T, hd)), dtype=cp.float32) for _ in range(2))
    inputs = 4 * (2 * B * H * T * hd + 2 * B * Hkv * T * hd)

    def flash():
        y, lse = flash_forward(q, k, v)
        flash_backward(dy, q, k, v, y, lse)

    def naive():
        naive_attention(q, k, v, dy, cp)

    flash()  # compile first
    naive_bytes, naive_ms = _peak_bytes(naive)
    flash_bytes, flash_ms = _peak_bytes(flash)
    return {"T": T, "B": B, "H": H, "Hkv": Hkv, "hd": hd, "input_bytes": inputs,
            "flash_peak_bytes": flash_bytes, "naive_peak_bytes": naive_bytes,
            "flash_ms": flash_ms, "naive_ms": naive_ms, "one_TxT_fp32_bytes": 4 * B * H * T * T}


PARTS = ("rows", "tensor-core", "roundtrip", "flash", "memory")
SMALL = {  # --small: shapes for the CPU emulator (tests/gpu_emu/run.py), where every CUDA thread is a fiber
    "model": Config(vocab_size=48, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx_len=20, ffn_hidden=40, n_mtp=2),
    "tensor_core": {"GQA ragged T=70 hd=32": (1, 4, 2, 70, 70, 32), "decode Tq=5 Tk=41 hd=16": (2, 2, 1, 5, 41, 16)},
    "roundtrip": Config(vocab_size=32, dim=32, n_heads=2, n_kv_heads=1, n_layers=1, ctx_len=8, ffn_hidden=32, n_mtp=2),
    "flash": {"Ts": (40, 72), "H": 4, "Hkv": 2, "hd": 32},
    "memory": {"T": 64, "H": 4, "Hkv": 2, "hd": 32},
}


def _print_rows(rows, tolerance, width=60):
    for r in rows:
        flag = "" if r.max_rel_error <= tolerance else "  FAIL"
        print(f"{r.name:<{width}}  {r.n_checked:>9}  {r.max_rel_error:.2e}{flag}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="GPU kernel and model checks against the NumPy reference. Every part, every kernel group "
                    "and every FlashAttention length is independent: a failure prints its error and the next runs.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default=None,
                   help=f"comma-separated parts to run, of {', '.join(PARTS)} (default rows; with --long all)")
    p.add_argument("--long", action="store_true", help="all parts: the rows, the tensor-core attention, the GPU->CPU "
                                                       "training round trip, FlashAttention at T=512/2048/8192, memory")
    p.add_argument("--no-rows", action="store_true", help="skip the kernel and model rows")
    p.add_argument("--small", action="store_true", help="tiny shapes (for a rehearsal on the CPU emulator)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",")] if args.parts else list(PARTS if args.long else ("rows",))
    if args.no_rows and "rows" in parts:
        parts.remove("rows")
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        print(f"error: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    try:
        require_cupy()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    say = (lambda *a, **k: None) if args.json else (lambda *a, **k: print(*a, **k, flush=True))
    show = (lambda rows, tol: None) if args.json else _print_rows
    ok = True
    out = {"parts": parts}

    if "rows" in parts:
        model_cfg = SMALL["model"] if args.small else MODEL_CHECK_CONFIG
        rows = check_kernels(args.seed, on_rows=lambda rs: show(rs, TOLERANCE))
        model_rows = run_section("model gradients", lambda: check_model_gpu(args.seed, model_cfg, 2 if args.small else 3))
        show(model_rows, TOLERANCE)
        rows += model_rows
        worst = max((r.max_rel_error for r in rows), default=0.0)
        ok &= worst <= TOLERANCE
        out.update(rows=[{"name": r.name, "rel_error": r.max_rel_error, "n": r.n_checked} for r in rows],
                   max_rel_error=worst, tolerance=TOLERANCE)
        say(f"max relative error: {worst:.2e} (tolerance {TOLERANCE:.0e})")

    if "tensor-core" in parts:
        tc_rows = check_tensor_core_attention(args.seed, SMALL["tensor_core"] if args.small else TENSOR_CORE_CASES)
        show(tc_rows, BF16_TOLERANCE)
        bf_rows = run_section("bf16 outputs", lambda: check_bf16_outputs(args.seed))
        show(bf_rows, BF16_TOLERANCE)
        tc_rows += bf_rows
        tc_worst = max(r.max_rel_error for r in tc_rows)
        ok &= tc_worst <= BF16_TOLERANCE
        out["tensor_core_rows"] = [{"name": r.name, "rel_error": r.max_rel_error} for r in tc_rows]
        say(f"bf16 kernels (tensor-core attention, bf16 outputs) max relative error: {tc_worst:.2e} "
            f"(bf16 tolerance {BF16_TOLERANCE:.0e})")

    if "roundtrip" in parts:
        try:
            rt = (check_train_roundtrip(steps=2, min_drop=0.0, config=SMALL["roundtrip"]) if args.small
                  else check_train_roundtrip())
            say(f"GPU training ({'tiny config, 2' if args.small else 'small preset, 30'} steps, one batch): loss "
                f"{rt['first_loss']:.4f} -> {rt['last_loss']:.4f}; saved and reloaded on the CPU (reference path): "
                f"GPU loss {rt['gpu_loss_after']:.6f}, CPU loss {rt['cpu_loss_after']:.6f}{'' if rt['ok'] else '  FAIL'}")
        except Exception as e:
            rt = {"ok": False, "error": describe(e)}
            print(f"error: GPU training round trip: {rt['error']}", file=sys.stderr, flush=True)
        ok &= rt["ok"]
        out["train_roundtrip"] = rt

    if "flash" in parts:
        shape = SMALL["flash"] if args.small else {"Ts": (512, 2048, 8192), "H": 12, "Hkv": 4, "hd": 64}
        out["flash_long"] = []
        for T in shape["Ts"]:  # one length at a time, printed as it finishes
            lr = check_flash_long((T,), H=shape["H"], Hkv=shape["Hkv"], hd=shape["hd"], seed=args.seed)[0]
            out["flash_long"].append(lr)
            if "error" in lr:
                ok = False
                say(f"flash T={T:>5}: ERROR {lr['error']}  FAIL")
                continue
            bad = max(lr[f"rel_{n}"] for n in ("y", "dq", "dk", "dv")) > TOLERANCE
            ok &= not bad
            say(f"flash T={lr['T']:>5} B={lr['B']} H={lr['H']}/{lr['Hkv']} hd={lr['hd']}: fwd {lr['fwd_ms']:.2f} ms, "
                f"bwd {lr['bwd_ms']:.2f} ms; rel err y {lr['rel_y']:.1e} dq {lr['rel_dq']:.1e} "
                f"dk {lr['rel_dk']:.1e} dv {lr['rel_dv']:.1e}{'  FAIL' if bad else ''}")
            if "wmma_fwd_ms" in lr:
                say(f"    tensor-core bf16 kernels: fwd {lr['wmma_fwd_ms']:.2f} ms, bwd {lr['wmma_bwd_ms']:.2f} ms; "
                    f"vs fp32 kernels: y {lr['wmma_rel_y']:.1e} dq {lr['wmma_rel_dq']:.1e} (bf16 inputs)")
            elif "wmma_error" in lr:
                ok = False
                say(f"    tensor-core bf16 kernels: ERROR {lr['wmma_error']}  FAIL")

    if "memory" in parts:
        shape = SMALL["memory"] if args.small else {"T": 8192, "H": 12, "Hkv": 4, "hd": 64}
        try:
            mem = flash_memory(**shape)
            say(f"memory at T={mem['T']} (fwd+bwd, fp32): flash peak {mem['flash_peak_bytes'] / 2**20:.1f} MiB "
                f"({mem['flash_ms']:.1f} ms) vs naive peak {mem['naive_peak_bytes'] / 2**20:.1f} MiB "
                f"({mem['naive_ms']:.1f} ms); one T×T fp32 matrix = {mem['one_TxT_fp32_bytes'] / 2**20:.0f} MiB")
        except Exception as e:
            mem = {"error": describe(e)}
            ok = False
            print(f"error: FlashAttention memory comparison: {mem['error']}", file=sys.stderr, flush=True)
        out["flash_memory"] = mem

    out["ok"] = bool(ok)
    if args.json:
        print(json.dumps(out, default=float))
    else:
        print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
