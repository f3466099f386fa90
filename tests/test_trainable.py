"""The one interface the training loop drives (nanoeuler/training/trainable.py): Model, LoraModel and GpuModel each
have every member of it, so train.py, dpo.py and dist.py never ask which kind of model they hold."""
import numpy as np
import pytest
from conftest import tiny_config

from nanoeuler import adapters as ad
from nanoeuler.training.lora import LoraModel
from nanoeuler.model import Model
from nanoeuler.training.trainable import Trainable

MEMBERS = ("config", "params", "precision", "device", "adapter_dropout", "dtype", "n_params", "loss_and_grads",
           "loss", "optimizer", "checkpoint_writers")


def test_members_are_the_protocol_s():
    declared = set(Trainable.__annotations__) | {n for n in vars(Trainable) if not n.startswith("_")}
    assert declared == set(MEMBERS)


def lora(dropout=0.0):
    base = Model.init(tiny_config(), seed=0)
    lcfg = ad.LoraConfig(2, 4.0, dropout=dropout).check(base.config)
    return LoraModel(base, lcfg, ad.init_adapters(base.config, lcfg, 0, base.dtype, base.params), {"path": "", "sha256": ""})


@pytest.mark.parametrize("make", [lambda: Model.init(tiny_config(), seed=0), lora], ids=["Model", "LoraModel"])
def test_cpu_models_are_trainable(make):
    m = make()
    assert isinstance(m, Trainable)
    assert m.device == "cpu" and m.precision == "f32" and m.dtype == np.float32
    opt = m.optimizer(m.params, lr=1e-3)
    assert set(opt.m) == set(m.params) and opt.lr == 1e-3


def test_what_differs_between_a_model_and_its_adapters():
    """A LoraModel trains and writes its adapters, with its own dropout; a Model its weights, with none."""
    m, a = Model.init(tiny_config(), seed=0), lora(dropout=0.25)
    assert m.adapter_dropout == 0.0 and a.adapter_dropout == 0.25
    assert {"model.safetensors", "config.json"} <= set(m.checkpoint_writers())
    assert set(a.checkpoint_writers()) == {ad.LORA_FILE, ad.ADAPTER_FILE}
    assert all(n.endswith((".lora_A", ".lora_B")) for n in a.params)
