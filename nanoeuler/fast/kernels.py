"""Fused numba kernels of the fast engine: each one pass over rows, in place where it can be.

Every kernel here is the same mathematics as a reference op in `nanoeuler/ops/` (named in its docstring)
and is tested against it (tests/test_fast.py, tests/test_gpt2_fast.py). Rules they all follow:

- Serial and `nogil`: the engine parallelises over whole sub-batches, one per core, each thread calling
  these kernels on its own rows. Every sum runs in a fixed order, so results are bit-identical run to run.
- Sums over a row accumulate in float64 with 8 interleaved accumulators (fixed order, and the
  float32 → float64 conversions vectorise); no `fastmath`, so every other operation rounds as written.
- dtype-generic: a float32 array gives float32 arithmetic (exp via `vexp`), float64 gives float64.

GELU-tanh goes through the sigmoid: ½·x·(1 + tanh(u)) = x·σ(2u), and 1 − tanh²(u) = 4·σ(2u)·(1 − σ(2u)), so

    gelu(x) = x·s,   gelu'(x) = s + 2·x·s·(1 − s)·c·(1 + 3a·x²),   s = σ(2·c·(x + a·x³))

with vexp (vmath.py) for the exponential: no cancellation near 0 and no scalar tanh call.

Shapes: N = B·T rows; d model width; F the MLP's width; V vocabulary; hd head width (h2 = hd/2).
"""
import math

import numpy as np
from numba import njit

from ..ops import dropout
from ..ops.gelu import A as GELU_A
from ..ops.gelu import C as GELU_C
from ..ops.gelu_erf import INV_SQRT2 as GELU_INV_SQRT2
from ..ops.gelu_erf import INV_SQRT_2PI as GELU_INV_SQRT_2PI
from .vmath import vexp

OPTS = dict(cache=True, nogil=True, error_model="numpy")  # numpy: x/0 is inf, no check that blocks SIMD


# ---- row reductions (fixed order, float64) -------------------------------------------------------
@njit(**OPTS)
def row_sum(a, n):
    """Σ a[:n] in float64, eight interleaved partial sums.  row_sum(np.arange(10.), 10) == 45.0"""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    i = 0
    while i + 8 <= n:
        s0 += a[i]; s1 += a[i + 1]; s2 += a[i + 2]; s3 += a[i + 3]  # noqa: E702
        s4 += a[i + 4]; s5 += a[i + 5]; s6 += a[i + 6]; s7 += a[i + 7]  # noqa: E702
        i += 8
    while i < n:
        s0 += a[i]
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(**OPTS)
def row_dot(a, b, n):
    """Σ a[:n]·b[:n] (products rounded in the arrays' dtype), accumulated in float64."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    i = 0
    while i + 8 <= n:
        s0 += a[i] * b[i]; s1 += a[i + 1] * b[i + 1]; s2 += a[i + 2] * b[i + 2]  # noqa: E702
        s3 += a[i + 3] * b[i + 3]; s4 += a[i + 4] * b[i + 4]; s5 += a[i + 5] * b[i + 5]  # noqa: E702
        s6 += a[i + 6] * b[i + 6]; s7 += a[i + 7] * b[i + 7]  # noqa: E702
        i += 8
    while i < n:
        s0 += a[i] * b[i]
        i += 1
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(**OPTS)
def row_max(a, n):
    """max(a[:n]) (exact in any order; eight lanes so it vectorises)."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = a[0]
    i = 0
    while i + 8 <= n:
        m0 = max(m0, a[i]); m1 = max(m1, a[i + 1]); m2 = max(m2, a[i + 2]); m3 = max(m3, a[i + 3])  # noqa: E702
        m4 = max(m4, a[i + 4]); m5 = max(m5, a[i + 5]); m6 = max(m6, a[i + 6]); m7 = max(m7, a[i + 7])  # noqa: E702
        i += 8
    while i < n:
        m0 = max(m0, a[i])
        i += 1
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


