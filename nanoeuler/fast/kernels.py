"""Fused numba kernels of the fast engine: each one pass over rows, in place where it can be.

Every kernel here is the same mathematics as a reference op in `nanoeuler/ops/` (named in its docstring)
and is tested against it (tests/test_fast.py). Rules they all follow:

- Parallel over independent rows (`prange`); a thread never adds into memory another thread writes, and
  every sum runs in a fixed order inside one row, so results are bit-identical run to run, whatever the
  number of threads or their scheduling. Sums across rows (the weight gradient of RMSNorm) go to
  per-chunk partial rows that are added in a fixed order afterwards.
- Sums over a row accumulate in float64 with 8 interleaved accumulators (fixed order, and the
  float32 → float64 conversions vectorise); no `fastmath`, so every other operation rounds as written.
- dtype-generic: a float32 array gives float32 arithmetic (exp via `vexp`), float64 gives float64.

Shapes: N = B·T rows; d model width; F SwiGLU width; V vocabulary; hd head width (h2 = hd/2).
"""
import math
import os
import threading

import numba
import numpy as np
from numba import njit, prange

from .vmath import vexp

# numba's "workqueue" threads block instead of spinning between parallel regions: on a shared machine
# a step cost 20 % less CPU than with the OpenMP layer (measured, engine.py profile). It does not allow
# two threads to launch parallel kernels at once, so every entry point holds LOCK.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"
LOCK = threading.RLock()
SERIAL_BELOW = 1 << 16  # AdamW on smaller tensors runs serially: a parallel launch costs more than it saves

OPTS = dict(cache=True, nogil=True)
POPTS = dict(OPTS, parallel=True)


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
@njit(**POPTS)
def rmsnorm_forward(x, w, eps, y, r):
    """x [N, d], w [d] -> y [N, d] = x·r·w and r [N] = 1/sqrt(mean(x²) + eps), written into y and r."""
    N, d = x.shape
    for i in prange(N):
        ri = x.dtype.type(1.0 / math.sqrt(row_dot(x[i], x[i], d) / d + eps))
        r[i] = ri
        for j in range(d):
            y[i, j] = (x[i, j] * ri) * w[j]


@njit(**POPTS)
def rmsnorm_backward(dy, x, r, w, dx, dw_part):
    """dy, x [N, d], r [N], w [d] -> dx [N, d] += r·(g − n·mean(g·n)) with g = dy·w, n = x·r;
    dw_part [C, d]: row c holds Σ dy·n over the c-th chunk of rows (dw = dw_part.sum(0), a fixed order)."""
    N, d = x.shape
    C = dw_part.shape[0]
    rows = (N + C - 1) // C
    for c in prange(C):
        part = dw_part[c]
        part[:] = 0
        for i in range(c * rows, min(N, (c + 1) * rows)):
            ri = r[i]
            acc = 0.0
            for j in range(d):  # Σ (dy·w)·(x·r), accumulated in float64
                acc += (dy[i, j] * w[j]) * (x[i, j] * ri)
            m = x.dtype.type(acc / d)
            for j in range(d):
                n = x[i, j] * ri
                dx[i, j] += ri * (dy[i, j] * w[j] - n * m)
                part[j] += dy[i, j] * n


# ---- fused attention: RoPE + causal GQA attention, straight from / to the token rows --------------------
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
def _scores(q, kT, m, s):
    """s[j] = Σ_d q[d]·kT[d, j] for j < m, four d at a time (each pass over s does 8 flops per load/store)."""
    hd = q.shape[0]
    s[:m] = 0
    d = 0
    while d + 4 <= hd:
        q0, q1, q2, q3 = q[d], q[d + 1], q[d + 2], q[d + 3]
        k0, k1, k2, k3 = kT[d], kT[d + 1], kT[d + 2], kT[d + 3]
        for j in range(m):
            s[j] += (q0 * k0[j] + q1 * k1[j]) + (q2 * k2[j] + q3 * k3[j])
        d += 4
    while d < hd:
        q0, k0 = q[d], kT[d]
        for j in range(m):
            s[j] += q0 * k0[j]
        d += 1


