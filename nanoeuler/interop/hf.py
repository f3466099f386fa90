"""Hugging Face `transformers` folders <-> nanoeuler checkpoints, for every architecture of arch.py.

    nanoeuler import --from SmolLM2-135M --out runs/smol --mtp 2
    nanoeuler export --ckpt runs/demo --format hf --out demo-hf
    AutoModelForCausalLM.from_pretrained("demo-hf"); AutoTokenizer.from_pretrained("demo-hf")

Tensors: each architecture's `hf` table (arch.py) names every tensor, so one pair of functions converts them
all: `to_hf` stacks ours by rows where one of theirs holds several (GPT-2's c_attn = q|k|v), transposes
GPT-2's Conv1D weights, and stores Gemma's norms as w − 1 (its norm multiplies by 1 + w); `from_hf` undoes
each step. A tied head (tie_word_embeddings) has no lm_head; MTP heads 1..K-1 travel in a side file
(`nanoeuler_mtp.safetensors`) that only `import` reads.

config.json: the architecture's `hf` Format (arch.py) names each Config field's keys, Llama-style (llama, qwen2,
gemma3_text) or GPT-2's, and what else export writes; `REFUSED` lists the settings that would make the imported
model compute something else than ours (soft-capping where the format reads no cap, other activations, ...):
each is refused by name.
RoPE scaling (rope_scaling, or transformers 5's rope_parameters) of type linear, llama3, yarn or longrope becomes
the Config's rope_* fields and is written back as rope_scaling; another type (dynamic) is refused in one line.

The folder's tokenizer (tokenizer.json: byte-level BPE, or SentencePiece-style BPE with byte fallback; or
GPT-2's vocab.json + merges.txt) keeps its token ids; its chat
template (chat_template.jinja or tokenizer_config.json) and extra end-of-turn ids come along.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..arch import ARCHS, Arch, by_format
from ..errors import UserError
from .hf_folder import HF_DTYPES, MTP_FILE, eos_id_of, mtp_heads, read_hf_config, read_json_file, read_weights

# the activation each MLP kind computes, as transformers names it (hidden_act, hidden_activation, activation_function)
ACTIVATIONS = {"swiglu": ("silu",), "geglu": ("gelu_pytorch_tanh", "gelu_tanh"), "gelu": ("gelu_new", "gelu_pytorch_tanh")}
# config.json keys whose other values change the function: key -> the values that do not
REFUSED = {
    "attention_bias": (None, False), "mlp_bias": (None, False),
    "quantization_config": (None,), "use_sliding_window": (None, False), "final_logit_softcapping": (None,),
    "attn_logit_softcapping": (None,), "use_bidirectional_attention": (None, False),
    "scale_attn_weights": (None, True), "scale_attn_by_inverse_layer_idx": (None, False),
    "reorder_and_upcast_attn": (None, False), "add_cross_attention": (None, False), "use_bias": (None, True),
    "qk_layernorm": (None, False), "use_parallel_residual": (None, False), "use_qkv_bias": (None, True),
}
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # buffers of old saves, not parameters


# ------------------------------------------------------------------------------------------------ tensors

def to_hf(cfg, P: dict) -> dict[str, np.ndarray]:
    """Our parameters -> Hugging Face tensor name -> array (their dtype), by the architecture's `hf` table.
    A tensor whose parts are not all in P (lm_head of a tied model) is left out."""
    fmt = cfg.spec.hf
    out = {}
    for e in fmt.tensors(cfg.n_layers):
        if all(n in P for n in e.ours):
            a = np.concatenate([external_value(fmt.norm_offset, n, format_rows(cfg, n, P[n])) for n in e.ours])
            a = head_interleaved(a, len(e.ours), cfg.head_dim) if e.per_head else a
            out[e.name] = np.ascontiguousarray(a.T if e.transposed else a)
    return out


def from_hf(cfg, W: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face tensors -> our parameters (every tensor of cfg, shapes checked); what it reads leaves W."""
    shapes, fmt = cfg.param_shapes(), cfg.spec.hf
    P = {}
    for e in fmt.tensors(cfg.n_layers):
        ours = [n for n in e.ours if n in shapes]
        if not ours:
            continue  # lm_head of a tied model
        if e.name not in W:
            raise UserError(f"tensor {e.name} is missing from the weights")
        a = W.pop(e.name)
        want = (sum(shapes[n][0] for n in ours), *shapes[ours[0]][1:])
        got = a.T.shape if e.transposed else a.shape
        if tuple(got) != want:
            shown = want[::-1] if e.transposed else want
            raise UserError(f"tensor {e.name} has shape {list(a.shape)}, expected {list(shown)}")
        a = a.T if e.transposed else a
        a = head_interleaved(a, len(ours), cfg.head_dim, inverse=True) if e.per_head else a
        for n, part in zip(ours, np.split(a, np.cumsum([shapes[n][0] for n in ours])[:-1])):
            P[n] = np.ascontiguousarray(internal_value(fmt.norm_offset, n, format_rows(cfg, n, part, inverse=True)),
                                        dtype=np.float32)
    return P