# ---- RMSNorm (ops/rmsnorm.py) ----------------------------------------------------------------------
@njit(**OPTS)
def rmsnorm_forward(x, w, eps, y, r):
    """x [N, d], w [d] -> y [N, d] = x·r·w and r [N] = 1/sqrt(mean(x²) + eps), written into y and r."""
    N, d = x.shape
    for i in range(N):
        ri = x.dtype.type(1.0 / math.sqrt(row_dot(x[i], x[i], d) / d + eps))
        r[i] = ri
        for j in range(d):
            y[i, j] = (x[i, j] * ri) * w[j]


@njit(**OPTS)
def rmsnorm_backward(dy, x, r, w, dx, dw):
    """dy, x [N, d], r [N], w [d] -> dx [N, d] += r·(g − n·mean(g·n)) with g = dy·w, n = x·r;
    dw [d] (float64) = Σ over rows of dy·n, accumulated in row order."""
    N, d = x.shape
    dw[:] = 0
    for i in range(N):
        ri = r[i]
        acc = 0.0
        for j in range(d):  # Σ (dy·w)·(x·r), accumulated in float64
            acc += (dy[i, j] * w[j]) * (x[i, j] * ri)
        m = x.dtype.type(acc / d)
        for j in range(d):
            n = x[i, j] * ri
            dx[i, j] += ri * (dy[i, j] * w[j] - n * m)
            dw[j] += dy[i, j] * n


# ---- attention around BLAS: RoPE + head split in, causal softmax, heads back to rows -----------------------
# The four products of attention (q·kᵀ, P·v and backward's three) are batched BLAS matmuls in engine.py,
# over the full T×T square: twice the flops of the causal half, but dense products that BLAS runs at its full
# rate, which a loop that skips the masked half does not reach. These kernels do everything around them in one pass each.
# Layout: item i = (sequence b, kv head g) = b·Hkv + g; the G = H/Hkv query heads of a group are stacked,
# so q is [B·Hkv, G·T, hd] (row hh·T + t), k and v are [B·Hkv, T, hd], scores [B·Hkv, G·T, T].
@njit(**OPTS)
def _rotate_row(x, base, hd, cos, sin, t, scale, out):
    """out[:hd] = RoPE of x[base : base+hd] at position t, times scale (pair i with i + hd/2)."""
    h2 = hd // 2
    for i in range(h2):
        a, b = x[base + i], x[base + h2 + i]
        c, s = cos[t, i], sin[t, i]
        out[i] = (a * c - b * s) * scale
        out[h2 + i] = (b * c + a * s) * scale


@njit(**OPTS)
def _unrotate_row(g, hd, cos, sin, t, scale, out, base):
    """The transpose of _rotate_row: out[base : base+hd] = scale · RoPE⁻¹(g) (the same formula with sin negated)."""
    h2 = hd // 2
    for i in range(h2):
        a, b = g[i], g[h2 + i]
        c, s = cos[t, i], sin[t, i]
        out[base + i] = (a * c + b * s) * scale
        out[base + h2 + i] = (b * c - a * s) * scale


@njit(**OPTS)
def attention_split(qkv, cos, sin, qscale, n_kv_heads, q, k, v):
    """qkv [B·T, (H + 2·Hkv)·hd] rows (per row: H q heads, Hkv k heads, Hkv v heads) ->
    q [B·Hkv, G·T, hd] = RoPE(q)/√hd, k [B·Hkv, T, hd] = RoPE(k), v [B·Hkv, T, hd] (ops/rope.py, ops/attention.py)."""
    Hkv = n_kv_heads
    BH, T, hd = k.shape
    G = q.shape[1] // T
    H = G * Hkv
    one = k.dtype.type(1.0)
    for n in range(qkv.shape[0]):
        b, t = n // T, n % T
        row = qkv[n]
        for g in range(Hkv):
            i = b * Hkv + g
            for hh in range(G):
                _rotate_row(row, (g * G + hh) * hd, hd, cos, sin, t, qscale, q[i, hh * T + t])
            _rotate_row(row, (H + g) * hd, hd, cos, sin, t, one, k[i, t])
            v[i, t, :] = row[(H + Hkv + g) * hd:(H + Hkv + g + 1) * hd]