@njit(**POPTS)
def attention_forward(qkv, cos, sin, qscale, n_heads, n_kv_heads, P, A):
    """Causal grouped-query attention with RoPE, from the rows of the stacked q/k/v projection.

    qkv [B·T, (H + 2·Hkv)·hd] (row n = token (b, t); per row: H q heads, Hkv k heads, Hkv v heads)
    -> P [B, H, T, T] softmax(q·kᵀ/√hd) with the future masked (0 above the diagonal; kept for backward),
       A [B·T, H·hd] = P·v with heads side by side (the input of wo).
    Parallel over (batch, kv head); q head h reads kv head h // (H / Hkv). Only keys j ≤ t are computed."""
    B, H, T, _ = P.shape
    Hkv = n_kv_heads
    G = H // Hkv
    hd = 2 * cos.shape[1]
    dt = P.dtype.type
    one = dt(1.0)
    for item in prange(B * Hkv):
        b, g = item // Hkv, item % Hkv
        kT = np.empty((hd, T), dtype=P.dtype)  # rotated keys, transposed: scores vectorise over keys
        v = np.empty((T, hd), dtype=P.dtype)
        q = np.empty(hd, dtype=P.dtype)
        kr = np.empty(hd, dtype=P.dtype)
        y = np.empty(hd, dtype=P.dtype)
        s = np.empty(T, dtype=P.dtype)
        for t in range(T):
            n = b * T + t
            _rotate_row(qkv[n], (H + g) * hd, hd, cos, sin, t, one, kr)
            for d in range(hd):
                kT[d, t] = kr[d]
                v[t, d] = qkv[n, (H + Hkv + g) * hd + d]
        for hh in range(G):
            h = g * G + hh
            for t in range(T):
                n = b * T + t
                _rotate_row(qkv[n], h * hd, hd, cos, sin, t, qscale, q)
                m = t + 1
                _scores(q, kT, m, s)
                mx = row_max(s, m)
                for j in range(m):
                    s[j] = vexp(s[j] - mx)
                tot = dt(row_sum(s, m))
                prow = P[b, h, t]
                for j in range(m):
                    s[j] = s[j] / tot
                    prow[j] = s[j]
                prow[m:] = 0
                y[:] = 0
                j = 0
                while j + 4 <= m:  # y = Σ_j p_j·v_j, four keys at a time
                    p0, p1, p2, p3 = s[j], s[j + 1], s[j + 2], s[j + 3]
                    v0, v1, v2, v3 = v[j], v[j + 1], v[j + 2], v[j + 3]
                    for d in range(hd):
                        y[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d])
                    j += 4
                while j < m:
                    p0, v0 = s[j], v[j]
                    for d in range(hd):
                        y[d] += p0 * v0[d]
                    j += 1
                A[n, h * hd:(h + 1) * hd] = y


@njit(**POPTS)
def attention_backward(qkv, cos, sin, qscale, n_kv_heads, P, dA, dqkv):
    """The backward of attention_forward: dA [B·T, H·hd] -> dqkv [B·T, (H + 2·Hkv)·hd] (every entry written).

    Per query row: dP = dy·vᵀ, dS = P ⊙ (dP − Σ dP⊙P), dq = dS·k, dk += dSᵀ·q, dv += Pᵀ·dy. Query rows go
    in blocks of 4 so each dk / dv row is loaded and stored once per block; dk and dv sum over the G
    query heads of their group inside one work item, in a fixed order (deterministic)."""
    B, H, T, _ = P.shape
    Hkv = n_kv_heads
    G = H // Hkv
    hd = 2 * cos.shape[1]
    dt = P.dtype.type
    one = dt(1.0)
    R = 4
    for item in prange(B * Hkv):
        b, g = item // Hkv, item % Hkv
        k = np.empty((T, hd), dtype=P.dtype)
        vT = np.empty((hd, T), dtype=P.dtype)
        dk = np.zeros((T, hd), dtype=P.dtype)
        dv = np.zeros((T, hd), dtype=P.dtype)
        q = np.zeros((R, hd), dtype=P.dtype)
        dy = np.zeros((R, hd), dtype=P.dtype)
        dq = np.empty((R, hd), dtype=P.dtype)
        ds = np.zeros((R, T), dtype=P.dtype)
        pr = np.zeros((R, T), dtype=P.dtype)
        for t in range(T):
            n = b * T + t
            _rotate_row(qkv[n], (H + g) * hd, hd, cos, sin, t, one, k[t])
            for d in range(hd):
                vT[d, t] = qkv[n, (H + Hkv + g) * hd + d]
        for hh in range(G):
            h = g * G + hh
            for t0 in range(0, T, R):
                rows = min(R, T - t0)
                mb = t0 + rows  # keys 0 .. mb-1 touch this block
                for r in range(R):
                    if r >= rows:  # past the end: a zero row contributes nothing
                        q[r, :] = 0
                        dy[r, :] = 0
                        ds[r, :mb] = 0
                        pr[r, :mb] = 0
                        continue
                    t = t0 + r
                    n = b * T + t
                    m = t + 1
                    _rotate_row(qkv[n], h * hd, hd, cos, sin, t, qscale, q[r])
                    dy[r, :] = dA[n, h * hd:(h + 1) * hd]
                    pr[r, :mb] = P[b, h, t, :mb]  # 0 beyond the diagonal
                    _scores(dy[r], vT, m, ds[r])   # dP = dy·vᵀ
                    a = dt(row_dot(ds[r], pr[r], m))
                    for j in range(m):
                        ds[r, j] = pr[r, j] * (ds[r, j] - a)
                    ds[r, m:mb] = 0
                q0, q1, q2, q3 = q[0], q[1], q[2], q[3]
                y0, y1, y2, y3 = dy[0], dy[1], dy[2], dy[3]
                dq[:, :] = 0
                dq0, dq1, dq2, dq3 = dq[0], dq[1], dq[2], dq[3]
                for j in range(mb):
                    s0, s1, s2, s3 = ds[0, j], ds[1, j], ds[2, j], ds[3, j]
                    p0, p1, p2, p3 = pr[0, j], pr[1, j], pr[2, j], pr[3, j]
                    kj, dkj, dvj = k[j], dk[j], dv[j]
                    for d in range(hd):
                        kd = kj[d]
                        dq0[d] += s0 * kd
                        dq1[d] += s1 * kd
                        dq2[d] += s2 * kd
                        dq3[d] += s3 * kd
                        dkj[d] += (s0 * q0[d] + s1 * q1[d]) + (s2 * q2[d] + s3 * q3[d])
                        dvj[d] += (p0 * y0[d] + p1 * y1[d]) + (p2 * y2[d] + p3 * y3[d])
                for r in range(rows):
                    t = t0 + r
                    _unrotate_row(dq[r], hd, cos, sin, t, qscale, dqkv[b * T + t], h * hd)
        for t in range(T):
            n = b * T + t
            _unrotate_row(dk[t], hd, cos, sin, t, one, dqkv[n], (H + g) * hd)
            for d in range(hd):
                dqkv[n, (H + Hkv + g) * hd + d] = dv[t, d]


