"""Training: the pipeline's stages on any model that is `trainable.Trainable` (Model, LoraModel, GpuModel).

    train.py      the one training loop (resume, logging, checkpoints) and its objectives; pretraining's data
    sft.py        instruction data: rendered to (ids, mask) through a chat template, packed, scored
    dpo.py        preference tuning: the DPO loss pair and its objective; dpo_data.py its pairs
    lora.py       LoraModel: a frozen base and its adapters (nanoeuler/adapters.py), as the loop sees them
    dist.py       data-parallel training over MPI (buckets, overlap, ZeRO-1, faults)
    memory.py     the memory of a training step (and of generation), refused before it runs
    trainable.py  what the loop and its objectives ask of a model: one declared interface
    check.py      the float64 finite-difference check of every backward pass (`nanoeuler check`)

Below it: the model and its engines (model.py, fast/, gpu/), optim.py (each engine's AdamW), adapters.py,
checkpoint.py; above it only cli/ (and gpu/check.py, which reuses check.py's rows). Nothing lower imports it.
"""