def format_rows(cfg, name: str, a: np.ndarray, inverse: bool = False) -> np.ndarray:
    """A q / k weight's, bias's, gradient's or LoRA B's rows (`name`: ours, "layers.0.attn.wq.weight") in the
    outside formats' order (HF, GGUF), or with `inverse` back in ours, where only part of each head turns
    (Config.qk_row_order); any other tensor as it is."""
    order = cfg.qk_row_order()
    if order is None or name.rsplit(".", 2)[-2:] not in [[w, s] for w in ("wq", "wk") for s in ("weight", "bias",
                                                                                                   "lora_B")]:
        return a
    within = order if inverse else np.argsort(order)       # theirs[k] = ours[argsort(order)[k]]
    rows = (np.arange(a.shape[0] // cfg.head_dim)[:, None] * cfg.head_dim + within).ravel()
    return a[rows]


def head_interleaved(a: np.ndarray, parts: int, hd: int, inverse: bool = False) -> np.ndarray:
    """Rows of `parts` tensors stacked one after the other ([parts, heads, hd, ...]) interleaved head by head
    ([heads, parts, hd, ...]: GPT-NeoX's query_key_value, External.per_head), or with `inverse` back.
    head_interleaved(np.arange(8), 2, 2) -> [0, 1, 4, 5, 2, 3, 6, 7]   (q0 k0 q1 k1 of q0 q1 k0 k1)"""
    lead = (-1, parts) if inverse else (parts, -1)
    return a.reshape(*lead, hd, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


def activations(arch: Arch) -> tuple[str, ...]:
    """The names transformers gives the activation of arch's MLP (hidden_act, ...), export's first: the exact
    GELU's "gelu" where the record says gelu_erf (GPT-NeoX's)."""
    return ("gelu",) if arch.gelu_erf else ACTIVATIONS[arch.mlp]


def external_value(offset: float, name: str, a: np.ndarray) -> np.ndarray:
    return a - a.dtype.type(offset) if offset and name.endswith("norm.weight") else a


def internal_value(offset: float, name: str, a: np.ndarray) -> np.ndarray:
    return a + np.float32(offset) if offset and name.endswith("norm.weight") else a


# ------------------------------------------------------------------------------------------------ config.json

def architecture_of(c: dict) -> Arch:
    """config.json -> the architecture (model_type, else its `architectures` entry), or a one-line UserError.
    Every name config.json gives must be the same architecture's."""
    mt, archs = c.get("model_type"), c.get("architectures")
    if mt is not None and not isinstance(mt, str):
        raise UserError(f"config.json: model_type must be a name, got {mt!r:.60}")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise UserError("config.json: architectures must be a list of names")
    found = {by_format("hf", a) for a in archs or []}
    arch = by_format("hf", mt) if mt is not None else next(iter(found)) if len(found) == 1 else None
    if arch is None or (found and found != {arch}):
        known = ", ".join(f"{a.hf.name} ({', '.join(a.hf.aliases)})" for a in ARCHS.values())
        raise UserError(f"config.json: model_type {mt!r:.60} (architectures {str(archs):.80}) is not supported; "
                        f"importable: {known}")
    return arch


def config_from_hf(c: dict, arch: Arch, vocab_rows: int | None = None):
    """A config.json -> our Config (one head; the caller sets n_mtp), refusing every setting that would change
    the function (REFUSED, the activation, Gemma's attention scale, GPT-2's untied head)."""
    from ..config import Config
    keys = arch.hf.config
    read = {k for names in keys.values() for k in names}
    for key, fine in REFUSED.items():
        fine = (None, arch.hf.config_fixed[key]) if key in arch.hf.config_fixed else fine   # (GPT-NeoX's biases)
        if key in c and c[key] not in fine and key not in read:   # (Gemma 2 reads its soft caps)
            raise UserError(f"config.json: {key}={json.dumps(c[key])[:60]} is not supported")
    for key in ("hidden_act", "hidden_activation", "activation_function"):
        act = c.get(key)
        if act is not None and act not in activations(arch):
            raise UserError(f"config.json: {key}={act!r:.40} is not supported for {arch.hf.name} "
                            f"({' or '.join(activations(arch))})")
    fields = _config_fields(c, keys) | _null_softcaps(c, keys)
    fields.update(_longrope_defaults(_rope_fields(c, arch, fields), fields, arch))
    fields = {f: v for f, v in arch.hf.absent.items() if not any(k in c for k in keys[f])} | fields
    if "sliding_window" in fields and "sliding_window" not in arch.defaults:  # an architecture without windows
        if c.get("use_sliding_window", True) is not False:                    # (Qwen2 names one it does not use)
            raise UserError(f"config.json: sliding_window={fields['sliding_window']!r:.20} is not supported for "
                            f"{arch.hf.name}")
        del fields["sliding_window"]
    if "sliding_window" in fields:
        fields.update(_window_pattern(c, arch, fields.get("n_layers")))
    if arch.hf.no_rope_list and c.get(arch.hf.no_rope_list) is not None:
        fields.update(_no_rope_pattern(c[arch.hf.no_rope_list], arch, fields))
    if not arch.gated:
        fields.setdefault("ffn_hidden", 4 * fields["dim"] if isinstance(fields.get("dim"), int) else None)
    if not isinstance(fields.get("tie_embeddings", False), bool):   # a string "false" is not false
        raise UserError(f"config.json: tie_word_embeddings must be true or false, got {fields['tie_embeddings']!r:.60}")
    if fields.get("vocab_size") is not None and type(fields["vocab_size"]) is not int:   # not "262144", not true
        raise UserError(f"config.json: vocab_size {fields['vocab_size']!r:.40} is not an integer")
    if vocab_rows is not None and fields.get("vocab_size") != vocab_rows:
        raise UserError(f"config.json: vocab_size {fields.get('vocab_size')} but the embedding has {vocab_rows} rows")
    missing = [keys[f][0] for f in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden") if fields.get(f) is None]
    if missing:
        raise UserError(f"config.json: {missing[0]} is missing")
    fields.setdefault("ctx_len", 2048)
    fields.setdefault("n_kv_heads", fields["n_heads"])
    if _reaches_no_key(fields):
        fields["sliding_window"] = 0
    try:
        cfg = Config(**fields, n_mtp=1, arch=arch.name)
    except TypeError as e:
        raise UserError(f"config.json: {e}") from None
    except UserError as e:
        raise UserError(f"config.json: {e}") from None
    return cfg


def _config_fields(c: dict, keys: dict) -> dict:
    """Config fields from config.json by the format's keys (Format.config): the first key given is read, any
    other given must agree with it (a Gemma 3 27B's query_pre_attn_scalar 168 beside its head_dim 128: refused).
    _config_fields({"n_positions": 64, "n_ctx": 64}, {"ctx_len": ("n_positions", "n_ctx")}) -> {"ctx_len": 64}"""
    fields = {}
    for ours, names in keys.items():
        given = [k for k in names if c.get(k) is not None]
        if given:
            fields[ours] = c[given[0]]
        for k in given[1:]:
            if c[k] != fields[ours]:
                raise UserError(f"config.json: {k}={json.dumps(c[k])[:40]} differs from {given[0]} "
                                f"{json.dumps(fields[ours])[:40]}; not supported")
    return fields


def _null_softcaps(c: dict, keys: dict) -> dict:
    """The soft caps config.json sets to null: none (transformers skips a None cap; an absent key is its default).
    _null_softcaps({"attn_logit_softcapping": None}, GEMMA2.hf.config) -> {"attn_softcap": 0.0}"""
    return {f: 0.0 for f in ("attn_softcap", "logit_softcap")
            if any(k in c and c[k] is None for k in keys.get(f, ()))}


def _rope_fields(c: dict, arch: Arch, given: dict) -> dict:
    """RoPE bases from rope_theta / rope_local_base_freq or transformers 5's rope_parameters (one object, or one
    per layer kind), and the scaling of the global layers from rope_scaling or those (`scaling_fields`); the
    sliding layers' RoPE is plain (transformers' Gemma 3: rope_scaling scales the global layers only).
    given: the fields config.json's own keys set; rope_parameters must agree with them and with rope_scaling
    (transformers 4 reads those, 5 rope_parameters: a file where they differ means one thing to each)."""
    out = scaling_fields(c["rope_scaling"], "rope_scaling", arch) if c.get("rope_scaling") is not None else {}
    rp = c.get("rope_parameters")
    if rp is None or arch.positions != "rope":
        return out
    if not isinstance(rp, dict):
        raise UserError("config.json: rope_parameters must be an object")
    kinds = {"full_attention": "rope_theta", "sliding_attention": "rope_local_theta"}
    per_kind = {k: v for k, v in rp.items() if k in kinds}
    for kind, params in (per_kind or {"full_attention": rp}).items():
        scaled = scaling_fields(params, "rope_parameters", arch)
        if scaled and kind == "sliding_attention":
            raise UserError(f"config.json: rope_parameters {json.dumps(params)[:80]} scales the sliding layers' "
                            f"RoPE; not supported (the global layers' only)")
        theirs = scaled or ({"rope_scaling": "none"} if kind == "full_attention" else {})
        if params.get("rope_theta") is not None:
            theirs[kinds[kind]] = params["rope_theta"]
        if params.get("partial_rotary_factor") is not None and kind == "full_attention":
            theirs["partial_rotary_factor"] = params["partial_rotary_factor"]
        for ours, value in theirs.items():
            earlier, source = ((out[ours], "rope_scaling") if ours in out
                               else (given.get(ours), arch.hf.config.get(ours, ("",))[0]))
            if earlier is not None and earlier != value:
                raise UserError(f"config.json: rope_parameters' {PARAMETER_KEYS.get(ours, 'rope_theta')} "
                                f"{json.dumps(value)[:40]} differs from {source}'s {json.dumps(earlier)[:40]}; "
                                f"not supported")
        out |= theirs
    return out


# rope_type -> its keys in rope_scaling / rope_parameters -> the Config fields they set
SCALING_KEYS = {"linear": {"factor": "rope_factor"},
                "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                           "high_freq_factor": "rope_high_freq_factor",
                           "original_max_position_embeddings": "rope_original_ctx"},
                "yarn": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_ctx"},
                "longrope": {"short_factor": "rope_freq_factors", "long_factor": "rope_long_factors"}}
# ... and the keys a type may leave out (transformers' defaults: the Config's; longrope's original context and
# factor: _longrope_defaults; yarn's attention factor from mscale / mscale_all_dim: _yarn_attn_factor)
OPTIONAL_KEYS = {"yarn": {"beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow",
                          "attention_factor": "rope_attn_factor"},
                 "longrope": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_ctx",
                              "attention_factor": "rope_attn_factor"}}
# a scaling field -> its key in rope_scaling / rope_parameters
PARAMETER_KEYS = {"rope_scaling": "rope_type", "partial_rotary_factor": "partial_rotary_factor"} | {
    ours: k for table in (SCALING_KEYS, OPTIONAL_KEYS) for keys in table.values() for k, ours in keys.items()}


def scaling_fields(params, key: str, arch: Arch) -> dict:
    """A rope_scaling / rope_parameters object -> the Config's RoPE scaling fields ({} where it scales nothing).
    scaling_fields({"rope_type": "linear", "factor": 2.0}, ...) -> {"rope_scaling": "linear", "rope_factor": 2.0};
    a type other than SCALING_KEYS' (yarn, longrope, dynamic) or a key of it missing: UserError."""
    if neutral_rope(params):
        return {}
    kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    if not isinstance(kind, str) or kind not in SCALING_KEYS or arch.positions != "rope":
        raise UserError(f"config.json: {key} {json.dumps(params)[:80]} is not supported (RoPE scaling: "
                        f"{', '.join(SCALING_KEYS)} only)")
    missing = [k for k in SCALING_KEYS[kind] if params.get(k) is None]
    if missing:
        raise UserError(f"config.json: {key} of type {kind} has no {missing[0]}")
    if kind == "yarn" and params.get("truncate", True) is not True:
        raise UserError(f"config.json: {key} of type yarn with truncate {json.dumps(params['truncate'])[:20]} is "
                        f"not supported (the ramp's ends at whole pairs only, as llama.cpp's)")
    keys = SCALING_KEYS[kind] | OPTIONAL_KEYS.get(kind, {})
    return {"rope_scaling": kind} | _yarn_attn_factor(params, kind) | {
        ours: params[k] for k, ours in keys.items() if params.get(k) is not None}


def _yarn_attn_factor(params: dict, kind: str) -> dict:
    """yarn's attention factor where rope_scaling gives mscale and mscale_all_dim but no attention_factor (DeepSeek's;
    transformers: m(factor, mscale) / m(factor, mscale_all_dim), m(s, c) = 0.1·c·ln(s) + 1 above s = 1), else {}."""
    f, ms, ms_all = params.get("factor"), params.get("mscale"), params.get("mscale_all_dim")
    if kind != "yarn" or params.get("attention_factor") is not None or not (ms and ms_all):
        return {}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (f, ms, ms_all)):
        raise UserError("config.json: rope_scaling's factor, mscale and mscale_all_dim must be numbers")

    def m(scale, c):
        return 1.0 if scale <= 1 else 0.1 * c * math.log(scale) + 1.0
    return {"rope_attn_factor": m(f, ms) / m(f, ms_all)}


def _longrope_defaults(out: dict, given: dict, arch: Arch) -> dict:
    """longrope's original context and factor where its object leaves them out, as transformers takes them: the
    original context from config.json's original_max_position_embeddings, else the model's default (Phi-3's
    4096), else max_position_embeddings (ctx_len); the factor ctx_len / that."""
    if out.get("rope_scaling") != "longrope":
        return out
    ctx = given.get("ctx_len")
    orig = out.get("rope_original_ctx", given.get("rope_original_ctx", arch.defaults.get("rope_original_ctx", ctx)))
    out = out | ({"rope_original_ctx": orig} if orig is not None else {})
    if out.get("rope_factor") is None and all(isinstance(v, int) and v > 0 for v in (ctx, orig)):
        out["rope_factor"] = ctx / orig
    return out


def rope_scaling_json(cfg) -> dict | None:
    """The config's RoPE scaling as transformers' rope_scaling object (None: plain; longrope's with every key, its
    factor and original context being defaults transformers takes from elsewhere); per-pair factors (a GGUF's
    rope_freqs that is not llama3's) have no transformers form and are refused."""
    if cfg.rope_scaling == "none":
        return None
    if cfg.rope_scaling not in SCALING_KEYS:
        raise UserError(f"cannot export to Hugging Face: transformers has no RoPE scaling of per-pair factors "
                        f"(rope_scaling {cfg.rope_scaling}, from a GGUF's rope_freqs)")
    optional = OPTIONAL_KEYS.get(cfg.rope_scaling, {})
    if cfg.rope_scaling == "yarn":   # where not transformers' defaults (Qwen3's yarn: factor and original context)
        defaults = cfg.replace(**{ours: None for ours in optional.values()})
        optional = {k: ours for k, ours in optional.items() if getattr(cfg, ours) != getattr(defaults, ours)}
    return {"rope_type": cfg.rope_scaling} | {k: _json_value(getattr(cfg, ours))
                                              for k, ours in (SCALING_KEYS[cfg.rope_scaling] | optional).items()}


def _json_value(v):
    """A Config field's value as config.json writes it (a tuple of factors as a list)."""
    return list(v) if isinstance(v, tuple) else v


def neutral_rope(params) -> bool:
    """Whether a rope_scaling / rope_parameters object leaves RoPE as it is: rope_type (or old `type`) "default",
    or "linear" / "dynamic" with factor 1 (the GGUF import accepts the same neutral values).
    neutral_rope({"rope_type": "linear", "factor": 1.0}) -> True; neutral_rope({"type": "linear", "factor": 2}) -> False"""
    if not isinstance(params, dict):
        return False
    kind = params.get("rope_type", params.get("type", "default"))
    return kind == "default" or (kind in ("linear", "dynamic") and params.get("factor") in (1, 1.0)
                                 and not isinstance(params.get("factor"), bool))


def _reaches_no_key(fields: dict) -> bool:
    """Whether a window on every layer is wider than the context, so that it leaves out no key: Phi-3.5-mini's
    and Phi-4-mini's 262,144 over 131,072 positions. Such a model is one without a window (transformers' mask
    leaves every key in; so may RoPE scaling then be); a window on some layers only (Gemma's) stays, as those
    layers turn at their own RoPE base."""
    window, ctx = fields.get("sliding_window"), fields["ctx_len"]
    return (type(window) is int and type(ctx) is int and window >= ctx > 0
            and not fields.get("global_every"))


def _window_pattern(c: dict, arch: Arch, n_layers) -> dict:
    """Which layers attend through the window (layer_types, one entry a layer; else the format's window_pattern
    key, else the architecture's default: Gemma 3's 6) as our global_every: layer i global iff (i + 1) % n == 0."""
    types, n = c.get("layer_types"), arch.defaults.get("global_every", 0)
    if arch.hf.window_pattern:
        n = c.get(arch.hf.window_pattern, n)
    if types is not None:
        if not isinstance(types, list) or not all(t in ("sliding_attention", "full_attention") for t in types):
            raise UserError("config.json: layer_types must list sliding_attention / full_attention")
        if len(types) != n_layers:
            raise UserError(f"config.json: layer_types lists {len(types)} layers, {arch.hf.config['n_layers'][0]} "
                            f"{n_layers!r:.20}")
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        n = full[0] + 1 if full else 0
        if [t == "full_attention" for t in types] != [bool(n) and (i + 1) % n == 0 for i in range(len(types))]:
            raise UserError("config.json: layer_types is not a repeating pattern of sliding layers then one full "
                            "one; not supported")
    return {"global_every": n}


def _no_rope_pattern(flags, arch: Arch, fields: dict) -> dict:
    """SmolLM3's no_rope_layers (layer i turns q and k where flags[i] is 1, not where 0; transformers reads the list,
    its no_rope_layer_interval only builds a missing one) as our no_rope_every: the interval config.json gives
    where the list is its pattern, else the pattern the list's first 0 starts; another list: UserError.
    _no_rope_pattern([1, 0, 1, 0], SMOLLM3, {"n_layers": 4}) -> {"no_rope_every": 2}"""
    key, n = arch.hf.no_rope_list, fields.get("n_layers")
    if not isinstance(n, int) or not isinstance(flags, list) or len(flags) < n or any(f not in (0, 1) for f in flags):
        raise UserError(f"config.json: {key} must give each of the {n!r:.20} layers 1 (RoPE) or 0 (none)")
    flags = [int(f) for f in flags[:n]]   # (transformers reads the first n)

    def pattern(every: int) -> list[int]:
        return [int(not every or (i + 1) % every != 0) for i in range(n)]
    every = fields.get("no_rope_every", arch.defaults["no_rope_every"])
    if isinstance(every, int) and pattern(every) == flags:
        return {}
    every = flags.index(0) + 1 if 0 in flags else 0
    if pattern(every) != flags:
        raise UserError(f"config.json: {key} {json.dumps(flags)[:80]} is not a layer without RoPE every n-th; "
                        f"not supported")
    return {"no_rope_every": every}


def hf_config(cfg, tok, tied: bool, dtype: str = "float32") -> dict:
    """config.json of the transformers model equal to ours."""
    from ..config import MULTIPLIERS
    a, fmt = cfg.spec, cfg.spec.hf
    eos = tok.eos_id if tok.eos_token in tok.special_tokens else None
    bos = tok.bos_id if tok.bos_id is not None else eos
    values = cfg.to_dict() | {"tie_embeddings": tied, "head_dim": cfg.head_dim,
                              "attn_softcap": cfg.attn_softcap or None, "logit_softcap": cfg.logit_softcap or None}
    values |= {m: getattr(cfg, m) for m in MULTIPLIERS}   # always (Granite's attention_multiplier: 1 where absent)
    if not cfg.sliding_window:   # (an architecture with windows says it has none: Mistral's default is 4096)
        values = {k: v for k, v in values.items() if k not in ("sliding_window", "rope_local_theta")}
        values |= {"sliding_window": None} if "sliding_window" in a.defaults else {}
    out = {"architectures": [fmt.aliases[0]], "model_type": fmt.name}
    out |= {key: values[ours] for ours, keys in fmt.config.items() if ours in values for key in keys}
    if cfg.sliding_window:
        out["layer_types"] = ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.n_layers)]
    if fmt.no_rope_list:   # (what transformers reads; the interval, Format.config, only builds a missing list)
        out[fmt.no_rope_list] = [int(cfg.turns(i)) for i in range(cfg.n_layers)]
    if not a.qkv_bias:
        out["attention_bias"] = False
    if a.positions == "rope":
        out["rope_scaling"] = rope_scaling_json(cfg)
    return out | {key: activations(a)[0] for key in fmt.activation_keys} | fmt.config_fixed | {
        "initializer_range": 0.02, "use_cache": True, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype,
        "nanoeuler_n_mtp": cfg.n_mtp}


