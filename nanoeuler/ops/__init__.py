"""Forward/backward pairs as plain functions on arrays (the reference implementation).

Every op is two functions, `X_forward(inputs..., params...) -> (out, cache)` and
`X_backward(dout, cache) -> (dinputs..., dparams...)`, with no hidden state: the cache is passed
explicitly. Each works in float32 and float64 (dtype in = dtype out) and each pair has a float64
finite-difference test (`nanoeuler check`, tests/test_ops.py).
"""
from .attention import attention_backward, attention_forward
from .bias import bias_backward, bias_forward
from .dropout import Dropout, dropout_backward, dropout_forward
from .cross_entropy import cross_entropy_backward, cross_entropy_forward, mtp_loss_backward, mtp_loss_forward, mtp_targets
from .embedding import embedding_backward, embedding_forward
from .geglu import geglu_backward, geglu_forward
from .gelu import gelu_backward, gelu_forward
from .gelu_erf import gelu_erf_backward, gelu_erf_forward
from .layernorm import layernorm_backward, layernorm_forward
from .linear import linear_backward, linear_forward
from .lora import lora_backward, lora_forward, lora_merge
from .position import position_backward, position_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward
from .rope import inv_freq, llama3_factors, rope_backward, rope_forward, rope_tables
from .scale import scale_backward, scale_forward
from .softcap import softcap_backward, softcap_forward
from .swiglu import swiglu_backward, swiglu_forward

__all__ = [
    "attention_forward", "attention_backward", "cross_entropy_forward", "cross_entropy_backward",
    "Dropout", "dropout_forward", "dropout_backward",
    "mtp_targets", "mtp_loss_forward", "mtp_loss_backward", "embedding_forward", "embedding_backward",
    "linear_forward", "linear_backward", "lora_forward", "lora_backward", "lora_merge",
    "rmsnorm_forward", "rmsnorm_backward", "rope_tables", "inv_freq", "llama3_factors",
    "rope_forward", "rope_backward", "swiglu_forward", "swiglu_backward",
    "layernorm_forward", "layernorm_backward", "gelu_forward", "gelu_backward", "gelu_erf_forward", "gelu_erf_backward",
    "geglu_forward", "geglu_backward",
    "bias_forward", "bias_backward",
    "position_forward", "position_backward", "softcap_forward", "softcap_backward",
    "scale_forward", "scale_backward",
]