# ---- SwiGLU (ops/swiglu.py) ---------------------------------------------------------------------------
@njit(**POPTS)
def swiglu_forward(gu, s):
    """gu [N, 2F] = [gate(x) | up(x)] -> s [N, F] = silu(g)·u, silu(g) = g·σ(g)."""
    N, F = s.shape
    one = s.dtype.type(1.0)
    for n in prange(N):
        for j in range(F):
            g = gu[n, j]
            s[n, j] = (g * (one / (one + vexp(-g)))) * gu[n, F + j]


@njit(**POPTS)
def swiglu_backward(ds, gu):
    """ds [N, F], gu [N, 2F] -> in place gu := [dg | du], dg = ds·u·σ·(1 + g·(1 − σ)), du = ds·g·σ."""
    N, F = ds.shape
    one = ds.dtype.type(1.0)
    for n in prange(N):
        for j in range(F):
            g, u, d = gu[n, j], gu[n, F + j], ds[n, j]
            sg = one / (one + vexp(-g))
            gu[n, j] = ((d * u) * sg) * (one + g * (one - sg))
            gu[n, F + j] = d * (g * sg)


# ---- cross-entropy (ops/cross_entropy.py) ---------------------------------------------------------------
@njit(**POPTS)
def cross_entropy(z, targets, scale, losses, grad):
    """z [N, V] logits, targets int [N] (−1 = no loss) -> losses [N] (float64, 0 on ignored rows); if grad,
    z is overwritten in place by dz = scale·(softmax(z) − onehot(target)) (0 on ignored rows)."""
    N, V = z.shape
    for i in prange(N):
        row = z[i]
        t = targets[i]
        if t < 0:
            losses[i] = 0.0
            if grad:
                row[:] = 0
            continue
        m = row_max(row, V)
        zt = row[t] - m
        for j in range(V):
            row[j] = vexp(row[j] - m)
        tot = row_sum(row, V)
        losses[i] = math.log(tot) - zt
        if grad:
            c = z.dtype.type(scale / tot)
            for j in range(V):
                row[j] = row[j] * c
            row[t] -= scale


# ---- embedding (ops/embedding.py) ---------------------------------------------------------------------------
@njit(**OPTS)
def embedding_backward(dx, ids, dW):
    """dx [N, d], ids int [N] -> dW [V, d] (zeroed, then rows of repeated ids accumulate in row order)."""
    dW[:] = 0
    N, d = dx.shape
    for n in range(N):
        r = ids[n]
        for j in range(d):
            dW[r, j] += dx[n, j]


# ---- AdamW (optim.py) ---------------------------------------------------------------------------------------
@njit(**POPTS)
def adamw_update(p, g, m, v, b1, c1, b2, c2, decay, bc2_sqrt, eps, step_size):
    """One AdamW step on flat arrays, rounding exactly as optim.AdamW's NumPy expressions do:
    m = m·b1 + c1·g;  v = v·b2 + c2·(g·g);  p = p·decay;  p = p − (step_size·m)/(sqrt(v)/bc2_sqrt + eps)
    (c1 = 1 − b1, c2 = 1 − b2, decay = 1 − lr·wd or 1, step_size = lr / (1 − b1ᵗ); all in p's dtype)."""
    for i in prange(p.shape[0]):
        gi = g[i]
        mi = m[i] * b1 + c1 * gi
        vi = v[i] * b2 + c2 * (gi * gi)
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * decay - (step_size * mi) / (np.sqrt(vi) / bc2_sqrt + eps)


@njit(**OPTS)
def adamw_update_serial(p, g, m, v, b1, c1, b2, c2, decay, bc2_sqrt, eps, step_size):
    """adamw_update on one thread (for small tensors), the same expressions."""
    for i in range(p.shape[0]):
        gi = g[i]
        mi = m[i] * b1 + c1 * gi
        vi = v[i] * b2 + c2 * (gi * gi)
        m[i] = mi
        v[i] = vi
        p[i] = p[i] * decay - (step_size * mi) / (np.sqrt(vi) / bc2_sqrt + eps)
