"""Weight forms: the weight types a decoding step reads, and the matrix products of its few rows.

How the decoding step reads each weight type (a row of quant.WTYPES, which names its kernel) is a KernelForm
made from that row, chosen by the dtype of the model's parameters (quant.of_dtype: the dtype carries the name):

    name     parameters   the NumPy reference computes with    the kernels read (gemv.pack of)
    float32  float32      the float32 values                   the float32 values
    float16  float16      their float32 values (exact)         the IEEE half bits (uint16), widened in the kernel
    q8_0  GGUF blocks  their dequantized values (quant.py)  the blocks' integers (qkernels.pack), in integers
    q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k   (the parameters: records of one block's bytes, [out, in / block],
                       dtype np.dtype([("q8_0", "V34")]), ...: quant.WTYPES[name].dtype)

A new type is a new row (its dequantize, its unpack) and, in qkernels.py, a kernel kind that reads its form.

Other dtypes (float64: tests, the finite-difference world) have no entry: they run the NumPy reference only.
Each matrix of the inference layout is a triple (W [out, in] as the reference computes with it, W.T made
contiguous [in, out] or None, W in kernel form or None): `Forms.pair` makes it, `linear` (a step's 1..8
rows) and `batched_linear` (a batch's n rows) multiply by it. A model the kernels run keeps, as the first
element, its parameters themselves (a tuple of raw parts, stacked along the outputs), which `values`
widens / dequantizes when the NumPy path needs them (prompts scored at every position): besides its
parameters it holds their kernel form and no float32 copy of its matrices (bench/decode_memory.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import ops
from ..errors import UserError
from . import float16, gemv, kernels, qkernels, quant


@dataclass(frozen=True)
class KernelForm:
    """How decoding reads one weight type: the parameters' dtype that selects it, the float32 values the NumPy
    reference computes with, its kernel form: `pack(W [..., out, in], out=None)`, `packed(shape)` -> (the kernel
    form's shape, dtype), so that all of a model's matrices can share one buffer (forward.fuse_weights), and
    `kind`, the kernels' number for it (gemv.form_kind)."""
    name: str
    dtype: np.dtype
    values: Callable[[np.ndarray], np.ndarray]
    pack: Callable[..., np.ndarray]
    packed: Callable[[tuple], tuple]
    kind: int


def _block_form(t: quant.WType) -> KernelForm:
    """A GGUF block type: parameters [..., out, in / block] of records of one block's bytes (quant.py)."""
    def values(a: np.ndarray) -> np.ndarray:  # (the norms stay float32)
        return a if a.dtype.kind == "f" else t.dequantize(a.view(np.uint8), a.shape[-1] * t.block)

    def pack(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return qkernels.pack(a.view(np.uint8), t.name, a.shape[-1] * t.block, out)

    def packed(shape: tuple) -> tuple:
        return ((*shape[:-2], -(-shape[-2] // qkernels.PANEL), shape[-1], qkernels.STRIDES[t.kind]),
                np.dtype(np.uint8))

    return KernelForm(t.name, t.dtype, values, pack, packed, t.kind)


FLOAT_FORMS = {  # the float types' forms (float16: its bits packed, widened in the kernel)
    "float32": lambda t: KernelForm(t.name, t.dtype, lambda a: a, gemv.pack,
                                    lambda shape: (gemv.packed_shape(shape), np.dtype(np.float32)), t.kind),
    "float16": lambda t: KernelForm(t.name, t.dtype, float16.widen,
                                    lambda a, out=None: gemv.pack(a.view(np.uint16), out),
                                    lambda shape: (gemv.packed_shape(shape), np.dtype(np.uint16)), t.kind),
}


@functools.cache
def _form(t: quant.WType) -> KernelForm:
    return FLOAT_FORMS[t.name](t) if t.block == 1 else _block_form(t)


def of_dtype(dtype: np.dtype) -> KernelForm | None:
    """How decoding reads parameters of this dtype: their type's form, or None (a type without a kernel, or no
    weight type: float64)."""
    t = quant.of_dtype(dtype)
    return None if t is None or t.kind is None else _form(t)


def values(W) -> np.ndarray:
    """The float values a matrix computes with on the NumPy path: W itself (an array of them), or, for the
    raw parts Forms.pair keeps of a model the kernels run, the parts widened / dequantized and stacked on each
    use (such a model holds no second float32 copy of its matrices).

        values((np.ones((2, 32), np.float16), np.zeros((1, 32), np.float16))).shape -> (3, 32), float32"""
    if isinstance(W, np.ndarray):
        return W
    parts = [of_dtype(p.dtype).values(np.asarray(p)) for p in W]   # (a checkpoint.Reordered's rows copied)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def n_out(W) -> int:
    """The output width of a matrix (Forms.pair's first element: values, or raw parts)."""
    return W.shape[0] if isinstance(W, np.ndarray) else sum(p.shape[0] for p in W)


NARROW = 1024  # output width up to which a [in, out] copy of W is kept for few-row products


class Forms:
    """How one model's matrices are held: each in its own weight type (by its dtype: a file's may mix them),
    whether the fused kernels run the model (kernels.ENABLED and a weight type for every matrix), and whether
    [in, out] copies are kept for many rows too (`batched`: the batcher reads more rows than the kernels take)."""

    def __init__(self, P: dict, batched: bool = False):
        self.kernels = kernels.ENABLED and all(of_dtype(p.dtype) is not None for p in P.values() if p.ndim == 2)
        self.batched = batched

    def values(self, a: np.ndarray) -> np.ndarray:
        """The values the NumPy path computes with (float16 widened to float32, blocks dequantized)."""
        t = of_dtype(a.dtype)
        return a if t is None else t.values(np.asarray(a))

    def kernel_form(self, a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
        """a as the fused kernels read it (its weight type's pack), or None without kernels."""
        return of_dtype(a.dtype).pack(a, out) if self.kernels else None

    def pair(self, W, Wk: np.ndarray | None = None) -> tuple:
        """(W, W.T contiguous or None, kernel form or None) of W (values); Wk: its kernel form when the caller
        made it from the raw weights (else W itself is packed). The copy W.T only where it pays (see linear).
        W may be a tuple of raw parts (the parameters stacked along the outputs, in the model's own type, with
        Wk given): a model the kernels run keeps those and the kernel form, and no float32 values."""
        if isinstance(W, tuple):
            return W, None, Wk
        Wk = Wk if Wk is not None or not self.kernels else gemv.pack(W)
        Wt = np.ascontiguousarray(W.T) if W.shape[0] <= NARROW and (self.batched or Wk is None) else None
        return W, Wt, Wk


def linear(x: np.ndarray, W: tuple) -> np.ndarray:
    """x [..., in] @ W[out, in].T (as ops.linear_forward) with W = Forms.pair's (W, W.T contiguous or None,
    kernel form or None), arranged for the 1..4 rows of a decoding or verification step.

    Up to kernels.ROWS float32 rows go to the kernels' matrix-vector product when W has a kernel form
    (both cores, float32 or float16 weights; faster than OpenBLAS's one row: docs/benchmarks.md).
    Otherwise, OpenBLAS (one thread) is uneven on such shapes: a 2-row x @ W.T can cost several 1-row ones;
    2-3 rows against a contiguous [in, out] copy cost about one row while out <= 1024, but far more for wide
    outputs, where row-by-row matrix-vector products (exactly n x) are kept. One row also goes through the
    [in, out] copy where there is one (x @ Wt is as fast as W @ x): a plain decoding step and a speculative
    verification then read the same matrices, so alternating between them does not pull the other copy of
    every weight back into the CPU cache."""
    W, Wt, Wk = W
    rows, out = x.reshape(-1, x.shape[-1]), n_out(W)
    if Wk is not None and len(rows) <= kernels.ROWS and rows.dtype == np.float32:
        return kernels.matvec(Wk, rows, out).reshape(*x.shape[:-1], out)
    W = values(W)
    if len(rows) <= 4 and Wt is not None:
        y = rows @ Wt
    elif len(rows) == 1:
        y = (W @ rows[0])[None]
    elif len(rows) <= 4:
        y = np.stack([W @ r for r in rows])
    else:
        y = ops.linear_forward(rows, W)[0]
    return y.reshape(*x.shape[:-1], out)


def batched_linear(x: np.ndarray, W: tuple) -> np.ndarray:
    """x [n, in] @ W[out, in].T for the n rows of a batched decoding step (W = Forms.pair's triple).
    Wide outputs (no [in, out] copy) are computed as (W @ x.T).T, which OpenBLAS (one thread) runs faster
    than x @ W.T there (docs/benchmarks.md); narrow ones read the [in, out] copy, faster at a few rows."""
    W0 = values(W[0])  # (raw parts: dequantized for this use)
    if len(x) == 1:
        return (W0 @ x[0])[None]
    if W[1] is not None:
        return x @ W[1]
    return (W0 @ x.T).T


class Float16Model:
    """A model's weights rounded to float16, for decoding: `generate(Float16Model(model), ids, ...)` decodes
    as llama.cpp runs an f16 GGUF (float16 weights, float32 arithmetic), reading half the bytes per token
    of the float32 model. It has what generation needs of a model (config, params, dtype); train, score
    and save the float32 model itself. `sample` / `chat --dtype float16` use it.

        m16 = Float16Model(model); m16.params["embed.weight"].dtype == np.float16
    """

    def __init__(self, model):
        self.config = model.config
        self.params = {name: p.astype(np.float16) for name, p in model.params.items()}
        self.dtype = np.dtype(np.float16)

    def n_params(self) -> int:
        return sum(p.size for p in self.params.values())


class QuantizedModel:
    """A model's matrices in a GGUF block type, for decoding; norms stay float32. QuantizedModel(model, t)
    quantizes a float model's matrices (q8_0, q4_0, q4_1, q5_0, q5_1: quant.quantizable()) as its GGUF export at
    that type holds them, bit for bit (quant.py rounds as gguf does); `from_blocks` takes matrices that are
    already blocks of one type (any of quant.block_types(): the K types come only so, as read from a file). The
    fused step multiplies in integers (qkernels.py: activations quantized per block to 8 bits, as llama.cpp does
    for the type), the NumPy path with the dequantized values. Like Float16Model it has what generation needs
    (config, params, dtype); `sample` / `chat` / `serve --dtype q8_0` use it.

        QuantizedModel(model, "q8_0").params["embed.weight"].dtype == np.dtype([("q8_0", "V34")])
    """

    def __init__(self, model, name: str):
        if name not in quant.quantizable():
            raise UserError(_not_quantizable(name))
        t = quant.WTYPES[name]
        for n, p in model.params.items():
            if p.ndim == 2 and p.shape[1] % t.block:
                raise UserError(f"{name} needs rows of a multiple of {t.block} weights; {n} has {p.shape[1]}")
        qkernels.require()
        self.config = model.config
        self.params = {n: t.quantize(p).view(t.dtype) if p.ndim == 2 else np.asarray(p, np.float32)
                       for n, p in model.params.items()}
        self.dtype = np.dtype(np.float32)

    @classmethod
    def from_blocks(cls, config, params: dict, done=None) -> "QuantizedModel":
        """A model whose matrices are blocks already (void records [out, in / block], as QuantizedModel's own),
        each in its own type as a file holds them (float32 or float16 matrices may be among them), the other
        parameters float32. Every weight must read back finite (a block's float16 scales included), as `import`
        requires of a file: a NaN or Inf is refused in one line, naming its tensor. done(arrays): called with
        each tensor once checked (`sample` passes checkpoint.drop_pages: a mapped file's pages let go, read back
        when packed, instead of the whole file resident at once)."""
        bad = sorted({str(p.dtype) for p in params.values() if p.ndim == 2 and of_dtype(p.dtype) is None})
        if bad:
            raise UserError(f"a quantized model's matrices are blocks, float32 or float16; got {', '.join(bad)}")
        for name, p in params.items():
            check_readable(name, p)
            if done is not None:
                done([p])
        qkernels.require()
        m = cls.__new__(cls)
        m.config, m.dtype = config, np.dtype(np.float32)
        m.params = {n: p if p.ndim == 2 else np.asarray(p, np.float32) for n, p in params.items()}
        return m

    def n_params(self) -> int:
        return sum(p.size * quant.of_dtype(p.dtype).block for p in self.params.values())


def check_readable(name: str, p: np.ndarray) -> None:
    """Refuse a weight that would read back NaN or Inf: a float array with one, or blocks with a NaN or Inf scale."""
    p = np.asarray(p)   # (a checkpoint.Reordered: its rows copied for the check)
    if p.dtype.kind == "V":
        t = of_dtype(p.dtype).name
        bad, what = quant.nonfinite_blocks(p, t), f"block(s) with a NaN/Inf scale ({t})"
    else:
        bad, what = p.size - np.count_nonzero(np.isfinite(p)), "NaN/Inf value(s)"
    if bad:
        raise UserError(f"tensor {name} holds {bad} {what}; the model's weights are damaged")


def _not_quantizable(name: str) -> str:
    if name in quant.block_types():
        return (f"cannot quantize a float model to {name}: K-quant blocks are read from GGUF files (llama.cpp makes "
                f"them with an iterative search this library does not reproduce); use one of "
                f"{', '.join(quant.quantizable())}")
    return f"unknown block type {name!r}; one of {', '.join(quant.quantizable())}"


def for_dtype(model, dtype: str):
    """model as decoded in `dtype` (sample / chat / serve --dtype): itself (float32), Float16Model (float16) or
    QuantizedModel (q8_0, q4_0, q4_1, q5_0, q5_1; a K type is refused: we cannot make its blocks)."""
    if dtype == "float16":
        return Float16Model(model)
    if dtype in quant.block_types():
        return QuantizedModel(model, dtype)
    if dtype != "float32":
        raise UserError(f"unknown dtype {dtype!r}; one of {', '.join(quant.decodable())}")
    return model