# ------------------------------------------------------------------------------------------------ import

def read_folder_weights(folder: Path, progress: bool = False) -> dict[str, np.ndarray]:
    """The folder's tensors, names without GPT-2's `transformer.` prefix, buffers skipped."""
    return {n.removeprefix("transformer."): a for n, a in read_weights(folder, progress).items()
            if not n.endswith(MASK_BUFFERS)}


def import_weights(folder: Path, c: dict, arch: Arch, n_mtp: int | None, progress: bool = False):
    """A folder of architecture `arch` -> (Config, params); rows stay in the folder's token id order."""
    W = read_folder_weights(folder, progress)
    embed = next((e.name for e in arch.hf.globals_ if e.ours == ("embed.weight",)), None)
    if embed not in W:
        raise UserError(f"tensor {embed} is missing from the weights")
    cfg = config_from_hf(c, arch, W[embed].shape[0])
    if cfg.tie_embeddings:  # transformers ties lm_head to the embedding; a stored lm_head is ignored as it does
        W.pop("lm_head.weight", None)
    if "wpe.weight" in W and W["wpe.weight"].shape[0] != cfg.ctx_len:
        raise UserError(f"tensor wpe.weight has {W['wpe.weight'].shape[0]} positions but config.json says "
                        f"n_positions {cfg.ctx_len}")
    params = from_hf(cfg, W)
    if W:
        extra = sorted(W)[0]
        what = " (biases are not supported for this architecture)" if extra.endswith(".bias") else ""
        raise UserError(f"unexpected tensor {extra}{what}")
    from ..config import head_weight
    params.update(mtp_heads(folder, n_mtp, head_weight(params, 0)))
    cfg = cfg.replace(n_mtp=1 + sum(1 for n in params if n.startswith("heads.") and n != "heads.0.weight"))
    return cfg, {n: params[n] for n in cfg.param_shapes()}