@njit(**OPTS)
def attention_join(dq, dk, dv, cos, sin, qscale, n_kv_heads, dqkv):
    """The transpose of attention_split: dq [B·Hkv, G·T, hd], dk, dv [B·Hkv, T, hd] -> dqkv rows
    [B·T, (H + 2·Hkv)·hd] (every entry written)."""
    Hkv = n_kv_heads
    BH, T, hd = dk.shape
    G = dq.shape[1] // T
    H = G * Hkv
    one = dk.dtype.type(1.0)
    for n in range(dqkv.shape[0]):
        b, t = n // T, n % T
        row = dqkv[n]
        for g in range(Hkv):
            i = b * Hkv + g
            for hh in range(G):
                _unrotate_row(dq[i, hh * T + t], hd, cos, sin, t, qscale, row, (g * G + hh) * hd)
            _unrotate_row(dk[i, t], hd, cos, sin, t, one, row, (H + g) * hd)
            row[(H + Hkv + g) * hd:(H + Hkv + g + 1) * hd] = dv[i, t]


@njit(**OPTS)
def heads_to_rows(y, n_kv_heads, A):
    """y [B·Hkv, G·T, hd] -> A [B·T, H·hd] (heads side by side; the input of wo). The transpose of rows_to_heads."""
    BH, GT, hd = y.shape
    Hkv = n_kv_heads
    T = A.shape[0] // (BH // Hkv)
    G = GT // T
    for i in range(BH):
        b, g = i // Hkv, i % Hkv
        for hh in range(G):
            h = g * G + hh
            for t in range(T):
                A[b * T + t, h * hd:(h + 1) * hd] = y[i, hh * T + t]


@njit(**OPTS)
def rows_to_heads(A, n_kv_heads, y):
    """A [B·T, H·hd] -> y [B·Hkv, G·T, hd] (the gradient of the attention output, per head)."""
    BH, GT, hd = y.shape
    Hkv = n_kv_heads
    T = A.shape[0] // (BH // Hkv)
    G = GT // T
    for i in range(BH):
        b, g = i // Hkv, i % Hkv
        for hh in range(G):
            h = g * G + hh
            for t in range(T):
                y[i, hh * T + t] = A[b * T + t, h * hd:(h + 1) * hd]


@njit(inline="always", **OPTS)
def _keys(r, T, window):
    """The keys row r of a [G·T, T] score block sees: j0 .. m-1 (position t = r mod T: 0 .. t, or with a
    window W > 0 the last W of them).  _keys(5, 4, 0) -> (0, 2); _keys(3, 4, 2) -> (2, 4)"""
    m = r % T + 1
    return (max(0, m - window) if window > 0 else 0), m


@njit(inline="always", **OPTS)
def _softcap(x, n, cap, t):
    """x[:n] := cap·tanh(x / cap) (ops/softcap.py), the tanh kept in t[:n] (for the backward's 1 − t²)."""
    for j in range(n):
        t[j] = math.tanh(x[j] / cap)
        x[j] = t[j] * cap


@njit(**OPTS)
def causal_softmax(S, T, window, cap):
    """S [I, G·T, T] scores -> in place P = softmax over the keys each row sees (`_keys`), 0 elsewhere; the
    scores soft-capped first where cap > 0 (Gemma 2)."""
    I, R, _ = S.shape
    c = S.dtype.type(cap)
    t = np.empty(T if cap else 0, S.dtype)
    for i in range(I):
        for r in range(R):
            row = S[i, r]
            j0, m = _keys(r, T, window)
            seen, n = row[j0:m], m - j0  # (loops from 0: numba then drops its negative-index check and vectorizes)
            if cap:
                _softcap(seen, n, c, t)
            mx = row_max(seen, n)
            for j in range(n):
                seen[j] = vexp(seen[j] - mx)
            tot = row.dtype.type(row_sum(seen, n))
            for j in range(n):
                seen[j] = seen[j] / tot
            row[:j0] = 0
            row[m:] = 0


