"""Model configuration: the SPEC presets and the validated config dataclass (its architecture: arch.py).

    >>> Config.preset("small").n_params()
    1049728
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .arch import ARCHS, Arch
from .errors import UserError
from .ops.rope import inv_freq, llama3_factors, yarn_factors


@dataclass(frozen=True)
class Config:
    vocab_size: int
    dim: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    ctx_len: int        # T, the context length
    ffn_hidden: int     # F, the MLP's hidden width
    n_mtp: int          # K, the number of multi-token-prediction heads (head k predicts k+1 ahead)
    rope_theta: float | None = None        # RoPE base (of the global layers)
    norm_eps: float | None = None
    arch: str = "euler"                    # an entry of arch.ARCHS: the block's recipe (arch.py)
    tie_embeddings: bool | None = None     # head 0 IS embed.weight (one matrix)
    head_dim: int | None = None            # the width of one head (default dim / n_heads)
    rope_local_theta: float | None = None  # RoPE base of the windowed layers (default rope_theta)
    sliding_window: int | None = None      # windowed layers attend to their last this many positions (0: none)
    global_every: int | None = None        # with a window: layer i attends globally iff (i + 1) % this == 0
                                           # (0: every layer windowed)
    # RoPE scaling of the global layers (windowed ones keep plain RoPE at rope_local_theta, as Gemma 3's, unless
    # the architecture's rope_scales_windows: every layer, Gemma 2's):
    # "none"; "linear" (every frequency / rope_factor); "llama3" (transformers' rope_type llama3, from
    # rope_factor, the two freq factors and rope_original_ctx); "factors" (frequency i / rope_freq_factors[i],
    # llama.cpp's rope_freqs tensor when it is not llama3's); "yarn" (transformers' rope_type yarn: rope_factor,
    # rope_original_ctx and the ramp's ends rope_beta_fast / rope_beta_slow, ops/rope.yarn_factors); "longrope"
    # (Phi-3's: frequency i / rope_freq_factors[i], the short factors, where the model runs at a ctx_len up to
    # rope_original_ctx, else / rope_long_factors[i], as llama.cpp chooses by its context). yarn and longrope
    # multiply cos and sin of q and k by rope_attn_factor (default as transformers derives it from rope_factor:
    # yarn 1 + 0.1·ln(factor), longrope √(1 + ln(factor) / ln(rope_original_ctx)); 1 where factor <= 1): the
    # scores by its square (score_scale). The one entry point: layer_freqs (and score_scale).
    rope_scaling: str | None = None
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_ctx: int | None = None       # original_max_position_embeddings
    rope_freq_factors: tuple[float, ...] | None = None
    rope_long_factors: tuple[float, ...] | None = None
    rope_beta_fast: float | None = None
    rope_beta_slow: float | None = None
    rope_attn_factor: float | None = None
    # partial rotary (StableLM, GPT-NeoX): RoPE turns the first rope_dims = int(head_dim · this) dimensions of each
    # head (rotate-half pairing within them: i with i + rope_dims/2), the others pass as they are; 1: all of them
    partial_rotary_factor: float | None = None
    # layers without RoPE (SmolLM3's NoPE layers; other values than 0 only where the architecture's defaults name
    # it): layer i turns neither q nor k iff (i + 1) % this == 0 (layer_freqs: frequency 0); 0: every layer turns
    no_rope_every: int | None = None
    # soft caps (Gemma 2): the attention scores and the final logits x become cap·tanh(x / cap); 0: none
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    # scalar multipliers (Granite's; other values than these defaults only where arch.Arch.multipliers):
    # x = embed[ids]·embedding_multiplier; x = x + residual_multiplier·(each sub-block's output);
    # attention softmax(q·kᵀ·attention_multiplier) (default 1/√head_dim); logits = norm(x)·headᵀ / logits_scaling
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    # parallel residual (GPT-NeoX's use_parallel_residual; only where the architecture's defaults name it): both
    # sub-blocks read the layer's input, x = x + attn(norm1(x)) + mlp(norm2(x)); false: the MLP reads x + attn
    parallel_residual: bool | None = None
    # None: the architecture's default (arch.Arch.defaults), else DEFAULTS below

    def __post_init__(self):
        if not isinstance(self.arch, str) or self.arch not in ARCHS:
            raise UserError(f"config: unknown arch {self.arch!r:.60}; choose one of {', '.join(ARCHS)}")
        if self.head_dim is None and isinstance(self.dim, int) and isinstance(self.n_heads, int) \
                and self.n_heads > 0 and self.dim % self.n_heads:
            raise UserError(f"config: dim {self.dim} is not divisible by n_heads {self.n_heads} (give head_dim)")
        for name, value in self._defaults().items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("vocab_size", "dim", "n_heads", "n_kv_heads", "n_layers", "ctx_len", "ffn_hidden", "n_mtp",
                     "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= LIMITS[name]:
                raise UserError(f"config: {name} must be a positive integer <= {LIMITS[name]:,}, got {value!r:.60}")
        for name in ("sliding_window", "global_every", "no_rope_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= LIMITS["ctx_len"]:
                raise UserError(f"config: {name} must be an integer in [0, {LIMITS['ctx_len']:,}], got {value!r:.60}")
        if self.no_rope_every and "no_rope_every" not in self.spec.defaults:
            raise UserError(f"config: no_rope_every {self.no_rope_every} for arch {self.arch}, whose layers all turn "
                            f"q and k (smollm3 has layers without RoPE)")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"config: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if not isinstance(self.tie_embeddings, bool):
            raise UserError(f"config: tie_embeddings must be true or false, got {self.tie_embeddings!r:.60}")
        if self.spec.positions == "rope" and self.head_dim % 2:
            raise UserError(f"config: head_dim {self.head_dim} must be even for RoPE")
        for name in ("rope_theta", "norm_eps", "rope_local_theta", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_attn_factor", *MULTIPLIERS):
            value = getattr(self, name)     # (an int compares exactly: 10**400 is beyond every float)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= FLOAT_MAX:
                raise UserError(f"config: {name} must be a finite number > 0, got {value!r:.60}")
            object.__setattr__(self, name, float(value))
        for name in ("attn_softcap", "logit_softcap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= FLOAT_MAX:
                raise UserError(f"config: {name} must be a finite number >= 0 (0: none), got {value!r:.60}")
            object.__setattr__(self, name, float(value))
        self._check_partial_rotary()
        self._check_rope_scaling()
        self._check_multipliers()
        self._check_parallel_residual()
        if self.n_params() > MAX_PARAMS:
            raise UserError(f"config: {self.n_params():,} parameters is more than this program handles "
                            f"({MAX_PARAMS:,})")

    def _check_rope_scaling(self) -> None:
        """The RoPE scaling fields name a known scaling and only what it reads; factors as a tuple."""
        kind, factors = self.rope_scaling, self.rope_freq_factors
        if kind not in ROPE_SCALINGS:
            raise UserError(f"config: rope_scaling must be one of {', '.join(ROPE_SCALINGS)}, got {kind!r:.40}")
        v = self.rope_original_ctx
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= LIMITS["ctx_len"]:
            raise UserError(f"config: rope_original_ctx must be a positive integer <= {LIMITS['ctx_len']:,}, "
                            f"got {v!r:.60}")
        if kind == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise UserError(f"config: rope_low_freq_factor {self.rope_low_freq_factor} must be below "
                            f"rope_high_freq_factor {self.rope_high_freq_factor}")
        if (factors is not None) != (kind in ("factors", "longrope")):
            raise UserError("config: rope_freq_factors goes with rope_scaling \"factors\" or \"longrope\" and only "
                            "with them")
        if (self.rope_long_factors is not None) != (kind == "longrope"):
            raise UserError("config: rope_long_factors goes with rope_scaling \"longrope\" and only with it")
        for name in ("rope_freq_factors", "rope_long_factors"):
            self._check_pair_factors(name)
        if kind == "yarn" and not self.rope_beta_slow < self.rope_beta_fast:
            raise UserError(f"config: rope_beta_slow {self.rope_beta_slow} must be below rope_beta_fast "
                            f"{self.rope_beta_fast}")
        if kind == "yarn" and not self.rope_theta > 1:   # (its ramp's ends divide by ln θ)
            raise UserError(f"config: rope_theta {self.rope_theta} with rope_scaling yarn must be above 1")
        if kind != "none" and self.spec.positions != "rope":
            raise UserError(f"config: rope_scaling {kind} for arch {self.arch}, which has no RoPE")
        if kind != "none" and self.sliding_window and not self.global_every and not self.spec.rope_scales_windows:
            raise UserError(f"config: rope_scaling {kind} scales the global layers, and every layer is windowed")
        if kind in ("yarn", "longrope") and (self.no_rope_every or self.sliding_window
                                             and not self.spec.rope_scales_windows):
            raise UserError(f"config: rope_scaling {kind} beside layers it does not turn (windowed or without RoPE) "
                            f"is not supported (its attention factor scales the turned layers' scores only)")

    def _check_pair_factors(self, name: str) -> None:
        """Field `name`, where given, is one finite number > 0 per turned pair (rope_dims / 2: head_dim / 2 unless
        part of each head turns, Phi-4-mini's); made a tuple of floats."""
        factors = getattr(self, name)
        if factors is None:
            return
        ok = isinstance(factors, (list, tuple)) and len(factors) == self.rope_dims // 2 and all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < float("inf") for f in factors)
        if not ok:
            raise UserError(f"config: {name} must be {self.rope_dims // 2} finite numbers > 0 (one per turned pair)")
        object.__setattr__(self, name, tuple(float(f) for f in factors))

    def _check_partial_rotary(self) -> None:
        """partial_rotary_factor in (0, 1], turning an even number of dimensions; per-pair factors (a rope_freqs
        tensor, LongRoPE's: Phi-4-mini) are the turned pairs', and llama3 / yarn, which derive them over the whole
        head, are refused with it."""
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise UserError(f"config: partial_rotary_factor must be a number in (0, 1], got {f!r:.60}")
        object.__setattr__(self, "partial_rotary_factor", float(f))
        if f == 1:
            return
        if "partial_rotary_factor" not in self.spec.defaults:
            raise UserError(f"config: partial_rotary_factor {f} for arch {self.arch}, whose RoPE turns every "
                            f"dimension (stablelm's turns part of each head)")
        if self.rope_dims < 2 or self.rope_dims % 2:
            raise UserError(f"config: partial_rotary_factor {f} turns {self.rope_dims} of head_dim {self.head_dim} "
                            f"dimensions; RoPE turns pairs (at least one)")
        if self.rope_scaling in ("llama3", "yarn"):
            raise UserError(f"config: rope_scaling {self.rope_scaling} with partial_rotary_factor {f} is not supported")

    def _check_parallel_residual(self) -> None:
        """parallel_residual a bool, true only where the architecture's defaults name it (GPT-NeoX)."""
        if not isinstance(self.parallel_residual, bool):
            raise UserError(f"config: parallel_residual must be true or false, got {self.parallel_residual!r:.60}")
        if self.parallel_residual and "parallel_residual" not in self.spec.defaults:
            raise UserError(f"config: parallel_residual for arch {self.arch}, whose sub-blocks run one after the "
                            f"other (gptneox's may run side by side)")

    @property
    def rope_dims(self) -> int:
        """The dimensions of each head RoPE turns (int(head_dim · partial_rotary_factor), as transformers)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rotary_freqs(self, theta: float, factors=None) -> np.ndarray:
        """The inverse frequencies [head_dim/2] of base θ over the turned dimensions (rope_dims: pair i at
        θ^(−2i/rope_dims), divided by factors[i]), then 0 for the pairs that pass (cos 1, sin 0: unchanged).
        Config(..., head_dim=8, partial_rotary_factor=0.5).rotary_freqs(100.0) -> [1.0, 0.01, 0.0, 0.0]"""
        R = self.rope_dims
        f = inv_freq(R, theta, None if factors is None else np.asarray(factors)[:R // 2])
        return np.pad(f, (0, (self.head_dim - R) // 2))

    def qk_row_order(self) -> np.ndarray | None:
        """Where each row of a q / k head sits in the outside formats' order (HF, GGUF), None where all turn.
        Partial rotary turns pairs (i, i + R/2) of the first R dimensions there; here, where the engines turn
        pairs (i, i + hd/2), the passing dimensions are moved between the halves so that they form the last pairs
        (frequency 0, rotary_freqs): head 8, R 4: theirs [r0 r1 r2 r3 p0 p1 p2 p3], ours [r0 r1 p0 p1 r2 r3 p2 p3]
        -> [0, 1, 4, 5, 2, 3, 6, 7]. The attention is the same: q and k heads are reordered alike."""
        R, hd = self.rope_dims, self.head_dim
        if self.spec.positions != "rope" or R == hd:
            return None
        p = (hd - R) // 2
        return np.concatenate([np.arange(R // 2), R + np.arange(p), R // 2 + np.arange(R // 2), R + p + np.arange(p)])

    def _check_multipliers(self) -> None:
        """Scalar multipliers other than their defaults only where the architecture has them (Granite)."""
        if self.spec.multipliers:
            return
        defaults = self._defaults()
        for name in MULTIPLIERS:
            if getattr(self, name) != defaults[name]:
                raise UserError(f"config: {name} {getattr(self, name)} for arch {self.arch}, whose block has no "
                                f"such multiplier (arch granite has)")

    def _defaults(self) -> dict:
        """The value each defaultable field takes when not given: the architecture's, else DEFAULTS."""
        out = DEFAULTS | ARCHS[self.arch].defaults
        out["head_dim"] = self.dim // self.n_heads if isinstance(self.dim, int) and isinstance(self.n_heads, int) \
            and self.n_heads > 0 else None
        out["rope_local_theta"] = out.get("rope_local_theta") or (self.rope_theta if self.rope_theta is not None
                                                                  else out["rope_theta"])
        hd = self.head_dim if self.head_dim is not None else out["head_dim"]
        out["attention_multiplier"] = 1.0 / math.sqrt(hd) if isinstance(hd, int) and hd > 0 else None
        out["rope_attn_factor"] = self._derived_attn_factor(out)
        return out

    def _derived_attn_factor(self, defaults: dict) -> float:
        """transformers' attention factor of yarn / longrope when config.json names none (see the rope fields'
        comment); 1 for the other scalings, and where the fields it reads are not numbers (refused later)."""
        kind, factor, ctx = (getattr(self, n) if getattr(self, n) is not None else defaults[n]
                             for n in ("rope_scaling", "rope_factor", "rope_original_ctx"))
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and 1 < v <= FLOAT_MAX
                      for v in (factor, ctx))
        if kind == "yarn" and numbers:
            return 0.1 * math.log(factor) + 1.0
        if kind == "longrope" and numbers:
            return math.sqrt(1 + math.log(factor) / math.log(ctx))
        return 1.0

    @property
    def spec(self) -> Arch:
        """The architecture's record (arch.py): what the block computes and its names in other formats."""
        return ARCHS[self.arch]

    def window(self, layer: int) -> int:
        """How many positions layer `layer` attends back over (itself included), 0 for all of them.
        Gemma 3 (window 512, global_every 6): layers 0-4 -> 512, layer 5 -> 0, ..."""
        if not self.sliding_window or (self.global_every and (layer + 1) % self.global_every == 0):
            return 0
        return self.sliding_window

    def layer_freqs(self, layer: int) -> np.ndarray | None:
        """The RoPE inverse frequencies [head_dim/2] (float64) of layer `layer`, None without RoPE: the one place
        every engine's cos/sin tables come from. Windowed layers: RoPE at rope_local_theta, plain unless the
        architecture's rope_scales_windows; the others: rope_theta with the scaling of the rope_* fields (see the
        fields' comment); a layer without RoPE (no_rope_every): zeros (cos 1, sin 0)."""
        if self.spec.positions != "rope":
            return None
        if not self.turns(layer):   # a rotation by angle 0 is the identity: every engine runs the layer as it is
            return np.zeros(self.head_dim // 2)
        if self.window(layer):
            return self.rotary_freqs(self.rope_local_theta,
                            self.rope_factors() if self.spec.rope_scales_windows else None)
        return self.rotary_freqs(self.rope_theta, self.rope_factors())

    def turns(self, layer: int) -> bool:
        """Whether layer `layer` applies RoPE (positions "rope" and not one of no_rope_every's layers).
        SmolLM3 (no_rope_every 4): layers 0, 1, 2 turn, layer 3 does not, ..."""
        return self.spec.positions == "rope" and not (self.no_rope_every and (layer + 1) % self.no_rope_every == 0)

    def score_scale(self) -> float:
        """What the attention multiplies q·kᵀ by: attention_multiplier (default 1/√head_dim), times the square of
        yarn's / longrope's rope_attn_factor, which multiplies cos and sin of both q and k (transformers'
        attention_scaling, llama.cpp's mscale). Scaling the scores is the same: q and k meet only in q·kᵀ, and
        the KV cache keeps k as RoPE turned it, unscaled."""
        m = self.rope_attn_factor if self.rope_scaling in ("yarn", "longrope") else 1.0
        return self.attention_multiplier * m * m

    def query_factor(self) -> float:
        """What q is multiplied by before an attention that divides q·kᵀ by √head_dim, so that it computes
        q·kᵀ·score_scale: 1 at the default 1/√head_dim without a RoPE attention factor."""
        if self.score_scale() == 1.0 / math.sqrt(self.head_dim):
            return 1.0
        return self.score_scale() * math.sqrt(self.head_dim)

    def rope_factors(self) -> np.ndarray:
        """What the global layers divide each pair's frequency θ^(−2i/hd) by [head_dim/2] (ones: plain RoPE;
        llama.cpp's rope_freqs tensor holds the same). longrope: the short factors at a ctx_len up to
        rope_original_ctx, the long ones beyond (llama.cpp's choice by n_ctx; `--ctx` sets ctx_len)."""
        plain = inv_freq(self.head_dim, self.rope_theta)
        if self.rope_scaling == "llama3":
            return llama3_factors(plain, self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                                  self.rope_original_ctx)
        if self.rope_scaling == "yarn":
            return yarn_factors(self.head_dim, self.rope_theta, self.rope_factor, self.rope_original_ctx,
                                self.rope_beta_fast, self.rope_beta_slow)
        if self.rope_scaling == "longrope" and self.ctx_len > self.rope_original_ctx:
            return np.array(self.rope_long_factors)
        if self.rope_scaling in ("factors", "longrope"):
            return np.array(self.rope_freq_factors)
        return np.full_like(plain, self.rope_factor if self.rope_scaling == "linear" else 1.0)

    def rope_kinds(self) -> tuple[list[np.ndarray], list[int]]:
        """The distinct inverse frequencies the layers use (layer_freqs), and each layer's index in them (-1: no
        RoPE). Gemma 3 (5 windowed layers, then a global one): ([local, global], [0, 0, 0, 0, 0, 1, ...])."""
        freqs, kinds = [], []
        for i in range(self.n_layers):
            f = self.layer_freqs(i)
            j = -1 if f is None else next((j for j, g in enumerate(freqs) if np.array_equal(f, g)), len(freqs))
            if j == len(freqs):
                freqs.append(f)
            kinds.append(j)
        return freqs, kinds

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape ([out, in] for matrices), in checkpoint order (arch.py names them).
        A linear's bias follows its weight; a LayerNorm has a bias, an RMSNorm none."""
        a, d, hd, V, F = self.spec, self.dim, self.head_dim, self.vocab_size, self.ffn_hidden
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, d)}
        if a.positions == "learned":
            shapes["pos_embed.weight"] = (self.ctx_len, d)

        def norm(name: str, n: int) -> None:
            shapes[name + ".weight"] = (n,)
            if a.norm == "layer":
                shapes[name + ".bias"] = (n,)

        def linear(name: str, out: int, inp: int, bias: bool) -> None:
            shapes[name + ".weight"] = (out, inp)
            if bias:
                shapes[name + ".bias"] = (out,)

        for i in range(self.n_layers):
            p = f"layers.{i}."
            if a.pre_norms:
                norm(p + "attn_norm", d)
            for w, heads in (("wq", self.n_heads), ("wk", self.n_kv_heads), ("wv", self.n_kv_heads)):
                linear(p + "attn." + w, heads * hd, d, a.qkv_bias)
            if a.qk_norm:   # per head, or over the whole projection (qk_norm_whole)
                norm(p + "attn.q_norm", hd * (self.n_heads if a.qk_norm_whole else 1))
                norm(p + "attn.k_norm", hd * (self.n_kv_heads if a.qk_norm_whole else 1))
            linear(p + "attn.wo", d, self.n_heads * hd, a.out_bias)
            if a.post_norms:
                norm(p + "attn_post_norm", d)
            if a.pre_norms:
                norm(p + "ffn_norm", d)
            *ins, out = a.mlp_weights
            for w in ins:
                linear(p + "ffn." + w, F, d, a.out_bias)
            linear(p + "ffn." + out, d, F, a.out_bias)
            if a.post_norms:
                norm(p + "ffn_post_norm", d)
        norm("norm", d)
        for k in range(1 if self.tie_embeddings else 0, self.n_mtp):  # tied: head 0 is embed.weight
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
        """config.json: the SPEC's fields always, the others only where they differ from their defaults."""
        d = dataclasses.asdict(self)
        defaults = self._defaults()
        for name in OPTIONAL:
            if d[name] == defaults[name]:
                del d[name]
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
        """A copy with some fields changed; the fields left at their defaults follow the change
        (Config.preset("small").replace(n_heads=2).head_dim == 64)."""
        d = self.to_dict()
        for name in OPTIONAL:
            d.setdefault(name, None)
        return Config(**(d | changes))

    @classmethod
    def preset(cls, name: str) -> "Config":
        if name not in PRESETS:
            raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return PRESETS[name]


