"""Model configuration: the SPEC presets and the validated config dataclass.

    >>> Config.preset("small").n_params()
    1049728
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError


@dataclass(frozen=True)
class Config:
    vocab_size: int
    dim: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    ctx_len: int        # T, the context length
    ffn_hidden: int     # F, the SwiGLU hidden width
    n_mtp: int          # K, the number of multi-token-prediction heads (head k predicts k+1 ahead)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    arch: str = "euler"  # "euler": RMSNorm/RoPE/SwiGLU, no biases; "gpt2": LayerNorm/learned positions/GELU, biases, tied head
    tie_embeddings: bool = False  # euler: head 0 IS embed.weight (one matrix, as tied imports); gpt2 always ties

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise UserError(f"config: unknown arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        for name in ("vocab_size", "dim", "n_heads", "n_kv_heads", "n_layers", "ctx_len", "ffn_hidden", "n_mtp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= LIMITS[name]:
                raise UserError(f"config: {name} must be a positive integer <= {LIMITS[name]:,}, got {value!r:.60}")
        if self.dim % self.n_heads:
            raise UserError(f"config: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"config: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if not isinstance(self.tie_embeddings, bool) or (self.tie_embeddings and self.arch != "euler"):
            raise UserError(f"config: tie_embeddings must be true or false (arch euler only; gpt2 always ties), "
                            f"got {self.tie_embeddings!r:.60}")
        if self.arch == "euler" and self.head_dim % 2:
            raise UserError(f"config: head_dim {self.head_dim} (dim / n_heads) must be even for RoPE")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise UserError(f"config: {name} must be a finite number > 0, got {value!r:.60}")
        if self.n_params() > MAX_PARAMS:
            raise UserError(f"config: {self.n_params():,} parameters is more than this program handles "
                            f"({MAX_PARAMS:,})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's SPEC name and shape ([out, in] for matrices), in checkpoint order."""
        d, hd, V, F = self.dim, self.head_dim, self.vocab_size, self.ffn_hidden
        if self.arch == "gpt2":
            return self._gpt2_param_shapes()
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, d)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes[p + "attn_norm.weight"] = (d,)
            shapes[p + "attn.wq.weight"] = (self.n_heads * hd, d)
            shapes[p + "attn.wk.weight"] = (self.n_kv_heads * hd, d)
            shapes[p + "attn.wv.weight"] = (self.n_kv_heads * hd, d)
            shapes[p + "attn.wo.weight"] = (d, self.n_heads * hd)
            shapes[p + "ffn_norm.weight"] = (d,)
            shapes[p + "ffn.gate.weight"] = (F, d)
            shapes[p + "ffn.up.weight"] = (F, d)
            shapes[p + "ffn.down.weight"] = (d, F)
        shapes["norm.weight"] = (d,)
        for k in range(1 if self.tie_embeddings else 0, self.n_mtp):  # tied: head 0 is embed.weight
            shapes[f"heads.{k}.weight"] = (V, d)
        return shapes

    def _gpt2_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """arch "gpt2" (see model.py): learned positions, LayerNorm weight+bias, biased linears; head 0 is
        tied to embed.weight (not stored), heads 1..K-1 (MTP, optional) are their own matrices."""
        d, hd, V, F = self.dim, self.head_dim, self.vocab_size, self.ffn_hidden
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, d), "pos_embed.weight": (self.ctx_len, d)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            for name, out, inp in (("attn_norm", d, 0), ("attn.wq", self.n_heads * hd, d),
                                   ("attn.wk", self.n_kv_heads * hd, d), ("attn.wv", self.n_kv_heads * hd, d),
                                   ("attn.wo", d, self.n_heads * hd), ("ffn_norm", d, 0),
                                   ("ffn.fc", F, d), ("ffn.proj", d, F)):
                shapes[p + name + ".weight"] = (out, inp) if inp else (out,)
                shapes[p + name + ".bias"] = (out,)
        shapes["norm.weight"] = (d,)
        shapes["norm.bias"] = (d,)
        for k in range(1, self.n_mtp):
            shapes[f"heads.{k}.weight"] = (V, d)
        return shapes

    def n_params(self) -> int:
        total = 0
        for shape in self.param_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    def flops_per_token(self) -> int:
        """Training FLOPs per token, the 6·N rule (forward 2·N, backward 4·N) used for MFU."""
        return 6 * self.n_params()

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.tie_embeddings:  # untied configs (every one before the field) keep their exact config.json
            del d["tie_embeddings"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        if not isinstance(d, dict):
            raise UserError("config: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"config: unknown field(s) {', '.join(unknown)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in d and f.default is dataclasses.MISSING)
        if missing:
            raise UserError(f"config: missing field(s) {', '.join(missing)}")
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> "Config":
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UserError(f"config: {path} not found") from None
        except (ValueError, RecursionError) as e:   # bad UTF-8 or JSON, or nested too deep
            raise UserError(f"config: {path} is not valid JSON ({str(e)[:120]})") from None
        except IsADirectoryError:
            raise UserError(f"config: {path} is a directory, not a config.json") from None
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> "Config":
        if name not in PRESETS:
            raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return PRESETS[name]


ARCHS = ("euler", "gpt2")
# of training's matrix products (--precision, trainer.json): float32, or bfloat16 operands with float32
# accumulation (fast/bf16.py on the CPU, gpu/matmul.py on the GPU)
PRECISIONS = ("f32", "bf16")

# upper bounds of the integer fields (checked before anything is allocated: a ctx_len of 1e8 is refused here)
LIMITS = {"vocab_size": 1 << 20, "dim": 1 << 15, "n_heads": 1 << 10, "n_kv_heads": 1 << 10, "n_layers": 1 << 10,
          "ctx_len": 1 << 20, "ffn_hidden": 1 << 17, "n_mtp": 64}
MAX_PARAMS = 20_000_000_000

PRESETS: dict[str, Config] = {
    "small": Config(vocab_size=512, dim=128, n_heads=4, n_kv_heads=2, n_layers=4, ctx_len=128, ffn_hidden=384, n_mtp=3),
    "big": Config(vocab_size=4096, dim=384, n_heads=6, n_kv_heads=2, n_layers=4, ctx_len=256, ffn_hidden=1024, n_mtp=2),
    "gpt": Config(vocab_size=4096, dim=768, n_heads=12, n_kv_heads=4, n_layers=16, ctx_len=512, ffn_hidden=2048, n_mtp=4),
    # OpenAI's GPT-2 124M shape (import its weights with `nanoeuler import`), and a tiny one for tests
    "gpt2": Config(vocab_size=50257, dim=768, n_heads=12, n_kv_heads=12, n_layers=12, ctx_len=1024, ffn_hidden=3072,
                   n_mtp=1, arch="gpt2"),
    "gpt2-tiny": Config(vocab_size=512, dim=64, n_heads=4, n_kv_heads=4, n_layers=2, ctx_len=64, ffn_hidden=256,
                        n_mtp=1, arch="gpt2"),
}


def check_params(config: Config, params: dict) -> None:
    """Every SPEC tensor present with its exact shape, one float dtype throughout, nothing extra.

    Lives beside the config (it needs nothing else), so that checkpoint.py can validate a load without
    importing model.py, which imports checkpoint.py back."""
    import numpy as np
    expected = config.param_shapes()
    missing = [n for n in expected if n not in params]
    if missing:
        raise UserError(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = [n for n in params if n not in expected]
    if extra:
        raise UserError(f"unexpected tensor {extra[0]} for this config")
    dtypes = set()
    for name, shape in expected.items():
        p = params[name]
        if tuple(p.shape) != shape:
            raise UserError(f"tensor {name} has shape {list(p.shape)}, expected {list(shape)}")
        dtypes.add(np.dtype(p.dtype))
    if len(dtypes) != 1 or dtypes.pop() not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise UserError("parameters must all be float32 or all float64")


def head_name(P: dict, k: int) -> str:
    """The parameter that is output head k: head 0 is the token embedding when tied (arch gpt2,
    tie_embeddings), and its gradient goes there too. head_name({"embed.weight": E}, 0) == "embed.weight"."""
    return "embed.weight" if k == 0 and "heads.0.weight" not in P else f"heads.{k}.weight"


def head_weight(P: dict, k: int) -> np.ndarray:
    """Output head k's matrix [V, d] (see head_name)."""
    return P[head_name(P, k)]