@njit(**OPTS)
def causal_softmax_backward(P, dP, T, window):
    """P, dP [I, G·T, T] -> in place dS = P ⊙ (dP − Σ_j dP⊙P) on the keys each row sees, 0 elsewhere
    (ops/attention.py)."""
    I, R, _ = P.shape
    for i in range(I):
        for r in range(R):
            j0, m = _keys(r, T, window)
            p, d, n = P[i, r, j0:m], dP[i, r, j0:m], m - j0
            a = d.dtype.type(row_dot(d, p, n))
            for j in range(n):
                d[j] = p[j] * (d[j] - a)
            dP[i, r, :j0] = 0
            dP[i, r, m:] = 0


@njit(**OPTS)
def softcap_backward(dS, C, T, window, cap):
    """dS [I, G·T, T] (the gradient of the capped scores) *= 1 − tanh²(C / cap) on the keys each row sees, C
    (like dS) the scores before the cap: the gradient of the raw scores (ops/softcap.py)."""
    I, R, _ = dS.shape
    c = dS.dtype.type(cap)
    for i in range(I):
        for r in range(R):
            j0, m = _keys(r, T, window)
            for j in range(j0, m):
                t = math.tanh(C[i, r, j] / c)
                dS[i, r, j] *= 1 - t * t


# ---- q/k norms: RMSNorm of each head of q and k, in place on the projected rows (Gemma 3) ----------------
@njit(**OPTS)
def qk_norm_forward(qkv, heads, hd, wq, wk, n_q, eps, raw, r):
    """The first `heads` heads of each row of qkv [N, ≥ heads·hd] (q's n_q heads, then k's) := their RMSNorm
    with weight wq [hd] (q) or wk [hd] (k), in place; raw [N, heads·hd] keeps the input, r [N, heads] 1/rms."""
    N = qkv.shape[0]
    for n in range(N):
        row = qkv[n]
        raw[n] = row[:heads * hd]
        for h in range(heads):
            x = row[h * hd:(h + 1) * hd]
            ri = x.dtype.type(1.0 / math.sqrt(row_dot(x, x, hd) / hd + eps))
            r[n, h] = ri
            w = wq if h < n_q else wk
            for j in range(hd):
                x[j] = (x[j] * ri) * w[j]


@njit(**OPTS)
def qk_norm_backward(dqkv, heads, hd, wq, wk, n_q, raw, r, dwq, dwk):
    """The transpose of qk_norm_forward on dqkv's first heads·hd columns (in place: dy -> dx, rmsnorm_backward
    per head); dwq, dwk [hd] (float64) = Σ over rows and heads of dy·n, accumulated in row order."""
    N = dqkv.shape[0]
    dwq[:] = 0
    dwk[:] = 0
    for n in range(N):
        for h in range(heads):
            dy, x = dqkv[n, h * hd:(h + 1) * hd], raw[n, h * hd:(h + 1) * hd]
            ri = r[n, h]
            w, dw = (wq, dwq) if h < n_q else (wk, dwk)
            acc = 0.0
            for j in range(hd):
                acc += (dy[j] * w[j]) * (x[j] * ri)
            m = x.dtype.type(acc / hd)
            for j in range(hd):
                nj = x[j] * ri
                dw[j] += dy[j] * nj
                dy[j] = ri * (dy[j] * w[j] - nj * m)


@njit(**OPTS)
def span_norm_forward(qkv, c0, c1, w, eps, raw, r):
    """Columns c0 .. c1-1 of each row of qkv [N, ...] := their RMSNorm with weight w [c1 - c0], in place (a whole q
    or k projection's norm, OLMo 2's); raw [N, >= c1] keeps those input columns, r [N] the 1/rms."""
    n = c1 - c0
    for i in range(qkv.shape[0]):
        x = qkv[i, c0:c1]
        raw[i, c0:c1] = x
        ri = x.dtype.type(1.0 / math.sqrt(row_dot(x, x, n) / n + eps))
        r[i] = ri
        for j in range(n):
            x[j] = (x[j] * ri) * w[j]