def read_tokenizer(folder: Path, vocab_size: int, eos_id):
    """Our Tokenizer (the folder's token ids kept exactly) from tokenizer.json, or GPT-2's vocab.json +
    merges.txt."""
    from .hf_tokenizer import from_hf_json
    path = folder / "tokenizer.json"
    if not path.is_file():
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            from .gpt2 import read_gpt2_tokenizer
            return read_gpt2_tokenizer(folder, vocab_size, eos_id)
        if (folder / "tokenizer.model").is_file():
            raise UserError(f"{folder} has a SentencePiece model file (tokenizer.model) but no tokenizer.json, "
                            "which import reads (transformers writes it: AutoTokenizer.from_pretrained(folder)"
                            ".save_pretrained(folder))")
        raise UserError(f"{folder} has no tokenizer.json")
    return from_hf_json(read_json_file(path, "tokenizer"), vocab_size, eos_id)


def with_chat_extras(folder: Path, c: dict, tok):
    """tok with the folder's chat template (chat_template.jinja, else tokenizer_config.json's chat_template)
    and, as stops, every other eos id config.json / generation_config.json name (Llama-3's <|eot_id|>)."""
    template = None
    if (folder / "chat_template.jinja").is_file():
        try:
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{folder / 'chat_template.jinja'} is not UTF-8 ({e})") from None
    elif (folder / "tokenizer_config.json").is_file():
        t = read_json_file(folder / "tokenizer_config.json", "tokenizer config")
        template = t.get("chat_template") if isinstance(t, dict) else None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((x.get("template") for x in template
                             if isinstance(x, dict) and x.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise UserError(f"{folder / 'tokenizer_config.json'}: chat_template is not a string")
    ends = []
    gen = folder / "generation_config.json"
    for d in (c, read_json_file(gen, "generation config") if gen.is_file() else {}):
        e = d.get("eos_token_id") if isinstance(d, dict) else None
        ends += e if isinstance(e, list) else [e]
    names = {i: s for s, i in tok.special_tokens.items()}
    stops = [names[i] for i in dict.fromkeys(ends) if isinstance(i, int) and i in names and names[i] != tok.eos_token]
    return tok.replace(chat_template=template, stops=stops)


def load_hf_folder(src: str | Path, n_mtp: int | None = None, progress: bool = False):
    """Any supported Hugging Face folder -> (Config, params, Tokenizer), without writing anything."""
    from ..checkpoint import check_finite
    from ..config import check_params
    folder = Path(src)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder")
    if n_mtp is not None and (not isinstance(n_mtp, int) or n_mtp < 1):
        raise UserError(f"--mtp must be a positive integer, got {n_mtp}")
    c = read_hf_config(folder)
    cfg, params = import_weights(folder, c, architecture_of(c), n_mtp, progress)
    check_params(cfg, params)
    check_finite(params, f"{folder}'s weights", " (as this program names it): the folder's model is damaged; "
                 "nothing was written")  # (the save's own check would blame a training that never ran)
    tok = read_tokenizer(folder, cfg.vocab_size, eos_id_of(folder, c))
    return cfg, params, with_chat_extras(folder, c, tok)


def import_folder(src: str | Path, out: str | Path, n_mtp: int | None = None, force: bool = False,
                  progress: bool = True):
    """Import src into the checkpoint directory out (atomically; refuses an existing out unless force, and
    an out that is, holds or lies inside src)."""
    from ..checkpoint import save_model
    from .outputs import check_free, output_dir
    check_free(out, force, inputs=[src])
    cfg, params, tok = load_hf_folder(src, n_mtp, progress)
    with output_dir(out, force, inputs=[src]) as tmp:
        save_model(tmp, cfg, params, tok)
    return cfg, params, tok


# ------------------------------------------------------------------------------------------------ export

def tokenizer_config(tok, ctx_len: int) -> dict:
    from ..chat_template import template_of
    eos = tok.eos_token if tok.eos_token in tok.special_tokens else None
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": ctx_len,
            "eos_token": eos, "bos_token": tok.bos_token, "pad_token": None, "unk_token": None,
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "chat_template": template_of(tok)}


def export_hf(model, tok, out: str | Path, dtype: str = "float32", force: bool = False, progress: bool = True) -> Path:
    """Write the Hugging Face folder `out` (atomically: a temporary folder renamed at the end)."""
    from .outputs import check_free, output_dir
    from .safetensors_io import write_tensors
    if dtype not in HF_DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(HF_DTYPES)} for --format hf")
    check_free(out, force)
    cfg, P = model.config, model.params
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens but the model {cfg.vocab_size} embeddings")
    tied = "heads.0.weight" not in P or bool(np.array_equal(P["embed.weight"], P["heads.0.weight"]))
    fmt = cfg.spec.hf
    if cfg.n_heads != cfg.n_kv_heads and "n_kv_heads" not in fmt.config:
        raise UserError(f"a {fmt.name} folder has as many key/value heads as query heads (its config.json names no "
                        f"other number); this model groups them (GQA)")
    if cfg.head_dim * cfg.n_heads != cfg.dim and "head_dim" not in fmt.config:
        raise UserError(f"a {fmt.name} folder's heads are hidden_size / num_attention_heads = {cfg.dim // cfg.n_heads} "
                        f"wide (its config.json names no other width); this model's are {cfg.head_dim}")
    if cfg.sliding_window and cfg.rope_local_theta != cfg.rope_theta and "rope_local_theta" not in fmt.config:
        raise UserError(f"a {fmt.name} folder has one RoPE base (its config.json names none for the windowed layers); "
                        f"this model's windowed layers use {cfg.rope_local_theta:g}, the others {cfg.rope_theta:g}")
    for f in ("attn_softcap", "logit_softcap"):
        if getattr(cfg, f) and f not in fmt.config:
            raise UserError(f"a {fmt.name} folder has no soft cap (its config.json names none); this model's "
                            f"{f} is {getattr(cfg, f):g}")
    tensors = to_hf(cfg, {n: p for n, p in P.items() if not (tied and n == "heads.0.weight")})
    tensors = {("" if n == "lm_head.weight" else fmt.prefix) + n: a for n, a in tensors.items()}
    with output_dir(out, force) as tmp:
        write_tensors(tmp / "model.safetensors", tensors, HF_DTYPES[dtype], {"format": "pt"})
        if cfg.n_mtp > 1:  # MTP heads 1..K-1 stay float32: only `nanoeuler import` reads them
            write_tensors(tmp / MTP_FILE, {f"heads.{k}.weight": P[f"heads.{k}.weight"] for k in range(1, cfg.n_mtp)},
                          "F32", {"format": "nanoeuler-mtp", "n_mtp": str(cfg.n_mtp)})
        config = hf_config(cfg, tok, tied, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(tmp, tok, cfg)
        ends = tok.stop_ids
        gen = {"bos_token_id": config["bos_token_id"], "do_sample": False,
               "eos_token_id": ends if len(ends) > 1 else config["eos_token_id"],
               "max_length": cfg.ctx_len}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return Path(out)


def write_tokenizer(folder: Path, tok, cfg) -> None:
    """The tokenizer files transformers' AutoTokenizer loads, as the format writes them (Format.tokenizer)."""
    TOKENIZER_WRITERS[cfg.spec.hf.tokenizer](folder, tok, cfg.ctx_len)


def write_hf_tokenizer(folder: Path, tok, ctx_len: int) -> None:
    """tokenizer.json and tokenizer_config.json (PreTrainedTokenizerFast)."""
    (folder / "tokenizer.json").write_text(tok.to_hf_json(), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok, ctx_len), indent=2) + "\n")


def write_gpt2_tokenizer(folder: Path, tok, ctx_len: int) -> None:
    """vocab.json + merges.txt as GPT2Tokenizer wants them, with GPT-2's pre-tokenizer (gpt2.py)."""
    from .gpt2 import write_gpt2_tokenizer
    write_gpt2_tokenizer(folder, tok, ctx_len)


TOKENIZER_WRITERS = {"tokenizer.json": write_hf_tokenizer, "vocab.json+merges.txt": write_gpt2_tokenizer}


def hf_names(cfg) -> dict[str, str]:
    """Our parameter name -> the Hugging Face tensor holding it (several of ours may share one: GPT-2's
    c_attn). hf_names(small)["layers.0.attn.wq.weight"] -> 'model.layers.0.self_attn.q_proj.weight'"""
    return {n: e.name for e in cfg.spec.hf.tensors(cfg.n_layers) for n in e.ours}

