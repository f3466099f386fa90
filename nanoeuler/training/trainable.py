"""What the training loop asks of a model: the one interface `Model`, `LoraModel` and `GpuModel` implement.

`train.run_training`, its objectives (`train.LMObjective`, `dpo.DPOObjective`) and the data-parallel
`dist.Trainer` drive any of the three through these members alone; none of them asks which kind it holds.

    model       params (what AdamW trains)       device  adapter_dropout    checkpoint_writers
    Model       every tensor                     cpu     0                  model.safetensors, config.json
    LoraModel   the adapters (+ saved modules)   cpu     its --lora-dropout lora.json, adapter.safetensors
    GpuModel    every tensor, on the device      gpu     0                  host copies, as Model's

`tests/test_trainable.py` checks that each class has every member.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Trainable(Protocol):
    config: object                 # config.Config: the architecture and shapes
    params: dict                   # name -> array: what the optimizer updates, in place
    precision: str                 # of the engine's matrix products: "f32" or "bf16"
    device: str                    # "cpu" (the fast engine: dropout, data parallelism) or "gpu"
    adapter_dropout: float         # dropout on the LoRA adapters' inputs; 0 for a model without adapters

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the parameters (float32 in training; float64 in gradient checks)."""

    def n_params(self) -> int:
        """The parameters a step computes with (a LoraModel: its base's): what MFU counts."""

    def loss_and_grads(self, tokens, loss_mask=None, *, dropout=None, **options) -> tuple[float, float, dict]:
        """tokens int [B, T+K] -> (head-0 loss, objective, grads keyed like params)."""

    def loss(self, tokens, loss_mask=None) -> tuple[float, float]:
        """Forward only: (head-0 loss, objective)."""

    def optimizer(self, params: dict, **settings):
        """The AdamW that updates `params` (the model's, or the share an objective trains) where they live."""

    def checkpoint_writers(self, tokenizer=None) -> dict:
        """{file name: writer} of the model's part of a checkpoint (checkpoint.save_files)."""