@njit(**OPTS)
def span_norm_backward(dqkv, c0, c1, w, raw, r, dw):
    """The transpose of span_norm_forward on columns c0 .. c1-1 of dqkv (in place: dy -> dx); dw [c1 - c0]
    (float64) = Σ over rows of dy·n, accumulated in row order."""
    n = c1 - c0
    dw[:] = 0
    for i in range(dqkv.shape[0]):
        dy, x, ri = dqkv[i, c0:c1], raw[i, c0:c1], r[i]
        acc = 0.0
        for j in range(n):
            acc += (dy[j] * w[j]) * (x[j] * ri)
        m = x.dtype.type(acc / n)
        for j in range(n):
            nj = x[j] * ri
            dw[j] += dy[j] * nj
            dy[j] = ri * (dy[j] * w[j] - nj * m)


# ---- SwiGLU (ops/swiglu.py) ---------------------------------------------------------------------------
@njit(**OPTS)
def swiglu_forward(gu, s):
    """gu [N, 2F] = [gate(x) | up(x)] -> s [N, F] = silu(g)·u, silu(g) = g·σ(g)."""
    N, F = s.shape
    one = s.dtype.type(1.0)
    for n in range(N):
        for j in range(F):
            g = gu[n, j]
            s[n, j] = (g * (one / (one + vexp(-g)))) * gu[n, F + j]


@njit(**OPTS)
def swiglu_backward(ds, gu):
    """ds [N, F], gu [N, 2F] -> in place gu := [dg | du], dg = ds·u·σ·(1 + g·(1 − σ)), du = ds·g·σ."""
    N, F = ds.shape
    one = ds.dtype.type(1.0)
    for n in range(N):
        for j in range(F):
            g, u, d = gu[n, j], gu[n, F + j], ds[n, j]
            sg = one / (one + vexp(-g))
            gu[n, j] = ((d * u) * sg) * (one + g * (one - sg))
            gu[n, F + j] = d * (g * sg)


# ---- GeGLU (ops/geglu.py): gelu_tanh(g)·u ---------------------------------------------------------------
@njit(**OPTS)
def geglu_forward(gu, s):
    """gu [N, 2F] = [gate(x) | up(x)] -> s [N, F] = gelu(g)·u."""
    N, F = s.shape
    one, two = s.dtype.type(1.0), s.dtype.type(2.0)
    c, a = s.dtype.type(GELU_C), s.dtype.type(GELU_A)
    for n in range(N):
        for j in range(F):
            x = gu[n, j]
            sg = one / (one + vexp(-two * (c * (x + a * (x * x * x)))))
            s[n, j] = (x * sg) * gu[n, F + j]


@njit(**OPTS)
def geglu_backward(ds, gu):
    """ds [N, F], gu [N, 2F] -> in place gu := [dg | du], dg = ds·u·gelu'(g), du = ds·gelu(g) (gelu' as in
    gelu_backward below)."""
    N, F = ds.shape
    one, two, three = ds.dtype.type(1.0), ds.dtype.type(2.0), ds.dtype.type(3.0)
    c, a = ds.dtype.type(GELU_C), ds.dtype.type(GELU_A)
    for n in range(N):
        for j in range(F):
            x, u, d = gu[n, j], gu[n, F + j], ds[n, j]
            sg = one / (one + vexp(-two * (c * (x + a * (x * x * x)))))
            gu[n, j] = (d * u) * (sg + ((two * x) * (sg * (one - sg))) * (c * (one + three * a * (x * x))))
            gu[n, F + j] = d * (x * sg)


# ---- LayerNorm, GELU, biases and learned positions (arch gpt2) ------------------------------------------------
@njit(**OPTS)
def layernorm_forward(x, w, b, eps, y, mu, r):
    """ops/layernorm.py. x [N, d], w, b [d] -> y [N, d] = (x − μ)·r·w + b; μ [N], r [N] = 1/sqrt(var + eps)."""
    N, d = x.shape
    for i in range(N):
        m = x.dtype.type(row_sum(x[i], d) / d)
        acc = 0.0
        for j in range(d):  # Σ (x − μ)², in float64
            c = x[i, j] - m
            acc += c * c
        ri = x.dtype.type(1.0 / math.sqrt(acc / d + eps))
        mu[i] = m
        r[i] = ri
        for j in range(d):
            y[i, j] = ((x[i, j] - m) * ri) * w[j] + b[j]