FLOAT_MAX = sys.float_info.max
# the defaults of the defaultable fields where the architecture has none (head_dim, rope_local_theta: derived)
# (the llama3 ones: Llama 3.1's rope_scaling, as llama.cpp's converter assumes where a config.json leaves one out)
DEFAULTS = {"rope_theta": 10000.0, "norm_eps": 1e-5, "tie_embeddings": False, "sliding_window": 0, "global_every": 0,
            "rope_scaling": "none", "rope_factor": 1.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
            "rope_original_ctx": 8192, "rope_freq_factors": None, "rope_long_factors": None, "rope_beta_fast": 32.0,
            "rope_beta_slow": 1.0, "partial_rotary_factor": 1.0, "no_rope_every": 0, "attn_softcap": 0.0,
            "logit_softcap": 0.0,
            "parallel_residual": False, "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0}
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
OPTIONAL = ("tie_embeddings", "head_dim", "rope_local_theta", "sliding_window", "global_every",  # config.json:
            "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",   # if not default
            "rope_original_ctx", "rope_freq_factors", "rope_long_factors", "rope_beta_fast", "rope_beta_slow",
            "rope_attn_factor", "partial_rotary_factor", "attn_softcap", "logit_softcap",
            "no_rope_every",
            *MULTIPLIERS, "parallel_residual")
ROPE_SCALINGS = ("none", "linear", "llama3", "factors", "yarn", "longrope")
# of training's matrix products (--precision, trainer.json): float32, or bfloat16 operands with float32
# accumulation (fast/bf16.py on the CPU, gpu/matmul.py on the GPU)
PRECISIONS = ("f32", "bf16")

# upper bounds of the integer fields (checked before anything is allocated: a ctx_len of 1e8 is refused here)
LIMITS = {"vocab_size": 1 << 20, "dim": 1 << 15, "n_heads": 1 << 10, "n_kv_heads": 1 << 10, "n_layers": 1 << 10,
          "ctx_len": 1 << 20, "ffn_hidden": 1 << 17, "n_mtp": 64, "head_dim": 1 << 12}
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
    """The parameter that is output head k: head 0 is the token embedding when tied (tie_embeddings), and
    its gradient goes there too. head_name({"embed.weight": E}, 0) == "embed.weight"."""
    return "embed.weight" if k == 0 and "heads.0.weight" not in P else f"heads.{k}.weight"


def head_weight(P: dict, k: int) -> np.ndarray:
    """Output head k's matrix [V, d] (see head_name)."""
    return P[head_name(P, k)]
