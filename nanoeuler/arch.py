"""Architectures as data: one record per architecture, read by every engine and every converter.

Every architecture here is one transformer, differing only in the choices this record makes:

    x = embed[ids] · (√d if embed_scale) · m_embed (+ pos_embed[t] if positions == "learned")
    each layer i:
        h = norm(x)                                     norm: "rms" x/rms·w, or "layer" (x − μ)/σ·w + b
                                                        (h = x where not pre_norms: OLMo 2's)
        q, k, v = h·Wqᵀ, h·Wkᵀ, h·Wvᵀ (+ biases if qkv_bias), cut into heads of head_dim
        q, k = rmsnorm(q), rmsnorm(k) per head          if qk_norm (qk_norm_whole: over the whole projection)
        q, k = RoPE(q), RoPE(k)                          if positions == "rope", at the layer's frequencies
                                                        (Config.layer_freqs: base θ, any scaling; windowed: local θ;
                                                        0, the identity, where Config.no_rope_every skips it)
        a = softmax(q·kᵀ·s, causal, the last `window` keys if layer i is windowed) · v     s: 1/√head_dim
        x = x + m_res · post(a·Woᵀ (+ b))               post: a norm if post_norms, else nothing
        x = x + m_res · post(mlp(norm(x)))              mlp: "swiglu" down(silu(gate·h)·up·h)
                                                             "geglu"  down(gelu_tanh(gate·h)·up·h)
                                                             "gelu"   proj(gelu_tanh(fc·h + b)) + b
                                                             (gelu_erf: the exact GELU x·Φ(x) instead)
        (Config.parallel_residual: both sub-blocks read the layer's input, GPT-NeoX's
         x = x + attn(norm1(x)) + mlp(norm2(x)))
    logits_k = norm(x) · head_kᵀ / logits_scaling        head 0 is the embedding itself when tied

m_embed, m_res, s and logits_scaling are 1, 1, 1/√head_dim and 1 except where the record says `multipliers`:
then they are the Config's numbers embedding_multiplier, residual_multiplier, attention_multiplier and
logits_scaling (Granite's).

| entry  | norm  | mlp    | positions             | biases        | q/k norm | post norms | embed ×√d |
|--------|-------|--------|-----------------------|---------------|----------|------------|-----------|
| euler  | rms   | swiglu | RoPE                  | none          |          |            |           |
| qwen2  | rms   | swiglu | RoPE                  | q, k, v       |          |            |           |
| qwen3  | rms   | swiglu | RoPE                  | none          | yes      |            |           |
| mistral| rms   | swiglu | RoPE, any window: all | none          |          |            |           |
| gemma3 | rms   | geglu  | RoPE, local and global| none          | yes      | yes        | yes       |
| gemma2 | rms   | geglu  | RoPE, every other layer windowed, soft caps | none |  | yes   | yes       |
| phi3   | rms   | swiglu | RoPE, any window: all | none          |          |            |           |
| gpt2   | layer | gelu   | learned               | every linear  |          |            |           |
| granite| rms   | swiglu | RoPE, multipliers     | none          |          |            |           |
| olmo2  | rms   | swiglu | RoPE                  | none          | whole    | only these |           |
| starcoder2 | layer | gelu | RoPE, any window: all | every linear  |          |            |           |
| stablelm | layer | swiglu | RoPE on a part of each head | q, k, v |        |            |           |
| smollm3 | rms  | swiglu | RoPE but every 4th layer | none       |          |            |           |
| gptneox | layer | gelu (erf) | RoPE on a part of each head, parallel residual | every linear | |   |           |

`euler` is the SPEC's model, which is Llama's block (Hugging Face `llama`, GGUF `llama`: SmolLM2 imports as
euler). `mistral` is the same block under Mistral's name, a window (if any) on every layer; llama.cpp's converter
writes it as `llama`. `smollm3` is Llama's block again where every 4th layer (Config.no_rope_every) attends
without RoPE (its q and k turned by angle 0). `starcoder2` is GPT-2's block with RoPE instead of learned positions
(llama.cpp reads no window for it). `phi3` is Llama's block again, its q|k|v and gate|up each one tensor in both
formats (and one LoRA target). `gptneox` (Pythia) is StarCoder2's block with the exact GELU, partial rotary and,
by default, the parallel residual; its Hugging Face query_key_value interleaves q, k and v head by head. A model's
own numbers (widths, θ, ε, window, RoPE scaling, tied head) live in its Config; `defaults` gives the ones a
checkpoint's config.json may leave out (config.json names the architecture and any field that differs). Parameter
names are the same for every entry (Config.param_shapes builds them from the record):

    layers.i.attn_norm  attn.wq attn.wk attn.wv  attn.q_norm attn.k_norm  attn.wo  attn_post_norm
    layers.i.ffn_norm   ffn.gate ffn.up ffn.down (gated) | ffn.fc ffn.proj (gelu)  ffn_post_norm

each `.weight`, plus `.bias` where the record says so. Checkpoints store a norm's effective scale w (the
norm multiplies by w); Gemma's files store w − 1 (their norm multiplies by 1 + w), `hf.norm_offset` = 1
converts. The tables `hf` and `gguf` name every tensor in those formats ({i} the layer; several of ours
stacked by rows into one of theirs, or stored transposed, as GPT-2's Conv1D `c_attn`), and `lora` names
the adapter targets as PEFT does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NORMS = ("rms", "layer")
MLPS = ("swiglu", "geglu", "gelu")
POSITIONS = ("rope", "learned")


@dataclass(frozen=True)
class External:
    """One tensor of another format: its name ({i}: the layer), our tensors stacked by rows in it, whether it
    is stored transposed ([in, out], GPT-2's Conv1D). External("h.{i}.attn.c_attn.weight", ("attn.wq.weight",
    "attn.wk.weight", "attn.wv.weight"), transposed=True)"""
    name: str
    ours: tuple[str, ...]
    transposed: bool = False
    per_head: bool = False   # ours interleaved head by head: rows [heads, len(ours), head_dim] (GPT-NeoX's
                             # query_key_value), not one after the other


@dataclass(frozen=True)
class Format:
    """How one outside format names an architecture's tensors.
    name: its architecture name there (HF model_type, GGUF general.architecture); aliases: other names read.
    globals_, layer: External entries (layer names under `layers.{i}.` on our side);
    norm_offset: their norm weights are ours − offset; permute_qk: q/k rows in llama.cpp's interleaved RoPE
    order (GGUF `llama`, `granite`); rope_freqs: its runtime reads per-pair RoPE factors, the tensor `rope_freqs`
    (llama.cpp's `llama`, for Llama 3.x; its qwen2, qwen3, gemma3 read none); rope_long_short: it reads LongRoPE's
    tensors `rope_factors_short` / `rope_factors_long` and rope.scaling.attn_factor (llama.cpp's phi3).
    A Hugging Face folder's files, as the format writes them (Llama-style, or GPT-2's):
    config: Config field -> its config.json keys: the first one given is read and any other given must agree
    (GPT-2's n_ctx beside n_positions; query_pre_attn_scalar beside head_dim); export writes them all
    (a GGUF format's: the Config numbers it reads and writes under `{arch}.` besides the common ones, Granite's
    multipliers);
    config_fixed: keys export writes with these values, which make transformers compute what we compute;
    activation_keys: the keys export names the MLP's activation under;
    prefix: the prefix of its tensors in the weights file, lm_head's excepted (GPT-2's `transformer.`), which
    PEFT's names carry too;
    tokenizer: its tokenizer files, "tokenizer.json" or GPT-2's "vocab.json+merges.txt";
    window_pattern: the config.json key that says which layers are windowed when `layer_types` does not
    (Gemma 3's sliding_window_pattern; absent: the architecture's default global_every);
    absent: Config field -> the value transformers' config class gives it where config.json has none of its
    keys, where that is not the architecture's default (Qwen2's rope_theta 10000, Mistral's window 4096);
    width_scaled_at: the depths (layer counts) at which its runtime scales attention by 1/√(dim / n_heads)
    instead of our 1/√head_dim (llama.cpp's Gemma 3 27B, 62 layers: gemma_pytorch's query_pre_attn_scalar);
    reads_window: where the architecture has windows, its runtime reads them (False: llama.cpp's starcoder2 and
    phi3, which attend over every position whatever the model was trained with: a window such a GGUF states, as
    Phi-3-mini's 2047, imports as none);
    heads_fill_dim: its runtime makes q and the attention output dim x dim, so a head is dim / n_heads wide
    whatever attention.key_length says (llama.cpp's qwen2, gpt2, starcoder2, phi3, stablelm, olmo2; its llama,
    qwen3, gemma2, gemma3, granite size them by key_length x head_count);
    no_rope_list: the config.json key listing each layer's RoPE, 1 on and 0 off (SmolLM3's no_rope_layers), which
    transformers reads rather than the interval: read as the Config's no_rope_every and written beside it;
    fixed: Config field -> the value its runtime fixes rather than reads (llama.cpp's smollm3: a layer without RoPE
    every 4th): import takes it, export refuses another;
    head_required: its runtime loads `output` and never falls back to the embedding (llama.cpp's olmo2, stablelm,
    gptneox): export writes a tied head as the embedding's copy, and import reads an `output` equal to
    token_embd as tied."""
    name: str
    globals_: tuple[External, ...]
    layer: tuple[External, ...]
    aliases: tuple[str, ...] = ()
    norm_offset: float = 0.0
    permute_qk: bool = False
    rope_freqs: bool = False
    rope_long_short: bool = False
    config: dict = field(default_factory=dict)
    config_fixed: dict = field(default_factory=dict)
    activation_keys: tuple[str, ...] = ()
    prefix: str = ""
    tokenizer: str = "tokenizer.json"
    window_pattern: str | None = None
    absent: dict = field(default_factory=dict)
    width_scaled_at: tuple[int, ...] = ()
    reads_window: bool = True
    heads_fill_dim: bool = False
    no_rope_list: str | None = None
    fixed: dict = field(default_factory=dict)
    head_required: bool = False

    def tensors(self, n_layers: int) -> list[External]:
        """Every tensor of an n-layer model: layer entries expanded, ours prefixed with `layers.{i}.`."""
        out = list(self.globals_)
        for i in range(n_layers):
            out += [External(e.name.format(i=i), tuple(f"layers.{i}.{o}" for o in e.ours), e.transposed, e.per_head)
                    for e in self.layer]
        return out


@dataclass(frozen=True, eq=False)   # one record per architecture: compared (and hashed) by identity
class Arch:
    """The recipe of one architecture (see the module docstring) and its names in other formats."""
    name: str
    norm: str = "rms"
    mlp: str = "swiglu"
    positions: str = "rope"
    qkv_bias: bool = False       # biases on q, k, v
    out_bias: bool = False       # biases on wo and on the MLP's matrices
    qk_norm: bool = False        # RMSNorm of each head of q and k (weights [head_dim]) before RoPE
    post_norms: bool = False     # a norm on the attention's and the MLP's output before the residual add
    pre_norms: bool = True       # a norm on each sub-block's input (attn_norm, ffn_norm; OLMo 2 has none)
    qk_norm_whole: bool = False  # the q/k norms over each whole projection (weights [H·hd], [Hkv·hd]; OLMo 2's)
    embed_scale: bool = False    # the looked-up embedding times √dim (not the tied head)
    multipliers: bool = False    # the Config's scalar multipliers may differ from 1 (attention: 1/√head_dim):
                                 # embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling
    gelu_erf: bool = False       # the "gelu" MLP's activation is the exact GELU x·Φ(x) (erf), not the tanh form
    rope_scales_windows: bool = False   # RoPE scaling applies to the windowed layers too (Gemma 2: one rotary
                                        # embedding; Gemma 3 scales its global layers only)
    defaults: dict = field(default_factory=dict)   # Config fields a config.json may leave out
    hf: Format | None = None
    gguf: Format | None = None
    lora: dict = field(default_factory=dict)       # target -> [(module, its weights stacked by rows)]
    lora_defaults: tuple[str, ...] = ()

    @property
    def gated(self) -> bool:
        """A gated MLP (gate, up, down) rather than GPT-2's (fc, proj)."""
        return self.mlp != "gelu"

    @property
    def mlp_weights(self) -> tuple[str, ...]:
        """The MLP's matrices under layers.i.ffn., input side first."""
        return ("gate", "up", "down") if self.gated else ("fc", "proj")

    def layer_products(self, i: int) -> dict[str, list[str]]:
        """The matrix products of layer i, each the weights it stacks by rows, in a step's order.
        EULER.layer_products(0)["mlp_in"] -> ["layers.0.ffn.gate.weight", "layers.0.ffn.up.weight"]"""
        p = f"layers.{i}."
        *ins, out = self.mlp_weights
        return {"qkv": [p + f"attn.w{x}.weight" for x in "qkv"], "wo": [p + "attn.wo.weight"],
                "mlp_in": [p + f"ffn.{w}.weight" for w in ins], "mlp_out": [p + f"ffn.{out}.weight"]}

    @property
    def layer_norms(self) -> tuple[str, ...]:
        """The norms of a layer, in order: ("attn_norm", "ffn_norm") plus post and q/k norms where present."""
        pre = self.pre_norms
        return ((("attn_norm",) if pre else ()) + (("attn.q_norm", "attn.k_norm") if self.qk_norm else ())
                + (("attn_post_norm",) if self.post_norms else ()) + (("ffn_norm",) if pre else ())
                + (("ffn_post_norm",) if self.post_norms else ()))


def _e(name: str, *ours: str, transposed: bool = False) -> External:
    return External(name, ours, transposed)


# ---- the names of Llama-like blocks in Hugging Face folders and GGUF files ------------------------------------
_HF_ATTN = tuple(_e(f"model.layers.{{i}}.self_attn.{x}_proj.weight", f"attn.w{x}.weight") for x in "qkvo")
_HF_MLP = tuple(_e(f"model.layers.{{i}}.mlp.{x}_proj.weight", f"ffn.{x}.weight") for x in ("gate", "up", "down"))
_HF_GLOBALS = (_e("model.embed_tokens.weight", "embed.weight"), _e("model.norm.weight", "norm.weight"),
               _e("lm_head.weight", "heads.0.weight"))
_GGUF_ATTN = tuple(_e(f"blk.{{i}}.attn_{t}.weight", f"attn.w{x}.weight")
                   for x, t in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")))
_GGUF_MLP = tuple(_e(f"blk.{{i}}.ffn_{x}.weight", f"ffn.{x}.weight") for x in ("gate", "up", "down"))
_GGUF_GLOBALS = (_e("token_embd.weight", "embed.weight"), _e("output_norm.weight", "norm.weight"),
                 _e("output.weight", "heads.0.weight"))
_HF_CONFIG = {  # Llama-style config.json: Config field -> its keys
    "vocab_size": ("vocab_size",), "dim": ("hidden_size",), "n_layers": ("num_hidden_layers",),
    "n_heads": ("num_attention_heads",), "n_kv_heads": ("num_key_value_heads",), "ffn_hidden": ("intermediate_size",),
    "ctx_len": ("max_position_embeddings",), "norm_eps": ("rms_norm_eps",),
    "head_dim": ("head_dim", "query_pre_attn_scalar"), "rope_theta": ("rope_theta",),
    "rope_local_theta": ("rope_local_base_freq",), "sliding_window": ("sliding_window",),
    "tie_embeddings": ("tie_word_embeddings",)}
_HF_FIXED = {"mlp_bias": False, "attention_dropout": 0.0, "pad_token_id": None}
_HF_ACTIVATION = ("hidden_act", "hidden_activation")
_LLAMA_LORA = {x: [(f"attn.w{x}", (f"attn.w{x}",))] for x in "qkvo"} | \
              {x: [(f"ffn.{x}", (f"ffn.{x}",))] for x in ("gate", "up", "down")}
_LLAMA_LORA_DEFAULTS = ("q", "k", "v", "o", "gate", "up", "down")
_LLAMA_DEFAULTS = {"rope_theta": 10000.0, "norm_eps": 1e-5, "tie_embeddings": False}

EULER = Arch(
    "euler", defaults=_LLAMA_DEFAULTS,
    hf=Format("llama", _HF_GLOBALS, (_e("model.layers.{i}.input_layernorm.weight", "attn_norm.weight"), *_HF_ATTN,
                                     _e("model.layers.{i}.post_attention_layernorm.weight", "ffn_norm.weight"),
                                     *_HF_MLP), aliases=("LlamaForCausalLM",),
              config=_HF_CONFIG, config_fixed=_HF_FIXED, activation_keys=_HF_ACTIVATION, absent={"norm_eps": 1e-6}),
    gguf=Format("llama", _GGUF_GLOBALS, (_e("blk.{i}.attn_norm.weight", "attn_norm.weight"), *_GGUF_ATTN,
                                         _e("blk.{i}.ffn_norm.weight", "ffn_norm.weight"), *_GGUF_MLP),
                permute_qk=True, rope_freqs=True),
    lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

QWEN2 = Arch(
    "qwen2", qkv_bias=True, defaults=_LLAMA_DEFAULTS | {"rope_theta": 1000000.0, "norm_eps": 1e-6},
    hf=Format("qwen2", _HF_GLOBALS, EULER.hf.layer + tuple(
        _e(f"model.layers.{{i}}.self_attn.{x}_proj.bias", f"attn.w{x}.bias") for x in "qkv"),
        aliases=("Qwen2ForCausalLM",), config=_HF_CONFIG, config_fixed=_HF_FIXED, activation_keys=_HF_ACTIVATION,
        absent={"rope_theta": 10000.0}),
    gguf=Format("qwen2", _GGUF_GLOBALS, EULER.gguf.layer + tuple(
        _e(f"blk.{{i}}.attn_{x}.bias", f"attn.w{x}.bias") for x in "qkv"), heads_fill_dim=True),
    lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

QWEN3 = Arch(
    "qwen3", qk_norm=True, defaults=QWEN2.defaults,
    hf=Format("qwen3", _HF_GLOBALS, EULER.hf.layer + (
        _e("model.layers.{i}.self_attn.q_norm.weight", "attn.q_norm.weight"),
        _e("model.layers.{i}.self_attn.k_norm.weight", "attn.k_norm.weight")),
        aliases=("Qwen3ForCausalLM",), config=_HF_CONFIG, config_fixed=_HF_FIXED, activation_keys=_HF_ACTIVATION,
        absent={"rope_theta": 10000.0, "head_dim": 128}),
    gguf=Format("qwen3", _GGUF_GLOBALS, EULER.gguf.layer + (
        _e("blk.{i}.attn_q_norm.weight", "attn.q_norm.weight"),
        _e("blk.{i}.attn_k_norm.weight", "attn.k_norm.weight"))),
    lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

MISTRAL = Arch(
    "mistral", defaults=_LLAMA_DEFAULTS | {"sliding_window": 0, "global_every": 0},
    hf=Format("mistral", _HF_GLOBALS, EULER.hf.layer, aliases=("MistralForCausalLM",), config=_HF_CONFIG,
              config_fixed=_HF_FIXED, activation_keys=_HF_ACTIVATION,
              absent={"norm_eps": 1e-6, "sliding_window": 4096}),
    gguf=EULER.gguf, lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

_QK_NORMS = ("attn.q_norm.weight", "attn.k_norm.weight")
GEMMA3 = Arch(
    "gemma3", mlp="geglu", qk_norm=True, post_norms=True, embed_scale=True,
    defaults={"rope_theta": 1000000.0, "rope_local_theta": 10000.0, "norm_eps": 1e-6, "tie_embeddings": True,
              "sliding_window": 512, "global_every": 6},
    hf=Format("gemma3_text", _HF_GLOBALS, (
        _e("model.layers.{i}.input_layernorm.weight", "attn_norm.weight"), *_HF_ATTN,
        _e("model.layers.{i}.self_attn.q_norm.weight", "attn.q_norm.weight"),
        _e("model.layers.{i}.self_attn.k_norm.weight", "attn.k_norm.weight"),
        _e("model.layers.{i}.post_attention_layernorm.weight", "attn_post_norm.weight"),
        _e("model.layers.{i}.pre_feedforward_layernorm.weight", "ffn_norm.weight"), *_HF_MLP,
        _e("model.layers.{i}.post_feedforward_layernorm.weight", "ffn_post_norm.weight")),
        aliases=("Gemma3ForCausalLM",), norm_offset=1.0, config=_HF_CONFIG, config_fixed=_HF_FIXED,
        activation_keys=_HF_ACTIVATION, window_pattern="sliding_window_pattern",
        absent={"sliding_window": 4096, "head_dim": 256}),
    gguf=Format("gemma3", _GGUF_GLOBALS, (
        _e("blk.{i}.attn_norm.weight", "attn_norm.weight"), *_GGUF_ATTN,
        _e("blk.{i}.attn_q_norm.weight", "attn.q_norm.weight"), _e("blk.{i}.attn_k_norm.weight", "attn.k_norm.weight"),
        _e("blk.{i}.post_attention_norm.weight", "attn_post_norm.weight"),
        _e("blk.{i}.ffn_norm.weight", "ffn_norm.weight"), *_GGUF_MLP,
        _e("blk.{i}.post_ffw_norm.weight", "ffn_post_norm.weight")), width_scaled_at=(62,)),
    lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

# Gemma 2: Gemma 3's block without q/k norms, every other layer windowed at one RoPE base, attention scores and
# final logits soft-capped (the Config's attn_softcap, logit_softcap; llama.cpp's gemma2 always caps, 50 / 30
# where the file says nothing, and its head is always the embedding: the table has no `output`)
_GEMMA2_HF_CONFIG = {f: keys for f, keys in _HF_CONFIG.items() if f != "rope_local_theta"} | {
    "attn_softcap": ("attn_logit_softcapping",), "logit_softcap": ("final_logit_softcapping",)}
GEMMA2 = Arch(
    "gemma2", mlp="geglu", post_norms=True, embed_scale=True, rope_scales_windows=True,
    defaults={"rope_theta": 10000.0, "norm_eps": 1e-6, "tie_embeddings": True, "sliding_window": 4096,
              "global_every": 2, "attn_softcap": 50.0, "logit_softcap": 30.0},
    hf=Format("gemma2", _HF_GLOBALS, tuple(e for e in GEMMA3.hf.layer if e.ours[0] not in _QK_NORMS),
              aliases=("Gemma2ForCausalLM",), norm_offset=1.0, config=_GEMMA2_HF_CONFIG, config_fixed=_HF_FIXED,
              activation_keys=_HF_ACTIVATION, absent={"head_dim": 256}),
    gguf=Format("gemma2", _GGUF_GLOBALS[:2], tuple(e for e in GEMMA3.gguf.layer if e.ours[0] not in _QK_NORMS),
                width_scaled_at=(46,), config={"attn_softcap": ("attn_logit_softcapping",),
                                               "logit_softcap": ("final_logit_softcapping",)}),
    lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

# Phi-3: Llama's block with q|k|v and gate|up each one tensor in both formats (stacked by rows), any window on every
# layer (Phi-3-mini's 2047; llama.cpp's phi3 reads none), partial rotary (Phi-4-mini's 0.75), LongRoPE's short and
# long factors (one per turned pair)
_QKV, _GATE_UP = ("attn.wq", "attn.wk", "attn.wv"), ("ffn.gate", "ffn.up")
PHI3 = Arch(
    "phi3", defaults=_LLAMA_DEFAULTS | {"sliding_window": 0, "global_every": 0, "rope_original_ctx": 4096,
                                        "partial_rotary_factor": 1.0},   # (Phi-4-mini's: 0.75)
    hf=Format("phi3", _HF_GLOBALS, (
        _e("model.layers.{i}.input_layernorm.weight", "attn_norm.weight"),
        _e("model.layers.{i}.self_attn.qkv_proj.weight", *(f"{w}.weight" for w in _QKV)),
        _e("model.layers.{i}.self_attn.o_proj.weight", "attn.wo.weight"),
        _e("model.layers.{i}.post_attention_layernorm.weight", "ffn_norm.weight"),
        _e("model.layers.{i}.mlp.gate_up_proj.weight", *(f"{w}.weight" for w in _GATE_UP)),
        _e("model.layers.{i}.mlp.down_proj.weight", "ffn.down.weight")), aliases=("Phi3ForCausalLM",),
        config={f: keys for f, keys in _HF_CONFIG.items() if f != "rope_local_theta"} | {
            "rope_original_ctx": ("original_max_position_embeddings",),
            "partial_rotary_factor": ("partial_rotary_factor",)},
        config_fixed=_HF_FIXED | {"resid_pdrop": 0.0, "embd_pdrop": 0.0}, activation_keys=_HF_ACTIVATION),
    gguf=Format("phi3", _GGUF_GLOBALS, (
        _e("blk.{i}.attn_norm.weight", "attn_norm.weight"), _e("blk.{i}.attn_qkv.weight", *(f"{w}.weight" for w in _QKV)),
        _e("blk.{i}.attn_output.weight", "attn.wo.weight"), _e("blk.{i}.ffn_norm.weight", "ffn_norm.weight"),
        _e("blk.{i}.ffn_up.weight", *(f"{w}.weight" for w in _GATE_UP)), _e("blk.{i}.ffn_down.weight", "ffn.down.weight")),
        reads_window=False, config={"rope_original_ctx": ("rope.scaling.original_context_length",)},
        heads_fill_dim=True, rope_long_short=True),
    lora={"qkv_proj": [("attn.wqkv", _QKV)], "o_proj": [("attn.wo", ("attn.wo",))],
          "gate_up_proj": [("ffn.gate_up", _GATE_UP)], "down_proj": [("ffn.down", ("ffn.down",))]},
    lora_defaults=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))

_GPT2_QKV = ("attn.wq", "attn.wk", "attn.wv")
GPT2 = Arch(
    "gpt2", norm="layer", mlp="gelu", positions="learned", qkv_bias=True, out_bias=True,
    defaults={"norm_eps": 1e-5, "tie_embeddings": True},
    hf=Format("gpt2", (_e("wte.weight", "embed.weight"), _e("wpe.weight", "pos_embed.weight"),
                       _e("ln_f.weight", "norm.weight"), _e("ln_f.bias", "norm.bias"),
                       _e("lm_head.weight", "heads.0.weight")), tuple(
        _e(f"h.{{i}}.{theirs}.{s}", *(f"{o}.{s}" for o in ours), transposed=s == "weight" and ".c_" in theirs)
        for ours, theirs in ((("attn_norm",), "ln_1"), (_GPT2_QKV, "attn.c_attn"), (("attn.wo",), "attn.c_proj"),
                             (("ffn_norm",), "ln_2"), (("ffn.fc",), "mlp.c_fc"), (("ffn.proj",), "mlp.c_proj"))
        for s in ("weight", "bias")), aliases=("GPT2LMHeadModel",),
        config={"vocab_size": ("vocab_size",), "dim": ("n_embd",), "n_layers": ("n_layer",), "n_heads": ("n_head",),
                "ffn_hidden": ("n_inner",), "ctx_len": ("n_positions", "n_ctx"), "norm_eps": ("layer_norm_epsilon",),
                "tie_embeddings": ("tie_word_embeddings",)},
        config_fixed={"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True},
        activation_keys=("activation_function",), prefix="transformer.", tokenizer="vocab.json+merges.txt"),
    gguf=Format("gpt2", (_e("token_embd.weight", "embed.weight"), _e("position_embd.weight", "pos_embed.weight"),
                         _e("output_norm.weight", "norm.weight"), _e("output_norm.bias", "norm.bias"),
                         _e("output.weight", "heads.0.weight")), tuple(
        _e(f"blk.{{i}}.{theirs}.{s}", *(f"{o}.{s}" for o in ours))
        for ours, theirs in ((("attn_norm",), "attn_norm"), (_GPT2_QKV, "attn_qkv"), (("attn.wo",), "attn_output"),
                             (("ffn_norm",), "ffn_norm"), (("ffn.fc",), "ffn_up"), (("ffn.proj",), "ffn_down"))
        for s in ("weight", "bias")), heads_fill_dim=True),
    lora={"c_attn": [("attn.wqkv", _GPT2_QKV)], "c_proj": [("attn.wo", ("attn.wo",)), ("ffn.proj", ("ffn.proj",))],
          "c_fc": [("ffn.fc", ("ffn.fc",))]},
    lora_defaults=("c_attn", "c_proj", "c_fc"))

_HF_SC2 = (("attn_norm", "input_layernorm"), *((f"attn.w{x}", f"self_attn.{x}_proj") for x in "qkvo"),
           ("ffn_norm", "post_attention_layernorm"), ("ffn.fc", "mlp.c_fc"), ("ffn.proj", "mlp.c_proj"))
_GGUF_SC2 = (("attn_norm", "attn_norm"), *((f"attn.w{x}", f"attn_{t}") for x, t in zip("qkvo", ("q", "k", "v", "output"))),
             ("ffn_norm", "ffn_norm"), ("ffn.fc", "ffn_up"), ("ffn.proj", "ffn_down"))
_HF_SC2_GLOBALS = (_e("model.norm.weight", "norm.weight"), _e("model.norm.bias", "norm.bias"))   # LayerNorm's
_GGUF_SC2_GLOBALS = (_e("output_norm.weight", "norm.weight"), _e("output_norm.bias", "norm.bias"))
_HF_SC2_CONFIG = {f: keys for f, keys in _HF_CONFIG.items() if f != "rope_local_theta"} | {   # (one RoPE base)
    "norm_eps": ("norm_epsilon",), "head_dim": ("head_dim",)}
STARCODER2 = Arch(
    "starcoder2", norm="layer", mlp="gelu", qkv_bias=True, out_bias=True,
    defaults={"rope_theta": 10000.0, "norm_eps": 1e-5, "tie_embeddings": True, "sliding_window": 0, "global_every": 0},
    hf=Format("starcoder2", (_HF_GLOBALS[0], *_HF_SC2_GLOBALS, _HF_GLOBALS[2]),
              tuple(_e(f"model.layers.{{i}}.{theirs}.{s}", f"{ours}.{s}") for ours, theirs in _HF_SC2
                    for s in ("weight", "bias")),
              aliases=("Starcoder2ForCausalLM",), config=_HF_SC2_CONFIG,
              config_fixed={"use_bias": True, "residual_dropout": 0.0, "embedding_dropout": 0.0,
                            "attention_dropout": 0.0, "pad_token_id": None},
              activation_keys=("hidden_act",)),
    gguf=Format("starcoder2", (_GGUF_GLOBALS[0], *_GGUF_SC2_GLOBALS, _GGUF_GLOBALS[2]),
                tuple(_e(f"blk.{{i}}.{theirs}.{s}", f"{ours}.{s}") for ours, theirs in _GGUF_SC2
                      for s in ("weight", "bias")), reads_window=False, heads_fill_dim=True),
    lora={x: [(f"attn.w{x}", (f"attn.w{x}",))] for x in "qkvo"} | {
        "c_fc": [("ffn.fc", ("ffn.fc",))], "c_proj": [("ffn.proj", ("ffn.proj",))]},
    lora_defaults=("q", "k", "v", "o", "c_fc", "c_proj"))

# StableLM 2: LayerNorm (with bias), Llama's SwiGLU, biases on q, k, v only, RoPE on a quarter of each head
_HF_STABLELM_CONFIG = {f: keys for f, keys in _HF_CONFIG.items()
                       if f not in ("rope_local_theta", "sliding_window", "head_dim")} | {   # (head: dim / heads)
    "norm_eps": ("layer_norm_eps",), "partial_rotary_factor": ("partial_rotary_factor",)}
STABLELM = Arch(
    "stablelm", norm="layer", qkv_bias=True,
    defaults={"rope_theta": 10000.0, "norm_eps": 1e-5, "tie_embeddings": False, "partial_rotary_factor": 0.25},
    hf=Format("stablelm", (_HF_GLOBALS[0], *_HF_SC2_GLOBALS, _HF_GLOBALS[2]), tuple(
        _e(f"model.layers.{{i}}.{theirs}.{s}", f"{ours}.{s}")
        for ours, theirs, sides in (("attn_norm", "input_layernorm", "wb"), *((f"attn.w{x}", f"self_attn.{x}_proj", "wb")
                                                                             for x in "qkv"),
                                    ("attn.wo", "self_attn.o_proj", "w"), ("ffn_norm", "post_attention_layernorm", "wb"),
                                    *((f"ffn.{x}", f"mlp.{x}_proj", "w") for x in ("gate", "up", "down")))
        for s in ("weight", "bias")[:len(sides)]), aliases=("StableLmForCausalLM",), config=_HF_STABLELM_CONFIG,
        config_fixed={"use_qkv_bias": True, "qk_layernorm": False, "use_parallel_residual": False,
                      "hidden_dropout": 0.0, "attention_dropout": 0.0, "pad_token_id": None},
        activation_keys=("hidden_act",)),
    gguf=Format("stablelm", (_GGUF_GLOBALS[0], *_GGUF_SC2_GLOBALS, _GGUF_GLOBALS[2]), tuple(
        _e(f"blk.{{i}}.{theirs}.{s}", f"{ours}.{s}")
        for ours, theirs, sides in (("attn_norm", "attn_norm", "wb"), *((f"attn.w{x}", f"attn_{x}", "wb") for x in "qkv"),
                                    ("attn.wo", "attn_output", "w"), ("ffn_norm", "ffn_norm", "wb"),
                                    *((f"ffn.{x}", f"ffn_{x}", "w") for x in ("gate", "up", "down")))
        for s in ("weight", "bias")[:len(sides)]), heads_fill_dim=True, head_required=True),
    lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

# Granite 3: Llama's block with four scalar multipliers, the Config's numbers under its names in both formats
_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
GRANITE = Arch(
    "granite", multipliers=True, defaults=_LLAMA_DEFAULTS,
    hf=Format("granite", _HF_GLOBALS, EULER.hf.layer, aliases=("GraniteForCausalLM",),
              config=_HF_CONFIG | {f: (f,) for f in _MULTIPLIERS}, config_fixed=_HF_FIXED,
              activation_keys=_HF_ACTIVATION, absent={"norm_eps": 1e-6, "attention_multiplier": 1.0}),
    gguf=Format("granite", _GGUF_GLOBALS, EULER.gguf.layer, permute_qk=True, rope_freqs=True,
                config=dict(zip(_MULTIPLIERS, (("embedding_scale",), ("residual_scale",), ("attention.scale",),
                                               ("logit_scale",))))),
    lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

# OLMo 2: Llama's block with its norms on the sub-blocks' outputs only and q/k norms over the whole projection
OLMO2 = Arch(
    "olmo2", pre_norms=False, post_norms=True, qk_norm=True, qk_norm_whole=True, defaults=_LLAMA_DEFAULTS,
    hf=Format("olmo2", _HF_GLOBALS, (*_HF_ATTN, *(_e(f"model.layers.{{i}}.self_attn.{x}_norm.weight",
                                                    f"attn.{x}_norm.weight") for x in "qk"),
                                     _e("model.layers.{i}.post_attention_layernorm.weight", "attn_post_norm.weight"),
                                     *_HF_MLP,
                                     _e("model.layers.{i}.post_feedforward_layernorm.weight", "ffn_post_norm.weight")),
              aliases=("Olmo2ForCausalLM",), config=_HF_CONFIG, config_fixed=_HF_FIXED,
              activation_keys=_HF_ACTIVATION),
    gguf=Format("olmo2", _GGUF_GLOBALS, (*_GGUF_ATTN, *(_e(f"blk.{{i}}.attn_{x}_norm.weight", f"attn.{x}_norm.weight")
                                                       for x in "qk"),
                                         _e("blk.{i}.post_attention_norm.weight", "attn_post_norm.weight"),
                                         *_GGUF_MLP, _e("blk.{i}.post_ffw_norm.weight", "ffn_post_norm.weight")),
                heads_fill_dim=True, head_required=True),
    lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

# GPT-NeoX (Pythia): StarCoder2's block (LayerNorm, GELU MLP, biases on every linear) with the exact (erf) GELU, RoPE
# on a part of each head (Pythia's rotary_pct 0.25) and the parallel residual (Config.parallel_residual). Its HF
# query_key_value interleaves q, k, v head by head; llama.cpp's converter writes them stacked (attn_qkv). llama.cpp's
# gptneox computes the tanh GELU: an imported GGUF keeps the erf the model was trained with (transformers' function;
# llama.cpp's distance from it is its own)
_NEOX_QKV = ("attn.wq", "attn.wk", "attn.wv")
_HF_NEOX = (("attn_norm", "input_layernorm"), ("attn.wo", "attention.dense"), ("ffn_norm", "post_attention_layernorm"),
            ("ffn.fc", "mlp.dense_h_to_4h"), ("ffn.proj", "mlp.dense_4h_to_h"))
_GGUF_NEOX = (("attn_norm", "attn_norm"), ("attn.wo", "attn_output"), ("ffn_norm", "ffn_norm"), ("ffn.fc", "ffn_up"),
              ("ffn.proj", "ffn_down"))
GPTNEOX = Arch(
    "gptneox", norm="layer", mlp="gelu", qkv_bias=True, out_bias=True, gelu_erf=True,
    defaults={"rope_theta": 10000.0, "norm_eps": 1e-5, "tie_embeddings": False, "partial_rotary_factor": 0.25,
              "parallel_residual": True},
    hf=Format("gpt_neox", (_e("gpt_neox.embed_in.weight", "embed.weight"),
                           _e("gpt_neox.final_layer_norm.weight", "norm.weight"),
                           _e("gpt_neox.final_layer_norm.bias", "norm.bias"), _e("embed_out.weight", "heads.0.weight")),
              tuple(External(f"gpt_neox.layers.{{i}}.attention.query_key_value.{s}", tuple(f"{w}.{s}" for w in _NEOX_QKV),
                             per_head=True) for s in ("weight", "bias"))
              + tuple(_e(f"gpt_neox.layers.{{i}}.{theirs}.{s}", f"{ours}.{s}") for ours, theirs in _HF_NEOX
                      for s in ("weight", "bias")),
              aliases=("GPTNeoXForCausalLM",),
              config={f: keys for f, keys in _HF_CONFIG.items()
                      if f not in ("rope_local_theta", "sliding_window", "head_dim", "n_kv_heads", "rope_theta")} | {
                  "norm_eps": ("layer_norm_eps",), "rope_theta": ("rotary_emb_base",),
                  "partial_rotary_factor": ("rotary_pct",), "parallel_residual": ("use_parallel_residual",)},
              config_fixed={"attention_bias": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                            "classifier_dropout": 0.0, "pad_token_id": None},
              activation_keys=("hidden_act",)),
    gguf=Format("gptneox", (_GGUF_GLOBALS[0], *_GGUF_SC2_GLOBALS, _GGUF_GLOBALS[2]),
                tuple(_e(f"blk.{{i}}.attn_qkv.{s}", *(f"{w}.{s}" for w in _NEOX_QKV)) for s in ("weight", "bias"))
                + tuple(_e(f"blk.{{i}}.{theirs}.{s}", f"{ours}.{s}") for ours, theirs in _GGUF_NEOX
                        for s in ("weight", "bias")),
                config={"parallel_residual": ("use_parallel_residual",)}, heads_fill_dim=True,
                head_required=True),
    lora={"query_key_value": [("attn.wqkv", _NEOX_QKV)], "dense": [("attn.wo", ("attn.wo",))],
          "dense_h_to_4h": [("ffn.fc", ("ffn.fc",))], "dense_4h_to_h": [("ffn.proj", ("ffn.proj",))]},
    lora_defaults=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"))

# SmolLM3: Llama's block with a layer that turns neither q nor k every no_rope_every-th (4; the Config's number:
# transformers reads its no_rope_layers list, llama.cpp's smollm3 fixes 4 and its converter writes no key)
SMOLLM3 = Arch(
    "smollm3", defaults=_LLAMA_DEFAULTS | {"rope_theta": 2000000.0, "norm_eps": 1e-6, "tie_embeddings": True,
                                           "no_rope_every": 4},
    hf=Format("smollm3", _HF_GLOBALS, EULER.hf.layer, aliases=("SmolLM3ForCausalLM",),
              config={f: keys for f, keys in _HF_CONFIG.items() if f != "rope_local_theta"} | {
                  "no_rope_every": ("no_rope_layer_interval",)},
              config_fixed=_HF_FIXED, activation_keys=("hidden_act",), no_rope_list="no_rope_layers"),
    gguf=Format("smollm3", _GGUF_GLOBALS, EULER.gguf.layer, permute_qk=True, fixed={"no_rope_every": 4}),
    lora=_LLAMA_LORA, lora_defaults=_LLAMA_LORA_DEFAULTS)

ARCHS: dict[str, Arch] = {a.name: a for a in (EULER, QWEN2, QWEN3, MISTRAL, GEMMA3, GEMMA2, PHI3, GPT2, STARCODER2, STABLELM, GRANITE, OLMO2, SMOLLM3, GPTNEOX)}


def by_format(kind: str, name: str) -> Arch | None:
    """The architecture that format `kind` ("hf" or "gguf") calls `name` (or an alias of it), or None; the first
    one where several share a name (GGUF `llama`: EULER, not MISTRAL, whose files are Llama's).
    by_format("gguf", "llama") is EULER; by_format("hf", "Gemma3ForCausalLM") is GEMMA3."""
    for a in ARCHS.values():
        f = getattr(a, kind)
        if f is not None and name in (f.name, *f.aliases):
            return a
    return None