@njit(**OPTS)
def layernorm_backward(dy, x, mu, r, w, dx, dw, db):
    """dy, x [N, d], μ, r [N], w [d] -> dx [N, d] += r·(g − mean(g) − n·mean(g·n)) with g = dy·w,
    n = (x − μ)·r; dw, db [d] (float64) = Σ over rows of dy·n and dy, accumulated in row order."""
    N, d = x.shape
    dw[:] = 0
    db[:] = 0
    for i in range(N):
        m, ri = mu[i], r[i]
        sg = 0.0
        sgn = 0.0
        for j in range(d):
            g = dy[i, j] * w[j]
            sg += g
            sgn += g * ((x[i, j] - m) * ri)
        mg = x.dtype.type(sg / d)
        mgn = x.dtype.type(sgn / d)
        for j in range(d):
            n = (x[i, j] - m) * ri
            dx[i, j] += ri * ((dy[i, j] * w[j] - mg) - n * mgn)
            dw[j] += dy[i, j] * n
            db[j] += dy[i, j]


@njit(**OPTS)
def bias_gelu_forward(f, b, s, exact=False):
    """ops/bias.py + ops/gelu.py (exact: ops/gelu_erf.py). f [N, F] := f + b (the pre-activation, kept for
    backward); s [N, F] = gelu(f)."""
    N, F = f.shape
    one, two, half = s.dtype.type(1.0), s.dtype.type(2.0), s.dtype.type(0.5)
    c, a, r2 = s.dtype.type(GELU_C), s.dtype.type(GELU_A), s.dtype.type(GELU_INV_SQRT2)
    for n in range(N):
        for j in range(F):
            x = f[n, j] + b[j]
            f[n, j] = x
            if exact:
                s[n, j] = x * (half * (one + math.erf(x * r2)))
            else:
                s[n, j] = x * (one / (one + vexp(-two * (c * (x + a * (x * x * x))))))


@njit(**OPTS)
def gelu_backward(ds, f, exact=False):
    """ds, f [N, F] -> in place ds := ds · gelu'(f) (exact: Φ(f) + f·φ(f), ops/gelu_erf.py)."""
    N, F = f.shape
    one, two, three, half = f.dtype.type(1.0), f.dtype.type(2.0), f.dtype.type(3.0), f.dtype.type(0.5)
    c, a = f.dtype.type(GELU_C), f.dtype.type(GELU_A)
    r2, r2pi = f.dtype.type(GELU_INV_SQRT2), f.dtype.type(GELU_INV_SQRT_2PI)
    for n in range(N):
        for j in range(F):
            x = f[n, j]
            if exact:
                ds[n, j] = ds[n, j] * (half * (one + math.erf(x * r2)) + x * (r2pi * math.exp(-half * (x * x))))
            else:
                sg = one / (one + vexp(-two * (c * (x + a * (x * x * x)))))
                ds[n, j] = ds[n, j] * (sg + ((two * x) * (sg * (one - sg))) * (c * (one + three * a * (x * x))))


@njit(**OPTS)
def col_sum(a, out):
    """a [N, n] -> out [n] (float64) = Σ over rows, in row order: a bias gradient."""
    N, n = a.shape
    out[:] = 0
    for i in range(N):
        for j in range(n):
            out[j] += a[i, j]


@njit(**OPTS)
def add_positions(x, pos, T):
    """x [b·T, d] += pos[t] on row s·T + t (every sequence of the part starts at position 0)."""
    N, d = x.shape
    for i in range(N):
        t = i % T
        for j in range(d):
            x[i, j] += pos[t, j]


@njit(**OPTS)
def position_backward(dx, T, dW):
    """dx [b·T, d] -> dW [ctx, d]: rows 0..T-1 = Σ over the sequences of dx at that position; the rest 0."""
    N, d = dx.shape
    dW[:] = 0
    for i in range(N):
        t = i % T
        for j in range(d):
            dW[t, j] += dx[i, j]


# ---- dropout on the residual branches (ops/dropout.py) ---------------------------------------------------
GAMMA, MIX1, MIX2 = np.uint64(dropout.GAMMA), np.uint64(dropout.MIX1), np.uint64(dropout.MIX2)
HASH_SHIFT = np.uint64(64 - dropout.THRESHOLD_BITS)


