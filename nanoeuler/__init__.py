"""nanoeuler: a GPT-2-class language model in NumPy, every backward pass written by hand.

    from nanoeuler import Model, Tokenizer
    model = Model.from_preset("small", seed=0)
    head0_loss, objective, grads = model.loss_and_grads(tokens)   # tokens: int [B, T+K]
"""
from .config import PRESETS, Config
from .errors import UserError

__all__ = ["Config", "PRESETS", "UserError", "Model", "Tokenizer"]


def __getattr__(name):  # lazy, so that `import nanoeuler` stays light
    if name == "Model":
        from .model import Model
        return Model
    if name == "Tokenizer":
        from .tokenizer import Tokenizer
        return Tokenizer
    raise AttributeError(name)
