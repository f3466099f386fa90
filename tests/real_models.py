"""The published model files that some tests run on (fetched by `make models`; scripts/fetch_models.py).

    path = real_model("smollm2")     # the file, or the test is skipped with the command that fetches it
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}


def models_dir() -> Path:
    return Path(os.environ.get("NANOEULER_MODELS") or ROOT / ".cache" / "models")


def llama_cpp_models_dir() -> Path | None:
    """llama.cpp's models/ folder (ggml-vocab-*.gguf, templates/) in llama-cpp-python's unpacked source
    distribution ($LLAMA_CPP_SRC, else .cache/llama-cpp-python: `make llama-src`), or None."""
    src = Path(os.environ.get("LLAMA_CPP_SRC") or ROOT / ".cache" / "llama-cpp-python")
    for folder in (src / "vendor" / "llama.cpp" / "models", src / "models"):
        if folder.is_dir() and any(folder.glob("ggml-vocab-*.gguf")):
            return folder
    return None


def real_model(name: str) -> Path:
    """The path of model `name` (a key of FILES); skips the calling test when it has not been fetched."""
    path = models_dir() / FILES[name]
    if not path.is_file():
        pytest.skip(f"{FILES[name]} is not fetched: run `make models`")
    return path