@njit(**OPTS)
def _kept(z, threshold):
    """splitmix64's output for state z, top 24 bits >= threshold."""
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    z = z ^ (z >> np.uint64(31))
    return (z >> HASH_SHIFT) >= threshold


@njit(**OPTS)
def dropout_add(x, t, base, threshold, scale, out):
    """out = x + t · mask [n, d]; element l of these rows keeps iff _kept(base + l·γ) (Dropout.base)."""
    n, d = t.shape
    for r in range(n):
        for c in range(d):
            z = base + np.uint64(r * d + c) * GAMMA
            out[r, c] = x[r, c] + t[r, c] * scale if _kept(z, threshold) else x[r, c]


@njit(**OPTS)
def dropout_scale(g, base, threshold, scale, out):
    """out = g · mask [n, d] (the backward of dropout_add's branch), same mask as dropout_add."""
    n, d = g.shape
    for r in range(n):
        for c in range(d):
            z = base + np.uint64(r * d + c) * GAMMA
            out[r, c] = g[r, c] * scale if _kept(z, threshold) else 0.0


# ---- cross-entropy (ops/cross_entropy.py) ---------------------------------------------------------------
@njit(**OPTS)
def cross_entropy(z, targets, scales, losses, grad, cap):
    """z [N, V] logits, targets int [N] (−1 = no loss) -> losses [N] (float64, 0 on ignored rows); if grad,
    z is overwritten in place by dz = scales[i]·(softmax(z) − onehot(target)) on row i (0 on ignored rows).
    cap > 0: the logits are soft-capped first (Gemma 2; ops/softcap.py), and dz is the raw logits' gradient."""
    N, V = z.shape
    c = z.dtype.type(cap)
    th = np.empty(V if cap else 0, z.dtype)   # a row's tanh(z / cap)
    for i in range(N):
        row = z[i]
        t = targets[i]
        if t < 0:
            losses[i] = 0.0
            if grad:
                row[:] = 0
            continue
        if cap:
            _softcap(row, V, c, th)
        m = row_max(row, V)
        zt = row[t] - m
        for j in range(V):
            row[j] = vexp(row[j] - m)
        tot = row_sum(row, V)
        losses[i] = math.log(tot) - zt
        if grad:
            scale = scales[i]
            k = z.dtype.type(scale / tot)
            for j in range(V):
                row[j] = row[j] * k
            row[t] -= scale
            if cap:
                for j in range(V):
                    row[j] *= 1 - th[j] * th[j]


# ---- embedding (ops/embedding.py) ---------------------------------------------------------------------------
@njit(**OPTS)
def embedding_backward_add(dx, ids, dW):
    """dx [N, d], ids int [N] -> dW [V, d] += dx rows, repeated ids in row order (a tied head's share may
    already be in dW)."""
    N, d = dx.shape
    for n in range(N):
        r = ids[n]
        for j in range(d):
            dW[r, j] += dx[n, j]


@njit(**OPTS)
def embedding_backward(dx, ids, dW):
    """dx [N, d], ids int [N] -> dW [V, d] (zeroed, then rows of repeated ids accumulate in row order)."""
    dW[:] = 0
    embedding_backward_add(dx, ids, dW)


# ---- AdamW (optim.py) ---------------------------------------------------------------------------------------
@njit(**OPTS)
def adamw_update(p, g, m, v, b1, c1, b2, c2, decay, bc2_sqrt, eps, step_size):
    """One AdamW step on flat arrays, rounding exactly as optim.AdamW's NumPy expressions do:
    m = m·b1 + c1·g;  v = v·b2 + c2·(g·g);  p = p·decay;  p = p − (step_size·m)/(sqrt(v)/bc2_sqrt + eps)
    (c1 = 1 − b1, c2 = 1 − b2, decay = 1 − lr·wd or 1, step_size = lr / (1 − b1ᵗ); all in p's dtype)."""
    for i in range(p.shape[0]):
        gi = g[i]
        mi = m[i] * b1 + c1 * gi
        vi = v[i] * b2 + c2 * (gi * gi)
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * decay - (step_size * mi) / (np.sqrt(vi) / bc2_sqrt + eps)

